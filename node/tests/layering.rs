//! Goal: the architecture's rules hold because a test fails when one is
//! broken, not because ARCHITECTURE.md says so. Method: read the real
//! dependency graph from `cargo metadata` and the real sources, and check
//!
//! 1. the layers: each workspace crate depends only on the workspace
//!    crates its layer allows (the arrows of ARCHITECTURE.md);
//! 2. the IO-free core: no crate of it reaches tokio, libp2p's network
//!    stack, sled, mDNS, sockets or an HTTP stack, even transitively;
//! 3. the core's sources read no files, clocks, environment or threads;
//! 4. in the daemon, only the executor's module does IO: the loop and its
//!    input translation contain no store, file, network or mDNS call, and
//!    the executor's IO handles are private to it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// This machine's target triple (the graph is resolved for it, as a
/// build here is).
fn host() -> String {
    let out = std::process::Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("rustc runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .expect("rustc names its host")
}

type Graph = (BTreeMap<String, BTreeSet<String>>, BTreeSet<String>);

/// The workspace's resolved graph (once per run): package name → names of
/// its normal (non-dev, non-build) dependencies, and the members.
fn graph() -> &'static Graph {
    static GRAPH: std::sync::OnceLock<Graph> = std::sync::OnceLock::new();
    GRAPH.get_or_init(read_graph)
}

