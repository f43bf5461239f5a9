//! `nuwa-node pair` and a fresh home's `recover`: the new device's side of
//! pairing, as a state machine the shell drives with the pairing steps it
//! receives and the clock.
//!
//! It runs the SPAKE2 exchange on the code, opens the grant (the DID chain
//! and key ring, sealed under the PAKE session key), and says what home to
//! write; the shell writes it and only then confirms. A wrong code fails
//! closed: the attempt is refused and counted, and three failures burn the
//! code. With recovery words, it takes a recovery handover (or a plain
//! grant) and lists this device itself, signing with the words; when no
//! lost device was named beforehand, it first shows the person the devices
//! the handover lists and asks which were lost ([`JoinStep::ChooseLost`]).

use nuwa_crypto::epoch::KeyRing;
use nuwa_crypto::pairing::{
    ApproverConfirm, AttemptLimiter, Grant, Joiner, JoinerOutcome, JoinerPublicKeys, PairingCode,
};
use nuwa_identity::chain::DidChain;
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_proto::{Frame, PairingStep};

use crate::announce::Announcement;
use crate::constants::*;
use crate::devices::Seen;
use crate::pairing::{GrantPlaintext, KnownDevice};
use crate::pairing::{mdns_agent, rendezvous_namespace};
use crate::peer::{Multiaddr, PeerId, Protocol, peer_in};

/// Listen addresses kept per peer that identified itself.
const MAX_IDENTIFIED_ADDRS: usize = 16;
/// Peers whose listen addresses are kept (the approver is one of them;
/// a crowd of others cannot grow the map).
const MAX_IDENTIFIED_PEERS: usize = 64;

/// What `recover` on a fresh home brings to pairing.
pub struct RecoveryJoin {
    /// The key of the recovery words.
    pub key: DeviceKey,
    /// Lost devices to remove (context ids), or `None` to ask the person
    /// once the handover shows which devices there are
    /// ([`JoinStep::ChooseLost`]).
    pub lost: Option<Vec<String>>,
    /// The public key of the new recovery words (already shown and confirmed).
    pub next_public: [u8; 32],
}

/// The home the shell writes once pairing succeeded.
pub struct PairedHome {
    pub name: String,
    pub keys: KeyRing,
    pub grant: Option<Vec<u8>>,
    pub log: DidChain,
    /// What recovery did, for the person (none for a plain pairing).
    pub recovered: Option<String>,
    /// Names and last-seen times of the agent's devices as a recovery
    /// handover carried them (empty otherwise): the home's first record
    /// of them (the shell stores it under [`crate::devices::SEEN_META`]).
    pub seen: Seen,
}

/// A device the person recovering may name as lost: one the handed-over
/// document lists as active, other than this one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostCandidate {
    pub context_id: String,
    /// Empty when the handing device did not know it.
    pub name: String,
    /// When the handing device last saw it (Unix ms), if ever.
    pub last_seen_ms: Option<u64>,
    /// Whether it may change the agent's devices.
    pub admin: bool,
}

/// What the shell does next.
pub enum JoinStep {
    /// Send this frame to the approving device.
    Send { peer: PeerId, frame: Frame },
    /// Tell the person waiting.
    Say(String),
    /// Write this home, then send `confirm` (the approver waits for it;
    /// `None` when it was sent already, before [`JoinStep::ChooseLost`]).
    /// `dial` is where the approver listens (each address with its
    /// `/p2p/`), for the first sync.
    Paired {
        peer: PeerId,
        home: Box<PairedHome>,
        confirm: Option<Frame>,
        dial: Vec<Multiaddr>,
    },
    /// Show the person these devices and ask which were lost (none is an
    /// answer), then call [`JoinFlow::lost_chosen`]
    /// ([`parse_lost_choice`] reads an answer).
    ChooseLost { devices: Vec<LostCandidate> },
    /// Pairing failed for good (the code is spent, expired, or recovery
    /// was refused); nothing was written.
    Failed(String),
    /// Register the code's namespace ([`JoinFlow::namespace`]) at this
    /// rendezvous server, with the addresses we have now.
    Register { server: PeerId },
    /// Hold a relay circuit on this server (reached at `addr`), so that an
    /// approver behind another NAT reaches us through it.
    ReserveRelay { server: PeerId, addr: Multiaddr },
}

struct Exchange {
    peer: PeerId,
    joiner: Joiner,
    started_ms: u64,
}

/// A recovery handover opened with the words, waiting for the person to
/// say which devices were lost.
struct Pending {
    peer: PeerId,
    opened: Opened,
    dial: Vec<Multiaddr>,
}

/// What a grant that opened leads to: a home to write, or a question
/// for the person first.
enum Granted {
    Home(PairedHome),
    Ask(Opened, Vec<LostCandidate>),
}

/// A recovery handover (or an admin's grant) opened with the words.
struct Opened {
    g: GrantPlaintext,
    ring: KeyRing,
    book: Vec<KnownDevice>,
}

