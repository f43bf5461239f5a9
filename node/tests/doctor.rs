//! `nuwa-node doctor` against real daemons on loopback: a healthy pair
//! passes, a loose home or a stopped daemon fails with the fix, mDNS with
//! no usable interface fails naming the flag, and `master-key backup`
//! turns the master-key warning into a pass.

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::Value;

/// Runs `doctor --json` with `extra` flags: (exit code, report).
fn doctor_json(home: &Path, extra: &[&str]) -> (i32, Value) {
    let mut args = vec!["doctor", "--json"];
    args.extend_from_slice(extra);
    let out = cli(home, &args);
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "doctor --json printed no JSON ({e}):\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), report)
}

fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name} in {report:#}"))
}

#[test]
fn healthy_pair_passes_and_a_loose_home_fails() {
    // Goal: on two devices that verified each other, doctor exits 0 with
    // every check pass or warn; the same home made world-readable fails
    // the home check with the chmod fix. Method: real daemons on loopback.
    isolated("healthy_pair_passes_and_a_loose_home_fails", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let b = c.provision(&a, "b");
        c.start(&a, &[]);
        c.start(&b, &[]);
        wait_for("a and b verified", Duration::from_secs(30), || {
            (status(&a).ok().map(|s| verified(&s).len()) == Some(1)
                && status(&b).ok().map(|s| verified(&s).len()) == Some(1))
            .then_some(())
        });

        let (code, report) = doctor_json(&a, &["--mdns-interface", "lo"]);
        assert_eq!(code, 0, "{report:#}");
        assert_eq!(report["ok"], true);
        for c in report["checks"].as_array().unwrap() {
            let s = c["status"].as_str().unwrap();
            assert!(s == "pass" || s == "warn", "check not pass/warn: {c:#}");
            if s == "warn" {
                assert!(c["fix"].is_string(), "a warning without a fix: {c:#}");
            }
        }
        assert_eq!(check(&report, "daemon")["status"], "pass");
        assert_eq!(check(&report, "peers")["status"], "pass");
        assert_eq!(check(&report, "mdns")["status"], "pass");
        assert!(
            check(&report, "mdns")["detail"]
                .as_str()
                .unwrap()
                .contains("lo"),
            "{report:#}"
        );
        assert_eq!(check(&report, "clock")["status"], "pass");
        assert_eq!(check(&report, "dht-pointer")["status"], "pass");

        // The text form says the same.
        let text = cli_ok(&a, &["doctor", "--mdns-interface", "lo"]);
        assert!(text.contains("PASS  daemon"), "{text}");
        assert!(text.contains("0 failed"), "{text}");

        std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = cli(&a, &["doctor", "--mdns-interface", "lo"]);
        std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o700)).unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{text}");
        assert!(text.contains("FAIL  home"), "{text}");
        assert!(text.contains("directory mode 755"), "{text}");
        assert!(
            text.contains(&format!("chmod 700 {}", a.display())),
            "{text}"
        );
    });
}

