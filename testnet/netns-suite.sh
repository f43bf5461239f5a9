#!/usr/bin/env bash
# Multi-host suite: devices of one agent on separate hosts (network
# namespaces on separate subnets, joined by a router, so mDNS cannot cross)
# with one rendezvous/DHT host reachable by all. Checks that devices
# converge using only rendezvous, then only the DHT, each within 10 s; that
# a partition with conflicting edits heals with nothing lost; that
# `sync --once` pulls the full state (or fails with a reason); and that
# `doctor` names the mDNS problem on a host with only loopback and passes on
# a healthy device. Needs root.
#
# Prints PASS/FAIL per check and ends with "N passed, M failed".
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
NETNS="$ROOT/testnet/netns.sh"
if [ "$(id -u)" != 0 ]; then
  echo "testnet/netns-suite.sh needs root (network namespaces); skipping" >&2
  exit 0
fi
cargo build --quiet -p nuwa-node --manifest-path "$ROOT/Cargo.toml"
BIN="$ROOT/target/debug/nuwa-node"
PREFIX="nuwa-suite-$$"
TMP="$(mktemp -d -t nuwa-suite.XXXXXX)"
PASSED=0 FAILED=0

LO_NS="$PREFIX-loonly"   # the doctor case's namespace with only loopback
cleanup() {
  set +e
  if [ -e "/run/netns/$LO_NS" ]; then
    for p in $(ip netns pids "$LO_NS" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
    ip netns del "$LO_NS" 2>/dev/null
  fi
  bash "$NETNS" --prefix "$PREFIX" down >/dev/null 2>&1
  if [ "$FAILED" -gt 0 ]; then echo "logs kept in $TMP" >&2; else rm -rf "$TMP"; fi
}
trap cleanup EXIT

pass() { echo "PASS  $*"; PASSED=$((PASSED + 1)); }
fail() { echo "FAIL  $*"; FAILED=$((FAILED + 1)); }
inh() { local h="$1"; shift; bash "$NETNS" --prefix "$PREFIX" exec "$h" -- "$@"; }
cli() { local h="$1" home="$2"; shift 2; inh "$h" "$BIN" --home "$home" "$@"; }
peers() { cli "$1" "$2" status --json 2>/dev/null | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["peers"]))' 2>/dev/null || echo 0; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round($(now) - $1, 2))"; }

PIDS=()
start_devices() { # extra args...
  PIDS=()
  for h in h1 h2 h3; do
    inh "$h" "$BIN" --home "$TMP/$h" run --listen /ip4/0.0.0.0/tcp/4001 "$@" >/dev/null 2>>"$TMP/$h.log" &
    PIDS+=($!)
  done
  for h in h1 h2 h3; do
    for _ in $(seq 1 100); do [ -f "$TMP/$h/api.json" ] && cli "$h" "$TMP/$h" status >/dev/null 2>&1 && break; sleep 0.1; done
  done
}
stop_devices() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
all_verified_within() { # seconds -> prints elapsed, returns 0/1
  local t0 limit="$1"; t0=$(now)
  while :; do
    local ok=1
    for h in h1 h2 h3; do [ "$(peers "$h" "$TMP/$h")" -ge 2 ] || ok=0; done
    if [ "$ok" = 1 ]; then since "$t0"; return 0; fi
    if python3 -c "import sys; sys.exit(0 if $(now) - $t0 > $limit else 1)"; then since "$t0"; return 1; fi
    sleep 0.2
  done
}
same_state_within() { # container seconds expected-keys -> 0/1
  local c="$1" limit="$2" want="$3" t0; t0=$(now)
  while :; do
    local a b d
    a=$(cli h1 "$TMP/h1" state get "$c" --json 2>/dev/null || true)
    b=$(cli h2 "$TMP/h2" state get "$c" --json 2>/dev/null || true)
    d=$(cli h3 "$TMP/h3" state get "$c" --json 2>/dev/null || true)
    if [ -n "$a" ] && [ "$a" = "$b" ] && [ "$a" = "$d" ] &&
      [ "$(echo "$a" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))')" = "$want" ]; then
      return 0
    fi
    if python3 -c "import sys; sys.exit(0 if $(now) - $t0 > $limit else 1)"; then
      echo "    h1=$a" >&2; echo "    h2=$b" >&2; echo "    h3=$d" >&2
      return 1
    fi
    sleep 0.2
  done
}

