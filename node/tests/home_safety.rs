//! Fault 7 of issue 11: a home's files used to be created 0644 (0666 under
//! umask 000), protected only by the home's 0700, which nothing checked.
//! Now everything under a home is 0600 / 0700 whatever the umask, and a
//! home others can enter is refused with the fix in the message.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::*;

fn modes(dir: &Path, out: &mut Vec<(String, u32, bool)>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let meta = e.metadata().unwrap();
        let mode = meta.permissions().mode() & 0o777;
        out.push((e.path().display().to_string(), mode, meta.is_dir()));
        if meta.is_dir() {
            modes(&e.path(), out);
        }
    }
}

// Goal: under umask 000, a daemon that wrote state leaves only 0600 files
// and 0700 directories in its home (sled's included).
#[test]
fn files_are_private_whatever_the_umask() {
    isolated("files_are_private_whatever_the_umask", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let d = c.start_under(
            &["sh", "-c", "umask 000; exec \"$0\" \"$@\""],
            &a,
            &["--no-mdns"],
        );
        cli_ok(&a, &["state", "put", "notes", "k", "\"v\""]);
        c.stop(d);
        let mut all = Vec::new();
        modes(&a, &mut all);
        assert!(all.iter().any(|(p, _, _)| p.contains("store")), "{all:?}");
        let open: Vec<_> = all
            .iter()
            .filter(|(_, mode, is_dir)| mode & 0o077 != 0 || (*is_dir && *mode != 0o700))
            .collect();
        assert!(open.is_empty(), "open to others: {open:?}");
    });
}

// Goal: a home that others can enter is refused at start, with the command
// that fixes it; after the fix the daemon starts.
#[test]
fn a_home_others_can_read_is_refused_with_the_fix() {
    isolated("a_home_others_can_read_is_refused_with_the_fix", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = cli(
            &a,
            &["run", "--no-mdns", "--listen", "/ip4/127.0.0.1/tcp/0"],
        );
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("open to other users (mode 755)") && stderr.contains("chmod -R go-rwx"),
            "{stderr}"
        );
        std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o700)).unwrap();
        c.start(&a, &["--no-mdns"]);
    });
}