#[test]
fn a_stopped_daemon_and_blind_mdns_fail_with_their_fixes() {
    // Goal: with no daemon, doctor fails "not running" with the command to
    // start it and skips what only the daemon knows; in this namespace
    // (only `lo`) default mDNS watches nothing, and the fix names
    // --mdns-interface. Method: a home that never ran.
    isolated(
        "a_stopped_daemon_and_blind_mdns_fail_with_their_fixes",
        || {
            let c = Cluster::new();
            let a = c.init("a");
            let b = c.provision(&a, "b");

            let (code, report) = doctor_json(&b, &[]);
            assert_eq!(code, 1, "{report:#}");
            assert_eq!(report["ok"], false);
            let daemon = check(&report, "daemon");
            assert_eq!(daemon["status"], "fail");
            assert!(
                daemon["detail"].as_str().unwrap().contains("not running"),
                "{daemon:#}"
            );
            assert!(
                daemon["fix"]
                    .as_str()
                    .unwrap()
                    .contains(&format!("nuwa-node --home {} run", b.display())),
                "{daemon:#}"
            );
            for name in ["clock", "reachability", "peers"] {
                assert_eq!(check(&report, name)["status"], "skip", "{report:#}");
            }
            let mdns = check(&report, "mdns");
            assert_eq!(mdns["status"], "fail", "{mdns:#}");
            assert!(
                mdns["detail"].as_str().unwrap().contains("watches nothing"),
                "{mdns:#}"
            );
            let fix = mdns["fix"].as_str().unwrap();
            for flag in ["--mdns-interface lo", "--peer", "--rendezvous", "--no-mdns"] {
                assert!(fix.contains(flag), "fix lacks {flag}: {mdns:#}");
            }
            // Offline checks still run: the pointer is sized from the home.
            assert_eq!(check(&report, "dht-pointer")["status"], "pass");
            // A device without the master key, and not an admin, is told
            // where approving happens.
            let mk = check(&report, "master-key");
            assert_eq!(mk["status"], "pass");
            let detail = mk["detail"].as_str().unwrap();
            assert!(detail.contains("this device is not an admin"), "{mk:#}");

            // With mDNS off, or on lo, the mDNS check passes.
            for flags in [&["--no-mdns"][..], &["--mdns-interface", "lo"][..]] {
                let (_, report) = doctor_json(&b, flags);
                assert_eq!(check(&report, "mdns")["status"], "pass", "{flags:?}");
            }
        },
    );
}

#[test]
fn master_key_backup_is_recorded_and_refuses_to_overwrite() {
    // Goal: doctor warns about a master key never backed up; after
    // `master-key backup --out FILE` (a 0600 copy, same bytes) it passes and
    // says when; a second backup to the same FILE is refused. Method: a
    // fresh `init` home, no daemon needed.
    let c = Cluster::new();
    let a = c.init("a");
    let (_, report) = doctor_json(&a, &["--no-mdns"]);
    let mk = check(&report, "master-key");
    assert_eq!(mk["status"], "warn", "{mk:#}");
    assert!(
        mk["fix"]
            .as_str()
            .unwrap()
            .contains("master-key backup --out"),
        "{mk:#}"
    );

    let out = c.dir.path().join("master-copy.key");
    let printed = cli_ok(
        &a,
        &["master-key", "backup", "--out", out.to_str().unwrap()],
    );
    assert!(printed.contains("master key copied"), "{printed}");
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(a.join("master.key")).unwrap()
    );
    let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);

    let (_, report) = doctor_json(&a, &["--no-mdns"]);
    let mk = check(&report, "master-key");
    assert_eq!(mk["status"], "pass", "{mk:#}");
    let detail = mk["detail"].as_str().unwrap();
    assert!(detail.contains("backed up on"), "{detail}");
    assert!(detail.contains("master-copy.key"), "{detail}");

    let again = cli(
        &a,
        &["master-key", "backup", "--out", out.to_str().unwrap()],
    );
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("already exists"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    let inside = cli(
        &a,
        &[
            "master-key",
            "backup",
            "--out",
            a.join("x.key").to_str().unwrap(),
        ],
    );
    assert!(!inside.status.success());
    assert!(String::from_utf8_lossy(&inside.stderr).contains("inside the home"));
}

#[test]
fn a_peer_refused_for_clock_skew_fails_the_clock_check() {
    // Goal: a peer whose clock is 600 s ahead (refused for skew) fails the
    // clock check with the offset and the NTP fix. Method: two real daemons
    // on loopback, one under libfaketime (`faketime`, installed by .ci/run).
    if std::process::Command::new("faketime")
        .args(["-f", "+0s", "true"])
        .status()
        .is_err()
    {
        panic!("this test needs libfaketime's `faketime` (apt-get install faketime)");
    }
    isolated(
        "a_peer_refused_for_clock_skew_fails_the_clock_check",
        || {
            let mut c = Cluster::new();
            let a = c.init("a");
            let b = c.provision(&a, "b");
            c.start(&a, &["--no-mdns"]);
            let a_addr = listen_addr(&a);
            c.start_under(
                &["faketime", "-f", "+600s"],
                &b,
                &["--no-mdns", "--peer", &a_addr],
            );
            wait_for("a reports b's clock skew", Duration::from_secs(20), || {
                status(&a)
                    .ok()
                    .filter(|st| st["clock_skew"].as_array().is_some_and(|v| !v.is_empty()))
            });
            let (code, report) = doctor_json(&a, &["--no-mdns"]);
            assert_eq!(code, 1, "{report:#}");
            let clock = check(&report, "clock");
            assert_eq!(clock["status"], "fail", "{clock:#}");
            let detail = clock["detail"].as_str().unwrap();
            assert!(
                detail.contains("clock skew") && detail.contains("+6"),
                "{detail}"
            );
            assert!(clock["fix"].as_str().unwrap().contains("NTP"), "{clock:#}");
        },
    );
}

