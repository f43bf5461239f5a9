// nuwa_app.mjs: a dependency-free Node.js (18+) client for nuwa-sync app
// capabilities. It is also the format's reference in code: everything the
// daemon checks is built here from Node's own `crypto`, and
// crates/caps/tests/node_client.rs holds it to the Rust verifier (nuwa-caps).
//
// An app holds its own Ed25519 key, named by a did:key. An admin of the agent
// delegates it a capability (ZCAP-LD, JSON) for a target: a container name
// such as `did:nuwa:cap:news:state:Item#v1`, or a prefix ending in `:` such
// as `did:nuwa:cap:weather:`. The app may delegate a narrower capability on
// to another key (`delegate`), and signs every HTTP request with its key
// (`signRequest`, `signedFetch`).
//
// A capability (every member required, no other accepted):
//
//   {
//     "@context": ["https://w3id.org/zcap/v1", "https://w3id.org/security/data-integrity/v2"],
//     "id": "urn:uuid:<uuid, lowercase>",
//     "controller": "<did:key of the invoker>",
//     "invocationTarget": "<target>",
//     "allowedAction": [<subset of read query events write delete reset schema>],
//     "expires": "YYYY-MM-DDTHH:MM:SSZ",
//     "parentCapability": "<root id, or the parent's id>",
//     "proof": {
//       "@context": <the document's @context>,
//       "type": "DataIntegrityProof",
//       "cryptosuite": "eddsa-jcs-2022",
//       "created": "YYYY-MM-DDTHH:MM:SSZ",
//       "verificationMethod": "<delegator's did:key>#<its multibase>",
//       "proofPurpose": "capabilityDelegation",
//       "capabilityChain": [<root id>, <ids of the ancestors between>..., <parent object>],
//       "proofValue": "z<base58btc of the 64-byte Ed25519 signature>"
//     }
//   }
//
// The root id of a target is `urn:zcap:root:` + encodeURIComponent(target).
// The proof signs SHA-256(JCS(proof without proofValue)) followed by
// SHA-256(JCS(capability without proof)), JCS being RFC 8785.
//
// A signed request carries four headers (RFC 9421 HTTP Message Signatures,
// RFC 9530 Content-Digest):
//
//   Capability-Invocation: zcap capability="<base64url of the capability JSON>",action="<action>"
//   Content-Digest: sha-256=:<base64 of SHA-256(body)>:
//   Signature-Input: sig1=("@method" "@path" "@query" "content-digest" "capability-invocation");created=<unix>;expires=<unix>;nonce="<16-64 of A-Za-z0-9_->";keyid="<did:key>#<multibase>";alg="ed25519"
//   Signature: sig1=:<base64 of the Ed25519 signature of the signature base>:
//
// The signature base is one line `"<component>": <value>` per covered
// component, then `"@signature-params": <Signature-Input after "sig1=">`,
// joined by "\n" without a trailing newline. `@method` is uppercase, `@path`
// the path as sent, `@query` "?" + the query as sent ("?" alone when empty).
// The daemon accepts created from 300 s before its clock to 1 s after it,
// and expires after its clock and at most 300 s after created; each nonce
// once.

import crypto from 'node:crypto';
import fs from 'node:fs';

export const CONTEXT = Object.freeze([
  'https://w3id.org/zcap/v1',
  'https://w3id.org/security/data-integrity/v2',
]);
export const ACTIONS = Object.freeze(['read', 'query', 'events', 'write', 'delete', 'reset', 'schema']);
export const ROOT_ID_PREFIX = 'urn:zcap:root:';
/** Most delegations in one chain, the admin's first one included. */
export const MAX_CHAIN_DEPTH = 4;
/** Longest lifetime of one request signature, in seconds. */
export const MAX_SIGNATURE_TTL_SECS = 300;

const COVERED_COMPONENTS = '("@method" "@path" "@query" "content-digest" "capability-invocation")';
const ED25519_PUB_MULTICODEC = [0xed, 0x01];
// PKCS#8 wrapping of a 32-byte Ed25519 seed (RFC 8410), so a seed can become a KeyObject.
const PKCS8_ED25519_PREFIX = Buffer.from('302e020100300506032b657004220420', 'hex');

// ---- base58btc (Bitcoin alphabet) ----