fn read_graph() -> Graph {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = std::process::Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--offline"])
        .args(["--filter-platform", &host()])
        .current_dir(root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).expect("metadata is JSON");
    let name_of: BTreeMap<String, String> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["id"].as_str().unwrap().to_owned(),
                p["name"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let members: BTreeSet<String> = meta["workspace_members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| name_of[id.as_str().unwrap()].clone())
        .collect();
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for node in meta["resolve"]["nodes"].as_array().unwrap() {
        let name = name_of[node["id"].as_str().unwrap()].clone();
        let entry = deps.entry(name).or_default();
        for d in node["deps"].as_array().unwrap() {
            let normal = d["dep_kinds"]
                .as_array()
                .unwrap()
                .iter()
                .any(|k| k["kind"].is_null());
            if normal {
                entry.insert(name_of[d["pkg"].as_str().unwrap()].clone());
            }
        }
    }
    (deps, members)
}

/// What each workspace crate may depend on in the workspace.
fn allowed() -> BTreeMap<&'static str, &'static [&'static str]> {
    BTreeMap::from([
        ("nuwa-counters", &[][..]),
        ("nuwa-entropy", &[][..]),
        ("nuwa-identity", &["nuwa-entropy"][..]),
        ("nuwa-crypto", &["nuwa-entropy"][..]),
        ("nuwa-proto", &["nuwa-crypto"][..]),
        ("nuwa-state", &["nuwa-proto"][..]),
        ("nuwa-asm", &[][..]),
        ("nuwa-caps", &["nuwa-identity"][..]),
        (
            "nuwa-sync",
            &[
                "nuwa-identity",
                "nuwa-crypto",
                "nuwa-proto",
                "nuwa-state",
                "nuwa-entropy",
                "nuwa-counters",
            ][..],
        ),
        (
            "nuwa-keeper",
            &["nuwa-identity", "nuwa-crypto", "nuwa-proto", "nuwa-entropy"][..],
        ),
        (
            "nuwa-agent",
            &[
                "nuwa-sync",
                "nuwa-identity",
                "nuwa-crypto",
                "nuwa-proto",
                "nuwa-state",
                "nuwa-asm",
                "nuwa-caps",
                "nuwa-keeper",
                "nuwa-entropy",
                "nuwa-counters",
            ][..],
        ),
        (
            "nuwa-store",
            &["nuwa-crypto", "nuwa-proto", "nuwa-keeper"][..],
        ),
        ("nuwa-discovery", &[][..]),
        ("nuwa-net", &["nuwa-counters", "nuwa-identity"][..]),
        (
            "nuwa-node",
            &[
                "nuwa-agent",
                "nuwa-store",
                "nuwa-net",
                "nuwa-discovery",
                "nuwa-keeper",
                "nuwa-counters",
            ][..],
        ),
        (
            "nuwa-bench",
            &["nuwa-crypto", "nuwa-state", "nuwa-store"][..],
        ),
    ])
}

/// The crates that do no IO.
const IO_FREE: &[&str] = &[
    "nuwa-counters",
    "nuwa-entropy",
    "nuwa-identity",
    "nuwa-crypto",
    "nuwa-proto",
    "nuwa-state",
    "nuwa-asm",
    "nuwa-caps",
    "nuwa-sync",
    "nuwa-keeper",
    "nuwa-agent",
];

/// Crates that do IO (or are an async runtime), which no IO-free crate may
/// reach. libp2p's two format crates (`libp2p-identity`, `multiaddr`) are
/// plain data and allowed; every other `libp2p*` crate is not.
fn is_io(name: &str) -> bool {
    let io = [
        "tokio",
        "mio",
        "socket2",
        "sled",
        "mdns-sd",
        "if-addrs",
        "hyper",
        "axum",
        "reqwest",
        "async-std",
        "smol",
        "libp2p",
        "quinn",
        "rustls",
        "nuwa-store",
        "nuwa-net",
        "nuwa-discovery",
        "nuwa-node",
    ];
    io.contains(&name)
        || name.starts_with("tokio-")
        || name.starts_with("hyper-")
        || (name.starts_with("libp2p-") && name != "libp2p-identity")
}

fn closure(deps: &BTreeMap<String, BTreeSet<String>>, from: &str) -> BTreeMap<String, String> {
    // Each reached crate, with the crate that brought it in.
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    let mut todo = vec![from.to_owned()];
    while let Some(c) = todo.pop() {
        for d in deps.get(&c).into_iter().flatten() {
            if !seen.contains_key(d) {
                seen.insert(d.clone(), c.clone());
                todo.push(d.clone());
            }
        }
    }
    seen
}

#[test]
fn workspace_crates_depend_only_on_their_layers() {
    let (deps, members) = graph();
    let allowed = allowed();
    for m in members {
        let ok = allowed
            .get(m.as_str())
            .unwrap_or_else(|| panic!("{m} has no layer in this test: add it to `allowed`"));
        let workspace: Vec<&String> = deps[m].iter().filter(|d| members.contains(*d)).collect();
        for d in workspace {
            assert!(
                ok.contains(&d.as_str()),
                "{m} depends on {d}, which its layer does not allow (ARCHITECTURE.md, \"Code map\")"
            );
        }
    }
}

#[test]
fn the_core_reaches_no_io_crate() {
    let (deps, _) = graph();
    for c in IO_FREE {
        let reached = closure(deps, c);
        for (d, via) in &reached {
            assert!(
                !is_io(d),
                "the IO-free crate {c} reaches {d} (through {via}); the core must stay runnable \
                 without an OS network, files or an async runtime"
            );
        }
    }
}

/// The source text of `path` without comments, test modules and test
/// files: what ships.
fn production_text(path: &Path) -> String {
    let src = std::fs::read_to_string(path).unwrap();
    let code = match src.find("#[cfg(test)]") {
        Some(i) => &src[..i],
        None => &src[..],
    };
    code.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs")
            && p.file_name().is_some_and(|n| n != "tests.rs")
        {
            out.push(p);
        }
    }
    out
}

fn assert_no(files: &[PathBuf], forbidden: &[&str], rule: &str) {
    for f in files {
        let text = production_text(f);
        for pattern in forbidden {
            assert!(
                !text.contains(pattern),
                "{} contains `{pattern}`: {rule}",
                f.strip_prefix(root()).unwrap_or(f).display()
            );
        }
    }
}

#[test]
fn the_core_reads_no_file_clock_or_environment() {
    let dirs = [
        "crates/counters/src",
        "crates/identity/src",
        "crates/crypto/src",
        "proto/src",
        "crates/state/src",
        "crates/asm/src",
        "crates/sync/src",
        "crates/keeper/src",
        "crates/agent/src",
    ];
    let files: Vec<PathBuf> = dirs
        .iter()
        .flat_map(|d| rust_files(&root().join(d)))
        .collect();
    assert!(files.len() > 40, "found the core's sources");
    assert_no(
        &files,
        &[
            "std::fs",
            "File::",
            "std::net::Tcp",
            "std::net::Udp",
            "std::thread",
            "std::process",
            "std::env",
            "SystemTime",
            "Instant::now",
            "tokio",
            "getrandom::",
        ],
        "the core does no IO: time comes in as a parameter, randomness from nuwa-entropy",
    );
    // nuwa-entropy is the core's one door to the OS: its randomness, and
    // nothing else.
    let entropy = rust_files(&root().join("crates/entropy/src"));
    assert!(!entropy.is_empty(), "found nuwa-entropy's sources");
    assert_no(
        &entropy,
        &[
            "std::fs",
            "File::",
            "std::net::Tcp",
            "std::net::Udp",
            "std::process",
            "std::env",
            "SystemTime",
            "Instant::now",
            "tokio",
        ],
        "nuwa-entropy reads the OS's randomness and nothing else",
    );
}

/// The executor's module, and the workers it starts and owns (the reader
/// thread, the metadata writer, the catch-up workers): the daemon's only
/// IO.
const EXECUTOR_AND_WORKERS: &[&str] = &[
    "node/src/daemon/exec.rs",
    "node/src/daemon/exec/",
    "node/src/daemon/reader.rs",
    "node/src/daemon/meta.rs",
    "node/src/daemon/catch_up.rs",
];

#[test]
fn only_the_executor_does_io_in_the_daemon() {
    // Every other file of the daemon, present and future.
    let mut loop_files = rust_files(&root().join("node/src/daemon"));
    loop_files.push(root().join("node/src/daemon.rs"));
    loop_files.retain(|f| {
        let rel = f
            .strip_prefix(root())
            .unwrap()
            .to_string_lossy()
            .into_owned();
        !EXECUTOR_AND_WORKERS.iter().any(|e| rel.starts_with(e))
    });
    // The loop (`daemon.rs`) and its inputs (`daemon/inputs.rs`) at least.
    assert!(
        loop_files.len() >= 2
            && loop_files.iter().any(|f| f.ends_with("daemon.rs"))
            && loop_files.iter().any(|f| f.ends_with("inputs.rs")),
        "found the loop's files: {loop_files:?}"
    );
    assert_no(
        &loop_files,
        &[
            "std::fs",
            "tokio::fs",
            "Storage",
            "SledStore",
            "home::save",
            "home::write",
            "home::lock",
            "home::read",
            "nuwa_net::spawn",
            "NetHandle",
            "Mdns::start",
            ".gossip_publish(",
            ".dial(",
            ".kad_",
            ".rendezvous_",
            "getrandom",
            "spawn_blocking",
        ],
        "the loop turns IO into inputs and hands effects to the executor, the only code that \
         touches the store, the home's files and the network",
    );
    // By construction: the executor's IO handles are its private fields.
    let exec = production_text(&root().join("node/src/daemon/exec.rs"));
    let start = exec
        .find("pub(super) struct Executor {")
        .expect("the executor");
    let end = start + exec[start..].find("\n}").expect("its end");
    for field in [
        "store:",
        "net:",
        "mdns:",
        "reader:",
        "meta:",
        "home_dir:",
        "catch_ups:",
    ] {
        let line = exec[start..end]
            .lines()
            .find(|l| l.trim_start().starts_with(field) || l.contains(&format!(" {field}")))
            .unwrap_or_else(|| panic!("the executor holds `{field}`"));
        assert!(
            !line.trim_start().starts_with("pub"),
            "the executor's `{field}` is public: other code could do IO through it"
        );
    }
}
