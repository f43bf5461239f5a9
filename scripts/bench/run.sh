#!/usr/bin/env bash
# Runs the automerge-repo comparison benchmark; installs the pinned packages
# from package-lock.json first if node_modules is missing. Arguments go to
# bench.mjs unchanged (relative paths are taken from the caller's directory).
set -euo pipefail
dir="$(cd "$(dirname "$0")" && pwd)"
if [ ! -d "$dir/node_modules" ]; then
  # Install output goes to stderr, so stdout carries only the table.
  (cd "$dir" && npm ci --no-audit --no-fund >&2)
fi
exec node "$dir/bench.mjs" "$@"
