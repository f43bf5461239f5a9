#!/usr/bin/env python3
"""Makes node/link/idle-order.txt: the functions an idle daemon runs, which
the release link places together (node/build.rs).

    sudo python3 scripts/bench/link_order.py [--passes 2] [--secs 70]
    python3 scripts/bench/link_order.py --check target/release/nuwa-node

Each pass builds the release binary (with the order so far), starts three
meshed daemons on loopback (as nuwa-bench's cluster) from their own copies
of it, under `perf record -e page-faults`, and waits until each has given
its code pages back for the last time (the core's memory release once it
settled with every peer). From then
on every page of code the idle daemon touches must fault on its own: the
disk's readahead is off while the pass runs (`read_ahead_kb` = 0, put back
after) and the daemon drops its copy's page cache right after the release
(`NUWA_PROFILE_IDLE_CODE`, node/src/daemon/exec/resident.rs), so the
kernel's fault-around finds no neighbour to map. The functions
overlapping each touched page are listed in the order first touched; the
passes are merged (idle work varies with timing), and the file is written.

Needs root (perf, read_ahead_kb), perf and nm. Rerun it after changing the
toolchain or the dependencies: the list holds mangled names, and a name the
linker no longer finds is skipped (the binary is correct, idle memory grows;
the figure is in docs/performance.md). The names are those of
`cargo build --release -p nuwa-node` (and `cargo install --path node`):
built together with another package, nuwa-node's dependencies get that
package's features too and other names. The release profile's single
codegen unit per crate (Cargo.toml) leaves local functions without the
`.llvm.` suffixes that followed each module's content and the checkout's
path: the names then survive other checkouts and unrelated changes.
"""

import argparse
import bisect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "node", "link", "idle-order.txt")
LOOPBACK = ["--listen", "/ip4/127.0.0.1/tcp/0", "--no-mdns", "--no-dht", "--no-rendezvous",
            "--no-known-peers", "--api-listen", "127.0.0.1:0"]
NODES = 3
# The code release gives back the binary's text and read-only data: one
# MADV_DONTNEED of at least this many bytes marks it.
RELEASE_MIN_BYTES = 8 << 20
# `--check`: the share of the list's names the binary must still define.
CHECK_MIN = 0.8


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def drop_page_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def readahead_file(path):
    """The sysfs readahead knob of the disk holding `path`."""
    dev = os.stat(path).st_dev
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for cand in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb"):
        if os.path.exists(cand):
            return cand
    sys.exit(f"no read_ahead_kb for the disk of {path} (device {os.major(dev)}:{os.minor(dev)})")


def text_symbols(binary):
    out = subprocess.run(["nm", "-n", "-S", "--defined-only", binary],
                         capture_output=True, text=True, check=True).stdout
    syms = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "tTwW":
            syms.append((int(parts[0], 16), int(parts[1], 16), parts[3]))
    syms.sort()
    return syms


