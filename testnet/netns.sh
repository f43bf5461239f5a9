#!/usr/bin/env bash
# Network-namespace testnet: several hosts on separate subnets behind one
# router, so that each host is its own LAN and mDNS cannot cross between them.
#
# Topology for `up --hosts N` (PREFIX defaults to nuwa-tn):
#
#               PREFIX-rv 10.77.0.2 (rendezvous / infrastructure host)
#                    |
#   PREFIX-h1 ---- PREFIX-rt ---- PREFIX-h2   ...   PREFIX-hN
#   10.77.1.2   (router, .1 on    10.77.2.2         10.77.N.2
#                every subnet)
#
# Every host has one veth (`eth0`) to the router on its own /24 and a default
# route via the router, which forwards unicast between the subnets. The router
# forwards no multicast, so each host's mDNS stays on its own link. Nothing is
# created in the caller's namespace: the router only has links to the hosts,
# so no packet from a host can leave the testnet.
#
# Links can be cut and restored, and latency and loss added with tc netem.
# `up` removes whatever it created if it fails midway; `down` removes
# everything of a prefix and is safe to run twice. Run `netns.sh --help`.
set -euo pipefail

SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
NET=10.77                 # first two octets of every testnet address
HOST_DEV=eth0             # the host's end of its link to the router
MAX_HOSTS=250
STATE_DIR="${NUWA_TN_STATE_DIR:-/run/nuwa-testnet}"
PREFIX="${NUWA_TN_PREFIX:-nuwa-tn}"

usage() {
  cat <<'EOF'
Usage: testnet/netns.sh [--prefix NAME] COMMAND [ARGS]

Builds a testnet of Linux network namespaces: a rendezvous host `rv` and
device hosts `h1`..`hN`, each on its own /24 subnet behind one router, so
hosts reach each other by IP but mDNS never crosses between them.
Needs root and iproute2 (`ip`, `tc`).

Commands:
  up --hosts N            create PREFIX-rt (router), PREFIX-rv (10.77.0.2) and
                          PREFIX-h1..hN (10.77.i.2); N is 1..250
  down                    stop every process inside the testnet's namespaces,
                          then delete the namespaces and links (safe to repeat)
  exec HOST [--] CMD...   run CMD inside HOST (rv, h1.., or rt for the router)
  ip HOST                 print HOST's address, e.g. 10.77.1.2
  cut HOST                take HOST's link to the router down on both ends:
                          HOST is cut off from every other host
  restore HOST            bring the link back with the same address and route
  netem HOST [--delay MS] [--jitter MS] [--loss PCT]
                          add latency and/or loss on HOST's link, in each
                          direction (a round trip gains 2 x MS)
  netem HOST --clear      remove it
  status                  namespaces, addresses, link states and qdiscs
  selftest [--strict]     build a 3-host testnet under a unique prefix, check
                          reachability, cut/restore, netem and that mDNS does
                          not cross, tear it down; print PASS/FAIL per check.
                          Checks the kernel cannot run (no netem) are SKIPped;
                          --strict counts a SKIP as a failure.

Options:
  --prefix NAME           namespace name prefix (default nuwa-tn, or
                          $NUWA_TN_PREFIX); lets several testnets coexist
  -h, --help              this text

Examples:
  sudo testnet/netns.sh up --hosts 3
  sudo testnet/netns.sh exec h1 -- ping -c1 10.77.2.2     # h2, see: ip h2
  sudo testnet/netns.sh netem h2 --delay 50 --loss 2
  sudo testnet/netns.sh cut h1; sudo testnet/netns.sh restore h1
  sudo testnet/netns.sh down
EOF
}

die() { echo "netns.sh: $*" >&2; exit 1; }
have() { command -v "$1" >/dev/null 2>&1; }

require_root_and_tools() {
  [ "$(id -u)" = 0 ] || die "must run as root (network namespaces need CAP_SYS_ADMIN); try: sudo $0 $*"
  have ip || die "the 'ip' command is missing; install iproute2 (e.g. apt-get install iproute2)"
  have tc || die "the 'tc' command is missing; install iproute2 (e.g. apt-get install iproute2)"
}

check_prefix() {
  [[ "$PREFIX" =~ ^[A-Za-z0-9][A-Za-z0-9_-]{0,39}$ ]] ||
    die "invalid --prefix '$PREFIX': use 1..40 letters, digits, '-' or '_', starting with a letter or digit"
}