const B58_ALPHABET = '123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz';

/** base58btc of bytes: each leading zero byte becomes '1'. */
export function base58Encode(bytes) {
  const input = Uint8Array.from(bytes);
  let zeros = 0;
  while (zeros < input.length && input[zeros] === 0) zeros++;
  const digits = []; // base-58 digits, least significant first
  for (let i = zeros; i < input.length; i++) {
    let carry = input[i];
    for (let j = 0; j < digits.length; j++) {
      carry += digits[j] << 8;
      digits[j] = carry % 58;
      carry = Math.floor(carry / 58);
    }
    while (carry > 0) {
      digits.push(carry % 58);
      carry = Math.floor(carry / 58);
    }
  }
  let out = '1'.repeat(zeros);
  for (let i = digits.length - 1; i >= 0; i--) out += B58_ALPHABET[digits[i]];
  return out;
}

/** The bytes of a base58btc string; throws on a character outside the alphabet. */
export function base58Decode(text) {
  let zeros = 0;
  while (zeros < text.length && text[zeros] === '1') zeros++;
  const bytes = []; // base-256 digits, least significant first
  for (let i = zeros; i < text.length; i++) {
    let carry = B58_ALPHABET.indexOf(text[i]);
    if (carry < 0) throw new Error(`not base58btc: ${JSON.stringify(text[i])}`);
    for (let j = 0; j < bytes.length; j++) {
      carry += bytes[j] * 58;
      bytes[j] = carry & 0xff;
      carry >>= 8;
    }
    while (carry > 0) {
      bytes.push(carry & 0xff);
      carry >>= 8;
    }
  }
  return Uint8Array.from([...new Array(zeros).fill(0), ...bytes.reverse()]);
}

// ---- keys and did:key ----

/** A fresh Ed25519 key: { privateKey (KeyObject), publicKeyRaw (32 bytes), did }. */
export function generateKey() {
  const { privateKey } = crypto.generateKeyPairSync('ed25519');
  return describeKey(privateKey);
}

/** The key of a 32-byte Ed25519 seed (the private key's raw form), as generateKey returns it. */
export function keyFromSeed(seed) {
  const raw = Buffer.from(seed);
  if (raw.length !== 32) throw new Error(`an Ed25519 seed is 32 bytes, not ${raw.length}`);
  const der = Buffer.concat([PKCS8_ED25519_PREFIX, raw]);
  return describeKey(crypto.createPrivateKey({ key: der, format: 'der', type: 'pkcs8' }));
}

function describeKey(privateKey) {
  const publicKeyRaw = publicKeyRawOf(privateKey);
  return { privateKey, publicKeyRaw, did: didKeyOf(publicKeyRaw) };
}

/** The 32 raw public-key bytes of an Ed25519 private KeyObject. */
export function publicKeyRawOf(privateKey) {
  const jwk = crypto.createPublicKey(privateKey).export({ format: 'jwk' });
  return new Uint8Array(Buffer.from(jwk.x, 'base64url'));
}

/** `z` + base58btc(0xed 0x01 ‖ key): the multibase of an Ed25519 public key ("z6Mk…"). */
export function publicKeyMultibase(publicKeyRaw) {
  if (publicKeyRaw.length !== 32) throw new Error('an Ed25519 public key is 32 bytes');
  return 'z' + base58Encode([...ED25519_PUB_MULTICODEC, ...publicKeyRaw]);
}

/** `did:key:z6Mk…` of an Ed25519 public key. */
export function didKeyOf(publicKeyRaw) {
  return 'did:key:' + publicKeyMultibase(publicKeyRaw);
}

/** The 32-byte public key inside `did:key:z6Mk…`. */
export function publicKeyOfDidKey(did) {
  const multibase = did.startsWith('did:key:') ? did.slice('did:key:'.length) : '';
  if (!multibase.startsWith('z')) throw new Error(`not an Ed25519 did:key: ${did}`);
  const bytes = base58Decode(multibase.slice(1));
  if (bytes.length !== 34 || bytes[0] !== 0xed || bytes[1] !== 0x01) {
    throw new Error(`not an Ed25519 did:key: ${did}`);
  }
  return bytes.slice(2);
}

