// The nuwa-node status page. It reads GET /v1/status and GET /v1/devices
// (the session cookie authorises them), refetches on every `change` event
// of GET /v1/state.events and every 2 s (peers come and go without a
// change event). Everything from the daemon goes into the DOM as text
// (textContent), never as HTML.
"use strict";

const REFRESH_MS = 2000;
const DASH = "\u2014";

// An element with text and an optional class; `children` are nodes.
function el(tag, text, cls, children) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  for (const c of children || []) e.appendChild(c);
  return e;
}

// A value shown as text: null, undefined and "" become a dash.
function show(v) {
  if (v === null || v === undefined || v === "") return DASH;
  if (Array.isArray(v)) return v.length ? v.join(", ") : DASH;
  if (typeof v === "boolean") return v ? "yes" : "no";
  return String(v);
}

function short(id, n) {
  if (!id) return DASH;
  const s = String(id);
  return s.length > n ? s.slice(0, n) + "\u2026" : s;
}

function ago(ms) {
  if (!ms) return "never";
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 60) return s + " s ago";
  if (s < 3600) return Math.round(s / 60) + " min ago";
  if (s < 86400) return Math.round(s / 3600) + " h ago";
  return Math.round(s / 86400) + " d ago";
}

function duration(s) {
  if (s === null || s === undefined) return DASH;
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600);
  const m = Math.floor((s % 3600) / 60), r = s % 60;
  if (d) return d + " d " + h + " h";
  if (h) return h + " h " + m + " min";
  if (m) return m + " min " + r + " s";
  return r + " s";
}

function bytes(n) {
  if (n === null || n === undefined) return DASH;
  if (n < 1024) return n + " B";
  if (n < 1048576) return (n / 1024).toFixed(1) + " KiB";
  return (n / 1048576).toFixed(1) + " MiB";
}

// A table from column names and rows of cells; a cell is a value or a node.
// With no rows, a muted line saying `empty`.
function table(cols, rows, empty) {
  if (!rows.length) return el("p", empty, "muted");
  const head = el("tr", null, null, cols.map((c) => el("th", c)));
  const body = rows.map((r) =>
    el("tr", null, null, r.map((c) => (c instanceof Node ? el("td", null, null, [c]) : el("td", show(c)))))
  );
  return el("table", null, null, [el("thead", null, null, [head]), el("tbody", null, null, body)]);
}

function defs(pairs) {
  const out = [];
  for (const [k, v] of pairs) {
    out.push(el("dt", k));
    out.push(v instanceof Node ? el("dd", null, null, [v]) : el("dd", show(v)));
  }
  return out;
}

function tag(text, kind) {
  return el("span", text, "tag " + kind);
}

function fill(id, nodes) {
  const e = document.getElementById(id);
  e.replaceChildren(...(Array.isArray(nodes) ? nodes : [nodes]));
}

function syncTag(state, behind) {
  const kinds = { in_sync: "ok", behind: "warn", ahead: "info", syncing: "info" };
  let text = state ? state.replace("_", " ") : "unknown";
  if (state === "behind" && behind !== null && behind !== undefined) text += " (" + behind + " changes)";
  return tag(text, kinds[state] || "muted");
}