bash "$NETNS" --prefix "$PREFIX" up --hosts 3 >/dev/null
inh rv "$BIN" --home "$TMP/rv" rendezvous --listen /ip4/0.0.0.0/tcp/4001 >"$TMP/rv.out" 2>"$TMP/rv.log" &
for _ in $(seq 1 100); do grep -q "/ip4/10.77.0.2/tcp/" "$TMP/rv.out" 2>/dev/null && break; sleep 0.1; done
RV="$(grep -m1 '/ip4/10.77.0.2/tcp/' "$TMP/rv.out")"
[ -n "$RV" ] && pass "rendezvous node prints its address: $RV" || { fail "rendezvous node did not start"; exit 1; }

"$BIN" --home "$TMP/h1" init --name h1 --i-have-written-it-down >/dev/null
for h in h2 h3 fresh lonely; do "$BIN" --home "$TMP/h1" device provision --out "$TMP/$h" --name "$h" >/dev/null; done

# 1a. Rendezvous only.
start_devices --no-mdns --no-dht --no-known-peers --rendezvous "$RV"
if t=$(all_verified_within 10); then pass "rendezvous only: 3 hosts verified each other in ${t}s"; else fail "rendezvous only: not verified within 10 s"; fi
cli h1 "$TMP/h1" state put notes via-rendezvous true >/dev/null
if same_state_within notes 10 1; then pass "rendezvous only: a write converges on all hosts"; else fail "rendezvous only: no convergence"; fi
stop_devices

# 1b. DHT only.
start_devices --no-mdns --no-rendezvous --no-known-peers --bootstrap "$RV"
if t=$(all_verified_within 10); then pass "DHT only: 3 hosts verified each other in ${t}s"; else fail "DHT only: not verified within 10 s"; fi
cli h2 "$TMP/h2" state put notes via-dht true >/dev/null
if same_state_within notes 10 2; then pass "DHT only: a write converges on all hosts"; else fail "DHT only: no convergence"; fi
stop_devices

# 2. Partition with conflicting edits, then heal.
start_devices --rendezvous "$RV" --bootstrap "$RV"
all_verified_within 10 >/dev/null || true
bash "$NETNS" --prefix "$PREFIX" cut h3 >/dev/null
# Wait until both sides notice (ping timeout), so the edits below really
# happen apart rather than sitting in TCP buffers.
t0=$(now)
for _ in $(seq 1 200); do
  [ "$(peers h1 "$TMP/h1")" -le 1 ] && [ "$(peers h3 "$TMP/h3")" -eq 0 ] && break
  sleep 0.2
done
if [ "$(peers h1 "$TMP/h1")" -le 1 ] && [ "$(peers h3 "$TMP/h3")" -eq 0 ]; then
  pass "partition: h3 cut off (noticed after $(since "$t0")s)"
else
  fail "partition: h3 still connected after the cut"
fi
for i in $(seq 1 10); do
  cli h1 "$TMP/h1" state put part "left$i" "$i" >/dev/null
  cli h3 "$TMP/h3" state put part "right$i" "$i" >/dev/null
  cli h1 "$TMP/h1" state put part conflict '"left"' >/dev/null
  cli h3 "$TMP/h3" state put part conflict '"right"' >/dev/null
done
cli h2 "$TMP/h2" state put part middle true >/dev/null
bash "$NETNS" --prefix "$PREFIX" restore h3 >/dev/null
t0=$(now)
if same_state_within part 30 22; then pass "partition: all 22 keys on every host $(since "$t0")s after restore"; else fail "partition: replicas differ 30 s after restore"; fi
stop_devices