state_file() { echo "$STATE_DIR/$PREFIX.state"; }
ns_of() { echo "$PREFIX-$1"; }
rt_ns() { echo "$PREFIX-rt"; }
ns_exists() { [ -e "/run/netns/$1" ]; }

# Every namespace name of this prefix that exists now (exact matches only, so
# that prefix `a` never touches the namespaces of prefix `a-b`).
prefix_namespaces() {
  local name
  while read -r name _; do
    [[ "$name" =~ ^"$PREFIX"-(rt|rv|h[0-9]+)$ ]] && echo "$name"
  done < <(ip netns list 2>/dev/null)
  return 0
}

HOSTS=""
load_state() {
  local f key val
  f="$(state_file)"
  [ -f "$f" ] || die "no testnet '$PREFIX' is up (no $f); start one with: $0 --prefix $PREFIX up --hosts 3"
  while IFS='=' read -r key val; do
    case "$key" in hosts) HOSTS="$val" ;; esac
  done <"$f"
  [[ "$HOSTS" =~ ^[0-9]+$ ]] || die "state file $f is damaged (no hosts=N); run: $0 --prefix $PREFIX down"
}

# host_index HOST: 0 for rv, i for hi; dies on a name this testnet lacks.
host_index() {
  case "$1" in
    rv) echo 0 ;;
    h[1-9]|h[1-9][0-9]|h[1-9][0-9][0-9])
      local i="${1#h}"
      [ "$i" -le "$HOSTS" ] || die "no host '$1' in testnet '$PREFIX' (it has rv and h1..h$HOSTS)"
      echo "$i" ;;
    *) die "unknown host '$1': use rv or h1..h$HOSTS" ;;
  esac
}
host_ip() { local i; i="$(host_index "$1")"; echo "$NET.$i.2"; }
router_ip() { local i; i="$(host_index "$1")"; echo "$NET.$i.1"; }
router_dev() { echo "v-$1"; }
all_hosts() { echo rv; local i; for ((i = 1; i <= HOSTS; i++)); do echo "h$i"; done; }

# ---------------------------------------------------------------- up / down

UP_CREATED=()
UP_DONE=0
up_rollback() {
  local rc=$? ns
  [ "$UP_DONE" = 1 ] && return 0
  set +e
  echo "netns.sh: up failed; removing what it created" >&2
  for ns in "${UP_CREATED[@]:-}"; do
    [ -n "$ns" ] && ip netns del "$ns" 2>/dev/null
  done
  rm -f "$(state_file)"
  [ "$rc" = 0 ] && rc=1
  exit "$rc"
}

add_ns() {
  ip netns add "$1"
  UP_CREATED+=("$1")
  ip -n "$1" link set lo up
}

cmd_up() {
  local n=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --hosts) n="${2:-}"; shift 2 || die "--hosts needs a number" ;;
      --prefix) PREFIX="${2:?--prefix needs a name}"; shift 2 ;;
      *) die "up: unknown argument '$1' (see --help)" ;;
    esac
  done
  check_prefix
  [[ "$n" =~ ^[0-9]+$ ]] || die "up needs --hosts N (a number 1..$MAX_HOSTS)"
  { [ "$n" -ge 1 ] && [ "$n" -le "$MAX_HOSTS" ]; } || die "--hosts must be 1..$MAX_HOSTS, got $n"
  local existing
  existing="$(prefix_namespaces | tr '\n' ' ')"
  [ -z "$existing" ] || die "testnet '$PREFIX' already exists (${existing% }); remove it with: $0 --prefix $PREFIX down"
  [ ! -e "$(state_file)" ] || die "stale state $(state_file); remove it with: $0 --prefix $PREFIX down"

  HOSTS="$n"
  trap up_rollback EXIT
  trap 'exit 130' INT TERM HUP

  mkdir -p "$STATE_DIR"
  printf 'hosts=%s\nnet=%s\n' "$HOSTS" "$NET" >"$(state_file)"

  local rt h ns count=0
  rt="$(rt_ns)"
  add_ns "$rt"
  # Unicast forwarding only: Linux forwards no multicast without a multicast
  # routing daemon, which is what keeps every host's mDNS on its own link.
  ip netns exec "$rt" bash -c 'echo 1 >/proc/sys/net/ipv4/ip_forward'
  while read -r h; do
    ns="$(ns_of "$h")"
    add_ns "$ns"
    # Create the pair inside the router namespace with its peer end moved
    # straight into the host: nothing ever appears in the caller's namespace.
    ip -n "$rt" link add name "$(router_dev "$h")" type veth peer name "$HOST_DEV" netns "$ns"
    ip -n "$rt" addr add "$(router_ip "$h")/24" dev "$(router_dev "$h")"
    ip -n "$rt" link set "$(router_dev "$h")" up
    ip -n "$ns" addr add "$(host_ip "$h")/24" dev "$HOST_DEV"
    ip -n "$ns" link set "$HOST_DEV" up
    ip -n "$ns" route add default via "$(router_ip "$h")"
    count=$((count + 1))
    # Test hook for the selftest: fail midway to prove the rollback.
    if [ -n "${NUWA_TN_FAIL_AFTER_HOSTS:-}" ] && [ "$count" -ge "$NUWA_TN_FAIL_AFTER_HOSTS" ]; then
      die "injected failure after $count hosts (NUWA_TN_FAIL_AFTER_HOSTS)"
    fi
  done < <(all_hosts)

  UP_DONE=1
  trap - EXIT INT TERM HUP
  echo "testnet '$PREFIX' is up: router $rt, rv $(host_ip rv), h1..h$HOSTS $NET.1.2..$NET.$HOSTS.2"
  echo "  run on a host:  $0 --prefix $PREFIX exec h1 -- CMD..."
  echo "  tear down:      $0 --prefix $PREFIX down"
}

