#!/usr/bin/env node
// Runs the nuwa-bench workloads against automerge-repo, so that
// `nuwa-bench --compare` can set both side by side (docs/performance.md,
// "JSON schema", defines the output).
//
// One file plays two parts. Started normally it is the coordinator: it forks
// one Node.js process per "node" (this same file with `--child`), drives the
// workloads over IPC, and writes the JSON and a table. Each child holds one
// automerge-repo `Repo` with NodeFS storage in its own temporary directory;
// node 0 listens on a WebSocket server on 127.0.0.1 and every other node
// connects to it as a client, so the topology is a star around node 0.
//
// Timestamps come from `process.hrtime`, which on Linux reads the system-wide
// CLOCK_MONOTONIC, so a time taken in one child can be subtracted from a time
// taken in another without any IPC delay in between.
//
// What this script leaves to others: it does not tune automerge-repo (all
// Repo and adapter settings are the library defaults, except the sync
// debounce when `--sync-debounce-ms` asks for it; see debounce-hook.mjs) and
// it does not compare figures; `nuwa-bench --compare FILE` does that.

import { fork } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

import * as A from "@automerge/automerge";
import { Repo } from "@automerge/automerge-repo";
import {
  WebSocketClientAdapter,
  WebSocketServerAdapter,
} from "@automerge/automerge-repo-network-websocket";
import { NodeFSStorageAdapter } from "@automerge/automerge-repo-storage-nodefs";
import { WebSocketServer } from "ws";

const SCRIPT_PATH = fileURLToPath(import.meta.url);
const SCRIPT_DIR = path.dirname(SCRIPT_PATH);

/** Milliseconds on the system-wide monotonic clock (comparable across processes). */
function nowMs() {
  return Number(process.hrtime.bigint()) / 1e6;
}

/** Heads as one comparable string; order inside Automerge heads is not significant. */
function headsKey(heads) {
  return [...heads].sort().join(",");
}

/** The value written by every put: small, and the same shape in every workload. */
function valueFor(i) {
  return `value-${String(i).padStart(10, "0")}`;
}

// ---------------------------------------------------------------------------
// Child: one automerge-repo node
// ---------------------------------------------------------------------------

