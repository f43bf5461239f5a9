#!/usr/bin/env python3
"""Where one write's propagation time goes, from the daemons' trace points.

Run the latency workload with the daemons' `nuwa_path` trace points on and
the homes kept, then point this at the run's directory:

    NUWA_BENCH_LOG=warn,nuwa_path=trace nuwa-bench --only latency --sizes 3 \
        --samples 200 --reps 1 --keep --work-dir /tmp/w
    python3 scripts/bench/path_profile.py /tmp/w/nuwa-bench-*/latency-n3-r0

Node n0 is the writer. A sample starts at n0's `put in` (the HTTP handler)
and holds every trace point until the next one; for each (node, point) the
first occurrence in the sample is taken, relative to `put in`. Prints the
median and p90 over samples, in microseconds, in the order the points occur.
The first 5 samples (warm-up) are skipped.
"""

import datetime
import glob
import os
import statistics
import sys


def parse(path, node):
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            if "nuwa_path:" not in line:
                continue
            ts, rest = line.split(" ", 1)
            point = rest.split("nuwa_path:", 1)[1].strip()
            t = datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
            out.append((t, node, point))
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    run = sys.argv[1]
    events = []
    for log in sorted(glob.glob(os.path.join(run, "n*.log"))):
        events += parse(log, os.path.basename(log)[:-4])
    events.sort()
    samples, cur = [], None
    for t, node, point in events:
        if node == "n0" and point == "put in":
            cur = {"t0": t, "first": {}}
            samples.append(cur)
        elif cur is not None:
            cur["first"].setdefault((node, point), t - cur["t0"])
    samples = samples[5:]
    if not samples:
        sys.exit("no samples: were the trace points on (NUWA_BENCH_LOG)?")
    keys = {}
    for s in samples:
        for k, v in s["first"].items():
            keys.setdefault(k, []).append(v * 1e6)
    rows = sorted(keys.items(), key=lambda kv: statistics.median(kv[1]))
    print(f"{len(samples)} samples; µs after the writer's HTTP handler began")
    print(f"{'node':<5} {'point':<14} {'median':>8} {'p90':>8} {'seen':>5}")
    for (node, point), vs in rows:
        vs.sort()
        p90 = vs[min(len(vs) - 1, int(len(vs) * 0.9))]
        print(f"{node:<5} {point:<14} {statistics.median(vs):>8.0f} {p90:>8.0f} {len(vs):>5}")


if __name__ == "__main__":
    main()