def one_pass(binary, secs, work):
    env = dict(os.environ, RUST_LOG="warn", NUWA_PROFILE_IDLE_CODE="1")
    env.pop("NUWA_HOME", None)

    def cli(home, *args):
        return subprocess.run([binary, "--home", home, *args], env=env,
                              capture_output=True, text=True, check=True).stdout

    homes = [os.path.join(work, f"n{i}") for i in range(NODES)]
    cli(homes[0], "init", "--name", "n0", "--i-have-written-it-down")
    for i in range(1, NODES):
        cli(homes[0], "device", "provision", "--out", homes[i], "--name", f"n{i}")
    copies = []
    for i in range(NODES):
        c = os.path.join(work, f"nuwa-node-{i}")
        shutil.copy(binary, c)
        copies.append(c)
    os.sync()
    for c in copies:
        drop_page_cache(c)

    knob = readahead_file(copies[0])
    with open(knob) as f:
        old = f.read().strip()
    perfs, pids, addrs = [], [], []
    released = [False] * NODES
    peak = [0] * NODES

    def watch():
        for i, pid in enumerate(pids):
            r = rss_kib(pid)
            peak[i] = max(peak[i], r)
            # The daemon drops its copy's page cache right after each
            # release (NUWA_PROFILE_IDLE_CODE); the last release counts.
            if r < peak[i] - RELEASE_MIN_BYTES // 1024:
                released[i] = True
                peak[i] = r

    try:
        with open(knob, "w") as f:
            f.write("0")
        for i in range(NODES):
            args = [copies[i], "--home", homes[i], "run", *LOOPBACK]
            for p in (sorted({addrs[0], addrs[i - 1]}) if i else []):
                args += ["--peer", p]
            q = subprocess.Popen(
                ["perf", "record", "-q", "-e", "page-faults", "-c", "1", "-d",
                 "-e", "syscalls:sys_enter_madvise", "-o", os.path.join(work, f"perf{i}.data"),
                 "--", *args],
                env=env, stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(work, f"n{i}.log"), "w"))
            perfs.append(q)
            deadline = time.time() + 10
            while not (kids := open(f"/proc/{q.pid}/task/{q.pid}/children").read().split()):
                if time.time() > deadline:
                    sys.exit(f"daemon n{i} did not start under perf")
                time.sleep(0.01)
            pids.append(int(kids[0]))
            deadline = time.time() + 60
            while True:
                try:
                    st = json.loads(cli(homes[i], "status", "--json"))
                    addrs.append(next(a for a in st["listen_addrs"] if a.startswith("/ip4/127.0.0.1/")))
                    break
                except (subprocess.CalledProcessError, ValueError, StopIteration):
                    if time.time() > deadline:
                        sys.exit(f"daemon n{i} did not answer within 60 s")
                    watch()
                    time.sleep(0.02)
        start = time.time()
        while time.time() - start < secs:
            watch()
            time.sleep(0.02)
        ends = [rss_kib(p) for p in pids]
        maps = [open(f"/proc/{p}/maps").read() for p in pids]
    finally:
        with open(knob, "w") as f:
            f.write(old)
        for p in pids:
            try:
                os.kill(p, 15)
            except ProcessLookupError:
                pass
        for q in perfs:
            q.wait()

    syms = text_symbols(binary)
    starts = [s[0] for s in syms]
    seen, order = set(), []
    for i in range(NODES):
        if not released[i]:
            print(f"  n{i}: its code release was not seen; skipped", file=sys.stderr)
            continue
        base = next(int(l.split()[0].split("-")[0], 16) for l in maps[i].splitlines()
                    if l.split()[-1] == copies[i] and int(l.split()[2], 16) == 0)
        lines = subprocess.run(["perf", "script", "-i", os.path.join(work, f"perf{i}.data"), "-F", "+addr"],
                               capture_output=True, text=True).stdout.splitlines()
        release = None
        for k, line in enumerate(lines):
            m = re.search(r"len_in: (0x[0-9a-f]+), behavior: (0x[0-9a-f]+)", line)
            if m and int(m.group(2), 16) == 4 and int(m.group(1), 16) >= RELEASE_MIN_BYTES:
                release = k
        pages = []
        for line in lines[(release or 0) + 1:]:
            if "page-faults:" not in line:
                continue
            tok = line.split()
            addr = int(tok[tok.index("page-faults:") + 1], 16) - base
            if 0 <= addr < (1 << 32):
                pages.append(addr & ~0xFFF)
        for page in pages:
            j = max(bisect.bisect_right(starts, page) - 1, 0)
            while j < len(syms) and syms[j][0] < page + 4096:
                at, size, name = syms[j]
                if at + size > page and name not in seen:
                    seen.add(name)
                    order.append(name)
                j += 1
        print(f"  n{i}: {len(set(pages))} pages touched after the release; RSS at the end {ends[i]} KiB",
              file=sys.stderr)
    return order


def check(binary):
    """Fails when the list went stale: fewer than CHECK_MIN of its names are
    in `binary`, or its first one is not where the text starts."""
    with open(OUT) as f:
        wanted = [line.strip() for line in f if line.strip()]
    syms = text_symbols(binary)
    have = {name for _, _, name in syms}
    found = sum(1 for w in wanted if w in have)
    first = next((at for at, _, name in syms if name == wanted[0]), None)
    share = found / len(wanted)
    where = "missing" if first is None else f"at {first:#x}"
    print(f"link order: {found} of {len(wanted)} names found ({share:.0%}); "
          f"the first {where}, the text starts at {syms[0][0]:#x}")
    if share < CHECK_MIN or first is None or first - syms[0][0] > (64 << 10):
        sys.exit("the idle link order is stale or not applied: rerun scripts/bench/link_order.py "
                 "(docs/performance.md, \"Issue 26, fourth session\")")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", metavar="BIN", help="only check that BIN was linked with a current list")
    ap.add_argument("--passes", type=int, default=2, help="profiles to merge (default 2)")
    ap.add_argument("--secs", type=float, default=70.0,
                    help="how long each pass runs idle (default 70: past the 60 s periodic work)")
    a = ap.parse_args()
    if a.check:
        return check(a.check)
    if os.geteuid() != 0:
        sys.exit("run as root: perf and the disk's readahead setting need it")
    merged, seen = [], set()
    for n in range(a.passes):
        print(f"pass {n + 1}: building the release binary", file=sys.stderr)
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "nuwa-node", "--bin", "nuwa-node"],
                       cwd=ROOT, check=True)
        binary = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")),
                              "release", "nuwa-node")
        work = tempfile.mkdtemp(prefix="nuwa-link-order-", dir=os.path.dirname(binary))
        try:
            got = one_pass(binary, a.secs, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        new = [s for s in got if s not in seen]
        merged += new
        seen.update(new)
        print(f"pass {n + 1}: {len(got)} functions, {len(new)} new, {len(merged)} in all", file=sys.stderr)
        os.makedirs(os.path.dirname(OUT), exist_ok=True)
        with open(OUT + ".tmp", "w") as f:
            f.writelines(s + "\n" for s in merged)
        os.replace(OUT + ".tmp", OUT)
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