async function runChild() {
  const state = {
    repo: undefined,
    handle: undefined,
    wss: undefined,
    // Bytes the WebSocket server (node 0) sent and received. In a star every
    // message has node 0 at one end, so sent + received is what all nodes sent.
    payloadSentBytes: 0,
    payloadRecvBytes: 0,
    payloadMessages: 0,
    tcpSockets: new Set(),
    tcpClosedWrittenBytes: 0,
    tcpClosedReadBytes: 0,
    lastHeadsChangeMs: 0,
    headsWaiters: [],
  };

  const reply = (id, result) => process.send({ id, ok: true, result });
  const fail = (id, err) =>
    process.send({ id, ok: false, error: String(err?.stack ?? err) });

  function attach(handle) {
    state.handle = handle;
    state.lastHeadsChangeMs = nowMs();
    // `heads-changed` fires on every new head, also for changes without
    // patches, so it is the exact moment the heads became what they are.
    handle.on("heads-changed", () => {
      state.lastHeadsChangeMs = nowMs();
      if (state.headsWaiters.length > 0) checkHeadsWaiters();
    });
    // Propagation samples: report the first sight of each `lat_*` key.
    handle.on("change", ({ patches }) => {
      const t = nowMs();
      for (const p of patches) {
        if (p.action === "put" && p.path.length === 1) {
          const key = String(p.path[0]);
          if (key.startsWith("lat_")) process.send({ event: "seen", key, t_ms: t });
        }
      }
    });
  }

  function checkHeadsWaiters() {
    const current = headsKey(A.getHeads(state.handle.doc()));
    const still = [];
    for (const w of state.headsWaiters) {
      if (w.key === current) {
        clearTimeout(w.timer);
        w.resolve(state.lastHeadsChangeMs);
      } else {
        still.push(w);
      }
    }
    state.headsWaiters = still;
  }

  function waitHeads(heads, timeoutMs) {
    const key = headsKey(heads);
    if (state.handle && headsKey(A.getHeads(state.handle.doc())) === key) {
      return Promise.resolve(state.lastHeadsChangeMs);
    }
    return new Promise((resolve, reject) => {
      const w = { key, resolve };
      w.timer = setTimeout(() => {
        state.headsWaiters = state.headsWaiters.filter((x) => x !== w);
        reject(new Error(`heads did not converge within ${timeoutMs} ms`));
      }, timeoutMs);
      state.headsWaiters.push(w);
    });
  }

  /**
   * Runs Automerge's save, load and sync paths once on a small in-memory
   * document. V8 compiles WebAssembly lazily and tiers hot functions up
   * later, so the first large sync in a fresh process otherwise measures the
   * compiler as much as the sync.
   */
  function warmUpAutomerge() {
    const backend = A.getBackend(A.init());
    for (let i = 0; i < 2000; i++) {
      backend.put("/", `w_${i}`, valueFor(i));
      backend.commit();
    }
    let source = A.load(backend.save());
    let target = A.init();
    let sourceState = A.initSyncState();
    let targetState = A.initSyncState();
    for (let round = 0; round < 10; round++) {
      let toSource;
      let toTarget;
      [targetState, toSource] = A.generateSyncMessage(target, targetState);
      if (toSource) [source, sourceState] = A.receiveSyncMessage(source, sourceState, toSource);
      [sourceState, toTarget] = A.generateSyncMessage(source, sourceState);
      if (toTarget) [target, targetState] = A.receiveSyncMessage(target, targetState, toTarget);
      if (!toSource && !toTarget) break;
    }
    A.getHeads(target);
  }

  async function startServer(dir, peerId) {
    const wss = new WebSocketServer({ host: "127.0.0.1", port: 0 });
    await new Promise((resolve, reject) => {
      wss.once("listening", resolve);
      wss.once("error", reject);
    });
    wss.on("connection", (socket, req) => {
      const tcp = req.socket;
      state.tcpSockets.add(tcp);
      tcp.once("close", () => {
        state.tcpClosedWrittenBytes += tcp.bytesWritten;
        state.tcpClosedReadBytes += tcp.bytesRead;
        state.tcpSockets.delete(tcp);
      });
      const send = socket.send.bind(socket);
      socket.send = (data, ...rest) => {
        state.payloadSentBytes += data.byteLength ?? data.length ?? 0;
        state.payloadMessages += 1;
        return send(data, ...rest);
      };
      socket.on("message", (data) => {
        state.payloadRecvBytes += data.byteLength ?? data.length ?? 0;
        state.payloadMessages += 1;
      });
    });
    state.wss = wss;
    state.repo = new Repo({
      peerId,
      network: [new WebSocketServerAdapter(wss)],
      storage: new NodeFSStorageAdapter(dir),
    });
    return { port: wss.address().port };
  }

  function startClient(dir, peerId, port) {
    const adapter = new WebSocketClientAdapter(`ws://127.0.0.1:${port}`);
    // Resolves once node 0 has answered the join, i.e. the peer is known to
    // the repo; a `find` before that would mark the document unavailable.
    state.serverPeer = new Promise((resolve) => adapter.once("peer-candidate", resolve));
    state.repo = new Repo({
      peerId,
      network: [adapter],
      storage: new NodeFSStorageAdapter(dir),
    });
  }

  async function findDoc(url, timeoutMs) {
    const signal = AbortSignal.timeout(timeoutMs);
    if (state.serverPeer) {
      await Promise.race([
        state.serverPeer,
        new Promise((_, reject) =>
          signal.addEventListener("abort", () =>
            reject(new Error(`no answer from node 0 within ${timeoutMs} ms`)),
          ),
        ),
      ]);
    }
    const handle = await state.repo.find(url, { signal });
    attach(handle);
  }

  function tcpCounters() {
    let written = state.tcpClosedWrittenBytes;
    let read = state.tcpClosedReadBytes;
    for (const s of state.tcpSockets) {
      written += s.bytesWritten;
      read += s.bytesRead;
    }
    return { written, read };
  }

  const handlers = {
    async start({ role, dir, peerId, port }) {
      if (role === "server") return startServer(dir, peerId);
      startClient(dir, peerId, port);
      return {};
    },
    create() {
      const handle = state.repo.create({});
      attach(handle);
      return { url: handle.url };
    },
    async find({ url, timeoutMs }) {
      await findDoc(url, timeoutMs);
      return {};
    },
    write({ key, value }) {
      const t = nowMs();
      state.handle.change((d) => {
        d[key] = value;
      });
      return { t_ms: t };
    },
    async writeMany({ prefix, count, perTurn }) {
      // `perTurn` writes per macrotask. Yielding through a timer (not
      // setImmediate) lets the repo's throttled sync and save timers run
      // between batches, as they would when writes arrive as separate
      // events; with setImmediate they are re-armed before they expire and
      // everything goes out in one message at the end.
      const t0 = nowMs();
      for (let i = 0; i < count; i++) {
        const key = `${prefix}${i}`;
        const value = valueFor(i);
        state.handle.change((d) => {
          d[key] = value;
        });
        if ((i + 1) % perTurn === 0) await new Promise((r) => setTimeout(r, 0));
      }
      const t1 = nowMs();
      return { t_start_ms: t0, t_end_ms: t1, heads: A.getHeads(state.handle.doc()) };
    },
    importFilled({ prefix, count }) {
      // Builds `count` one-put changes through Automerge's low-level API and
      // imports the result as a new document. Going through `handle.change`
      // would cost time quadratic in `count`: every change copies the root
      // map of the immutable JS document (see README.md).
      const t0 = nowMs();
      const backend = A.getBackend(A.init());
      for (let i = 0; i < count; i++) {
        backend.put("/", `${prefix}${i}`, valueFor(i));
        backend.commit(undefined, Math.floor(Date.now() / 1000));
      }
      const handle = state.repo.import(backend.save());
      attach(handle);
      const t1 = nowMs();
      return { url: handle.url, heads: A.getHeads(handle.doc()), t_start_ms: t0, t_end_ms: t1 };
    },
    async waitHeads({ heads, timeoutMs }) {
      const t = await waitHeads(heads, timeoutMs);
      return { t_ms: t };
    },
    heads() {
      return { heads: A.getHeads(state.handle.doc()) };
    },
    countKeys() {
      return { keys: Object.keys(state.handle.doc()).length };
    },
    rss() {
      return { rss_bytes: process.memoryUsage().rss };
    },
    counters() {
      const tcp = tcpCounters();
      return {
        payload_sent_bytes: state.payloadSentBytes,
        payload_recv_bytes: state.payloadRecvBytes,
        payload_messages: state.payloadMessages,
        tcp_written_bytes: tcp.written,
        tcp_read_bytes: tcp.read,
      };
    },
    localLoad() {
      // The same bytes a fresh device has to end up with, loaded from memory.
      const bytes = A.save(state.handle.doc());
      const t0 = nowMs();
      const doc = A.load(bytes);
      const t1 = nowMs();
      const keys = Object.keys(doc).length;
      return { ms: t1 - t0, saved_bytes: bytes.byteLength, keys };
    },
    async coldSync({ dir, peerId, port, url, heads, timeoutMs, warmUp }) {
      // Timed from the Repo's construction: module loading and Automerge's
      // wasm set-up happened at process start and are reported apart.
      if (warmUp) warmUpAutomerge();
      const t0 = nowMs();
      startClient(dir, peerId, port);
      await findDoc(url, timeoutMs);
      const t1 = await waitHeads(heads, Math.max(1, timeoutMs - (nowMs() - t0)));
      return { t_start_ms: t0, t_done_ms: t1 };
    },
    async flush() {
      await state.repo.flush();
      return {};
    },
    async stop() {
      await state.repo?.shutdown();
      if (state.wss) {
        for (const c of state.wss.clients) c.terminate();
        await new Promise((r) => state.wss.close(r));
      }
      return {};
    },
  };

  process.on("message", async (msg) => {
    const h = handlers[msg.cmd];
    if (!h) return fail(msg.id, `unknown command ${msg.cmd}`);
    try {
      reply(msg.id, await h(msg.args ?? {}));
      if (msg.cmd === "stop") process.disconnect();
    } catch (e) {
      fail(msg.id, e);
    }
  });
  process.on("disconnect", () => process.exit(0));
  process.send({ event: "up", t_ms: nowMs() });
}