/// The new device's pairing.
pub struct JoinFlow {
    code: PairingCode,
    keys: JoinerPublicKeys,
    name: String,
    /// `pair --expires`: seconds after it is added.
    expires_secs: Option<u64>,
    local: PeerId,
    device: DeviceKey,
    recovery: Option<RecoveryJoin>,
    limiter: AttemptLimiter,
    exchange: Option<Exchange>,
    /// The opened handover while the person chooses the lost devices.
    pending: Option<Pending>,
    /// The last device that sent a step (the one to let hang up).
    last_peer: Option<PeerId>,
    /// Listen addresses of the peers that identified themselves.
    identified: std::collections::BTreeMap<PeerId, Vec<Multiaddr>>,
    /// Rendezvous servers we are connected to (each is also a relay).
    servers: std::collections::BTreeSet<PeerId>,
}

fn abort(peer: PeerId, reason: String) -> JoinStep {
    JoinStep::Send {
        peer,
        frame: Frame::Pairing {
            step: PairingStep::Abort,
            body: reason.into_bytes(),
        },
    }
}

fn send(peer: PeerId, step: PairingStep, body: Vec<u8>) -> JoinStep {
    JoinStep::Send {
        peer,
        frame: Frame::Pairing { step, body },
    }
}

/// Why a join cannot start.
#[derive(Debug, thiserror::Error)]
pub enum JoinSetupError {
    /// The device key has no key-agreement form.
    #[error("cannot derive the key-agreement key: {0}")]
    Key(#[from] nuwa_identity::document::DidError),
    /// The name or PeerId a pairing session would refuse (checked before a
    /// code is shown, not after an approver has connected).
    #[error(transparent)]
    Pairing(#[from] nuwa_crypto::pairing::PairingError),
}

impl JoinFlow {
    /// A flow for `device` (whose key-agreement key is derived from it),
    /// showing `code`, named `name`, on the network as `local`.
    pub fn new(
        code: PairingCode,
        device: DeviceKey,
        name: String,
        local: PeerId,
        recovery: Option<RecoveryJoin>,
    ) -> Result<JoinFlow, JoinSetupError> {
        let keys = JoinerPublicKeys {
            ed25519_public: device.public(),
            x25519_public: nuwa_identity::did_key::x25519_public_from_ed25519(&device.public())?,
        };
        // The session each approver gets checks the name; check it now.
        Joiner::new(code.clone(), &local.to_string(), keys, &name)?;
        Ok(JoinFlow {
            code,
            keys,
            name,
            expires_secs: None,
            local,
            device,
            recovery,
            limiter: AttemptLimiter::default(),
            exchange: None,
            pending: None,
            last_peer: None,
            identified: Default::default(),
            servers: Default::default(),
        })
    }

    /// Asks the approver to list this device as expiring `secs` after it
    /// is added (`pair --expires`; the approver may make it shorter).
    pub fn with_expiry(mut self, secs: Option<u64>) -> Self {
        self.expires_secs = secs;
        self
    }

    /// The code this device shows.
    pub fn code(&self) -> &PairingCode {
        &self.code
    }

    /// The last device that sent a pairing step.
    pub fn last_peer(&self) -> Option<PeerId> {
        self.last_peer
    }

    /// Our mDNS TXT record: the code's nameplate as the agent, naming our
    /// TCP `port`, self-signed by the new device's key (refresh it every
    /// [`ANNOUNCE_REFRESH_MS`]).
    pub fn announcement(&self, port: u16, now_ms: u64) -> Vec<(String, String)> {
        Announcement::new_signed(
            &mdns_agent(&self.code.nameplate()),
            context_id_for(&self.device.public()),
            self.local.to_string(),
            port,
            (now_ms / 1000) as i64,
            |b| self.device.sign(b),
        )
        .to_txt()
    }

    /// The rendezvous namespace to register under at each server.
    pub fn namespace(&self) -> String {
        rendezvous_namespace(&self.code.nameplate())
    }

    /// Connected to the rendezvous server `server` (at `addr`): register
    /// the code there at once (an approver on our network can use our
    /// private addresses), and hold a relay circuit on it, so that an
    /// approver elsewhere (a phone on mobile data, a laptop behind another
    /// NAT) can reach us through it once the registration names it.
    pub fn on_server_connected(&mut self, server: PeerId, addr: Multiaddr) -> Vec<JoinStep> {
        self.servers.insert(server);
        vec![
            JoinStep::Register { server },
            JoinStep::ReserveRelay { server, addr },
        ]
    }

    /// The connection to `server` closed: its registration and circuit
    /// went with it (the shell dials it again).
    pub fn on_server_lost(&mut self, server: PeerId) {
        self.servers.remove(&server);
    }

    /// The addresses we advertise changed (a relay circuit is held, or
    /// went): register again at every server we are connected to, so the
    /// registration names them (a registration replaces the one before).
    pub fn on_addresses_changed(&mut self) -> Vec<JoinStep> {
        self.servers
            .iter()
            .map(|&server| JoinStep::Register { server })
            .collect()
    }

    /// `peer`'s listen addresses, as identify reports them.
    pub fn on_identified(&mut self, peer: PeerId, addrs: Vec<Multiaddr>) {
        if self.identified.len() >= MAX_IDENTIFIED_PEERS && !self.identified.contains_key(&peer) {
            return;
        }
        let addrs = addrs.into_iter().take(MAX_IDENTIFIED_ADDRS);
        let with_p2p = addrs.map(|a| match peer_in(&a) {
            Some(_) => a,
            None => a.with(Protocol::P2p(peer)),
        });
        self.identified.insert(peer, with_p2p.collect());
    }

    /// A frame from `peer`: a pairing step goes to [`JoinFlow::on_step`];
    /// anything else (the approver's Hello) is not for pairing.
    pub fn on_frame(&mut self, peer: PeerId, frame: &[u8], now_ms: u64) -> Vec<JoinStep> {
        match Frame::decode(frame) {
            Ok(Frame::Pairing { step, body }) => self.on_step(peer, step, &body, now_ms),
            _ => Vec::new(),
        }
    }

    /// The code expired, or an exchange stalled. Nothing expires while the
    /// person chooses the lost devices: the code did its work.
    pub fn tick(&mut self, now_ms: u64) -> Vec<JoinStep> {
        if self.pending.is_some() {
            return Vec::new();
        }
        if self.code.is_expired(now_ms / 1000) {
            return vec![JoinStep::Failed(
                "the pairing code expired before a device approved it; run `nuwa-node pair` again"
                    .to_owned(),
            )];
        }
        if self
            .exchange
            .as_ref()
            .is_some_and(|s| now_ms.saturating_sub(s.started_ms) > SESSION_TIMEOUT_MS)
        {
            self.exchange = None;
            return vec![JoinStep::Say(
                "a pairing exchange stalled; waiting for a new approval".to_owned(),
            )];
        }
        Vec::new()
    }

    /// A pairing step from `peer`.
    pub fn on_step(
        &mut self,
        peer: PeerId,
        step: PairingStep,
        body: &[u8],
        now_ms: u64,
    ) -> Vec<JoinStep> {
        self.last_peer = Some(peer);
        let in_exchange = self.exchange.as_ref().is_some_and(|s| s.peer == peer);
        match step {
            PairingStep::Offer => self.on_offer(peer, in_exchange, now_ms),
            PairingStep::ApproverConfirm if in_exchange => self.on_confirm(peer, body, now_ms),
            PairingStep::Grant if in_exchange => self.on_grant(peer, body, now_ms),
            PairingStep::Abort if in_exchange => {
                self.exchange = None;
                let reason =
                    String::from_utf8_lossy(&body[..body.len().min(MAX_REASON_BYTES)]).into_owned();
                vec![JoinStep::Say(format!(
                    "the approving device stopped: {reason}; still waiting"
                ))]
            }
            _ => Vec::new(),
        }
    }

    fn on_offer(&mut self, peer: PeerId, in_exchange: bool, now_ms: u64) -> Vec<JoinStep> {
        if (self.exchange.is_some() && !in_exchange) || self.pending.is_some() {
            let busy = "the new device is busy pairing with another device";
            return vec![abort(peer, busy.to_owned())];
        }
        let now_secs = now_ms / 1000;
        if let Err(e) = self.limiter.begin_attempt(&self.code, now_secs) {
            return vec![abort(peer, e.to_string()), JoinStep::Failed(e.to_string())];
        }
        let started = Joiner::new(
            self.code.clone(),
            &self.local.to_string(),
            self.keys,
            &self.name,
        )
        .map(|j| j.with_expiry(self.expires_secs))
        .and_then(|mut j| j.start(&peer.to_string(), now_secs).map(|req| (j, req)));
        let (joiner, req) = match started {
            Ok(x) => x,
            Err(e) => return vec![JoinStep::Failed(format!("cannot start pairing: {e}"))],
        };
        self.exchange = Some(Exchange {
            peer,
            joiner,
            started_ms: now_ms,
        });
        vec![
            JoinStep::Say(format!("device {peer} is approving; checking the code...")),
            send(peer, PairingStep::JoinRequest, req.encode()),
        ]
    }

    fn on_confirm(&mut self, peer: PeerId, body: &[u8], now_ms: u64) -> Vec<JoinStep> {
        let Some(s) = self.exchange.as_mut() else {
            return Vec::new();
        };
        let result = ApproverConfirm::decode(body)
            .and_then(|m| s.joiner.on_approver_confirm(&m, now_ms / 1000));
        let e = match result {
            Ok(confirm) => return vec![send(peer, PairingStep::JoinerConfirm, confirm.encode())],
            Err(e) => e,
        };
        self.exchange = None;
        let mut out = vec![abort(peer, e.to_string())];
        if e.counts_as_failed_attempt() {
            self.limiter.record_failure(&self.code);
        }
        let left = self.limiter.remaining_attempts(&self.code);
        out.push(if left == 0 {
            JoinStep::Failed(format!(
                "pairing failed: {e}. The code is now burned after too many failed \
                 attempts; run `nuwa-node pair` again for a new code"
            ))
        } else {
            JoinStep::Say(format!(
                "pairing attempt from {peer} failed: {e} ({left} attempts left)"
            ))
        });
        out
    }

    fn on_grant(&mut self, peer: PeerId, body: &[u8], now_ms: u64) -> Vec<JoinStep> {
        let Some(s) = self.exchange.as_mut() else {
            return Vec::new();
        };
        let plaintext = match Grant::decode(body).and_then(|g| s.joiner.on_grant(&g)) {
            Ok(JoinerOutcome::Granted(pt)) => pt,
            Ok(_) => {
                self.exchange = None;
                let reason = "unexpected pairing outcome".to_owned();
                return vec![abort(peer, reason.clone()), JoinStep::Failed(reason)];
            }
            Err(e) => {
                self.exchange = None;
                return vec![
                    abort(peer, e.to_string()),
                    JoinStep::Say(format!("pairing attempt from {peer} failed: {e}")),
                ];
            }
        };
        let now_secs = (now_ms / 1000) as i64;
        let granted = match &self.recovery {
            None => granted_home(&plaintext, &self.device, now_secs).map(Granted::Home),
            Some(r) => {
                open_recovery(&plaintext, r, &self.device, now_secs).and_then(|o| match &r.lost {
                    Some(lost) => {
                        recovered_home(o, r, &self.device, lost, false, now_secs).map(Granted::Home)
                    }
                    None => {
                        let devices = candidates(&o, &self.device, now_secs);
                        Ok(Granted::Ask(o, devices))
                    }
                })
            }
        };
        let granted = match granted {
            Ok(g) => g,
            Err(reason) => {
                self.exchange = None;
                return vec![abort(peer, reason.clone()), JoinStep::Failed(reason)];
            }
        };
        self.limiter.record_success(&self.code);
        let dial = self.identified.remove(&peer).unwrap_or_default();
        let (opened, devices) = match granted {
            Granted::Home(home) => {
                return vec![JoinStep::Paired {
                    peer,
                    home: Box::new(home),
                    confirm: Some(done()),
                    dial,
                }];
            }
            Granted::Ask(opened, devices) => (opened, devices),
        };
        // The person may take minutes to choose, longer than the approver
        // waits for the confirmation (its `--timeout`, 60 s by default,
        // counted from the start of the approval) and than an exchange
        // lives here (`SESSION_TIMEOUT_MS`). So the handover is confirmed
        // now, once it opened with the words: that is all the approver's
        // part, and nothing on the approver changes with it. Signing is
        // this device's alone and follows the answer; if the person stops
        // here, nothing was written and the approver only handed over.
        self.exchange = None;
        self.pending = Some(Pending { peer, opened, dial });
        vec![
            send(peer, PairingStep::Done, Vec::new()),
            JoinStep::ChooseLost { devices },
        ]
    }

    /// The person's answer to [`JoinStep::ChooseLost`]: remove the `lost`
    /// devices (context ids), sign with the words and say what home to
    /// write. Nothing without a pending choice.
    pub fn lost_chosen(&mut self, lost: Vec<String>, now_ms: u64) -> Vec<JoinStep> {
        let (Some(p), Some(r)) = (self.pending.take(), self.recovery.as_ref()) else {
            return Vec::new();
        };
        let now_secs = (now_ms / 1000) as i64;
        match recovered_home(p.opened, r, &self.device, &lost, true, now_secs) {
            Ok(home) => vec![JoinStep::Paired {
                peer: p.peer,
                home: Box::new(home),
                confirm: None,
                dial: p.dial,
            }],
            Err(reason) => vec![JoinStep::Failed(reason)],
        }
    }
}

fn done() -> Frame {
    Frame::Pairing {
        step: PairingStep::Done,
        body: Vec::new(),
    }
}

/// A plain grant: the home of the device the approver listed.
fn granted_home(plaintext: &[u8], device: &DeviceKey, now_secs: i64) -> Result<PairedHome, String> {
    let (g, ring) = GrantPlaintext::open(plaintext, &device.public(), now_secs).map_err(|e| {
        format!(
            "the approving device sent an unusable grant: {}",
            crate::explain(&e)
        )
    })?;
    let grant = hex::decode(&g.epoch_grant_hex).unwrap_or_default();
    Ok(PairedHome {
        name: g.name.clone(),
        keys: ring,
        grant: (!grant.is_empty()).then_some(grant),
        log: g.did_log.clone(),
        recovered: None,
        seen: Seen::default(),
    })
}

/// Opens a recovery handover (`approve --recovery`), or a plain grant
/// from an admin that listed this device already, with the words.
fn open_recovery(
    plaintext: &[u8],
    r: &RecoveryJoin,
    device: &DeviceKey,
    now_secs: i64,
) -> Result<Opened, String> {
    let handover =
        serde_json::from_slice::<GrantPlaintext>(plaintext).is_ok_and(|g| g.is_handover());
    let (g, ring) = if handover {
        GrantPlaintext::open_handover(plaintext, &r.key, now_secs)
    } else {
        GrantPlaintext::open(plaintext, &device.public(), now_secs)
    }
    .map_err(|e| format!("recovery failed: {}", crate::explain(&e)))?;
    let book = g.device_book();
    Ok(Opened { g, ring, book })
}

/// The devices the person may name as lost: every active device of the
/// document but this one, with what the handover's book says of it.
fn candidates(o: &Opened, device: &DeviceKey, now_secs: i64) -> Vec<LostCandidate> {
    let doc = o.g.did_log.current();
    let me = context_id_for(&device.public());
    crate::devices::listed_devices(doc)
        .into_iter()
        .filter(|ctx| *ctx != me)
        .filter(|ctx| {
            let id = doc.key_id(ctx);
            doc.key_status(&id, now_secs) == nuwa_identity::document::KeyStatus::Active
        })
        .map(|ctx| {
            let known = o.book.iter().find(|d| d.context_id == ctx);
            LostCandidate {
                name: known.map(|d| d.name.clone()).unwrap_or_default(),
                last_seen_ms: known.map(|d| d.last_seen_ms).filter(|t| *t > 0),
                admin: doc.has_relationship(
                    &ctx,
                    nuwa_identity::document::Relationship::CapabilityDelegation,
                ),
                context_id: ctx,
            }
        })
        .collect()
}

/// Signs the recovery: the words make this device the admin, remove the
/// `lost` devices and open a new key epoch. When nobody was asked and no
/// device was named, what it says names the devices that stay and how to
/// revoke one later.
fn recovered_home(
    o: Opened,
    r: &RecoveryJoin,
    device: &DeviceKey,
    lost: &[String],
    asked: bool,
    now_secs: i64,
) -> Result<PairedHome, String> {
    let failed =
        |e: &(dyn std::error::Error + 'static)| format!("recovery failed: {}", crate::explain(e));
    let stay = (!asked && lost.is_empty()).then(|| candidates(&o, device, now_secs));
    let Opened { g, ring, book } = o;
    let rec = crate::lifecycle::recover(
        &g.did_log,
        &ring,
        &r.key,
        device,
        lost,
        &r.next_public,
        now_secs,
    )
    .map_err(|e| failed(&e))?;
    let removed = if rec.removed.is_empty() {
        "nothing".to_owned()
    } else {
        rec.removed
            .iter()
            .map(|r| crate::lifecycle::describe_removed(r))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut said = format!(
        "recovered: this device ({}) is an admin of {}; removed {removed}; new key epoch {} \
         sealed to {}",
        context_id_for(&device.public()),
        rec.log.did(),
        rec.epoch,
        rec.remaining.join(", ")
    );
    if let Some(stay) = stay.filter(|s| !s.is_empty()) {
        let named: Vec<String> = stay.iter().map(describe).collect();
        said.push_str(&format!(
            "\nnote: no lost device was named, so every device stays a member: {}. If one of \
             them was lost, revoke it: nuwa-node device revoke CONTEXT_ID",
            named.join("; ")
        ));
    }
    let mut seen = Seen::default();
    for d in &book {
        seen.saw(&d.context_id, &d.name, d.last_seen_ms);
    }
    Ok(PairedHome {
        name: g.name.clone(),
        keys: rec.keys,
        grant: Some(rec.grant),
        log: rec.log,
        recovered: Some(said),
        seen,
    })
}

/// `device-… ("laptop", admin, last seen 2026-…)`, for the person.
fn describe(c: &LostCandidate) -> String {
    let mut parts = Vec::new();
    if !c.name.is_empty() {
        parts.push(format!("\"{}\"", c.name));
    }
    if c.admin {
        parts.push("admin".to_owned());
    }
    parts.push(match c.last_seen_ms {
        Some(t) => format!("last seen {}", crate::devices::format_unix_ms(t)),
        None => "never seen by the handing device".to_owned(),
    });
    format!("{} ({})", c.context_id, parts.join(", "))
}

/// The devices of [`JoinStep::ChooseLost`] as numbered rows for the
/// person, with last-seen times relative to `now_ms`.
pub fn render_candidates(devices: &[LostCandidate], now_ms: u64) -> String {
    let mut out = format!(
        "{:>3}  {:<22} {:<16} {:<6} last seen (by the handing device)\n",
        "#", "context id", "name", "admin"
    );
    for (i, c) in devices.iter().enumerate() {
        let seen = match c.last_seen_ms {
            Some(t) => format!(
                "{} ({})",
                crate::devices::ago(now_ms, t),
                crate::devices::format_unix_ms(t)
            ),
            None => "never".to_owned(),
        };
        out.push_str(&format!(
            "{:>3}  {:<22} {:<16} {:<6} {seen}\n",
            i + 1,
            c.context_id,
            if c.name.is_empty() { "-" } else { &c.name },
            if c.admin { "yes" } else { "no" },
        ));
    }
    out
}

/// Reads the person's answer to [`JoinStep::ChooseLost`]: row numbers or
/// context ids of `devices`, separated by commas or spaces; empty means
/// none. Returns the context ids, each once, or what to tell the person.
pub fn parse_lost_choice(answer: &str, devices: &[LostCandidate]) -> Result<Vec<String>, String> {
    let mut lost: Vec<String> = Vec::new();
    for token in answer
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
    {
        let row = token
            .parse::<usize>()
            .ok()
            .and_then(|n| n.checked_sub(1))
            .and_then(|i| devices.get(i));
        let found = row.or_else(|| devices.iter().find(|d| d.context_id == token));
        let Some(d) = found else {
            return Err(format!(
                "{} is neither a row number (1 to {}) nor a listed context id",
                nuwa_identity::document::shorten(token),
                devices.len()
            ));
        };
        if !lost.contains(&d.context_id) {
            lost.push(d.context_id.clone());
        }
    }
    Ok(lost)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow() -> (JoinFlow, DeviceKey) {
        let device = DeviceKey::generate().unwrap();
        let local = crate::peer::id_of(&device.public()).unwrap();
        let code = PairingCode::generate(1_000).unwrap();
        let flow = JoinFlow::new(
            code,
            DeviceKey::from_seed(&device.seed()),
            "new".into(),
            local,
            None,
        )
        .unwrap();
        (flow, device)
    }

    fn peer() -> PeerId {
        crate::peer::id_of(&DeviceKey::generate().unwrap().public()).unwrap()
    }

    // Goal: a name the approver's pairing session would refuse (empty, over
    // 64 bytes, control characters) is refused before a code is shown,
    // not after an approver connected.
    #[test]
    fn a_name_pairing_refuses_is_refused_before_the_code_is_shown() {
        let device = DeviceKey::generate().unwrap();
        let local = crate::peer::id_of(&device.public()).unwrap();
        for bad in [String::new(), "x".repeat(65), "bad\nname".to_owned()] {
            let code = PairingCode::generate(1_000).unwrap();
            let key = DeviceKey::from_seed(&device.seed());
            let r = JoinFlow::new(code, key, bad.clone(), local, None);
            assert!(
                matches!(r, Err(JoinSetupError::Pairing(_))),
                "{bad:?} was taken"
            );
        }
    }

    // Goal: the new device's mDNS record names the code's nameplate and
    // verifies under the new device's own key, and no other.
    #[test]
    fn the_announcement_is_self_signed_for_the_nameplate() {
        let (flow, device) = flow();
        let a = Announcement::from_txt(flow.announcement(4001, 1_000_000)).unwrap();
        assert!(a.matches_agent(&mdns_agent(&flow.code().nameplate())));
        assert_eq!(a.port, 4001);
        a.verify(&device.public(), 1_000, 600).unwrap();
        let other = DeviceKey::generate().unwrap();
        assert!(a.verify(&other.public(), 1_000, 600).is_err());
    }

    // Goal: what identify reports is bounded (addresses per peer, peers in
    // all), and every kept address names its peer, ready to dial.
    #[test]
    fn identified_addresses_are_bounded_and_name_their_peer() {
        let (mut flow, _) = flow();
        let p = peer();
        let addrs: Vec<Multiaddr> = (0..40)
            .map(|i| format!("/ip4/10.0.0.{i}/tcp/4001").parse().unwrap())
            .collect();
        flow.on_identified(p, addrs);
        let kept = &flow.identified[&p];
        assert_eq!(kept.len(), MAX_IDENTIFIED_ADDRS);
        assert!(kept.iter().all(|a| peer_in(a) == Some(p)));
        for _ in 0..2 * MAX_IDENTIFIED_PEERS {
            flow.on_identified(peer(), vec!["/ip4/10.0.0.1/tcp/1".parse().unwrap()]);
        }
        assert_eq!(flow.identified.len(), MAX_IDENTIFIED_PEERS);
    }

    // Goal: a device waiting to pair is reachable from behind another NAT:
    // on each rendezvous server it registers at once and holds a relay
    // circuit, and once its addresses change (a circuit is held) it
    // registers again everywhere
    // (so the registration names the circuit); a server it lost is not
    // registered at again until it reconnects.
    #[test]
    fn a_waiting_device_registers_and_holds_a_relay_circuit_on_each_server() {
        let (mut flow, _) = flow();
        let (s1, s2) = (peer(), peer());
        let a1: Multiaddr = format!("/ip4/198.51.100.1/tcp/4001/p2p/{s1}")
            .parse()
            .unwrap();
        let a2: Multiaddr = format!("/ip4/198.51.100.2/tcp/4001/p2p/{s2}")
            .parse()
            .unwrap();
        let steps = flow.on_server_connected(s1, a1.clone());
        assert!(matches!(steps[0], JoinStep::Register { server } if server == s1));
        assert!(
            matches!(&steps[1], JoinStep::ReserveRelay { server, addr } if *server == s1 && *addr == a1)
        );
        flow.on_server_connected(s2, a2);
        let again: Vec<PeerId> = flow
            .on_addresses_changed()
            .into_iter()
            .map(|s| match s {
                JoinStep::Register { server } => server,
                _ => panic!("only registrations follow an address change"),
            })
            .collect();
        let mut want = vec![s1, s2];
        want.sort();
        assert_eq!(again, want);
        flow.on_server_lost(s1);
        assert!(matches!(
            flow.on_addresses_changed().as_slice(),
            [JoinStep::Register { server }] if *server == s2
        ));
    }

    /// An agent with a recovery key and two devices: the desk hands over,
    /// the laptop is the one lost.
    struct World {
        log: DidChain,
        keys: KeyRing,
        recovery: DeviceKey,
        desk: String,
        laptop: String,
    }

    fn world() -> World {
        let master = DeviceKey::generate().unwrap();
        let recovery = DeviceKey::generate().unwrap();
        let (desk, laptop) = (
            DeviceKey::generate().unwrap(),
            DeviceKey::generate().unwrap(),
        );
        let mut log = DidChain::genesis(&master, 1_000).unwrap();
        crate::lifecycle::first_update(&mut log, &master, &desk, &recovery.public(), 1_000)
            .unwrap();
        let admin = crate::lifecycle::Admin {
            key_id: crate::lifecycle::master_key_id(&log).unwrap(),
            key: master,
        };
        let x = nuwa_crypto::epoch::x25519_public_key(&laptop.x25519_secret());
        crate::lifecycle::add_device(&mut log, &admin, &laptop.public(), &x, 1_000).unwrap();
        World {
            log,
            keys: KeyRing::new(nuwa_crypto::SyncKey::generate(0).unwrap()),
            recovery,
            desk: context_id_for(&desk.public()),
            laptop: context_id_for(&laptop.public()),
        }
    }

    /// The desk's handover plaintext, with its device book: it knows the
    /// laptop as "laptop", last seen at 5 000 s.
    fn handover(w: &World, now_ms: u64) -> GrantPlaintext {
        let mut seen = Seen::default();
        seen.saw(&w.laptop, "laptop", 5_000_000);
        GrantPlaintext::handover(&w.log, &w.keys, &[], "new")
            .unwrap()
            .with_device_book(&seen, &w.desk, "desk", now_ms)
    }

    fn recovery_join(w: &World, lost: Option<Vec<String>>) -> RecoveryJoin {
        RecoveryJoin {
            key: DeviceKey::from_seed(&w.recovery.seed()),
            lost,
            next_public: DeviceKey::generate().unwrap().public(),
        }
    }

    fn listed(log: &DidChain, ctx: &str) -> bool {
        crate::devices::listed_devices(log.current())
            .iter()
            .any(|c| c == ctx)
    }

    // Goal: a recovery handover carries the handing device's names and
    // last-seen times (and the handing device itself, seen now), and the
    // recovered home holds them for its `Seen` record; with no lost device
    // named and nobody asked, what it says names the devices that stay and
    // how to revoke one.
    #[test]
    fn a_handover_carries_names_and_the_recovered_home_keeps_them() {
        let w = world();
        let bytes = handover(&w, 9_000_000).to_bytes().unwrap();
        let r = recovery_join(&w, Some(Vec::new()));
        let device = DeviceKey::generate().unwrap();
        let opened = open_recovery(&bytes, &r, &device, 9_000).unwrap();
        let home = recovered_home(opened, &r, &device, &[], false, 9_000).unwrap();
        assert_eq!(home.seen.get(&w.laptop), Some(("laptop", 5_000_000)));
        assert_eq!(home.seen.get(&w.desk), Some(("desk", 9_000_000)));
        let back = Seen::from_bytes(&home.seen.to_bytes(9_000_000));
        assert_eq!(back.name_of(&w.laptop), Some("laptop"));
        let said = home.recovered.unwrap();
        assert!(said.contains("every device stays a member"), "{said}");
        assert!(
            said.contains(&format!("{} (\"laptop\"", w.laptop)),
            "{said}"
        );
        assert!(
            said.contains("nuwa-node device revoke CONTEXT_ID"),
            "{said}"
        );
        assert!(listed(&home.log, &w.laptop) && listed(&home.log, &w.desk));
    }

    // Goal: a hostile or broken device book never fails a recovery nor
    // panics, and only what can be believed is kept: devices the document
    // lists, each once, names within 64 bytes without control characters;
    // a book of the wrong shape makes the handover malformed (refused,
    // nothing written).
    #[test]
    fn a_hostile_device_book_is_bounded_and_checked() {
        let w = world();
        let mut g = handover(&w, 9_000_000);
        g.devices = (0..5_000)
            .map(|i| KnownDevice {
                context_id: format!("device-{i:016x}"),
                name: "x".repeat(1 << 10),
                last_seen_ms: u64::MAX,
            })
            .collect();
        for name in [
            "x".repeat(65),
            "bad\u{1b}[2Jname".to_owned(),
            "laptop".to_owned(),
        ] {
            g.devices.push(KnownDevice {
                context_id: w.laptop.clone(),
                name,
                last_seen_ms: 1,
            });
        }
        let book = g.device_book();
        assert_eq!(book.len(), 1, "only the laptop is listed, once: {book:?}");
        assert_eq!(book[0].context_id, w.laptop);
        assert_eq!(book[0].name, "", "an over-long name is dropped");
        let bytes = g.to_bytes().unwrap();
        let r = recovery_join(&w, Some(Vec::new()));
        let device = DeviceKey::generate().unwrap();
        let opened = open_recovery(&bytes, &r, &device, 9_000).unwrap();
        let home = recovered_home(opened, &r, &device, &[], false, 9_000).unwrap();
        assert_eq!(home.seen.get(&w.laptop), Some(("", 1)));
        assert_eq!(home.seen.get("device-0000000000000000"), None);

        let mut v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        v["devices"] = serde_json::json!({"not": "a list"});
        let bad = serde_json::to_vec(&v).unwrap();
        let err = open_recovery(&bad, &r, &device, 9_000).err().unwrap();
        assert!(err.contains("malformed"), "{err}");
    }

    // Goal: asked which devices were lost, the person's choice removes
    // exactly those. Method: run the whole exchange with a real approver
    // session; the flow confirms the handover before it asks (the
    // approver does not wait on the person), lists the laptop with its
    // name, and signs only after the answer.
    #[test]
    fn choosing_lost_devices_removes_exactly_those() {
        let w = world();
        let device = DeviceKey::generate().unwrap();
        let local = crate::peer::id_of(&device.public()).unwrap();
        let code = PairingCode::generate(1_000).unwrap();
        let mut flow = JoinFlow::new(
            code.clone(),
            DeviceKey::from_seed(&device.seed()),
            "new".into(),
            local,
            Some(recovery_join(&w, None)),
        )
        .unwrap();
        let approver = peer();
        let now_ms = 1_000_000;
        let frame_of = |steps: Vec<JoinStep>| -> Vec<u8> {
            match steps.into_iter().last() {
                Some(JoinStep::Send {
                    frame: Frame::Pairing { body, .. },
                    ..
                }) => body,
                _ => panic!("the flow answers with a pairing step"),
            }
        };
        let req = frame_of(flow.on_step(approver, PairingStep::Offer, &[], now_ms));
        let mut session =
            nuwa_crypto::pairing::Approver::new(code, &approver.to_string(), &local.to_string())
                .unwrap();
        let req = nuwa_crypto::pairing::JoinRequest::decode(&req).unwrap();
        let confirm = session.on_join_request(&req, 1_000).unwrap().encode();
        let joiner =
            frame_of(flow.on_step(approver, PairingStep::ApproverConfirm, &confirm, now_ms));
        let joiner = nuwa_crypto::pairing::JoinerConfirm::decode(&joiner).unwrap();
        session.on_joiner_confirm(&joiner, 1_000).unwrap();
        let pt = handover(&w, now_ms).to_bytes().unwrap();
        let grant = session.grant(&pt).unwrap().encode();
        let steps = flow.on_step(approver, PairingStep::Grant, &grant, now_ms);
        let devices = match steps.as_slice() {
            [
                JoinStep::Send {
                    frame:
                        Frame::Pairing {
                            step: PairingStep::Done,
                            ..
                        },
                    ..
                },
                JoinStep::ChooseLost { devices },
            ] => devices.clone(),
            _ => panic!("the flow confirms, then asks"),
        };
        assert!(flow.tick(now_ms + 10 * SESSION_TIMEOUT_MS).is_empty());
        let mut want = [w.desk.clone(), w.laptop.clone()];
        want.sort();
        // In the document's order (the order they were paired), which the
        // random keys make either way round here.
        let mut got: Vec<&str> = devices.iter().map(|d| d.context_id.as_str()).collect();
        got.sort();
        assert_eq!(got, want.iter().map(String::as_str).collect::<Vec<_>>());
        let row = devices
            .iter()
            .position(|d| d.context_id == w.laptop)
            .unwrap()
            + 1;
        assert_eq!(devices[row - 1].name, "laptop");
        assert_eq!(devices[row - 1].last_seen_ms, Some(5_000_000));
        assert!(render_candidates(&devices, now_ms).contains("laptop"));

        assert!(parse_lost_choice("9", &devices).is_err());
        assert!(parse_lost_choice("device-nope", &devices).is_err());
        assert_eq!(parse_lost_choice(" ", &devices), Ok(Vec::new()));
        let lost = parse_lost_choice(&format!("{row}, {}", w.laptop), &devices).unwrap();
        assert_eq!(lost, vec![w.laptop.clone()]);

        let home = match flow.lost_chosen(lost, now_ms).into_iter().next() {
            Some(JoinStep::Paired { home, confirm, .. }) => {
                assert!(confirm.is_none(), "confirmed once, before asking");
                home
            }
            _ => panic!("the answer signs the recovery"),
        };
        assert!(
            !listed(&home.log, &w.laptop),
            "the chosen device is removed"
        );
        assert!(listed(&home.log, &w.desk), "the other one stays");
        assert!(listed(&home.log, &context_id_for(&device.public())));
        assert!(
            flow.lost_chosen(Vec::new(), now_ms).is_empty(),
            "asked once"
        );
    }

    // Goal: frames that are not pairing steps (the approver's Hello,
    // garbage) change nothing and ask for nothing.
    #[test]
    fn frames_other_than_pairing_steps_are_not_for_the_flow() {
        let (mut flow, _) = flow();
        assert!(flow.on_frame(peer(), &[0xff; 12], 1_000_000).is_empty());
        assert!(flow.last_peer().is_none());
    }
}
