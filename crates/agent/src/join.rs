//! `nuwa-node pair` and a fresh home's `recover`: the new device's side of
//! pairing, as a state machine the shell drives with the pairing steps it
//! receives and the clock.
//!
//! It runs the SPAKE2 exchange on the code, opens the grant (the DID chain
//! and key ring, sealed under the PAKE session key), and says what home to
//! write; the shell writes it and only then confirms. A wrong code fails
//! closed: the attempt is refused and counted, and three failures burn the
//! code. With recovery words, it takes a recovery handover (or a plain
//! grant) and lists this device itself, signing with the words.

use nuwa_crypto::epoch::KeyRing;
use nuwa_crypto::pairing::{
    ApproverConfirm, AttemptLimiter, Grant, Joiner, JoinerOutcome, JoinerPublicKeys, PairingCode,
};
use nuwa_identity::chain::DidChain;
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_proto::{Frame, PairingStep};

use crate::announce::Announcement;
use crate::constants::*;
use crate::pairing::GrantPlaintext;
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
    /// Lost devices to remove (context ids).
    pub lost: Vec<String>,
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
}

/// What the shell does next.
pub enum JoinStep {
    /// Send this frame to the approving device.
    Send { peer: PeerId, frame: Frame },
    /// Tell the person waiting.
    Say(String),
    /// Write this home, then send `confirm` (the approver waits for it).
    /// `dial` is where the approver listens (each address with its
    /// `/p2p/`), for the first sync.
    Paired {
        peer: PeerId,
        home: Box<PairedHome>,
        confirm: Frame,
        dial: Vec<Multiaddr>,
    },
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

    /// The code expired, or an exchange stalled.
    pub fn tick(&mut self, now_ms: u64) -> Vec<JoinStep> {
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
        if self.exchange.is_some() && !in_exchange {
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
        let opened = match &self.recovery {
            Some(r) => recovered_home(&plaintext, r, &self.device, now_secs),
            None => granted_home(&plaintext, &self.device, now_secs),
        };
        match opened {
            Ok(home) => {
                self.limiter.record_success(&self.code);
                vec![JoinStep::Paired {
                    peer,
                    home: Box::new(home),
                    confirm: Frame::Pairing {
                        step: PairingStep::Done,
                        body: Vec::new(),
                    },
                    dial: self.identified.remove(&peer).unwrap_or_default(),
                }]
            }
            Err(reason) => {
                self.exchange = None;
                vec![abort(peer, reason.clone()), JoinStep::Failed(reason)]
            }
        }
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
    })
}

/// A recovery handover (`approve --recovery`), or a plain grant from an
/// admin that listed this device already: the words then make it the
/// admin, remove the lost devices and open a new key epoch.
fn recovered_home(
    plaintext: &[u8],
    r: &RecoveryJoin,
    device: &DeviceKey,
    now_secs: i64,
) -> Result<PairedHome, String> {
    let failed =
        |e: &(dyn std::error::Error + 'static)| format!("recovery failed: {}", crate::explain(e));
    let handover =
        serde_json::from_slice::<GrantPlaintext>(plaintext).is_ok_and(|g| g.is_handover());
    let (g, ring) = if handover {
        GrantPlaintext::open_handover(plaintext, &r.key, now_secs)
    } else {
        GrantPlaintext::open(plaintext, &device.public(), now_secs)
    }
    .map_err(|e| failed(&e))?;
    let rec = crate::lifecycle::recover(
        &g.did_log,
        &ring,
        &r.key,
        device,
        &r.lost,
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
    let said = format!(
        "recovered: this device ({}) is an admin of {}; removed {removed}; new key epoch {} \
         sealed to {}",
        context_id_for(&device.public()),
        rec.log.did(),
        rec.epoch,
        rec.remaining.join(", ")
    );
    Ok(PairedHome {
        name: g.name.clone(),
        keys: rec.keys,
        grant: Some(rec.grant),
        log: rec.log,
        recovered: Some(said),
    })
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

    // Goal: frames that are not pairing steps (the approver's Hello,
    // garbage) change nothing and ask for nothing.
    #[test]
    fn frames_other_than_pairing_steps_are_not_for_the_flow() {
        let (mut flow, _) = flow();
        assert!(flow.on_frame(peer(), &[0xff; 12], 1_000_000).is_empty());
        assert!(flow.last_peer().is_none());
    }
}
