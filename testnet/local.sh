#!/usr/bin/env bash
# Local testnet: N devices of one agent on this machine.
#
# Builds nuwa-node, creates fresh homes in a temp dir (one `init`, N-1
# `device provision`), starts one daemon per home on random ports,
# prints how to talk to each, and tears everything down on exit or Ctrl-C.
#
# As root the nodes run with default flags inside a private network namespace
# that holds loopback and one LAN interface (`eth0`, a veth with a private
# address), as a machine on a LAN does: LAN discovery (mDNS) runs on it and no
# packet leaves the machine. Without root
# (or with --host) they run on the host's loopback with mDNS off and find each
# other through --peer addresses instead.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: testnet/local.sh [-n N] [--smoke] [--host] [--release] [--keep]

  -n N        number of nodes (default 3, at most 20)
  --smoke     write on node 1, wait until every node has converged, print
              PASS or FAIL, tear down and exit (0 on PASS)
  --host      run on the host's loopback without a network namespace
              (mDNS off; each node dials the ones started before it)
  --release   build and run the release binary
  --keep      keep the temp dir (homes and logs) after tear-down
  -h, --help  this text

Without --smoke the testnet runs until Ctrl-C.
EOF
}

N=3 SMOKE=0 HOST=0 PROFILE=debug KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    -n) N="${2:?-n needs a number}"; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --host) HOST=1; shift ;;
    --release) PROFILE=release; shift ;;
    --keep) KEEP=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done
