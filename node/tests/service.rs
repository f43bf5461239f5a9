//! `nuwa-node service install|status|uninstall` as a user runs them: the
//! real binary, with HOME and XDG_CONFIG_HOME pointed at temp dirs, on a
//! home made by `init`. The unit it writes must pass `systemd-analyze
//! verify` with no complaint at all.
//!
//! Where systemd really runs (a developer's machine), the test passes
//! `--files-only`, so that it never enables or stops anything in the real
//! user manager; where it does not (CI's sandbox), it checks that install
//! says so and still succeeds.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;

struct UserEnv {
    _dir: tempfile::TempDir,
    home: PathBuf,
    config: PathBuf,
    runtime: PathBuf,
}

impl UserEnv {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let home = dir.path().join("home");
        let config = dir.path().join("config");
        let runtime = dir.path().join("runtime");
        for d in [&home, &config, &runtime] {
            std::fs::create_dir_all(d).unwrap();
        }
        UserEnv {
            _dir: dir,
            home,
            config,
            runtime,
        }
    }

    fn unit(&self) -> PathBuf {
        self.config.join("systemd/user/nuwa-node.service")
    }

    /// `nuwa-node --home HOME service ARGS` in this user environment.
    fn service(&self, nuwa_home: &Path, args: &[&str]) -> Output {
        Command::new(bin())
            .arg("--home")
            .arg(nuwa_home)
            .arg("service")
            .args(args)
            .env("HOME", &self.home)
            .env("XDG_CONFIG_HOME", &self.config)
            .output()
            .expect("run nuwa-node service")
    }

    fn service_ok(&self, nuwa_home: &Path, args: &[&str]) -> String {
        let out = self.service(nuwa_home, args);
        assert!(
            out.status.success(),
            "service {args:?} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

fn systemd_runs() -> bool {
    Path::new("/run/systemd/system").is_dir()
}

/// `systemd-analyze [--user] verify UNIT`: `Ok(output)` or `Err` when the
/// tool is missing (fails the test under CI=true, where it must exist).
fn verify(env: &UserEnv, unit: &Path, user: bool) -> Option<Output> {
    let mut cmd = Command::new("systemd-analyze");
    if user {
        cmd.arg("--user");
    }
    match cmd
        .arg("verify")
        .arg(unit)
        .env("HOME", &env.home)
        .env("XDG_CONFIG_HOME", &env.config)
        // The user manager it simulates needs a runtime directory.
        .env("XDG_RUNTIME_DIR", &env.runtime)
        .output()
    {
        Ok(out) => Some(out),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "systemd-analyze is missing in CI: .ci/run must install systemd"
            );
            eprintln!(
                "\n!!!!!! SKIPPING systemd-analyze verify: systemd-analyze is not installed \
                 (apt-get install systemd) !!!!!!\n"
            );
            None
        }
        Err(e) => panic!("cannot run systemd-analyze: {e}"),
    }
}

fn assert_clean(what: &str, out: &Output) {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("systemd-analyze verify ({what}): {} {text:?}", out.status);
    assert!(
        out.status.success() && text.trim().is_empty(),
        "systemd-analyze verify found problems in the {what} unit ({}):\n{text}",
        out.status
    );
}

// Goal: install --user writes a unit that runs this binary on this home
// with file logging and passes `systemd-analyze verify` cleanly; status
// reports it; a second install is a no-op; a different unit is not
// overwritten without --force; uninstall removes it.
#[test]
fn user_unit_installs_verifies_and_uninstalls() {
    let c = Cluster::new();
    let home = c.init("a");
    let env = UserEnv::new();
    let files_only: &[&str] = if systemd_runs() {
        &["--files-only"]
    } else {
        &[]
    };

    let mut args = vec!["install", "--user"];
    args.extend(files_only);
    let out = env.service_ok(&home, &args);
    let unit = env.unit();
    assert!(out.contains(&format!("wrote {}", unit.display())), "{out}");
    if !systemd_runs() {
        assert!(
            out.contains("systemd is not running")
                && out.contains("systemctl --user enable --now nuwa-node.service"),
            "install should say systemd is not running and how to start the unit:\n{out}"
        );
    }

    let text = std::fs::read_to_string(&unit).expect("the unit file");
    let exe = std::fs::canonicalize(bin()).unwrap();
    let home_abs = std::fs::canonicalize(&home).unwrap();
    let exec = format!(
        "ExecStart={} --home {} run --log-file {}",
        exe.display(),
        home_abs.display(),
        home_abs.join("logs").display()
    );
    assert!(text.lines().any(|l| l == exec), "want {exec:?} in:\n{text}");
    for line in [
        "Restart=on-failure",
        "KillSignal=SIGTERM",
        "WantedBy=default.target",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }

    if let Some(out) = verify(&env, &unit, true) {
        assert_clean("user", &out);
        // The system unit for the same home, from --dry-run (which needs
        // no root), must be as clean.
        let sys = env.service_ok(&home, &["install", "--dry-run"]);
        assert!(sys.contains("ProtectSystem=strict"), "{sys}");
        let dir = tempfile::tempdir().unwrap();
        let sys_unit = dir.path().join("nuwa-node.service");
        std::fs::write(&sys_unit, &sys).unwrap();
        assert_clean("system", &verify(&env, &sys_unit, false).unwrap());
    }

    let st = env.service_ok(&home, &["status", "--user"]);
    assert!(st.contains("installed:  yes"), "{st}");
    assert!(st.contains(&unit.display().to_string()), "{st}");
    assert!(st.contains("up to date: yes"), "{st}");
    let st: serde_json::Value =
        serde_json::from_str(&env.service_ok(&home, &["status", "--user", "--json"])).unwrap();
    assert_eq!(st["installed"], true, "{st}");
    assert_eq!(st["up_to_date"], true, "{st}");

    let again = env.service_ok(&home, &args);
    assert!(
        again.contains("already installed and up to date"),
        "{again}"
    );

    // Another home's unit would differ: refused, the file untouched.
    let other = c.init("b");
    let out = env.service(&other, &args);
    assert!(!out.status.success(), "a different unit was overwritten");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--force") && err.contains("differs"), "{err}");
    assert_eq!(std::fs::read_to_string(&unit).unwrap(), text);
    let st = env.service_ok(&other, &["status", "--user"]);
    assert!(st.contains("up to date: no"), "{st}");

    let mut args = vec!["uninstall", "--user"];
    args.extend(files_only);
    let out = env.service_ok(&home, &args);
    assert!(
        out.contains(&format!("removed {}", unit.display())),
        "{out}"
    );
    assert!(!unit.exists(), "uninstall left the unit");
    let st = env.service_ok(&home, &["status", "--user"]);
    assert!(st.contains("installed:  no"), "{st}");
    let out = env.service_ok(&home, &args);
    assert!(out.contains("not installed"), "{out}");
}

// Goal: install refuses a home that was never initialised, and says how to
// make one, writing nothing.
#[test]
fn install_needs_an_initialised_home() {
    let env = UserEnv::new();
    let dir = tempfile::tempdir().unwrap();
    for home in [dir.path().join("missing"), dir.path().to_path_buf()] {
        let out = env.service(&home, &["install", "--user", "--files-only"]);
        assert!(!out.status.success(), "installed on {}", home.display());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("init") && err.contains("pair"), "{err}");
        assert!(!env.unit().exists());
    }
}
