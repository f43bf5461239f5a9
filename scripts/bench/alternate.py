#!/usr/bin/env python3
"""Propagation latency of nuwa-node and samod, measured in alternation.

`all.sh` runs each tool's workloads to the end before the next tool starts,
about half an hour apart; on a shared machine whose speed drifts by that
much, a same-run comparison of the latency rows can say more about the
machine than about the tools (docs/bench/history.md, "Issue 26, tenth
session"). This script runs only the latency workload, one repetition of
each tool per round, the first tool swapped every round, so that a drift
lands on both. Each ratio is taken inside one round; the table gives the
median and min-max over the rounds.

    python3 scripts/bench/alternate.py                  # 5 rounds, N=3,5,10
    python3 scripts/bench/alternate.py --rounds 3 --sizes 3 --samples 500
    python3 scripts/bench/alternate.py --out docs/bench/alternate.md

Builds nuwa-node and nuwa-bench in release mode, and samod's benchmark
program through scripts/bench/samod/run.sh (crates.io on first use).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build() -> tuple[Path, Path]:
    for pkg in ("nuwa-node", "nuwa-bench"):
        # Apart, as in all.sh: built together, cargo unifies their features.
        subprocess.run(["cargo", "build", "--release", "-q", "-p", pkg], cwd=ROOT, check=True)
    meta = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )
    target = Path(json.loads(meta.stdout)["target_directory"]) / "release"
    return target / "nuwa-node", target / "nuwa-bench"


def nuwa_round(node: Path, bench: Path, work: Path, args, r: int) -> dict:
    out = work / f"nuwa-{r}"
    cmd = [str(bench), "--node-bin", str(node), "--only", "latency", "--sizes", args.sizes,
           "--samples", str(args.samples), "--reps", "1", "--out", str(out)]
    run(cmd, work / f"nuwa-{r}.log")
    return json.loads((out / "results.json").read_text())["propagation_latency"]


def samod_round(work: Path, args, r: int) -> dict:
    out = work / f"samod-{r}.json"
    # samod's program has no workload filter: its other workloads are made
    # as small as it takes (and measured, but not reported here).
    cmd = [str(ROOT / "scripts/bench/samod/run.sh"), "--sizes", args.sizes,
           "--samples", str(args.samples), "--reps", "1", "--writes", "10",
           "--log-entries", "10", "--batch-items", "0", "--json-out", str(out)]
    run(cmd, work / f"samod-{r}.log")
    return json.loads(out.read_text())["propagation_latency"]


def run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[:1])} failed with status {done.returncode}; its output: {log}")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}–{max(values):.3g})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds of one repetition per tool (default 5)")
    p.add_argument("--sizes", default="3,5,10", help="cluster sizes (default 3,5,10)")
    p.add_argument("--samples", type=int, default=300, help="writes timed per size and round (default 300)")
    p.add_argument("--out", type=Path, help="also write the table (Markdown) to this file")
    args = p.parse_args()
    if args.rounds < 1 or args.samples < 1:
        p.error("--rounds and --samples must be at least 1")
    # Checked here, before a build of minutes; the JSON keys are the sizes as written.
    try:
        sizes = [str(int(s)) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes takes cluster sizes such as 3,5,10, not {args.sizes!r}")
    if not sizes or any(int(n) < 2 for n in sizes):
        p.error("--sizes needs at least one cluster size, each of 2 or more")
    args.sizes = ",".join(sizes)
    node, bench = build()
    work = Path(tempfile.mkdtemp(prefix="nuwa-alternate-"))
    rounds = []
    for r in range(args.rounds):
        order = ("nuwa", "samod") if r % 2 == 0 else ("samod", "nuwa")
        got = {}
        for tool in order:
            got[tool] = nuwa_round(node, bench, work, args, r) if tool == "nuwa" else samod_round(work, args, r)
        line = "  ".join(
            f"N={n} p50 {got['nuwa'][n]['p50_ms']['median']:.2f}/{got['samod'][n]['p50_ms']['median']:.2f}"
            for n in sizes
        )
        print(f"round {r + 1} ({order[0]} first), nuwa/samod ms: {line}", file=sys.stderr)
        rounds.append(got)
    rows = ["| figure | nuwa-node (ms) | samod (ms) | nuwa / samod, per round |", "|---|---|---|---|"]
    for n in sizes:
        for q in ("p50_ms", "p99_ms"):
            nu = [g["nuwa"][n][q]["median"] for g in rounds]
            sa = [g["samod"][n][q]["median"] for g in rounds]
            ratio = [a / b for a, b in zip(nu, sa)]
            rows.append(f"| propagation {q[:3]} N={n} | {spread(nu)} | {spread(sa)} | {spread(ratio)} |")
    table = (
        f"{args.rounds} rounds, {args.samples} writes per size and round, the first tool "
        "swapped every round; median (min–max) over the rounds.\n\n" + "\n".join(rows) + "\n"
    )
    print(table)
    if args.out:
        args.out.write_text(table)
    print(f"logs and JSON: {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