case "$N" in ''|*[!0-9]*) echo "-n takes a number" >&2; exit 2 ;; esac
if [ "$N" -lt 1 ] || [ "$N" -gt 20 ]; then echo "-n must be 1..20" >&2; exit 2; fi

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ "$HOST" = 0 ] && { [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null; }; then
  echo "note: not root (or no iproute2): running on the host's loopback with mDNS off (--host)" >&2
  HOST=1
fi

echo "building nuwa-node ($PROFILE; a first build takes several minutes)..." >&2
# Cargo's progress and diagnostics go to stderr as usual; its JSON messages on
# stdout name the binary it built, wherever the target dir is
# (CARGO_TARGET_DIR, a config's build.target-dir, or $ROOT/target).
build_args=(build -p nuwa-node --manifest-path "$ROOT/Cargo.toml" --message-format=json-render-diagnostics)
[ "$PROFILE" = release ] && build_args+=(--release)
BIN="$(cargo "${build_args[@]}" \
  | sed -n 's/.*"executable":"\([^"]*\/nuwa-node\)".*/\1/p' | tail -n 1)"
if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then
  echo "cannot find the nuwa-node binary cargo built (got: '${BIN}')" >&2
  exit 1
fi

TMP="$(mktemp -d -t nuwa-testnet.XXXXXX)"
NS="nuwa-testnet-$$"
PIDS=()

cleanup() {
  set +e
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill -TERM "$p" 2>/dev/null; done
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && wait "$p" 2>/dev/null; done
  [ "$HOST" = 0 ] && ip netns del "$NS" 2>/dev/null
  if [ "$KEEP" = 1 ]; then echo "kept $TMP" >&2; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "$HOST" = 0 ]; then
  ip netns add "$NS"
  ip -n "$NS" link set lo up multicast on
  # eth0's other end, eth1, stays up without an address: a cable to a LAN
  # with nobody else on it (mDNS reaches the daemons by multicast loopback).
  ip -n "$NS" link add eth0 type veth peer name eth1
  ip -n "$NS" addr add 10.202.0.1/24 dev eth0
  ip -n "$NS" link set eth1 up
  ip -n "$NS" link set eth0 multicast on up
  RUN=(ip netns exec "$NS")
  FLAGS=()
else
  RUN=()
  FLAGS=(--listen /ip4/127.0.0.1/tcp/0 --no-mdns)
fi

# A wrapper so that CLI calls reach the daemons inside the namespace.
cat >"$TMP/nuwa" <<EOF
#!/usr/bin/env bash
exec ${RUN[*]:-} "$BIN" "\$@"
EOF
chmod +x "$TMP/nuwa"
NUWA="$TMP/nuwa"

mkdir -p "$TMP/logs"
"$BIN" --home "$TMP/node1" init --name node1 --i-have-written-it-down >/dev/null
for i in $(seq 2 "$N"); do
  "$BIN" --home "$TMP/node1" device provision --out "$TMP/node$i" --name "node$i" >/dev/null
done

wait_api() { # home pid
  for _ in $(seq 1 200); do
    if [ -f "$1/api.json" ] && "$NUWA" --home "$1" status --json >/dev/null 2>&1; then return 0; fi
    kill -0 "$2" 2>/dev/null || { echo "daemon for $1 exited; log:" >&2; cat "$TMP/logs/$(basename "$1").log" >&2; return 1; }
    sleep 0.1
  done
  echo "daemon for $1 did not come up" >&2; return 1
}

ADDRS=()
for i in $(seq 1 "$N"); do
  home="$TMP/node$i"
  extra=()
  if [ "$HOST" = 1 ]; then
    for a in "${ADDRS[@]:-}"; do [ -n "$a" ] && extra+=(--peer "$a"); done
  fi
  RUST_LOG="${RUST_LOG:-info}" "${RUN[@]}" "$BIN" --home "$home" run \
    "${FLAGS[@]}" "${extra[@]}" \
    >"$TMP/logs/node$i.log" 2>&1 &
  PIDS+=($!)
  wait_api "$home" "$!"
  ADDRS+=("$("$NUWA" --home "$home" status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["listen_addrs"][0])')")
done

peers_of() { "$NUWA" --home "$1" status --json | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["peers"]))'; }
want=$((N - 1))
for _ in $(seq 1 100); do
  ok=1
  for i in $(seq 1 "$N"); do [ "$(peers_of "$TMP/node$i")" -ge "$want" ] || ok=0; done
  [ "$ok" = 1 ] && break
  sleep 0.1
done

echo
echo "nuwa testnet: $N nodes of agent $("$NUWA" --home "$TMP/node1" status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["agent_did"])')"
[ "$HOST" = 0 ] && echo "network namespace: $NS (default flags; mDNS on its eth0)"
echo "homes and logs:    $TMP"
for i in $(seq 1 "$N"); do
  echo "  node$i: $(peers_of "$TMP/node$i") verified peers   log: $TMP/logs/node$i.log"
done
echo
echo "talk to a node (any of node1..node$N):"
echo "  $NUWA --home $TMP/node1 status"
echo "  $NUWA --home $TMP/node1 state put notes hello '\"world\"'"
echo "  $NUWA --home $TMP/node$N state get notes --json"
echo
echo "status page of node1 (open --print gives a one-time login link, valid 60 s):"
if [ "$HOST" = 0 ]; then
  API_PORT=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["url"].rsplit(":", 1)[1])' "$TMP/node1/api.json")
  echo "  the link points into namespace $NS, which a browser on this host cannot reach;"
  echo "  forward its port to this host's loopback first (socat), then paste the link:"
  echo "    socat TCP-LISTEN:$API_PORT,bind=127.0.0.1,fork,reuseaddr EXEC:'ip netns exec $NS socat STDIO TCP\:127.0.0.1\:$API_PORT' &"
  echo "    $NUWA --home $TMP/node1 open --print"
else
  echo "  $NUWA --home $TMP/node1 open"
fi
echo

if [ "$SMOKE" = 1 ]; then
  "$NUWA" --home "$TMP/node1" state put notes hello '"world"' >/dev/null
  for _ in $(seq 1 100); do
    ok=1
    for i in $(seq 1 "$N"); do
      [ "$("$NUWA" --home "$TMP/node$i" state get notes hello --json 2>/dev/null)" = '"world"' ] || ok=0
    done
    if [ "$ok" = 1 ]; then echo "PASS: all $N nodes converged"; exit 0; fi
    sleep 0.1
  done
  echo "FAIL: nodes did not converge within 10 s" >&2
  exit 1
fi

echo "running; press Ctrl-C to stop and tear down"
wait