function render(st, devices) {
  document.title = "nuwa-node " + (st.device.name || st.device.context_id);
  fill("version", st.version ? "v" + st.version + " \u00b7 up " + duration(st.uptime_s) : "");
  const badge = document.getElementById("sync-badge");
  if (st.device.revoked) {
    badge.textContent = "REVOKED: removed from the agent; nothing written here reaches another device";
    badge.className = "badge bad";
  } else if (!st.peers.length) {
    badge.textContent = "no peer connected";
    badge.className = "badge muted";
  } else if (st.in_sync) {
    badge.textContent = "in sync";
    badge.className = "badge ok";
  } else {
    badge.textContent = "not in sync";
    badge.className = "badge warn";
  }

  const d = st.device;
  fill("overview", defs([
    ["agent", el("code", st.agent_did)],
    ["this device", (d.name || "unnamed") + " (" + d.context_id + ")"],
    ["authorised", d.authorised ? tag("authorised", "ok") : tag("NOT authorised", "bad")],
    ["peer id", el("code", d.peer_id)],
    ["key epoch", st.key_epoch],
    ["admin", st.admin ? (st.master_key ? "yes (holds the master key)" : "yes") : "no"],
    ["recovery words", st.recovery_key ? "set" : "none: run nuwa-node recovery create"],
    ["DID log entries", d.did_log_len],
    ["listening", st.listen_addrs],
    ["version", st.version],
    ["uptime", duration(st.uptime_s)],
  ]));

  fill("devices", table(
    ["name", "context id", "status", "last seen"],
    devices.map((x) => [
      x.name,
      el("code", x.context_id),
      tag(x.status, x.status === "active" ? "ok" : "bad"),
      x.this_device ? tag("this device", "info") : ago(x.last_seen_unix_ms),
    ]),
    "no devices"
  ));

  fill("peers", table(
    ["name", "context id", "peer id", "address", "path", "transport", "RTT", "clock offset", "verified"],
    st.peers.map((p) => [
      p.name,
      el("code", p.context_id),
      el("code", short(p.peer_id, 16)),
      el("code", p.address),
      p.relayed ? tag("relayed", "warn") : tag("direct", "ok"),
      p.transport,
      p.rtt_ms === null || p.rtt_ms === undefined ? DASH : p.rtt_ms + " ms",
      p.clock_offset_ms ? p.clock_offset_ms + " ms" : "0 ms",
      ago(p.verified_at_unix_ms),
    ]),
    "no peer connected"
  ));

  const syncRows = [];
  for (const p of st.peers) {
    const who = p.name || p.context_id;
    if (!p.sync || !p.sync.length) {
      syncRows.push([who, DASH, tag("unknown", "muted")]);
      continue;
    }
    for (const s of p.sync) syncRows.push([who, s.container, syncTag(s.state, s.behind)]);
  }
  fill("sync", table(["peer", "container", "state"], syncRows, "no peer connected"));

  fill("containers", table(
    ["name", "changes", "heads"],
    st.containers.map((c) => [c.name, c.changes, el("code", c.heads.map((h) => short(h, 12)).join(" "))]),
    "no containers yet"
  ));

  fill("catchups", table(
    ["container", "from peer", "changes", "bytes", "started"],
    (st.catch_ups || []).map((c) => [c.container, short(c.peer_id, 16), c.changes, bytes(c.bytes), ago(c.started_unix_ms)]),
    "none"
  ));

  const r = st.reachability || {};
  const mdns = st.mdns || {};
  const ptr = st.dht_pointer;
  fill("network", defs([
    ["reachability", r.nat],
    ["advertised", r.advertised],
    ["relays", r.relays],
    ["mDNS", mdns.enabled ? (mdns.interfaces && mdns.interfaces.length ? "on: " + mdns.interfaces.join(", ") : "on, but watching no interface") : mdns.error ? "FAILED: " + mdns.error + " (see nuwa-node doctor)" : "off"],
    ["DHT pointer", ptr ? bytes(ptr.bytes) + " of " + bytes(ptr.limit) : DASH],
  ]));
  fill("keepers", table(
    ["peer id", "reachable", "pushed all", "pulled all", "cursor"],
    (st.keepers || []).map((k) => [
      el("code", short(k.peer_id, 16)),
      k.connected ? tag("connected", "ok") : tag("not connected", "bad"),
      k.pushed_all, k.pulled_all, k.cursor,
    ]),
    "no keepers configured"
  ));
  fill("rendezvous", table(
    ["address", "reachable"],
    (st.rendezvous || []).map((z) => [el("code", z.address), z.connected ? tag("connected", "ok") : tag("not connected", "bad")]),
    "no rendezvous servers configured"
  ));

  fill("rejections", table(
    ["source", "peer", "label", "reason", "count", "last"],
    st.rejections.map((x) => [x.source, el("code", short(x.peer, 24)), x.label, x.reason, x.count, ago(x.last_unix_ms)]),
    "none"
  ));
  const problems = [];
  for (const c of st.clock_skew || []) {
    problems.push(el("p", "Clock skew: peer " + c.peer_id + " is " + (c.offset_ms / 1000).toFixed(1) +
      " s off this device's clock (at most \u00b1" + c.window_ms / 1000 + " s is accepted); enable NTP.", "error"));
  }
  for (const q of st.quarantined || []) {
    problems.push(el("p", "Quarantined: container " + (q.container || "(name unreadable)") + " could not be read (" +
      q.reason + "); its " + q.records + " records were moved aside and it is resynced from peers.", "error"));
  }
  fill("problems", problems);

  fill("counters", table(
    ["counter", "value"],
    Object.entries(st.counters || {}).map(([k, v]) => [k, v]),
    "none"
  ));
  fill("updated", new Date().toLocaleTimeString());
}

function showError(text) {
  const e = document.getElementById("error");
  e.textContent = text;
  e.hidden = !text;
}

async function getJson(path) {
  const r = await fetch(path, { cache: "no-store", credentials: "same-origin" });
  if (r.status === 401) throw new Error("Your session has ended. Run `nuwa-node open` for a new login link.");
  if (!r.ok) {
    let msg = r.status + "";
    try {
      const b = await r.json();
      msg = b.error.message;
    } catch (_) { /* not JSON */ }
    throw new Error("The daemon refused " + path + ": " + msg);
  }
  return r.json();
}

let inFlight = false;
let again = false;

// Refetches both; calls made while one is running collapse into one more.
async function refresh() {
  if (inFlight) {
    again = true;
    return;
  }
  inFlight = true;
  try {
    const [st, devices] = await Promise.all([getJson("/v1/status"), getJson("/v1/devices")]);
    render(st, devices);
    showError("");
  } catch (e) {
    showError(e.message === "Failed to fetch" ? "The daemon is not answering (stopped?)." : e.message);
  } finally {
    inFlight = false;
    if (again) {
      again = false;
      refresh();
    }
  }
}

function live() {
  const badge = document.getElementById("live-badge");
  const es = new EventSource("/v1/state.events");
  es.addEventListener("ready", () => {
    badge.textContent = "live";
    badge.className = "badge ok";
    refresh();
  });
  es.addEventListener("change", refresh);
  es.addEventListener("lagged", refresh);
  es.onerror = () => {
    badge.textContent = "reconnecting";
    badge.className = "badge warn";
  };
}

refresh();
live();
setInterval(refresh, REFRESH_MS);