# Stop the processes still inside a namespace (its daemons), TERM first and
# KILL after 3 s, so that deleting it really frees it.
stop_processes_in() {
  local ns="$1" pids p i
  pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
  [ -n "${pids// /}" ] || return 0
  echo "netns.sh: stopping processes in $ns: $pids" >&2
  for p in $pids; do kill -TERM "$p" 2>/dev/null || true; done
  for ((i = 0; i < 30; i++)); do
    pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
    [ -n "${pids// /}" ] || return 0
    sleep 0.1
  done
  for p in $pids; do kill -KILL "$p" 2>/dev/null || true; done
}

cmd_down() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --prefix) PREFIX="${2:?--prefix needs a name}"; shift 2 ;;
      *) die "down: unknown argument '$1' (see --help)" ;;
    esac
  done
  check_prefix
  local nss ns rt left
  nss="$(prefix_namespaces)"
  rt="$(rt_ns)"
  for ns in $nss; do stop_processes_in "$ns"; done
  if ns_exists "$rt"; then
    # Deleting the router's end of each pair deletes the host's end too.
    local dev
    for dev in $(ip -n "$rt" -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep '^v-' || true); do
      ip -n "$rt" link del "$dev" 2>/dev/null || true
    done
  fi
  for ns in $nss; do ip netns del "$ns" 2>/dev/null || true; done
  rm -f "$(state_file)"
  left="$(prefix_namespaces | tr '\n' ' ')"
  [ -z "$left" ] || die "could not delete: $left"
  if [ -n "$nss" ]; then echo "testnet '$PREFIX' is down"; else echo "testnet '$PREFIX' was not up"; fi
}

# --------------------------------------------------------- per-host commands

