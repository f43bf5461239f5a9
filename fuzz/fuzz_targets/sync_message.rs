//! Fuzzes what a peer's Automerge bytes reach in `nuwa_state::Container`:
//! `receive_sync_message` with a fresh `SyncState`, and `apply_changes` with
//! the input as one change, each on an empty container (fixed actor) and on
//! a container that already holds a few entries.
//!
//! Checks that neither panics, and that a container which accepted the bytes
//! still renders, saves and reloads.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use nuwa_fuzz::{STATE_ACTOR, populated_container};
use nuwa_state::{Container, SyncState};

/// The populated container, saved once and reloaded per input (a container
/// cannot be cloned).
static POPULATED: LazyLock<Vec<u8>> = LazyLock::new(|| populated_container().save());

fn containers() -> Vec<Container> {
    let mut out = vec![Container::new(STATE_ACTOR)];
    if let Ok(c) = Container::load(STATE_ACTOR, Some(&POPULATED), Vec::new()) {
        out.push(c);
    }
    out
}

fn check_still_usable(c: &Container) {
    let _ = c.to_json();
    let _ = c.heads();
    let saved = c.save();
    let reloaded = Container::load(STATE_ACTOR, Some(&saved), Vec::new());
    assert!(reloaded.is_ok(), "a saved container failed to load");
}

fuzz_target!(
    init: {
        // `Container` runs Automerge on peer bytes inside `catch_unwind` and
        // reports a panic there as `StateError::Poisoned` (the daemon then
        // reloads the container from its store). libfuzzer-sys's own hook
        // would abort on that handled panic before it is caught, so a quiet
        // hook replaces it: a panic that escapes the target still reaches
        // libfuzzer-sys's `catch_unwind` and aborts, and counts as a crash.
        // Panics outside Automerge's sources are still printed.
        std::panic::set_hook(Box::new(|info| {
            let in_automerge = info
                .location()
                .is_some_and(|l| l.file().contains("/automerge-"));
            if !in_automerge {
                eprintln!("{info}");
            }
        }));
    },
    |data: &[u8]| {
    for mut c in containers() {
        let mut state = SyncState::new();
        if let Ok(changes) = c.receive_sync_message(&mut state, data) {
            if !changes.is_empty() {
                check_still_usable(&c);
            }
            // Answering is what the engine does next.
            let _ = c.generate_sync_message(&mut state);
        }
    }
    for mut c in containers() {
        if let Ok(applied) = c.apply_changes(vec![data.to_vec()]) {
            if !applied.new_changes.is_empty() {
                check_still_usable(&c);
            }
        }
    }
}
);
