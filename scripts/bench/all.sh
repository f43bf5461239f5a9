#!/usr/bin/env bash
# The whole benchmark in one command: builds nuwa-node and nuwa-bench in
# release mode, measures real daemons on 127.0.0.1, then runs the same
# workloads through automerge-repo twice (defaults, sync debounce 0; Node.js
# 20+, npm registry on first use) and through samod, the Rust automerge-repo
# (scripts/bench/samod/, built here with cargo; crates.io on first use),
# and writes one report with all tools side by side.
#
#   ./scripts/bench/all.sh            # full run (about 45 min on 2 cores)
#   ./scripts/bench/all.sh --quick    # smoke run (a minute or two once built)
#   ./scripts/bench/all.sh --no-automerge-repo [nuwa-bench options]
#   ./scripts/bench/all.sh --no-samod [nuwa-bench options]
#
# Other arguments go to nuwa-bench (see `nuwa-bench --help`). The report,
# JSON and PNG charts go to bench-out/ (or --out DIR).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
amrepo=(--automerge-repo)
samod=(--samod)
args=()
for a in "$@"; do
  case "$a" in
    --no-automerge-repo) amrepo=() ;;
    --no-samod) samod=() ;;
    *) args+=("$a") ;;
  esac
done
if [ ${#amrepo[@]} -gt 0 ] && ! command -v node >/dev/null; then
  echo "error: Node.js 20+ is needed for the automerge-repo side; install it or pass --no-automerge-repo" >&2
  exit 2
fi
# Apart: built together, cargo unifies their dependencies' features, and
# the idle link order (node/build.rs) names the functions of nuwa-node's own.
cargo build --release -q -p nuwa-node
cargo build --release -q -p nuwa-bench
target="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
exec "$target/release/nuwa-bench" --node-bin "$target/release/nuwa-node" "${amrepo[@]}" "${samod[@]}" "${args[@]}"
