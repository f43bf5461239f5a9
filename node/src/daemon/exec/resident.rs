//! Gives back the resident pages of code (this program's and its shared
//! libraries') that startup and past bursts touched and idle does not use.
//!
//! Why: the binary's text is 28 MB, and a fault maps its neighbours too
//! (the kernel's fault-around), so after start most of it stays mapped:
//! 21 MB of an idle daemon's 31 MB RSS was code, against 4 MB of heap
//! (docs/performance.md, "Idle memory"). Clean file pages cost nothing to
//! drop from the page tables: they stay in the page cache, and a page idle
//! needs comes back as a minor fault.
//!
//! Only read-only file mappings with no anonymous (written, copied) page
//! are dropped: relocated read-only data must keep its relocations, which
//! `MADV_DONTNEED` would throw away. The heap, stacks and `[vdso]` are
//! never touched.

/// Drops this process's clean pages of read-only file mappings from its
/// page tables; returns the bytes of mappings advised. Linux only;
/// elsewhere 0.
pub(super) fn release_code_pages() -> u64 {
    #[cfg(target_os = "linux")]
    {
        linux::release()
    }
    #[cfg(not(target_os = "linux"))]
    {
        0
    }
}

#[cfg(target_os = "linux")]
mod linux {
    /// One mapping of the executable, as `/proc/self/smaps` lists it.
    #[derive(Debug, PartialEq)]
    pub(super) struct Mapping {
        pub start: usize,
        pub end: usize,
        pub writable: bool,
        pub anonymous_kb: u64,
    }

    pub(super) fn release() -> u64 {
        let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
            return 0;
        };
        let mut advised = 0u64;
        for m in clean_mappings(&smaps) {
            let len = m.end - m.start;
            // SAFETY: the range is a whole file mapping (the executable or a
            // shared library) that is not writable and holds no anonymous
            // page, so MADV_DONTNEED only drops page-table entries of clean
            // file pages; the next access maps the same bytes from the file.
            let r =
                unsafe { libc::madvise(m.start as *mut libc::c_void, len, libc::MADV_DONTNEED) };
            if r == 0 {
                advised += len as u64;
            }
        }
        // Set by scripts/bench/link_order.py, which runs the daemon from
        // its own copy of the binary to learn which code idle touches: the
        // copy's page cache goes too, so each page idle touches next faults
        // alone (the kernel maps a fault's cached neighbours with it).
        if std::env::var_os("NUWA_PROFILE_IDLE_CODE").is_some() {
            if let Ok(exe) = std::fs::File::open("/proc/self/exe") {
                use std::os::fd::AsRawFd;
                // SAFETY: an open descriptor; only clean cached pages go.
                unsafe { libc::posix_fadvise(exe.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            }
        }
        advised
    }

    /// The file mappings in `smaps` that are read-only and hold no
    /// anonymous page.
    pub(super) fn clean_mappings(smaps: &str) -> Vec<Mapping> {
        let mut out = Vec::new();
        let mut current: Option<Mapping> = None;
        for line in smaps.lines() {
            if let Some(m) = header(line) {
                out.extend(current.take().filter(is_clean));
                current = m;
            } else if let Some(rest) = line.strip_prefix("Anonymous:") {
                if let Some(m) = current.as_mut() {
                    m.anonymous_kb = rest
                        .trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse()
                        .unwrap_or(u64::MAX);
                }
            }
        }
        out.extend(current.filter(is_clean));
        out
    }

    fn is_clean(m: &Mapping) -> bool {
        !m.writable && m.anonymous_kb == 0
    }

    /// `Some(Some(_))` for a header line of a file mapping, `Some(None)`
    /// for a header of any other mapping (heap, stack, `[vdso]`...), `None`
    /// for a field line.
    fn header(line: &str) -> Option<Option<Mapping>> {
        let mut parts = line.split_whitespace();
        let range = parts.next()?;
        let (start, end) = range.split_once('-')?;
        let start = usize::from_str_radix(start, 16).ok()?;
        let end = usize::from_str_radix(end, 16).ok()?;
        let perms = parts.next()?;
        if perms.len() != 4 {
            return None;
        }
        let path = parts.nth(3).unwrap_or_default();
        if !path.starts_with('/') {
            return Some(None);
        }
        Some(Some(Mapping {
            start,
            end,
            writable: perms.as_bytes()[1] == b'w',
            // Unknown until the mapping's Anonymous line: dirty by default.
            anonymous_kb: u64::MAX,
        }))
    }

    #[cfg(test)]
    mod tests {
        //! Goal: only read-only file mappings without anonymous pages are
        //! chosen. Method: a hand-written smaps excerpt with text, relocated
        //! read-only data, data, a library, the vDSO and the heap.

        use super::*;

        const SMAPS: &str = "\
5600-5700 r--p 00000000 fd:01 12 /bin/nuwa-node
Rss:                 100 kB
Anonymous:             0 kB
5700-5900 r-xp 00100000 fd:01 12 /bin/nuwa-node
Anonymous:             0 kB
5900-5a00 r--p 00300000 fd:01 12 /bin/nuwa-node
Anonymous:            16 kB
5a00-5b00 rw-p 00400000 fd:01 12 /bin/nuwa-node
Anonymous:             0 kB
7000-7100 r-xp 00000000 fd:01 99 /usr/lib/libc.so.6
Anonymous:             0 kB
7100-7200 r--p 00100000 fd:01 99 /usr/lib/libc.so.6
Anonymous:             8 kB
7f00-7f01 r-xp 00000000 00:00 0 [vdso]
Anonymous:             0 kB
8000-9000 rw-p 00000000 00:00 0 [heap]
Anonymous:          4096 kB
9000-9100 r-xp 00500000 fd:01 12 /bin/nuwa-node
";

        #[test]
        fn only_clean_read_only_file_mappings() {
            let got = clean_mappings(SMAPS);
            let ranges: Vec<(usize, usize)> = got.iter().map(|m| (m.start, m.end)).collect();
            // The last mapping has no Anonymous line: it is kept as dirty.
            assert_eq!(
                ranges,
                vec![(0x5600, 0x5700), (0x5700, 0x5900), (0x7000, 0x7100)]
            );
        }
    }
}