// ---------------------------------------------------------------------------
// Coordinator
// ---------------------------------------------------------------------------

const IPC_TIMEOUT_MS = 120_000;
const WARMUP_WRITES = 5;
const children = new Set();

/** A forked node: `call(cmd, args)` sends one command and resolves with its reply. */
class Node {
  constructor(name) {
    this.name = name;
    this.nextId = 1;
    this.pending = new Map();
    this.seenListeners = new Set();
    this.forkedAtMs = nowMs();
    const debounce = process.env.NUWA_AM_SYNC_DEBOUNCE_MS;
    this.proc = fork(SCRIPT_PATH, ["--child"], {
      serialization: "advanced",
      // See debounce-hook.mjs: sets the sync debounce the Repo does not expose.
      execArgv: debounce === undefined ? [] : ["--import", path.join(SCRIPT_DIR, "debounce-hook.mjs")],
      stdio: ["ignore", "inherit", "inherit", "ipc"],
    });
    children.add(this.proc);
    this.up = new Promise((resolve, reject) => {
      this.upResolve = resolve;
      this.upReject = reject;
    });
    this.proc.on("message", (msg) => this.onMessage(msg));
    this.proc.on("exit", (code, signal) => {
      children.delete(this.proc);
      const err = new Error(`${name} exited (code ${code}, signal ${signal})`);
      this.upReject(err);
      for (const p of this.pending.values()) p.reject(err);
      this.pending.clear();
    });
  }

