//! Goal: a device whose clock is 600 s ahead is reported as `clock_skew`
//! with the measured offset (status, counter, WARN log) on the other device,
//! instead of a silent `replay` rejection every 5 s. Method: two real
//! daemons of one agent on loopback, one run under libfaketime 600 s ahead
//! (the `faketime` package, installed by `.ci/run`), the other told to
//! dial it. The library is preloaded directly, not through the `faketime`
//! wrapper: the wrapper makes a named semaphore per process id, a killed
//! wrapper leaves it in /dev/shm, and a later wrapper with the same id (in
//! a fresh namespace ids start low) fails with `sem_open: File exists`.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn a_device_600_s_ahead_is_reported_as_clock_skew() {
    // `.ci/run` installs it; say so rather than pass silently.
    let lib = libfaketime().expect("this test needs libfaketime (apt-get install faketime)");
    let preload = format!("LD_PRELOAD={}", lib.display());
    isolated("a_device_600_s_ahead_is_reported_as_clock_skew", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let b = c.provision(&a, "b");
        c.start(&a, &["--no-mdns"]);
        let a_addr = listen_addr(&a);
        c.start_under(
            &["env", &preload, "FAKETIME=+600s"],
            &b,
            &["--no-mdns", "--peer", &a_addr],
        );
        let st = wait_for("a reports b's clock skew", Duration::from_secs(20), || {
            status(&a)
                .ok()
                .filter(|st| st["clock_skew"].as_array().is_some_and(|v| !v.is_empty()))
        });
        let offset = st["clock_skew"][0]["offset_ms"].as_i64().unwrap();
        assert!(
            (590_000..=610_000).contains(&offset),
            "offset measured from b's Hello: {offset}"
        );
        assert_eq!(
            st["clock_skew"][0]["peer_id"],
            status(&b).unwrap()["device"]["peer_id"]
        );
        assert!(st["counters"]["clock_skew_detected"].as_u64().unwrap_or(0) >= 1);
        assert!(
            st["counters"]["rejected_connection_clock_skew"]
                .as_u64()
                .unwrap_or(0)
                >= 1
        );
        assert!(verified(&st).is_empty(), "nothing syncs across the skew");
        let text = cli_ok(&a, &["status"]);
        assert!(text.contains("CLOCK SKEW"), "{text}");
        assert!(
            c.logs().contains("WARN") && c.logs().contains("clock_skew"),
            "a WARN names clock_skew"
        );
    });
}

/// Where the distribution put libfaketime (Debian and Ubuntu: under the
/// multiarch directory; others: `/usr/lib/faketime` or `/usr/local`).
fn libfaketime() -> Option<std::path::PathBuf> {
    let mut dirs: Vec<std::path::PathBuf> = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("faketime"))
        .collect();
    dirs.push("/usr/lib/faketime".into());
    dirs.push("/usr/local/lib/faketime".into());
    dirs.into_iter()
        .map(|d| d.join("libfaketime.so.1"))
        .find(|p| p.is_file())
}