# 4. sync --once from a fresh home, then with nobody to reach.
start_devices --rendezvous "$RV" --bootstrap "$RV"
all_verified_within 10 >/dev/null || true
t0=$(now)
if inh h2 "$BIN" --home "$TMP/fresh" sync --once --timeout 30s --listen /ip4/0.0.0.0/tcp/0 \
  --rendezvous "$RV" --bootstrap "$RV" 2>"$TMP/fresh.err"; then
  pass "sync --once converged in $(since "$t0")s: $(tail -1 "$TMP/fresh.err")"
else
  fail "sync --once did not converge: $(tail -3 "$TMP/fresh.err")"
fi
stop_devices
inh h2 "$BIN" --home "$TMP/fresh" run --listen /ip4/0.0.0.0/tcp/0 --no-mdns --no-dht --no-rendezvous --no-known-peers >/dev/null 2>>"$TMP/fresh.log" &
FP=$!
for _ in $(seq 1 100); do cli h2 "$TMP/fresh" status >/dev/null 2>&1 && break; sleep 0.1; done
n=$(cli h2 "$TMP/fresh" state get part --json 2>/dev/null | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))' 2>/dev/null || echo 0)
kill -TERM "$FP"; wait "$FP" 2>/dev/null || true
[ "$n" = 22 ] && pass "sync --once stored the full state (22 keys)" || fail "sync --once stored $n of 22 keys"
t0=$(now)
if inh h1 "$BIN" --home "$TMP/lonely" sync --once --timeout 3s --listen /ip4/0.0.0.0/tcp/0 \
  --no-mdns --no-dht --no-rendezvous --no-known-peers 2>"$TMP/lonely.err"; then
  fail "sync --once with no peer exited 0"
else
  pass "sync --once with no peer failed after $(since "$t0")s: $(tail -1 "$TMP/lonely.err")"
fi

# 5. doctor. (a) A host with only loopback: default mDNS watches nothing,
# and doctor says so, names the flag, and exits non-zero. (b) A healthy
# device of the testnet: doctor exits 0.
ip netns add "$LO_NS"
ip -n "$LO_NS" link set lo up
"$BIN" --home "$TMP/loonly" init --name loonly --i-have-written-it-down >/dev/null
ip netns exec "$LO_NS" "$BIN" --home "$TMP/loonly" run >/dev/null 2>>"$TMP/loonly.log" &
LP=$!
for _ in $(seq 1 100); do ip netns exec "$LO_NS" "$BIN" --home "$TMP/loonly" status >/dev/null 2>&1 && break; sleep 0.1; done
set +e
ip netns exec "$LO_NS" "$BIN" --home "$TMP/loonly" doctor >"$TMP/loonly.doctor" 2>&1
rc=$?
set -e
if [ "$rc" != 0 ] && grep -q '^FAIL  mdns .*watches nothing' "$TMP/loonly.doctor" &&
  grep -q -- '--mdns-interface lo' "$TMP/loonly.doctor" && grep -q '^PASS  daemon' "$TMP/loonly.doctor"; then
  pass "doctor on a loopback-only host exits $rc: $(grep -m1 '^FAIL  mdns' "$TMP/loonly.doctor" | cut -c1-110)..."
else
  fail "doctor on a loopback-only host (exit $rc):"; sed 's/^/    /' "$TMP/loonly.doctor"
fi
kill -TERM "$LP"; wait "$LP" 2>/dev/null || true
ip netns del "$LO_NS"

start_devices --rendezvous "$RV" --bootstrap "$RV"
all_verified_within 10 >/dev/null || true
set +e
cli h1 "$TMP/h1" doctor --rendezvous "$RV" --bootstrap "$RV" >"$TMP/h1.doctor" 2>&1
rc=$?
set -e
if [ "$rc" = 0 ] && grep -q '^PASS  peers .*2 verified' "$TMP/h1.doctor"; then
  pass "doctor on a healthy testnet device exits 0: $(tail -1 "$TMP/h1.doctor")"
else
  fail "doctor on a healthy testnet device (exit $rc):"; sed 's/^/    /' "$TMP/h1.doctor"
fi
stop_devices

echo
echo "netns suite: $PASSED passed, $FAILED failed"
[ "$FAILED" = 0 ]
