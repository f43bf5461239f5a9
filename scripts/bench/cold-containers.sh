#!/usr/bin/env bash
# Issue 13, "containers out of memory": one daemon gets 10,000 containers
# of 100 items each through state.batch, restarts, and reports its idle RSS
# and the time of point reads of cold containers.
#
#   ./scripts/bench/cold-containers.sh [path/to/nuwa-node]
#
# Loopback only, mDNS off, in a temporary directory that is removed after.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
B="${1:-}"
if [ -z "$B" ]; then
  (cd "$root" && cargo build --release -q -p nuwa-node)
  target="$(cd "$root" && cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
  B="$target/release/nuwa-node"
fi
D="$(mktemp -d)"
PID=
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null; rm -rf "$D"; }
trap cleanup EXIT
"$B" --home "$D/a" init --name a --i-have-written-it-down >/dev/null 2>&1
start() {
  rm -f "$D/a/api.json"
  "$B" --home "$D/a" run --no-mdns --listen /ip4/127.0.0.1/tcp/0 >"$D/a.log" 2>&1 &
  for _ in $(seq 300); do [ -f "$D/a/api.json" ] && break; sleep 0.1; done
  read -r URL TOKEN PID < <(python3 -c "import json;d=json.load(open('$D/a/api.json'));print(d['url'],d['token'],d['pid'])")
}
rss() { grep VmRSS "/proc/$PID/status" | awk '{printf "%.1f MB", $2/1000}'; }
start
python3 - "$URL" "$TOKEN" <<'PY'
import json, sys, time, urllib.request
url, token = sys.argv[1], sys.argv[2]
t = time.time()
for b in range(100):
    ops = [{"op": "put", "container": "c-%05d" % c, "key": "k%d" % k,
            "value": {"n": k, "text": "item %d of container %d" % (k, c)}}
           for c in range(b * 100, (b + 1) * 100) for k in range(100)]
    req = urllib.request.Request(url + "/v1/state.batch", data=json.dumps({"ops": ops}).encode(),
                                 headers={"authorization": "Bearer " + token,
                                          "content-type": "application/json"})
    assert json.load(urllib.request.urlopen(req))["ok"]
print("filled 10,000 containers x 100 items in %.1f s" % (time.time() - t))
PY
echo "RSS after the fill: $(rss)"
kill "$PID"; while kill -0 "$PID" 2>/dev/null; do sleep 0.2; done
echo "store: $(du -sh "$D/a/store" | cut -f1)"
t0=$(date +%s.%N); start; t1=$(date +%s.%N)
echo "restart until the API answers: $(python3 -c "print(round($t1 - $t0, 1))") s"
sleep 8
echo "idle RSS after the restart: $(rss)"
for c in 04242 07777 00001; do
  curl -s -o /dev/null -w "point read of cold container c-$c: %{time_total} s\n" \
    -H "authorization: Bearer $TOKEN" "$URL/v1/state/get?container=c-$c&key=k7"
done
curl -s -o /dev/null -w "the same container again: %{time_total} s\n" \
  -H "authorization: Bearer $TOKEN" "$URL/v1/state/get?container=c-04242&key=k8"
