#!/usr/bin/env bash
# The project's test command: formatting, lints, every unit and integration
# test (real daemons in private network namespaces), and a smoke run of the
# local testnet. CI (.ci/run) runs exactly this.
#
# Needs: the Rust toolchain, iproute2 (`ip`), util-linux (`unshare`),
# python3, and root (or unprivileged user namespaces) for the network
# namespaces that keep mDNS off real networks.
#
# Slower suites run only when asked:
#   SIM_SEEDS=5000     more seeds for the sync simulator (default: a few hundred)
#   NUWA_CRASH_RUNS=100  more kill -9 rounds in the store crash test (default 10)
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets --quiet -- -D warnings

step "cargo test"
cargo test --workspace

step "local testnet smoke run"
if [ "$(id -u)" = 0 ]; then
  ./testnet/local.sh -n 3 --smoke
else
  ./testnet/local.sh -n 3 --smoke --host
fi