  onMessage(msg) {
    if (msg.event === "up") return this.upResolve(msg.t_ms);
    if (msg.event === "seen") {
      for (const l of this.seenListeners) l(msg);
      return;
    }
    const p = this.pending.get(msg.id);
    if (!p) return;
    this.pending.delete(msg.id);
    clearTimeout(p.timer);
    if (msg.ok) p.resolve(msg.result);
    else p.reject(new Error(`${this.name}: ${msg.error}`));
  }

  call(cmd, args = {}, timeoutMs = IPC_TIMEOUT_MS) {
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.pending.delete(id);
        reject(new Error(`${this.name}: ${cmd} got no answer within ${timeoutMs} ms`));
      }, timeoutMs);
      this.pending.set(id, { resolve, reject, timer });
      this.proc.send({ id, cmd, args });
    });
  }

  async stop() {
    if (this.proc.exitCode !== null || this.proc.signalCode !== null) return;
    const exited = new Promise((r) => this.proc.once("exit", r));
    try {
      await this.call("stop", {}, 10_000);
    } catch {
      // Fall through to the kill below.
    }
    const timer = setTimeout(() => this.proc.kill("SIGKILL"), 5_000);
    await exited;
    clearTimeout(timer);
  }
}

/** A star of `n` nodes around node 0, all holding one new document. */
class Cluster {
  static async start(n, baseDir, label, timeoutMs) {
    const c = new Cluster();
    c.nodes = [];
    for (let i = 0; i < n; i++) c.nodes.push(new Node(`${label}-node${i}`));
    await Promise.all(c.nodes.map((x) => x.up));
    const dirOf = (i) => {
      const d = path.join(baseDir, `${label}-node${i}`);
      fs.mkdirSync(d, { recursive: true });
      return d;
    };
    const { port } = await c.nodes[0].call("start", {
      role: "server",
      dir: dirOf(0),
      peerId: `${label}-node0`,
    });
    c.port = port;
    const { url } = await c.nodes[0].call("create");
    c.url = url;
    await Promise.all(
      c.nodes.slice(1).map(async (node, j) => {
        const i = j + 1;
        await node.call("start", { role: "client", dir: dirOf(i), peerId: `${label}-node${i}`, port });
        await node.call("find", { url, timeoutMs }, timeoutMs + 5_000);
      }),
    );
    return c;
  }

  async stop() {
    await Promise.all(this.nodes.map((n) => n.stop()));
  }
}

// ---- statistics ----

