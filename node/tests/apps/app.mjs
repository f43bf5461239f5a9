// A test app of the agent, outside Rust: it uses only scripts/app-client/
// nuwa_app.mjs, the signing format docs/api.md documents. node/tests/apps.rs
// runs it; each command prints one JSON value.
//
//   key SEED_BYTE                          -> "did:key:..."
//   call URL CAP SEED METHOD PATH BODY ACTION [NONCE [CREATED]]
//                                          -> {"status", "body"}
//   stream URL CAP SEED                    -> one line per event as it comes: {"event", "data"},
//                                             then {"event": "end"} when the daemon ends it
//   headers CAP SEED METHOD PATH ACTION    -> the four signed headers of a bodiless request
//   tampered URL CAP SEED                  -> {"status", "body"} of a create whose body changed after signing
//   delegate CAP SEED TO_DID ACTIONS OUT   -> the delegated capability (also written to OUT)
//   events URL CAP SEED MS [CONTAINER]     -> {"status", "events": [names of containers seen]}
//   forge SIGNER_SEED TO_DID TARGET ACTIONS OUT
//                                          -> a capability "from the root" signed by a key that
//                                             is no admin of the agent (another agent's chain)
import fs from 'node:fs';
import * as app from '../../../scripts/app-client/nuwa_app.mjs';

const [cmd, ...args] = process.argv.slice(2);
const keyOf = (seed) => app.keyFromSeed(Buffer.alloc(32, Number(seed)));
const capOf = (file) => JSON.parse(fs.readFileSync(file, 'utf8'));
const out = (v) => process.stdout.write(JSON.stringify(v) + '\n');

async function reply(r) {
  const text = await r.text();
  let body;
  try { body = JSON.parse(text); } catch { body = text; }
  return { status: r.status, body };
}

if (cmd === 'key') {
  out(keyOf(args[0]).did);
} else if (cmd === 'call') {
  const [url, cap, seed, method, path, body, action, nonce, created] = args;
  const opts = nonce ? { nonce } : {};
  if (created) opts.createdUnixSecs = Number(created);
  const b = body === '-' ? null : body;
  out(await reply(await app.signedFetch(url, capOf(cap), keyOf(seed).privateKey, method, path, b, action, opts)));
} else if (cmd === 'tampered') {
  const [url, cap, seed] = args;
  const body = JSON.stringify({ schema_uri: 'did:nuwa:cap:weather:state:Item#v1', object: { id: 't1', text: 'rain' } });
  const headers = app.signRequest(capOf(cap), keyOf(seed).privateKey, 'POST', '/v1/state.create', '', body, 'write');
  const r = await fetch(url + '/v1/state.create', {
    method: 'POST',
    headers: { ...headers, 'Content-Type': 'application/json' },
    body: body.replace('rain', 'hail'),
  });
  out(await reply(r));
} else if (cmd === 'delegate') {
  const [cap, seed, to, actions, file] = args;
  const parent = capOf(cap);
  const child = app.delegate(parent, keyOf(seed).privateKey, {
    invokerDid: to,
    target: parent.invocationTarget,
    actions: actions.split(','),
    expiresUnixSecs: Math.floor(Date.parse(parent.expires) / 1000),
  });
  fs.writeFileSync(file, JSON.stringify(child), { mode: 0o600 });
  out(child);
} else if (cmd === 'forge') {
  const [seed, to, target, actions, file] = args;
  const cap = app.delegate(null, keyOf(seed).privateKey, {
    invokerDid: to,
    target,
    actions: actions.split(','),
    expiresUnixSecs: Math.floor(Date.now() / 1000) + 3600,
  });
  fs.writeFileSync(file, JSON.stringify(cap), { mode: 0o600 });
  out(cap);
} else if (cmd === 'headers') {
  const [cap, seed, method, path, action] = args;
  const u = new URL('http://x' + path);
  out(app.signRequest(capOf(cap), keyOf(seed).privateKey, method, u.pathname, u.search.slice(1), null, action));
} else if (cmd === 'stream') {
  const [url, cap, seed] = args;
  const r = await app.signedFetch(url, capOf(cap), keyOf(seed).privateKey, 'GET', '/v1/state.events', null, 'events');
  if (r.status !== 200) {
    out({ event: 'refused', data: await r.text() });
    process.exit(0);
  }
  const decoder = new TextDecoder();
  let buf = '';
  try {
    for await (const chunk of r.body) {
      buf += decoder.decode(chunk, { stream: true });
      let i;
      while ((i = buf.indexOf('\n\n')) >= 0) {
        const lines = buf.slice(0, i).split('\n');
        buf = buf.slice(i + 2);
        const event = lines.find((l) => l.startsWith('event:'));
        const data = lines.find((l) => l.startsWith('data:'));
        if (event) out({ event: event.slice(6).trim(), data: data ? data.slice(5).trim() : null });
      }
    }
  } catch (e) {
    out({ event: 'error', data: String(e) });
  }
  out({ event: 'end' });
} else if (cmd === 'events') {
  const [url, cap, seed, ms, container] = args;
  const path = '/v1/state.events' + (container ? '?container=' + encodeURIComponent(container) : '');
  const ctl = new AbortController();
  const seen = [];
  const r = await app.signedFetch(url, capOf(cap), keyOf(seed).privateKey, 'GET', path, null, 'events', { signal: ctl.signal });
  if (r.status !== 200) {
    out(await reply(r));
    process.exit(0);
  }
  const timer = setTimeout(() => ctl.abort(), Number(ms));
  const decoder = new TextDecoder();
  let buf = '';
  let ended = false;
  try {
    for await (const chunk of r.body) {
      buf += decoder.decode(chunk, { stream: true });
      let i;
      while ((i = buf.indexOf('\n\n')) >= 0) {
        const ev = buf.slice(0, i);
        buf = buf.slice(i + 2);
        const data = ev.split('\n').find((l) => l.startsWith('data:'));
        if (ev.includes('event: change') && data) seen.push(JSON.parse(data.slice(5)).container);
        if (ev.includes('event: ready')) process.stderr.write('ready\n');
      }
    }
    ended = true;
  } catch (e) {
    if (e.name !== 'AbortError') throw e;
  }
  clearTimeout(timer);
  out({ status: 200, events: seen, ended });
} else {
  process.stderr.write(`unknown command ${cmd}\n`);
  process.exit(2);
}
