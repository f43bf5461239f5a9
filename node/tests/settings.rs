//! Settings come from one declaration: `config.toml`, then `NUWA_…`
//! environment variables, then flags. An error names where the bad value
//! came from.

mod common;

use common::*;

// Goal: a bad value from an environment variable is refused at start and
// named by its flag and variable; the flag, given too, wins over it.
#[test]
fn environment_variables_are_layered_under_the_flags() {
    let c = Cluster::new();
    let a = c.init("a");
    let out = std::process::Command::new(bin())
        .args(["--home", a.to_str().unwrap(), "run", "--no-mdns"])
        .env("NUWA_API_LISTEN", "192.0.2.1:1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr
            .contains("--api-listen (or NUWA_API_LISTEN) is 192.0.2.1:1, which is not a loopback"),
        "{stderr}"
    );
    let out = std::process::Command::new(bin())
        .args(["--home", a.to_str().unwrap(), "run", "--no-mdns"])
        .env("NUWA_LISTEN", "tcp:4001")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--listen (or NUWA_LISTEN)"), "{stderr}");
    // The file's value, named by its key, when neither is given.
    std::fs::write(a.join("config.toml"), "[api]\nlisten = \"192.0.2.1:1\"\n").unwrap();
    let out = cli(&a, &["run", "--no-mdns"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("`api.listen` in"), "{stderr}");
}