function stat(values) {
  const s = [...values].sort((a, b) => a - b);
  const n = s.length;
  const median = n % 2 === 1 ? s[(n - 1) / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
  return { median: round(median), min: round(s[0]), max: round(s[n - 1]) };
}

/** Nearest-rank percentile. */
function percentile(values, p) {
  const s = [...values].sort((a, b) => a - b);
  const rank = Math.max(1, Math.ceil((p / 100) * s.length));
  return s[rank - 1];
}

function round(x) {
  return Math.round(x * 1000) / 1000;
}

// ---- workloads ----

/** S sequential writes on node 0, each timed until every other node saw it. */
async function measureLatency(cluster, samples, gapMs, tag) {
  const [writer, ...followers] = cluster.nodes;
  const latencies = [];
  for (let i = 0; i < samples; i++) {
    const key = `lat_${tag}_${i}`;
    const seen = followers.map(
      (f) =>
        new Promise((resolve, reject) => {
          const timer = setTimeout(() => {
            f.seenListeners.delete(l);
            reject(new Error(`${f.name} did not see ${key} within 30 s`));
          }, 30_000);
          const l = (msg) => {
            if (msg.key !== key) return;
            clearTimeout(timer);
            f.seenListeners.delete(l);
            resolve(msg.t_ms);
          };
          f.seenListeners.add(l);
        }),
    );
    const { t_ms: t0 } = await writer.call("write", { key, value: valueFor(i) });
    const seenAt = await Promise.all(seen);
    latencies.push(Math.max(...seenAt) - t0);
    // An intentional pause between writes (only with --spaced-gap-ms).
    if (gapMs > 0) await new Promise((r) => setTimeout(r, gapMs));
  }
  return latencies;
}

/** Polls node 0's byte counters until they stop moving, so trailing sync replies are counted. */
async function quiescentCounters(server, quietMs = 300, timeoutMs = 10_000) {
  const deadline = nowMs() + timeoutMs;
  let last = await server.call("counters");
  let stableSince = nowMs();
  while (nowMs() < deadline) {
    await new Promise((r) => setTimeout(r, 50));
    const c = await server.call("counters");
    if (c.payload_sent_bytes !== last.payload_sent_bytes || c.payload_recv_bytes !== last.payload_recv_bytes) {
      last = c;
      stableSince = nowMs();
    } else if (nowMs() - stableSince >= quietMs) {
      return last;
    }
  }
  return last;
}

/** The same W one-key changes on a plain in-process Automerge document. */
function localAppend(writes) {
  let doc = A.init();
  const t0 = nowMs();
  for (let i = 0; i < writes; i++) {
    const key = `tp_${i}`;
    const value = valueFor(i);
    doc = A.change(doc, (d) => {
      d[key] = value;
    });
  }
  const elapsedMs = nowMs() - t0;
  // Sizes from a second, untimed pass, so that fetching them does not slow the rate.
  let sizeDoc = A.init();
  let totalBytes = 0;
  for (let i = 0; i < writes; i++) {
    const key = `tp_${i}`;
    const value = valueFor(i);
    sizeDoc = A.change(sizeDoc, (d) => {
      d[key] = value;
    });
    totalBytes += A.getLastLocalChange(sizeDoc).byteLength;
  }
  return { rate_per_sec: writes / (elapsedMs / 1000), raw_change_bytes: totalBytes / writes };
}

async function measureThroughput(baseDir, rep, opts) {
  const cluster = await Cluster.start(3, baseDir, `tp${rep}`, 60_000);
  try {
    const idleRss = [];
    for (const n of cluster.nodes) idleRss.push((await n.call("rss")).rss_bytes / 1e6);
    // Untimed writes first, as for the latency (see `WARMUP_WRITES`).
    await measureLatency(cluster, WARMUP_WRITES, 0, "w");
    const server = cluster.nodes[0];
    const before = await quiescentCounters(server);
    const w = await server.call(
      "writeMany",
      { prefix: "tp_", count: opts.writes, perTurn: opts.inFlight },
      600_000,
    );
    const done = await Promise.all(
      cluster.nodes.slice(1).map((n) => n.call("waitHeads", { heads: w.heads, timeoutMs: 600_000 }, 610_000)),
    );
    const elapsedMs = Math.max(w.t_end_ms, ...done.map((d) => d.t_ms)) - w.t_start_ms;
    const after = await quiescentCounters(server);
    const payload =
      after.payload_sent_bytes - before.payload_sent_bytes + (after.payload_recv_bytes - before.payload_recv_bytes);
    const tcp = after.tcp_written_bytes - before.tcp_written_bytes + (after.tcp_read_bytes - before.tcp_read_bytes);
    return {
      idleRss,
      elapsedMs,
      writeMs: w.t_end_ms - w.t_start_ms,
      wirePerChange: payload / opts.writes,
      tcpPerChange: tcp / opts.writes,
      messages: after.payload_messages - before.payload_messages,
    };
  } finally {
    await cluster.stop();
  }
}

/** Starts a fresh node with empty storage, syncs the document from node 0, and checks it. */
async function syncFreshNode(name, baseDir, port, fill, opts, warmUp) {
  const fresh = new Node(name);
  try {
    await fresh.up;
    const dir = path.join(baseDir, name);
    fs.mkdirSync(dir, { recursive: true });
    const r = await fresh.call(
      "coldSync",
      { dir, peerId: name, port, url: fill.url, heads: fill.heads, timeoutMs: 1_200_000, warmUp },
      1_210_000,
    );
    const { keys } = await fresh.call("countKeys");
    if (keys !== opts.logEntries) {
      throw new Error(`${name} has ${keys} entries after sync, expected ${opts.logEntries}`);
    }
    // Like a device that keeps running after the sync: storage written, then RSS.
    await fresh.call("flush", {}, 600_000);
    const { rss_bytes } = await fresh.call("rss");
    return {
      syncMs: r.t_done_ms - r.t_start_ms,
      inclStartMs: r.t_done_ms - fresh.forkedAtMs,
      rssMb: rss_bytes / 1e6,
    };
  } finally {
    await fresh.stop();
  }
}

/**
 * Each repetition syncs two fresh nodes: first a plain one (the figures in
 * `extra`, and `rss_mb.after_sync`), then one whose Automerge was warmed up
 * before the clock started (`cold_sync.sync_ms`), so that the headline figure
 * measures syncing rather than V8 compiling WebAssembly.
 */
async function measureColdSync(baseDir, opts, log) {
  const source = new Node("cold-node0");
  await source.up;
  const sourceDir = path.join(baseDir, "cold-node0");
  fs.mkdirSync(sourceDir, { recursive: true });
  const { port } = await source.call("start", { role: "server", dir: sourceDir, peerId: "cold-node0" });
  const out = { sync: [], unwarmed: [], inclStart: [], load: [], ratio: [], rssAfter: [] };
  try {
    log(`cold sync: filling node 0 with ${opts.logEntries} entries (one change each)`);
    const fill = await source.call("importFilled", { prefix: "e_", count: opts.logEntries }, 1_800_000);
    await source.call("flush", {}, 600_000);
    log(`cold sync: filled in ${fmt(fill.t_end_ms - fill.t_start_ms)} ms`);
    // One untimed load, so that the timed ones run on compiled code as well.
    await source.call("localLoad", {}, 600_000);
    for (let rep = 0; rep < opts.reps; rep++) {
      const plain = await syncFreshNode(`cold-plain${rep}`, baseDir, port, fill, opts, false);
      const warm = await syncFreshNode(`cold-warm${rep}`, baseDir, port, fill, opts, true);
      const local = await source.call("localLoad", {}, 600_000);
      if (local.keys !== opts.logEntries) {
        throw new Error(`local load gave ${local.keys} entries, expected ${opts.logEntries}`);
      }
      out.sync.push(warm.syncMs);
      out.unwarmed.push(plain.syncMs);
      out.inclStart.push(plain.inclStartMs);
      out.load.push(local.ms);
      out.ratio.push(warm.syncMs / local.ms);
      out.rssAfter.push(plain.rssMb);
      out.savedBytes = local.saved_bytes;
      log(
        `cold sync rep ${rep + 1}: sync ${fmt(warm.syncMs)} ms warmed up, ${fmt(plain.syncMs)} ms not ` +
          `(${fmt(plain.inclStartMs)} ms from process start), local load ${fmt(local.ms)} ms`,
      );
    }
  } finally {
    await source.stop();
  }
  return out;
}

// ---- CLI, output ----

const HELP = `Usage: node bench.mjs [options]   (or ./run.sh [options])

Runs the nuwa-bench workloads against automerge-repo on 127.0.0.1 and writes
the figures as JSON (schema: docs/performance.md, "JSON schema") and a table.

Options:
  --quick               N=3 only, 20 samples, 500 writes, 2000 entries, 1 rep
  --reps N              repetitions of every workload (default 3)
  --samples S           propagation samples per cluster size (default 100)
  --sizes LIST          cluster sizes for propagation latency (default 3,5,10)
  --writes W            writes in the throughput run (default 5000)
  --in-flight K         writes per event-loop turn in the throughput run (default 32)
  --log-entries E       entries for the cold sync (default 100000)
  --spaced-gap-ms MS    also measure latency with MS between writes (default 150, 0 = skip)
  --sync-debounce-ms MS set automerge-repo's sync debounce (default: the library's 100 ms)
  --json-out FILE       where to write the JSON (default scripts/bench/out/automerge-repo.json)
  -h, --help            show this text
`;

function parseCli(argv) {
  const { values } = parseArgs({
    args: argv,
    options: {
      quick: { type: "boolean", default: false },
      reps: { type: "string" },
      samples: { type: "string" },
      sizes: { type: "string" },
      writes: { type: "string" },
      "in-flight": { type: "string" },
      "log-entries": { type: "string" },
      "spaced-gap-ms": { type: "string" },
      "json-out": { type: "string" },
      "sync-debounce-ms": { type: "string" },
      help: { type: "boolean", short: "h", default: false },
    },
    strict: true,
  });
  if (values.help) {
    process.stdout.write(HELP);
    process.exit(0);
  }
  if (values["sync-debounce-ms"] !== undefined) {
    const d = Number(values["sync-debounce-ms"]);
    if (!Number.isInteger(d) || d < 0) {
      throw new Error(`--sync-debounce-ms must be an integer >= 0, got "${values["sync-debounce-ms"]}"`);
    }
    // Read by the children (fork inherits the environment) and the hook.
    process.env.NUWA_AM_SYNC_DEBOUNCE_MS = String(d);
  }
  const q = values.quick;
  const int = (name, fallback, min) => {
    const raw = values[name];
    if (raw === undefined) return fallback;
    const n = Number(raw);
    if (!Number.isInteger(n) || n < min) {
      throw new Error(`--${name} must be an integer >= ${min}, got "${raw}"`);
    }
    return n;
  };
  const sizes = (values.sizes ?? (q ? "3" : "3,5,10")).split(",").map((s) => {
    const n = Number(s.trim());
    if (!Number.isInteger(n) || n < 2) throw new Error(`--sizes takes cluster sizes >= 2, got "${s}"`);
    return n;
  });
  return {
    quick: q,
    reps: int("reps", q ? 1 : 3, 1),
    samples: int("samples", q ? 20 : 100, 1),
    sizes,
    writes: int("writes", q ? 500 : 5000, 1),
    inFlight: int("in-flight", 32, 1),
    logEntries: int("log-entries", q ? 2000 : 100_000, 1),
    spacedGapMs: int("spaced-gap-ms", 150, 0),
    jsonOut: values["json-out"] ?? path.join(SCRIPT_DIR, "out", "automerge-repo.json"),
  };
}

function packageVersion(name) {
  const file = path.join(SCRIPT_DIR, "node_modules", ...name.split("/"), "package.json");
  return JSON.parse(fs.readFileSync(file, "utf8")).version;
}

function fmt(x) {
  if (x >= 100) return x.toFixed(0);
  if (x >= 10) return x.toFixed(1);
  return x.toFixed(2);
}

function printTable(result) {
  const rows = [];
  const add = (name, s, unit) => {
    if (s) rows.push([name, fmt(s.median), `${fmt(s.min)}–${fmt(s.max)}`, unit]);
  };
  for (const [n, v] of Object.entries(result.propagation_latency)) {
    add(`propagation p50, N=${n}`, v.p50_ms, "ms");
    add(`propagation p99, N=${n}`, v.p99_ms, "ms");
  }
  for (const [n, v] of Object.entries(result.extra.propagation_latency_spaced ?? {})) {
    add(`propagation p50, N=${n}, spaced`, v.p50_ms, "ms");
    add(`propagation p99, N=${n}, spaced`, v.p99_ms, "ms");
  }
  const t = result.throughput;
  add("throughput, 3 nodes", t.rate_per_sec, "writes/s");
  add("throughput elapsed", t.elapsed_ms, "ms");
  add("local append (Automerge)", t.local_append_rate_per_sec, "writes/s");
  add("throughput ratio", t.ratio, "×");
  const c = result.cold_sync;
  add(`cold sync, ${c.entries} entries`, c.sync_ms, "ms");
  add("cold sync, not warmed up", result.extra.cold_sync_not_warmed_up_ms, "ms");
  add("cold sync incl. process start", result.extra.cold_sync_incl_process_start_ms, "ms");
  add("local Automerge.load", c.local_load_ms, "ms");
  add("cold sync ratio", c.ratio, "×");
  const b = result.bytes_per_change;
  add("wire bytes per change", b.wire_bytes_per_change, "B");
  add("tcp bytes per change", result.extra.tcp_bytes_per_change, "B");
  add("raw change bytes", b.raw_change_bytes, "B");
  add("bytes ratio", b.ratio, "×");
  add("RSS idle", result.rss_mb.idle, "MB");
  add("RSS after cold sync", result.rss_mb.after_sync, "MB");

  const head = ["figure", "median", "min–max", "unit"];
  const widths = head.map((h, i) => Math.max(h.length, ...rows.map((r) => r[i].length)));
  const line = (cells) => `| ${cells.map((c, i) => c.padEnd(widths[i])).join(" | ")} |`;
  console.log(line(head));
  console.log(`|${widths.map((w) => "-".repeat(w + 2)).join("|")}|`);
  for (const r of rows) console.log(line(r));
}

async function main() {
  let opts;
  try {
    opts = parseCli(process.argv.slice(2));
  } catch (e) {
    console.error(`error: ${e.message}\n\n${HELP}`);
    process.exit(2);
  }
  const log = (msg) => console.error(`[bench] ${msg}`);
  const baseDir = fs.mkdtempSync(path.join(os.tmpdir(), "amrepo-bench-"));
  log(`nodes keep their storage under ${baseDir}`);

  const latency = {};
  const latencySpaced = {};
  const tp = { elapsed: [], rate: [], local: [], ratio: [], wire: [], tcp: [], raw: [], bytesRatio: [], idleRss: [] };
  let cold;
  try {
    for (let rep = 0; rep < opts.reps; rep++) {
      for (const n of opts.sizes) {
        const cluster = await Cluster.start(n, baseDir, `lat${n}r${rep}`, 60_000);
        try {
          // A few untimed writes first: a fresh process runs Automerge's
          // WebAssembly unoptimised at first, which is not what we measure.
          await measureLatency(cluster, WARMUP_WRITES, 0, "w");
          const l = await measureLatency(cluster, opts.samples, 0, "b");
          (latency[n] ??= { p50: [], p99: [] }).p50.push(percentile(l, 50));
          latency[n].p99.push(percentile(l, 99));
          log(`latency N=${n} rep ${rep + 1}: p50 ${fmt(percentile(l, 50))} ms, p99 ${fmt(percentile(l, 99))} ms`);
          if (opts.spacedGapMs > 0) {
            const s = await measureLatency(cluster, opts.samples, opts.spacedGapMs, "s");
            (latencySpaced[n] ??= { p50: [], p99: [] }).p50.push(percentile(s, 50));
            latencySpaced[n].p99.push(percentile(s, 99));
            log(`latency N=${n} rep ${rep + 1}, ${opts.spacedGapMs} ms apart: p50 ${fmt(percentile(s, 50))} ms, p99 ${fmt(percentile(s, 99))} ms`);
          }
        } finally {
          await cluster.stop();
        }
      }

      const r = await measureThroughput(baseDir, rep, opts);
      const local = localAppend(opts.writes);
      const rate = opts.writes / (r.elapsedMs / 1000);
      tp.elapsed.push(r.elapsedMs);
      tp.rate.push(rate);
      tp.local.push(local.rate_per_sec);
      tp.ratio.push(rate / local.rate_per_sec);
      tp.wire.push(r.wirePerChange);
      tp.tcp.push(r.tcpPerChange);
      tp.raw.push(local.raw_change_bytes);
      tp.bytesRatio.push(r.wirePerChange / local.raw_change_bytes);
      tp.idleRss.push(...r.idleRss);
      log(
        `throughput rep ${rep + 1}: ${fmt(rate)} writes/s converged (${fmt(r.elapsedMs)} ms), ` +
          `local ${fmt(local.rate_per_sec)} writes/s, ${fmt(r.wirePerChange)} wire B/change in ${r.messages} messages`,
      );
    }
    cold = await measureColdSync(baseDir, opts, log);
  } finally {
    await Promise.all([...children].map((p) => (p.kill("SIGKILL"), null)));
    fs.rmSync(baseDir, { recursive: true, force: true });
  }

  const perSize = (m) =>
    Object.fromEntries(Object.entries(m).map(([n, v]) => [n, { p50_ms: stat(v.p50), p99_ms: stat(v.p99) }]));
  const result = {
    schema_version: 1,
    tool:
      process.env.NUWA_AM_SYNC_DEBOUNCE_MS === undefined
        ? "automerge-repo"
        : `automerge-repo (sync debounce ${process.env.NUWA_AM_SYNC_DEBOUNCE_MS} ms)`,
    tool_version: packageVersion("@automerge/automerge-repo"),
    generated_at_unix_ms: Date.now(),
    machine: {
      os: process.platform,
      arch: { x64: "x86_64", arm64: "aarch64" }[process.arch] ?? process.arch,
      cpus: os.availableParallelism(),
    },
    params: {
      reps: opts.reps,
      samples: opts.samples,
      writes: opts.writes,
      in_flight: opts.inFlight,
      log_entries: opts.logEntries,
      sizes: opts.sizes,
      quick: opts.quick,
    },
    propagation_latency: perSize(latency),
    throughput: {
      nodes: 3,
      elapsed_ms: stat(tp.elapsed),
      rate_per_sec: stat(tp.rate),
      local_append_rate_per_sec: stat(tp.local),
      ratio: stat(tp.ratio),
    },
    cold_sync: {
      entries: opts.logEntries,
      sync_ms: stat(cold.sync),
      local_load_ms: stat(cold.load),
      ratio: stat(cold.ratio),
    },
    bytes_per_change: {
      wire_bytes_per_change: stat(tp.wire),
      raw_change_bytes: stat(tp.raw),
      ratio: stat(tp.bytesRatio),
    },
    rss_mb: {
      idle: stat(tp.idleRss),
      after_sync: stat(cold.rssAfter),
    },
    // Figures with no counterpart in nuwa-bench; `--compare` ignores them.
    extra: {
      versions: {
        node: process.versions.node,
        "@automerge/automerge": packageVersion("@automerge/automerge"),
        "@automerge/automerge-repo": packageVersion("@automerge/automerge-repo"),
        "@automerge/automerge-repo-network-websocket": packageVersion("@automerge/automerge-repo-network-websocket"),
        "@automerge/automerge-repo-storage-nodefs": packageVersion("@automerge/automerge-repo-storage-nodefs"),
      },
      propagation_latency_spaced_gap_ms: opts.spacedGapMs,
      propagation_latency_spaced: perSize(latencySpaced),
      tcp_bytes_per_change: stat(tp.tcp),
      cold_sync_not_warmed_up_ms: stat(cold.unwarmed),
      cold_sync_incl_process_start_ms: stat(cold.inclStart),
      cold_sync_saved_doc_bytes: cold.savedBytes,
    },
  };

  fs.mkdirSync(path.dirname(path.resolve(opts.jsonOut)), { recursive: true });
  fs.writeFileSync(opts.jsonOut, `${JSON.stringify(result, null, 2)}\n`);
  printTable(result);
  log(`wrote ${opts.jsonOut}`);
}

if (process.argv[2] === "--child") {
  runChild().catch((e) => {
    console.error(e);
    process.exit(1);
  });
} else {
  main().then(
    () => process.exit(0),
    (e) => {
      console.error(`error: ${e?.stack ?? e}`);
      for (const p of children) p.kill("SIGKILL");
      process.exit(1);
    },
  );
}