cmd_exec() {
  [ $# -ge 1 ] || die "exec needs a host and a command: exec h1 -- CMD..."
  local h="$1"; shift
  [ "${1:-}" = "--" ] && shift
  [ $# -ge 1 ] || die "exec needs a command after the host: exec $h -- CMD..."
  load_state
  [ "$h" = rt ] || host_index "$h" >/dev/null
  local ns; ns="$(ns_of "$h")"
  ns_exists "$ns" || die "namespace $ns is missing; rebuild with: $0 --prefix $PREFIX down && $0 --prefix $PREFIX up --hosts $HOSTS"
  exec ip netns exec "$ns" "$@"
}

cmd_ip() {
  [ $# -eq 1 ] || die "usage: ip HOST (rv, h1, ...)"
  load_state
  host_ip "$1"
}

set_link() { # HOST up|down
  local h="$1" state="$2" ns rt
  host_index "$h" >/dev/null
  ns="$(ns_of "$h")"; rt="$(rt_ns)"
  ns_exists "$ns" || die "namespace $ns is missing"
  ip -n "$rt" link set "$(router_dev "$h")" "$state"
  ip -n "$ns" link set "$HOST_DEV" "$state"
  if [ "$state" = up ]; then
    # IPv4 addresses survive a link going down but the default route does
    # not, so put both back (replace is a no-op when they are present).
    ip -n "$rt" addr replace "$(router_ip "$h")/24" dev "$(router_dev "$h")"
    ip -n "$ns" addr replace "$(host_ip "$h")/24" dev "$HOST_DEV"
    ip -n "$ns" route replace default via "$(router_ip "$h")"
  fi
}

cmd_cut() {
  [ $# -eq 1 ] || die "usage: cut HOST"
  load_state; set_link "$1" down
  echo "$1 is cut off"
}

cmd_restore() {
  [ $# -eq 1 ] || die "usage: restore HOST"
  load_state; set_link "$1" up
  echo "$1 is connected again ($(host_ip "$1"))"
}

is_number() { [[ "$1" =~ ^[0-9]+([.][0-9]+)?$ ]]; }

# tc_netem NS DEV ARGS...: replace the root qdisc. Exits 3 with a clear message
# when the kernel has no netem, so that callers can tell it from misuse.
tc_netem() {
  local ns="$1" dev="$2" err; shift 2
  if ! err="$(tc -n "$ns" qdisc replace dev "$dev" root netem "$@" 2>&1)"; then
    if [[ "$err" == *"qdisc kind is unknown"* || "$err" == *"No such file or directory"* ]]; then
      echo "netns.sh: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM, module sch_netem); try 'modprobe sch_netem' or use a kernel that has it" >&2
      return 3
    fi
    echo "netns.sh: tc failed on $ns/$dev: $err" >&2
    return 1
  fi
}

clear_netem() { # NS DEV
  if tc -n "$1" qdisc show dev "$2" 2>/dev/null | grep -q netem; then
    tc -n "$1" qdisc del dev "$2" root
  fi
}

cmd_netem() {
  [ $# -ge 1 ] || die "usage: netem HOST [--delay MS] [--jitter MS] [--loss PCT] | netem HOST --clear"
  local h="$1"; shift
  local delay="" jitter="" loss="" clear=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --delay) delay="${2:-}"; shift 2 || die "--delay needs milliseconds" ;;
      --jitter) jitter="${2:-}"; shift 2 || die "--jitter needs milliseconds" ;;
      --loss) loss="${2:-}"; shift 2 || die "--loss needs a percentage" ;;
      --clear) clear=1; shift ;;
      *) die "netem: unknown argument '$1' (see --help)" ;;
    esac
  done
  load_state
  host_index "$h" >/dev/null
  local ns rt
  ns="$(ns_of "$h")"; rt="$(rt_ns)"
  if [ "$clear" = 1 ]; then
    [ -z "$delay$jitter$loss" ] || die "netem: --clear takes no other option"
    clear_netem "$ns" "$HOST_DEV"
    clear_netem "$rt" "$(router_dev "$h")"
    echo "netem cleared on $h"
    return 0
  fi
  [ -z "$jitter" ] || [ -n "$delay" ] || die "--jitter needs --delay"
  [ -n "$delay$loss" ] || die "netem needs --delay MS and/or --loss PCT (or --clear)"
  [ -z "$delay" ] || is_number "$delay" || die "--delay takes milliseconds, got '$delay'"
  [ -z "$jitter" ] || is_number "$jitter" || die "--jitter takes milliseconds, got '$jitter'"
  [ -z "$loss" ] || is_number "$loss" || die "--loss takes a percentage, got '$loss'"
  if [ -n "$loss" ] && ! awk -v l="$loss" 'BEGIN { exit !(l <= 100) }'; then
    die "--loss must be at most 100, got $loss"
  fi
  local args=()
  [ -z "$delay" ] || args+=(delay "${delay}ms")
  [ -z "$jitter" ] || args+=("${jitter}ms")
  [ -z "$loss" ] || args+=(loss "${loss}%")
  local rc=0
  tc_netem "$ns" "$HOST_DEV" "${args[@]}" || rc=$?
  if [ "$rc" = 0 ]; then
    tc_netem "$rt" "$(router_dev "$h")" "${args[@]}" || rc=$?
    # Never leave one direction shaped and the other not.
    [ "$rc" = 0 ] || clear_netem "$ns" "$HOST_DEV" || true
  fi
  [ "$rc" = 0 ] || exit "$rc"
  echo "netem on $h, each direction: ${args[*]}"
}

cmd_status() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --prefix) PREFIX="${2:?--prefix needs a name}"; shift 2 ;;
      *) die "status: unknown argument '$1' (see --help)" ;;
    esac
  done
  check_prefix
  if [ ! -f "$(state_file)" ]; then
    echo "no testnet '$PREFIX' is up"
    local others="" f
    for f in "$STATE_DIR"/*.state; do
      [ -e "$f" ] && others+="$(basename "$f" .state) "
    done
    [ -z "$others" ] || echo "testnets that are up: $others(use --prefix NAME)"
    local stray; stray="$(prefix_namespaces | tr '\n' ' ')"
    [ -z "$stray" ] || echo "stray namespaces of '$PREFIX': $stray(remove with: $0 --prefix $PREFIX down)"
    return 0
  fi
  load_state
  local rt h ns
  rt="$(rt_ns)"
  echo "testnet '$PREFIX': router $rt, $HOSTS device hosts, state $(state_file)"
  printf '%-5s %-22s %-12s %-15s %-15s %s\n' HOST NAMESPACE ADDRESS HOST-LINK ROUTER-LINK QDISC
  while read -r h; do
    ns="$(ns_of "$h")"
    if ! ns_exists "$ns"; then
      printf '%-5s %-22s %s\n' "$h" "$ns" "MISSING"
      continue
    fi
    local addr hl rl q
    addr="$(ip -n "$ns" -4 -br addr show dev "$HOST_DEV" 2>/dev/null | awk '{print $3}')"
    hl="$(ip -n "$ns" -br link show dev "$HOST_DEV" 2>/dev/null | awk '{print $2}')"
    rl="$(ip -n "$rt" -br link show dev "$(router_dev "$h")" 2>/dev/null | awk '{print $2}')"
    q="$(tc -n "$ns" qdisc show dev "$HOST_DEV" 2>/dev/null | head -n1 | sed -E 's/^qdisc ([a-z_]+) [0-9a-f]*: (dev [^ ]+ )?(root )?(refcnt [0-9]+ )?/\1 /')"
    printf '%-5s %-22s %-12s %-15s %-15s %s\n' "$h" "$ns" "${addr:--}" "${hl:--}" "${rl:--}" "${q:--}"
  done < <(all_hosts)
}

# ----------------------------------------------------------------- selftest

# The selftest's network helpers, run inside namespaces with python3 (only the
# standard library). Every address they use is a testnet address.
SELFTEST_PY='
import socket, statistics, struct, sys, time

def tcp_listen(addr, port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, int(port)))
    s.listen(64)
    while True:
        c, _ = s.accept()
        c.close()

def connect_ms(addr, port, n):
    times = []
    for _ in range(int(n)):
        t = time.monotonic()
        c = socket.create_connection((addr, int(port)), timeout=5)
        times.append((time.monotonic() - t) * 1000)
        c.close()
    print("%.1f" % statistics.median(times))

def mcast_listen(ifaddr, group, port, secs, token, out, ready):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", int(port)))
    mreq = struct.pack("4s4s", socket.inet_aton(group), socket.inet_aton(ifaddr))
    s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
    open(ready, "w").close()
    deadline = time.monotonic() + float(secs)
    got = "none"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        s.settimeout(left)
        try:
            data, src = s.recvfrom(2048)
        except socket.timeout:
            break
        if data == token.encode():
            got = "got from %s" % src[0]
            break
    with open(out, "w") as f:
        f.write(got + "\n")

def mcast_send(ifaddr, group, port, token):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(ifaddr))
    # TTL 255 as mDNS uses: if the datagram stays on its link, TTL is not why.
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 255)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
    for _ in range(3):
        s.sendto(token.encode(), (group, int(port)))
        time.sleep(0.2)

globals()[sys.argv[1].replace("-", "_")](*sys.argv[2:])
'

ST_PASS=0 ST_FAIL=0 ST_SKIP=0
ST_PIDS=()
ST_TMP=""
ST_PY=""
ST_PORT=7411

st_result() { # PASS|FAIL|SKIP text
  printf '%-4s  %s\n' "$1" "$2"
  case "$1" in
    PASS) ST_PASS=$((ST_PASS + 1)) ;;
    FAIL) ST_FAIL=$((ST_FAIL + 1)) ;;
    SKIP) ST_SKIP=$((ST_SKIP + 1)) ;;
  esac
}
st_check() { # text CMD...: PASS if CMD succeeds
  local text="$1"; shift
  if "$@"; then st_result PASS "$text"; else st_result FAIL "$text"; fi
}

st_cleanup() {
  set +e
  local p
  for p in "${ST_PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null; done
  for p in "${ST_PIDS[@]:-}"; do [ -n "$p" ] && wait "$p" 2>/dev/null; done
  if [ -n "$(prefix_namespaces)" ] || [ -f "$(state_file)" ]; then
    "$SELF" --prefix "$PREFIX" down >/dev/null 2>&1 || echo "selftest: cleanup of $PREFIX failed; run: $SELF --prefix $PREFIX down" >&2
  fi
  [ -n "$ST_TMP" ] && rm -rf "$ST_TMP"
}

st_py() { # HOST MODE ARGS...: run the python helper inside HOST
  local h="$1"; shift
  ip netns exec "$(ns_of "$h")" "$ST_PY" "$ST_TMP/helper.py" "$@"
}

# tcp_probe NS ADDR PORT SECS: whether a TCP connect from NS succeeds in time.
tcp_probe() {
  # shellcheck disable=SC2016 # $1 and $2 expand in the inner bash.
  ip netns exec "$1" timeout "$4" bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$2" "$3" 2>/dev/null
}

# reach FROM TO: one probe; ping when installed, else a TCP connect with
# bash's /dev/tcp to the listener the selftest runs on every host.
reach() {
  local addr; addr="$(host_ip "$2")"
  if have ping && [ "${NUWA_TN_PROBE:-}" != tcp ]; then
    ip netns exec "$(ns_of "$1")" ping -c1 -W1 -q "$addr" >/dev/null 2>&1
  else
    tcp_probe "$(ns_of "$1")" "$addr" "$ST_PORT" 2
  fi
}
reach_within() { # FROM TO SECS: wait for reachability with a deadline
  local end=$((SECONDS + $3))
  while :; do
    reach "$1" "$2" && return 0
    [ "$SECONDS" -lt "$end" ] || return 1
    sleep 0.1
  done
}
unreachable() { ! reach "$1" "$2"; }

wait_files() { # SECS FILE...: wait until every FILE exists
  local end=$((SECONDS + $1)) f; shift
  for f in "$@"; do
    while [ ! -e "$f" ]; do
      [ "$SECONDS" -lt "$end" ] || return 1
      sleep 0.05
    done
  done
}

quietly() { "$@" >>"$ST_TMP/quiet.log" 2>&1; }
none_alive() {
  local p
  for p in "$@"; do ! kill -0 "$p" 2>/dev/null || return 1; done
}
no_prefix_left() { [ -z "$(prefix_namespaces)" ] && [ ! -f "$(state_file)" ]; }
router_has_no_default() { [ -z "$(ip -n "$(rt_ns)" route show default)" ]; }
router_forwards() { [ "$(ip netns exec "$(rt_ns)" cat /proc/sys/net/ipv4/ip_forward)" = 1 ]; }
lo_up_everywhere() {
  local h
  for h in rt $(all_hosts); do
    ip -n "$(ns_of "$h")" -br link show dev lo | grep -q UP || return 1
  done
}
median_ms() { st_py "$1" connect-ms "$(host_ip "$2")" "$ST_PORT" 7; }
at_least() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a >= b) }'; }
at_most() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a <= b) }'; }
file_says() { grep -q "^$2" "$1" 2>/dev/null; }

cmd_selftest() {
  local strict=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --strict) strict=1; shift ;;
      *) die "selftest: unknown argument '$1' (see --help)" ;;
    esac
  done
  have python3 || die "selftest needs python3 (standard library only)"
  have timeout || die "selftest needs 'timeout' (coreutils)"
  # The interpreter itself, not a version-manager shim, so that $! is its PID.
  ST_PY="$(python3 -c 'import sys; print(sys.executable)')"
  PREFIX="nuwa-st-$$"
  ST_TMP="$(mktemp -d -t nuwa-netns-selftest.XXXXXX)"
  trap st_cleanup EXIT
  trap 'exit 130' INT TERM HUP
  printf '%s' "$SELFTEST_PY" >"$ST_TMP/helper.py"
  local probe="TCP connect (no ping installed)"
  if have ping && [ "${NUWA_TN_PROBE:-}" != tcp ]; then probe="ping"; fi
  echo "selftest: prefix $PREFIX, reachability by $probe"

  # A failing `up` must leave nothing behind.
  if NUWA_TN_FAIL_AFTER_HOSTS=2 "$SELF" --prefix "$PREFIX" up --hosts 3 >/dev/null 2>&1; then
    st_result FAIL "up fails on an injected error midway"
  else
    st_check "up removes what it created when it fails midway" no_prefix_left
  fi

  if ! "$SELF" --prefix "$PREFIX" up --hosts 3 >/dev/null; then
    st_result FAIL "up --hosts 3"
    exit 1
  fi
  st_result PASS "up --hosts 3"
  load_state
  st_check "lo is up in every namespace" lo_up_everywhere
  st_check "router forwards IPv4" router_forwards
  st_check "router has no default route (nothing can leave the testnet)" router_has_no_default
  st_check "ip h1 prints 10.77.1.2" test "$("$SELF" --prefix "$PREFIX" ip h1)" = "$NET.1.2"

  local h
  for h in $(all_hosts); do
    ip netns exec "$(ns_of "$h")" "$ST_PY" "$ST_TMP/helper.py" tcp-listen "$(host_ip "$h")" "$ST_PORT" \
      >/dev/null 2>&1 &
    ST_PIDS+=($!)
  done
  local listening=1
  for h in $(all_hosts); do
    local end=$((SECONDS + 5))
    until tcp_probe "$(ns_of "$h")" "$(host_ip "$h")" "$ST_PORT" 1; do
      [ "$SECONDS" -lt "$end" ] || { listening=0; break; }
      sleep 0.05
    done
  done
  st_check "a TCP listener is up on every host" test "$listening" = 1

  st_check "h1 reaches h2" reach_within h1 h2 3
  st_check "h1 reaches rv" reach_within h1 rv 3
  st_check "h3 reaches h1" reach_within h3 h1 3

  "$SELF" --prefix "$PREFIX" cut h1 >/dev/null
  st_check "cut h1: h1 cannot reach rv" unreachable h1 rv
  st_check "cut h1: h2 cannot reach h1" unreachable h2 h1
  st_check "cut h1: h2 still reaches rv" reach_within h2 rv 3
  "$SELF" --prefix "$PREFIX" restore h1 >/dev/null
  st_check "restore h1: h1 reaches rv again" reach_within h1 rv 5
  st_check "restore h1: h2 reaches h1 again" reach_within h2 h1 5

  # netem: a TCP connect is one round trip, which crosses h2's link once in
  # each direction, so --delay 50 should add about 100 ms.
  local base rc=0 slow cleared
  base="$(median_ms h1 h2)"
  "$SELF" --prefix "$PREFIX" netem h2 --delay 50 >/dev/null 2>"$ST_TMP/netem.err" || rc=$?
  if [ "$rc" = 3 ]; then
    st_result SKIP "netem h2 --delay 50 slows a round trip ($(sed 's/^netns.sh: //' "$ST_TMP/netem.err"))"
    st_result SKIP "netem h3 --loss 100 cuts h3 off, --clear brings it back (no netem in this kernel)"
  elif [ "$rc" != 0 ]; then
    st_result FAIL "netem h2 --delay 50: $(cat "$ST_TMP/netem.err")"
  else
    slow="$(median_ms h1 h2)"
    st_check "netem h2 --delay 50: connect h1->h2 ${base} ms -> ${slow} ms (want >= +80)" \
      at_least "$slow" "$(awk -v b="$base" 'BEGIN { print b + 80 }')"
    "$SELF" --prefix "$PREFIX" netem h2 --clear >/dev/null
    cleared="$(median_ms h1 h2)"
    st_check "netem h2 --clear: connect h1->h2 back to ${cleared} ms (want <= ${base} + 30)" \
      at_most "$cleared" "$(awk -v b="$base" 'BEGIN { print b + 30 }')"
    "$SELF" --prefix "$PREFIX" netem h3 --loss 100 >/dev/null
    st_check "netem h3 --loss 100: h1 cannot reach h3" unreachable h1 h3
    "$SELF" --prefix "$PREFIX" netem h3 --clear >/dev/null
    st_check "netem h3 --clear: h1 reaches h3 again" reach_within h1 h3 5
  fi

  # mDNS: h1 sends to 224.0.0.251:5353. Controls that the datagram really
  # went out: h1 itself (multicast loopback) and the router on h1's link both
  # receive it. What matters: listeners in h2 and rv, joined to the group on
  # their own links, receive nothing within 2 s.
  local token="nuwa-selftest-$$-$RANDOM" l ready=()
  local -A listen_ns=([h1]="$(ns_of h1)" [rt-h1]="$(rt_ns)" [h2]="$(ns_of h2)" [rv]="$(ns_of rv)")
  local -A listen_if=([h1]="$(host_ip h1)" [rt-h1]="$(router_ip h1)" [h2]="$(host_ip h2)" [rv]="$(host_ip rv)")
  for l in h1 rt-h1 h2 rv; do
    ip netns exec "${listen_ns[$l]}" "$ST_PY" "$ST_TMP/helper.py" mcast-listen \
      "${listen_if[$l]}" 224.0.0.251 5353 3 "$token" "$ST_TMP/mcast.$l" "$ST_TMP/ready.$l" \
      >"$ST_TMP/mcast.$l.log" 2>&1 &
    ST_PIDS+=($!)
    ready+=("$ST_TMP/ready.$l")
  done
  if wait_files 5 "${ready[@]}"; then
    st_py h1 mcast-send "$(host_ip h1)" 224.0.0.251 5353 "$token"
    # Each listener stops on its first match or after 3 s, i.e. at least
    # 2 s after the last datagram.
    local p
    for p in "${ST_PIDS[@]: -4}"; do wait "$p" 2>/dev/null || true; done
    st_check "mDNS control: h1 hears its own datagram (multicast loopback)" file_says "$ST_TMP/mcast.h1" got
    st_check "mDNS control: the router hears it on h1's link" file_says "$ST_TMP/mcast.rt-h1" got
    st_check "mDNS from h1 does not reach h2 within 2 s" file_says "$ST_TMP/mcast.h2" none
    st_check "mDNS from h1 does not reach rv within 2 s" file_says "$ST_TMP/mcast.rv" none
  else
    st_result FAIL "mDNS listeners did not start: $(cat "$ST_TMP"/mcast.*.log 2>/dev/null | tail -n 3)"
  fi

  # The TCP listeners are still running inside the namespaces, as daemons
  # would be: down must stop them.
  local alive=("${ST_PIDS[@]:0:$((HOSTS + 1))}")
  ST_PIDS=()
  st_check "down" quietly "$SELF" --prefix "$PREFIX" down
  st_check "down stops the processes left inside the namespaces" none_alive "${alive[@]}"
  st_check "down leaves no namespace or state of $PREFIX" no_prefix_left
  st_check "down again is a no-op" quietly "$SELF" --prefix "$PREFIX" down

  echo "selftest: $ST_PASS passed, $ST_FAIL failed, $ST_SKIP skipped"
  [ "$ST_FAIL" = 0 ] || exit 1
  if [ "$ST_SKIP" != 0 ] && [ "$strict" = 1 ]; then
    echo "selftest: --strict counts skipped checks as failures" >&2
    exit 1
  fi
}

# --------------------------------------------------------------------- main

main() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --prefix) PREFIX="${2:?--prefix needs a name}"; shift 2 ;;
      -h|--help|help) usage; exit 0 ;;
      -*) die "unknown option '$1' (see --help)" ;;
      *) break ;;
    esac
  done
  [ $# -ge 1 ] || { usage >&2; exit 2; }
  local cmd="$1"; shift
  # `--prefix` may also follow the command (but never inside exec's CMD).
  local rest=()
  if [ "$cmd" = exec ]; then
    rest=("$@")
  else
    while [ $# -gt 0 ]; do
      case "$1" in
        --prefix) PREFIX="${2:?--prefix needs a name}"; shift 2 ;;
        *) rest+=("$1"); shift ;;
      esac
    done
  fi
  check_prefix
  require_root_and_tools "$cmd" "${rest[@]}"
  case "$cmd" in
    up) cmd_up "${rest[@]}" ;;
    down) cmd_down "${rest[@]}" ;;
    exec) cmd_exec "${rest[@]}" ;;
    ip) cmd_ip "${rest[@]}" ;;
    cut) cmd_cut "${rest[@]}" ;;
    restore) cmd_restore "${rest[@]}" ;;
    netem) cmd_netem "${rest[@]}" ;;
    status) cmd_status "${rest[@]}" ;;
    selftest) cmd_selftest "${rest[@]}" ;;
    *) die "unknown command '$cmd' (see --help)" ;;
  esac
}

main "$@"