/** `did:key:z6Mk…#z6Mk…`: the verificationMethod and HTTP keyid of a key. */
export function verificationMethodOf(publicKeyRaw) {
  return `${didKeyOf(publicKeyRaw)}#${publicKeyMultibase(publicKeyRaw)}`;
}

// ---- JSON canonicalization (RFC 8785), for the subset capabilities use ----

/**
 * JCS text of a value made of objects, arrays, strings, booleans, null and
 * safe integers. Anything else (fractions, NaN, undefined, lone surrogates)
 * throws: capabilities hold no other numbers, and refusing them spares the
 * ECMAScript number formatting rules.
 */
export function canonicalize(value) {
  if (value === null || typeof value === 'boolean') return JSON.stringify(value);
  if (typeof value === 'number') {
    if (!Number.isSafeInteger(value)) throw new Error(`only safe integers are accepted, not ${value}`);
    return String(value);
  }
  if (typeof value === 'string') {
    if (!isWellFormed(value)) throw new Error('a string has a lone surrogate');
    return JSON.stringify(value);
  }
  if (Array.isArray(value)) return '[' + value.map(canonicalize).join(',') + ']';
  if (typeof value === 'object') {
    // Array.prototype.sort compares UTF-16 code units, as JCS sorts keys.
    const keys = Object.keys(value).sort();
    return '{' + keys.map((k) => canonicalize(k) + ':' + canonicalize(value[k])).join(',') + '}';
  }
  throw new Error(`a ${typeof value} cannot be canonicalized`);
}

