#!/usr/bin/env bash
# Runs the samod comparison benchmark: builds this folder's program in
# release mode (cargo's output on stderr; target dir $CARGO_TARGET_DIR if
# set, else ./target here), then runs it with the arguments given.
# Relative paths are taken from the caller's directory.
set -euo pipefail
dir="$(cd "$(dirname "$0")" && pwd)"
target="${CARGO_TARGET_DIR:-$dir/target}"
# Build output goes to stderr, so stdout carries only the table.
cargo build --release --manifest-path "$dir/Cargo.toml" --target-dir "$target" >&2
exec "$target/release/samod-bench" "$@"
