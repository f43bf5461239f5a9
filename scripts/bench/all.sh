#!/usr/bin/env bash
# The whole benchmark in one command: builds nuwa-node and nuwa-bench in
# release mode, measures real daemons on 127.0.0.1, then runs the same
# workloads through automerge-repo twice (defaults, sync debounce 0; Node.js
# 20+, npm registry on first use)
# and writes one report with both tools side by side.
#
#   ./scripts/bench/all.sh            # full run (about 40 min on 2 cores)
#   ./scripts/bench/all.sh --quick    # smoke run (under a minute)
#   ./scripts/bench/all.sh --no-automerge-repo [nuwa-bench options]
#
# Other arguments go to nuwa-bench (see `nuwa-bench --help`). The report,
# JSON and PNG charts go to bench-out/ (or --out DIR).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
compare=(--automerge-repo)
args=()
for a in "$@"; do
  if [ "$a" = "--no-automerge-repo" ]; then compare=(); else args+=("$a"); fi
done
if [ ${#compare[@]} -gt 0 ] && ! command -v node >/dev/null; then
  echo "error: Node.js 20+ is needed for the automerge-repo side; install it or pass --no-automerge-repo" >&2
  exit 2
fi
cargo build --release -q -p nuwa-node -p nuwa-bench
target="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
exec "$target/release/nuwa-bench" --node-bin "$target/release/nuwa-node" "${compare[@]}" "${args[@]}"