// String.prototype.isWellFormed is Node 20+; the expression is its fallback.
function isWellFormed(text) {
  if (typeof text.isWellFormed === 'function') return text.isWellFormed();
  return !/[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/.test(text);
}

// ---- capabilities ----

/** `urn:zcap:root:` + the target percent-encoded. */
export function rootId(target) {
  return ROOT_ID_PREFIX + encodeURIComponent(target);
}

/** `2026-12-01T00:00:00Z` for unix seconds. */
export function formatTime(unixSecs) {
  return new Date(unixSecs * 1000).toISOString().replace(/\.\d{3}Z$/, 'Z');
}

function parseTime(text) {
  const ms = Date.parse(text);
  if (!/^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$/.test(text) || Number.isNaN(ms)) {
    throw new Error(`not an RFC 3339 UTC time in whole seconds: ${text}`);
  }
  return ms / 1000;
}

/** Whether `target` reaches `name`: equal, or a prefix of it ending in ':'. */
export function covers(target, name) {
  return target === name || (target.endsWith(':') && name.startsWith(target));
}

const TARGET_RE = /^[A-Za-z0-9._@\-:#]{1,256}$/;
const ID_RE = /^urn:uuid:([0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$/;

/** The depth of a capability: 1 for one an admin delegated. */
export function depthOf(cap) {
  const last = cap.proof.capabilityChain.at(-1);
  return typeof last === 'object' ? 1 + depthOf(last) : 1;
}

/**
 * A capability delegated by `signerPrivateKey` to `invokerDid`.
 *
 * With `parentCap` null, the signer must be an admin of the agent (only the
 * daemon knows that). Otherwise the signer must be the parent's controller,
 * and the new capability may only narrow the parent: the same target or
 * one inside it, a subset of its actions, an expiry no later.
 *
 * options: { invokerDid, target, actions, expiresUnixSecs,
 *            nowUnixSecs = now, id = "urn:uuid:" + a random UUID }
 */
export function delegate(parentCap, signerPrivateKey, options) {
  const {
    invokerDid,
    target,
    actions,
    expiresUnixSecs,
    nowUnixSecs = Math.floor(Date.now() / 1000),
    id = `urn:uuid:${crypto.randomUUID()}`,
  } = options;
  if (!ID_RE.test(id)) throw new Error(`id must be urn:uuid: and a lowercase UUID: ${id}`);
  const controllerKey = publicKeyOfDidKey(invokerDid);
  if (!TARGET_RE.test(target)) throw new Error(`target must be 1 to 256 of A-Z a-z 0-9 . _ @ - : #: ${target}`);
  const unknown = actions.filter((a) => !ACTIONS.includes(a));
  if (unknown.length > 0) throw new Error(`unknown actions: ${unknown.join(', ')}`);
  const allowed = ACTIONS.filter((a) => actions.includes(a)); // canonical order, no repeats
  if (allowed.length === 0) throw new Error('a capability allows at least one action');
  if (!(expiresUnixSecs > nowUnixSecs)) throw new Error('expires must be after now');

  const signerPublic = publicKeyRawOf(signerPrivateKey);
  let parentCapability;
  let capabilityChain;
  if (parentCap === null || parentCap === undefined) {
    parentCapability = rootId(target);
    capabilityChain = [parentCapability];
  } else {
    if (depthOf(parentCap) >= MAX_CHAIN_DEPTH) throw new Error(`a chain holds at most ${MAX_CHAIN_DEPTH} delegations`);
    if (verificationMethodOf(signerPublic) !== verificationMethodOf(publicKeyOfDidKey(parentCap.controller))) {
      throw new Error(`only the parent's controller ${parentCap.controller} may delegate from it`);
    }
    const parentExpires = parseTime(parentCap.expires);
    if (parentExpires <= nowUnixSecs) throw new Error(`the parent capability ${parentCap.id} has expired`);
    if (!covers(parentCap.invocationTarget, target)) {
      throw new Error(`target ${target} is not ${parentCap.invocationTarget} nor inside it`);
    }
    const extra = allowed.filter((a) => !parentCap.allowedAction.includes(a));
    if (extra.length > 0) throw new Error(`the parent does not allow ${extra.join(', ')}`);
    if (expiresUnixSecs > parentExpires) throw new Error('a capability cannot outlive its parent');
    const parentChain = parentCap.proof.capabilityChain;
    const grandparent = parentChain.at(-1);
    const ids = parentChain.filter((entry) => typeof entry === 'string');
    if (typeof grandparent === 'object') ids.push(grandparent.id);
    parentCapability = parentCap.id;
    capabilityChain = [...ids, parentCap];
  }

  const document = {
    '@context': [...CONTEXT],
    id,
    controller: didKeyOf(controllerKey),
    invocationTarget: target,
    allowedAction: allowed,
    expires: formatTime(expiresUnixSecs),
    parentCapability,
  };
  const proof = {
    '@context': [...CONTEXT],
    type: 'DataIntegrityProof',
    cryptosuite: 'eddsa-jcs-2022',
    created: formatTime(nowUnixSecs),
    verificationMethod: verificationMethodOf(signerPublic),
    proofPurpose: 'capabilityDelegation',
    capabilityChain,
  };
  const hashData = Buffer.concat([sha256(canonicalize(proof)), sha256(canonicalize(document))]);
  const signature = crypto.sign(null, hashData, signerPrivateKey);
  return { ...document, proof: { ...proof, proofValue: 'z' + base58Encode(signature) } };
}

function sha256(data) {
  return crypto.createHash('sha256').update(data).digest();
}

// ---- signed requests ----

/**
 * The four headers that invoke `cap` (held by `privateKey`) for `action` on
 * a request. `path` is the path as sent (percent-encoded), `query` the
 * query without "?" ("" for none), `body` a string, bytes or null.
 *
 * options: { createdUnixSecs = now, ttlSecs = 60,
 *            nonce = 22 random base64url characters }
 */
export function signRequest(cap, privateKey, method, path, query, body, action, options = {}) {
  const {
    createdUnixSecs = Math.floor(Date.now() / 1000),
    ttlSecs = 60,
    nonce = crypto.randomBytes(16).toString('base64url'),
  } = options;
  if (!Array.isArray(cap?.allowedAction)) {
    throw new Error('not a capability (it has no allowedAction): pass the capability itself, as ' +
      '`nuwa-node app grant --out FILE` writes it; loadCapability(FILE) reads one');
  }
  if (!cap.allowedAction.includes(action)) throw new Error(`the capability does not allow ${action}`);
  if (!/^[A-Za-z0-9_-]{16,64}$/.test(nonce)) throw new Error('a nonce is 16 to 64 of A-Za-z0-9_-');
  if (!(ttlSecs > 0 && ttlSecs <= MAX_SIGNATURE_TTL_SECS)) throw new Error('ttlSecs is 1 to 300');
  const publicKeyRaw = publicKeyRawOf(privateKey);
  if (didKeyOf(publicKeyRaw) !== cap.controller) {
    throw new Error(`the capability is for ${cap.controller}, not for this key`);
  }
  const bodyBytes = body === null || body === undefined ? Buffer.alloc(0) : Buffer.from(body);
  const capabilityInvocation = `zcap capability="${Buffer.from(canonicalize(cap)).toString('base64url')}",action="${action}"`;
  const contentDigest = `sha-256=:${sha256(bodyBytes).toString('base64')}:`;
  const params =
    `${COVERED_COMPONENTS};created=${createdUnixSecs};expires=${createdUnixSecs + ttlSecs}` +
    `;nonce="${nonce}";keyid="${verificationMethodOf(publicKeyRaw)}";alg="ed25519"`;
  const base = [
    `"@method": ${method.toUpperCase()}`,
    `"@path": ${path === '' ? '/' : path}`,
    `"@query": ?${query}`,
    `"content-digest": ${contentDigest}`,
    `"capability-invocation": ${capabilityInvocation}`,
    `"@signature-params": ${params}`,
  ].join('\n');
  const signature = crypto.sign(null, Buffer.from(base), privateKey);
  return {
    'Capability-Invocation': capabilityInvocation,
    'Content-Digest': contentDigest,
    'Signature-Input': `sig1=${params}`,
    Signature: `sig1=:${signature.toString('base64')}:`,
  };
}

/**
 * fetch() of `baseUrl` + `pathAndQuery` with the request signed by
 * `privateKey` under `cap` for `action`. Path and query are signed as the
 * URL parser normalizes them, which is what fetch sends.
 */
export async function signedFetch(baseUrl, cap, privateKey, method, pathAndQuery, body, action, options = {}) {
  const url = new URL(baseUrl.replace(/\/+$/, '') + pathAndQuery);
  // A daemon refuses requests dated before its start + 1 s
  // (`signed_before_start`, docs/api.md): signed again a moment later.
  for (let attempt = 0; ; attempt++) {
    const headers = signRequest(cap, privateKey, method, url.pathname, url.search.slice(1), body, action, options);
    const init = { method, headers: { ...headers }, signal: options.signal };
    if (body !== null && body !== undefined) {
      init.body = body;
      if (typeof body === 'string') init.headers['Content-Type'] = 'application/json';
    }
    const r = await fetch(url, init);
    const fixed = options.createdUnixSecs !== undefined || options.nonce !== undefined;
    if (attempt >= 10 || fixed || !(await refusedBeforeStart(r))) return r;
    await new Promise((done) => setTimeout(done, 300));
  }
}

/** Whether `r` is a 401 `signed_before_start` (worth signing again). */
export async function refusedBeforeStart(r) {
  if (r.status !== 401) return false;
  return (await r.clone().text()).includes('signed_before_start');
}

// ---- files ----

/**
 * The capability in `file`: the capability itself, as `nuwa-node app
 * grant --out FILE` writes it (also the `{"id", "capability"}` reply of
 * `POST /v1/apps/grant`, whose `capability` it takes).
 */
export function loadCapability(file) {
  const value = JSON.parse(fs.readFileSync(file, 'utf8'));
  const cap = Array.isArray(value?.allowedAction) ? value : value?.capability;
  if (!Array.isArray(cap?.allowedAction)) {
    throw new Error(`${file} holds no capability (no allowedAction); write it with nuwa-node app grant --out`);
  }
  return cap;
}

/**
 * The app's own key, kept in `file`: 64 hex digits of a random seed,
 * made (mode 0600, never overwritten) the first time. Keep the file in
 * the app's own data directory; whoever reads it can act as the app.
 */
export function keyFromFile(file) {
  if (!fs.existsSync(file)) {
    const seed = crypto.randomBytes(32).toString('hex');
    try {
      fs.writeFileSync(file, seed + '\n', { mode: 0o600, flag: 'wx' });
    } catch (e) {
      if (e.code !== 'EEXIST') throw e; // another process made it first
    }
  }
  const hex = fs.readFileSync(file, 'utf8').trim();
  if (!/^[0-9a-f]{64}$/.test(hex)) throw new Error(`${file} is not 64 hex digits of an app key`);
  return keyFromSeed(Buffer.from(hex, 'hex'));
}