#[test]
fn an_unreachable_keeper_fails_the_reachability_check() {
    // Goal: a configured keeper this device cannot reach fails the
    // reachability check, naming the keeper and the --keeper setting.
    // Method: a real daemon given a keeper address where nothing listens
    // (a real PeerId on a closed loopback port).
    isolated("an_unreachable_keeper_fails_the_reachability_check", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        c.start(&a, &["--no-mdns"]);
        let a_id = status(&a).unwrap()["device"]["peer_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let b = c.provision(&a, "b");
        let keeper = format!("/ip4/127.0.0.1/tcp/1/p2p/{a_id}");
        c.start(&b, &["--no-mdns", "--keeper", &keeper]);
        let (code, report) = doctor_json(&b, &["--no-mdns", "--keeper", &keeper]);
        assert_eq!(code, 1, "{report:#}");
        let reach = check(&report, "reachability");
        assert_eq!(reach["status"], "fail", "{reach:#}");
        assert!(
            reach["detail"].as_str().unwrap().contains(&a_id),
            "{reach:#}"
        );
        assert!(
            reach["fix"].as_str().unwrap().contains("--keeper"),
            "{reach:#}"
        );
    });
}

// Goal: a daemon whose mDNS failed (here: nothing to announce, QUIC only)
// says so and why in its log, in `status` (text and JSON) and in doctor,
// as a FAIL with the fix, instead of "off". Method: one real daemon whose
// only --listen is QUIC, mDNS left on.
#[test]
fn a_daemon_whose_mdns_failed_says_so_everywhere() {
    isolated("a_daemon_whose_mdns_failed_says_so_everywhere", || {
        let c = Cluster::new();
        let a = c.init("a");
        let log = c.dir.path().join("a.log");
        let mut child = std::process::Command::new(bin())
            .arg("--home")
            .arg(&a)
            .args(["run", "--listen", "/ip4/127.0.0.1/udp/0/quic-v1"])
            .args(["--mdns-interface", "lo"])
            .stdin(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn nuwa-node run");
        let st = wait_for("the daemon's API", Duration::from_secs(20), || {
            status(&a).ok()
        });
        let text = cli_ok(&a, &["status"]);
        let (code, report) = doctor_json(&a, &["--mdns-interface", "lo"]);
        let _ = child.kill();
        let _ = child.wait();
        let logged = std::fs::read_to_string(&log).unwrap();
        assert_eq!(st["mdns"]["enabled"], false, "{}", st["mdns"]);
        let reason = st["mdns"]["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{}", st["mdns"]));
        assert!(reason.contains("no listen address is TCP"), "{reason}");
        assert!(
            logged.contains("mDNS FAILED") && logged.contains(reason),
            "{logged}"
        );
        assert!(
            text.contains(&format!("mdns       FAILED: {reason}")),
            "{text}"
        );
        assert_ne!(code, 0, "{report:#}");
        let mdns = check(&report, "mdns");
        assert_eq!(mdns["status"], "fail", "{mdns:#}");
        assert!(
            mdns["detail"].as_str().unwrap().contains(reason),
            "{mdns:#}"
        );
        let fix = mdns["fix"].as_str().unwrap();
        assert!(
            fix.contains("restart the daemon") && fix.contains("--no-mdns"),
            "{mdns:#}"
        );
    });
}
