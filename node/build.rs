//! Lays out the release binary's code so that what an idle daemon runs sits
//! together.
//!
//! Why: an idle daemon's resident memory is mostly the binary's code that
//! its ticks, heartbeats and digests fault back in after the core gives
//! memory back, and a fault maps the 64 KiB around it. Idle touches 3-4 MB
//! of the 28 MB text (25 MB since one codegen unit per crate); spread over
//! all of it, 12 MB of text stayed resident and an idle daemon settled at
//! 20 MB; laid out together, at 13 MB (docs/performance.md, "Issue 26,
//! fourth session").
//!
//! `link/idle-order.txt` lists the functions an idle cluster touched, in the
//! order it touched them (made by `scripts/bench/link_order.py`). The linker
//! places them first; a name it does not find (a function renamed since) is
//! skipped, so a stale list costs memory, never correctness.
//!
//! Only release builds for x86_64 Linux (GNU), where rustc links with its
//! own LLD by default; `NUWA_LINK_ORDER=0` turns it off for a linker that
//! does not take `--symbol-ordering-file`.

use std::path::Path;

fn main() {
    println!("cargo::rerun-if-changed=link/idle-order.txt");
    println!("cargo::rerun-if-env-changed=NUWA_LINK_ORDER");
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let wanted = var("PROFILE") == "release"
        && var("CARGO_CFG_TARGET_OS") == "linux"
        && var("CARGO_CFG_TARGET_ARCH") == "x86_64"
        && var("CARGO_CFG_TARGET_ENV") == "gnu"
        && var("NUWA_LINK_ORDER") != "0";
    let order = Path::new(&var("CARGO_MANIFEST_DIR")).join("link/idle-order.txt");
    if !wanted || !order.is_file() {
        return;
    }
    println!(
        "cargo::rustc-link-arg-bin=nuwa-node=-Wl,--symbol-ordering-file={}",
        order.display()
    );
    println!("cargo::rustc-link-arg-bin=nuwa-node=-Wl,--no-warn-symbol-ordering");
}
