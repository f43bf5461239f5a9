//! Gives back the resident pages of this program's own code that startup
//! and past bursts touched and idle does not use.
//!
//! Why: the binary's text is 28 MB, and a fault maps its neighbours too
//! (the kernel's fault-around), so after start most of it stays mapped:
//! 21 MB of an idle daemon's 31 MB RSS was code, against 4 MB of heap
//! (docs/performance.md, "Idle memory"). Clean file pages cost nothing to
//! drop from the page tables: they stay in the page cache, and a page idle
//! needs comes back as a minor fault.
//!
//! Only mappings of the executable with no anonymous (written, copied)
//! page are dropped: the relocated read-only data must keep its
//! relocations, which `MADV_DONTNEED` would throw away.

/// Drops this process's clean pages of its own executable from its page
/// tables; returns the bytes of mappings advised. Linux only; elsewhere 0.
pub(in crate::daemon) fn release_code_pages() -> u64 {
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
    use std::path::PathBuf;

    /// One mapping of the executable, as `/proc/self/smaps` lists it.
    #[derive(Debug, PartialEq)]
    pub(super) struct Mapping {
        pub start: usize,
        pub end: usize,
        pub writable: bool,
        pub anonymous_kb: u64,
    }

    pub(super) fn release() -> u64 {
        let Ok(exe) = std::fs::read_link("/proc/self/exe") else {
            return 0;
        };
        let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
            return 0;
        };
        let mut advised = 0u64;
        for m in clean_mappings(&smaps, &exe) {
            let len = m.end - m.start;
            // SAFETY: the range is a whole mapping of our own executable
            // that is not writable and holds no anonymous page, so
            // MADV_DONTNEED only drops page-table entries of clean file
            // pages; the next access maps the same bytes from the file.
            let r =
                unsafe { libc::madvise(m.start as *mut libc::c_void, len, libc::MADV_DONTNEED) };
            if r == 0 {
                advised += len as u64;
            }
        }
        advised
    }

    /// The mappings of `exe` in `smaps` that are read-only and hold no
    /// anonymous page.
    pub(super) fn clean_mappings(smaps: &str, exe: &std::path::Path) -> Vec<Mapping> {
        let mut out = Vec::new();
        let mut current: Option<Mapping> = None;
        for line in smaps.lines() {
            if let Some(m) = header(line, exe) {
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

    /// `Some(Some(_))` for a header line of a mapping of `exe`, `Some(None)`
    /// for a header of any other mapping, `None` for a field line.
    fn header(line: &str, exe: &std::path::Path) -> Option<Option<Mapping>> {
        let mut parts = line.split_whitespace();
        let range = parts.next()?;
        let (start, end) = range.split_once('-')?;
        let start = usize::from_str_radix(start, 16).ok()?;
        let end = usize::from_str_radix(end, 16).ok()?;
        let perms = parts.next()?;
        if perms.len() != 4 {
            return None;
        }
        let path: PathBuf = parts.nth(3).map(PathBuf::from).unwrap_or_default();
        if path != exe {
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
        //! Goal: only read-only mappings of the executable without anonymous
        //! pages are chosen. Method: a hand-written smaps excerpt with text,
        //! relocated read-only data, data, a library and the heap.

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
8000-9000 rw-p 00000000 00:00 0 [heap]
Anonymous:          4096 kB
9000-9100 r-xp 00500000 fd:01 12 /bin/nuwa-node
";

        #[test]
        fn only_clean_read_only_mappings_of_the_executable() {
            let got = clean_mappings(SMAPS, std::path::Path::new("/bin/nuwa-node"));
            let ranges: Vec<(usize, usize)> = got.iter().map(|m| (m.start, m.end)).collect();
            // The last mapping has no Anonymous line: it is kept as dirty.
            assert_eq!(ranges, vec![(0x5600, 0x5700), (0x5700, 0x5900)]);
        }
    }
}
