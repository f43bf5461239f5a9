//! `device approve CODE`: the approving side of pairing, inside the daemon.
//!
//! Find the new device by its code's nameplate (mDNS first, then the
//! configured rendezvous servers), dial it, run SPAKE2 on the code, sign the
//! DID update adding its keys, and send the DID log and key ring sealed under
//! the PAKE session key. One approval at a time; failures are counted
//! against the code by an attempt limiter.

use crate::metrics::Event;
use std::collections::{BTreeMap, BTreeSet};

use nuwa_crypto::pairing::{
    Approver, AttemptLimiter, JoinRequest, JoinerConfirm, PairingCode, PairingError,
};
use nuwa_net::{Multiaddr, PeerId, public_from_peer_id};
use nuwa_proto::{Frame, PairingStep};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::Daemon;
use crate::api::{ApiError, ApproveBody, ApproveReply, ErrorCode};
use crate::home;
use nuwa_agent::lifecycle;
use nuwa_agent::pairing::{GrantPlaintext, PAIR_AGENT_PREFIX, rendezvous_namespace};

/// How long one approval may take in total, unless the request says.
const APPROVE_TIMEOUT_MS: u64 = 60_000;
const MAX_APPROVE_TIMEOUT_MS: u64 = 10 * 60_000;
/// How long a dialed candidate has to start the exchange.
const CANDIDATE_TIMEOUT_MS: u64 = 10_000;
/// Rendezvous lookups while searching.
const RV_LOOKUP_MS: u64 = 2_000;
/// Pairing candidates remembered (mDNS and rendezvous), and for how long.
const MAX_CANDIDATES: usize = 64;
const CANDIDATE_TTL_MS: u64 = 15 * 60_000;
/// Longest abort reason accepted or sent.
const MAX_REASON_BYTES: usize = 256;

pub(super) struct Candidate {
    nameplate: String,
    addrs: Vec<Multiaddr>,
    seen_ms: u64,
}

pub(super) struct Approval {
    code: PairingCode,
    name: Option<String>,
    /// A recovery handover (`approve --recovery`): hand over the log and the
    /// keys sealed to the recovery key instead of adding the device.
    recovery: bool,
    reply: oneshot::Sender<Result<ApproveReply, ApiError>>,
    timeout_ms: u64,
    deadline_ms: u64,
    /// The candidate being talked to, and since when.
    target: Option<(PeerId, u64)>,
    session: Option<Approver>,
    tried: BTreeSet<PeerId>,
    next_rv_ms: u64,
    /// Set once the grant is sent: what to answer when the device confirms.
    granted: Option<ApproveReply>,
}

#[derive(Default)]
pub(super) struct Pairing {
    candidates: BTreeMap<PeerId, Candidate>,
    approval: Option<Approval>,
    limiter: AttemptLimiter,
}

fn pairing_error(e: &PairingError) -> ApiError {
    let code = match e {
        PairingError::WrongCode => ErrorCode::WrongCode,
        PairingError::Expired => ErrorCode::CodeExpired,
        PairingError::CodeBurned => ErrorCode::CodeBurned,
        PairingError::RateLimited { .. } => ErrorCode::RateLimited,
        PairingError::BadCode { .. } => ErrorCode::BadCode,
        _ => ErrorCode::PairingFailed,
    };
    ApiError::new(code, e.to_string())
}

fn clip(mut s: String) -> String {
    while s.len() > MAX_REASON_BYTES {
        s.pop();
    }
    s
}

impl Daemon {
    pub(super) async fn on_approve(
        &mut self,
        body: ApproveBody,
        reply: oneshot::Sender<Result<ApproveReply, ApiError>>,
    ) {
        if self.pairing.approval.is_some() {
            let _ = reply.send(Err(ApiError::new(
                ErrorCode::Busy,
                "another approval is in progress on this device; wait for it to finish",
            )));
            return;
        }
        let code = match PairingCode::parse(&body.code) {
            Ok(c) => c,
            Err(e) => {
                let _ = reply.send(Err(pairing_error(&e)));
                return;
            }
        };
        if let Some(name) = &body.name {
            if name.is_empty() || name.len() > nuwa_proto::MAX_DEVICE_NAME_BYTES {
                let _ = reply.send(Err(ApiError::new(
                    ErrorCode::BadName,
                    "a device name must be 1 to 64 bytes",
                )));
                return;
            }
        }
        if body.recovery {
            // Any device of the agent may hand over: what it sends opens
            // only with the recovery words.
            if lifecycle::recovery_keys(self.session.log().current()).is_empty() {
                let _ = reply.send(Err(ApiError::new(
                    ErrorCode::CannotChangeDevices,
                    "this agent has no recovery key, so there is nothing to recover with (an \
                     admin device adds one with `nuwa-node recovery create`)",
                )));
                return;
            }
        } else if let Err(e) = self.admin_key(home::now_unix_secs()) {
            let _ = reply.send(Err(e));
            return;
        }
        if !self.mdns_on && self.wide.rv_servers().is_empty() {
            let _ = reply.send(Err(ApiError::new(ErrorCode::NoDiscovery,
                "mDNS is off and no rendezvous server is configured, so the new device cannot be found",
            )));
            return;
        }
        let now = home::now_ms();
        if let Err(e) = self.pairing.limiter.begin_attempt(&code, now / 1000) {
            let _ = reply.send(Err(pairing_error(&e)));
            return;
        }
        info!(nameplate = %code.nameplate(), "approving a new device");
        self.count(Event::PairingApprovalsStarted);
        let timeout_ms = body
            .timeout_secs
            .map(|s| s.saturating_mul(1000).clamp(1000, MAX_APPROVE_TIMEOUT_MS))
            .unwrap_or(APPROVE_TIMEOUT_MS);
        self.pairing.approval = Some(Approval {
            code,
            name: body.name,
            recovery: body.recovery,
            reply,
            timeout_ms,
            deadline_ms: now + timeout_ms,
            target: None,
            session: None,
            tried: BTreeSet::new(),
            next_rv_ms: 0,
            granted: None,
        });
        self.pairing_tick(now).await;
    }

    /// Ends the approval with `result`.
    async fn finish_approval(&mut self, result: Result<ApproveReply, ApiError>) {
        let Some(a) = self.pairing.approval.take() else {
            return;
        };
        match &result {
            Ok(r) => {
                self.pairing.limiter.record_success(&a.code);
                self.count(Event::PairingApprovalsSucceeded);
                info!(context_id = %r.context_id, name = %r.name, "new device paired");
            }
            Err(e) => {
                self.count(Event::PairingApprovalsFailed);
                warn!(code = e.code.as_str(), reason = %e.message, "approval failed");
                if let Some((peer, _)) = a.target {
                    if a.granted.is_none() {
                        let _ = self
                            .net
                            .send(
                                peer,
                                Frame::Pairing {
                                    step: PairingStep::Abort,
                                    body: clip(e.message.clone()).into_bytes(),
                                }
                                .encode(),
                            )
                            .await;
                    }
                }
            }
        }
        let _ = a.reply.send(result);
    }

    /// Timeouts, and the search: next candidate, rendezvous lookups.
    pub(super) async fn pairing_tick(&mut self, now: u64) {
        self.pairing
            .candidates
            .retain(|_, c| now.saturating_sub(c.seen_ms) < CANDIDATE_TTL_MS);
        let Some(a) = &mut self.pairing.approval else {
            return;
        };
        if now >= a.deadline_ms {
            let msg = if a.granted.is_some() {
                "the new device did not confirm the grant in time; it may still have been \
                 added: check `nuwa-node device list`"
                    .to_owned()
            } else if a.tried.is_empty() {
                format!(
                    "no device showing a code that starts with {}- was found within {} s \
                     (searched: {}); is `nuwa-node pair` running and reachable?",
                    a.code.nameplate(),
                    a.timeout_ms / 1000,
                    self.search_sources()
                )
            } else if a.session.is_none() {
                format!(
                    "a device showing a code that starts with {}- was found but did not answer \
                     within {} s; is `nuwa-node pair` still running?",
                    a.code.nameplate(),
                    a.timeout_ms / 1000
                )
            } else {
                "the new device did not complete pairing in time".to_owned()
            };
            self.finish_approval(Err(ApiError::new(ErrorCode::Timeout, msg)))
                .await;
            return;
        }
        if let Some((peer, since)) = a.target {
            if a.session.is_none() && now.saturating_sub(since) > CANDIDATE_TIMEOUT_MS {
                debug!(%peer, "pairing candidate did not answer; trying the next");
                a.target = None;
            } else {
                return;
            }
        }
        let nameplate = a.code.nameplate();
        let next = self
            .pairing
            .candidates
            .iter()
            .find(|(p, c)| c.nameplate == nameplate && !a.tried.contains(p))
            .map(|(p, c)| (*p, c.addrs.clone()));
        if let Some((peer, addrs)) = next {
            a.tried.insert(peer);
            a.target = Some((peer, now));
            info!(%peer, "found the new device; connecting");
            if self.is_connected(&peer) {
                self.send_offer(peer).await;
            } else {
                let _ = self.net.dial(Some(peer), addrs).await;
            }
            return;
        }
        if now >= a.next_rv_ms {
            a.next_rv_ms = now + RV_LOOKUP_MS;
            let ns = rendezvous_namespace(&nameplate);
            for (server, _) in self.wide.rv_servers().to_vec() {
                let _ = self.net.rendezvous_discover(server, ns.clone()).await;
            }
        }
    }

    fn search_sources(&self) -> String {
        let mut s = Vec::new();
        if self.mdns_on && self.mdns_watching.is_empty() {
            s.push(
                "mDNS, which watches NO interface here (only loopback?): use --mdns-interface lo \
                 for a device on this host, or --rendezvous for one elsewhere; `nuwa-node doctor` \
                 explains"
                    .to_owned(),
            );
        } else if self.mdns_on {
            s.push(format!("mDNS on {}", self.mdns_watching.join(", ")));
        }
        let n = self.wide.rv_servers().len();
        if n > 0 {
            s.push(format!("{n} rendezvous server(s)"));
        }
        if s.is_empty() {
            return "nothing: mDNS is off and no --rendezvous server is set".to_owned();
        }
        s.join(", ")
    }

    /// A connection came up: if it is the candidate we dialed, offer.
    pub(super) async fn pairing_on_connected(&mut self, peer: PeerId) {
        if matches!(&self.pairing.approval, Some(a) if a.target.map(|t| t.0) == Some(peer)) {
            self.send_offer(peer).await;
        }
    }

    async fn send_offer(&mut self, peer: PeerId) {
        let frame = Frame::Pairing {
            step: PairingStep::Offer,
            body: Vec::new(),
        };
        let _ = self.net.send(peer, frame.encode()).await;
    }

    /// An mDNS announcement of a device waiting to pair (self-signed by the
    /// key behind its PeerId).
    pub(super) fn on_pairing_announcement(
        &mut self,
        ann: &nuwa_discovery::Announcement,
        addrs: Vec<Multiaddr>,
    ) {
        let nuwa_discovery::AgentRef::Did(agent) = &ann.agent else {
            return;
        };
        let Some(nameplate) = agent.strip_prefix(PAIR_AGENT_PREFIX) else {
            return;
        };
        let Ok(peer) = ann.peer_id.parse::<PeerId>() else {
            self.count(Event::PairingAnnouncementsRejected);
            return;
        };
        let Some(public) = public_from_peer_id(&peer) else {
            self.count(Event::PairingAnnouncementsRejected);
            return;
        };
        let now = home::now_ms();
        if ann
            .verify(&public, (now / 1000) as i64, super::ANNOUNCE_MAX_AGE_SECS)
            .is_err()
            || addrs.is_empty()
        {
            self.count(Event::PairingAnnouncementsRejected);
            return;
        }
        self.add_candidate(peer, nameplate, addrs, now);
    }

    /// mDNS says a device went away (a `pair` that ended says goodbye).
    pub(super) fn pairing_candidate_gone(&mut self, peer: &PeerId) {
        self.pairing.candidates.remove(peer);
    }

    /// A rendezvous registration under a pairing namespace.
    pub(super) fn on_pairing_registration(
        &mut self,
        peer: PeerId,
        namespace: &str,
        addrs: Vec<Multiaddr>,
    ) {
        let Some(a) = &self.pairing.approval else {
            return;
        };
        let nameplate = a.code.nameplate();
        if namespace != rendezvous_namespace(&nameplate) || addrs.is_empty() {
            return;
        }
        self.add_candidate(peer, &nameplate, addrs, home::now_ms());
    }

    fn add_candidate(&mut self, peer: PeerId, nameplate: &str, addrs: Vec<Multiaddr>, now: u64) {
        if peer == self.net.local_peer_id() || nameplate.len() > 8 {
            return;
        }
        let c = &mut self.pairing.candidates;
        if !c.contains_key(&peer) && c.len() >= MAX_CANDIDATES {
            let oldest = c.iter().min_by_key(|(_, v)| v.seen_ms).map(|(p, _)| *p);
            if let Some(p) = oldest {
                c.remove(&p);
            }
        }
        c.insert(
            peer,
            Candidate {
                nameplate: nameplate.to_owned(),
                addrs: addrs.into_iter().take(16).collect(),
                seen_ms: now,
            },
        );
    }

    /// A pairing step from `peer`.
    pub(super) async fn on_pairing_frame(
        &mut self,
        peer: PeerId,
        step: PairingStep,
        body: Vec<u8>,
    ) {
        let ours = matches!(&self.pairing.approval, Some(a) if a.target.map(|t| t.0) == Some(peer));
        if !ours {
            self.count(Event::PairingFramesUnexpected);
            debug!(%peer, ?step, "pairing step from a peer we are not pairing with");
            return;
        }
        let result = match step {
            PairingStep::JoinRequest => self.on_join_request(peer, &body).await,
            PairingStep::JoinerConfirm => self.on_joiner_confirm(peer, &body).await,
            PairingStep::Done => {
                let granted = self
                    .pairing
                    .approval
                    .as_mut()
                    .and_then(|a| a.granted.take());
                match granted {
                    Some(r) => {
                        self.finish_approval(Ok(r)).await;
                        return;
                    }
                    None => Err(ApiError::new(
                        ErrorCode::PairingFailed,
                        "the new device confirmed a grant that was never sent",
                    )),
                }
            }
            PairingStep::Abort => {
                let reason = clip(String::from_utf8_lossy(&body).into_owned());
                let wrong = reason.contains("does not match");
                if wrong {
                    if let Some(a) = &self.pairing.approval {
                        let code = a.code.clone();
                        self.pairing.limiter.record_failure(&code);
                    }
                }
                let code = if wrong {
                    ErrorCode::WrongCode
                } else {
                    ErrorCode::PairingFailed
                };
                if let Some(a) = &mut self.pairing.approval {
                    a.target = None; // do not answer an abort with an abort
                }
                self.finish_approval(Err(ApiError::new(
                    code,
                    format!("the new device refused the pairing: {reason}"),
                )))
                .await;
                // Nothing more to say to it; closing lets it move on at once.
                let effects = self.session.hang_up(&peer.to_string());
                self.execute(effects, Vec::new()).await;
                return;
            }
            other => Err(ApiError::new(
                ErrorCode::PairingFailed,
                format!("unexpected pairing step {other:?} from the new device"),
            )),
        };
        if let Err(e) = result {
            self.finish_approval(Err(e)).await;
        }
    }

    async fn on_join_request(&mut self, peer: PeerId, body: &[u8]) -> Result<(), ApiError> {
        let req = JoinRequest::decode(body).map_err(|e| pairing_error(&e))?;
        let Some(a) = &mut self.pairing.approval else {
            return Ok(());
        };
        if a.session.is_some() {
            return Err(ApiError::new(
                ErrorCode::PairingFailed,
                "the new device restarted the exchange",
            ));
        }
        let local = self.net.local_peer_id().to_string();
        let mut session = Approver::new(a.code.clone(), &local, &peer.to_string())
            .map_err(|e| pairing_error(&e))?;
        let confirm = session
            .on_join_request(&req, home::now_unix_secs() as u64)
            .map_err(|e| pairing_error(&e))?;
        a.session = Some(session);
        let frame = Frame::Pairing {
            step: PairingStep::ApproverConfirm,
            body: confirm.encode(),
        };
        let _ = self.net.send(peer, frame.encode()).await;
        Ok(())
    }

    async fn on_joiner_confirm(&mut self, peer: PeerId, body: &[u8]) -> Result<(), ApiError> {
        let msg = JoinerConfirm::decode(body).map_err(|e| pairing_error(&e))?;
        let Some(a) = &mut self.pairing.approval else {
            return Ok(());
        };
        let Some(session) = a.session.as_mut() else {
            return Err(ApiError::new(
                ErrorCode::PairingFailed,
                "confirmation before the join request",
            ));
        };
        let joiner = match session.on_joiner_confirm(&msg, home::now_unix_secs() as u64) {
            Ok(j) => j,
            Err(e) => {
                if e.counts_as_failed_attempt() {
                    let code = a.code.clone();
                    self.pairing.limiter.record_failure(&code);
                }
                return Err(pairing_error(&e));
            }
        };
        // The PAKE authenticated the keys; they must also be the key behind
        // the connection, and its key-agreement key its Montgomery form.
        if public_from_peer_id(&peer) != Some(joiner.ed25519_public) {
            return Err(ApiError::new(
                ErrorCode::PairingFailed,
                "the new device's key is not the key of its connection",
            ));
        }
        let x = nuwa_identity::did_key::x25519_public_from_ed25519(&joiner.ed25519_public).ok();
        if x != Some(joiner.x25519_public) {
            return Err(ApiError::new(
                ErrorCode::PairingFailed,
                "the new device's key-agreement key does not match its signing key",
            ));
        }
        let name = a.name.clone().unwrap_or_else(|| joiner.name.clone());
        let now_secs = home::now_unix_secs();
        if a.recovery {
            return self.hand_over(peer, name).await;
        }
        let master = self.admin_key(now_secs)?;
        let mut log = self.session.log().clone();
        let context_id = lifecycle::add_device(
            &mut log,
            &master,
            &joiner.ed25519_public,
            &joiner.x25519_public,
            now_secs,
        )
        .map_err(|e| ApiError::new(ErrorCode::Internal, nuwa_agent::explain(&e)))?;
        drop(master);
        let grant_pt = GrantPlaintext::new(
            &log,
            self.session.secure().keys(),
            self.session.membership().epoch_grant(),
            &name,
        )
        .to_bytes()
        .map_err(|e| ApiError::new(ErrorCode::Internal, nuwa_agent::explain(&e)))?;
        let Some(a) = &mut self.pairing.approval else {
            return Ok(());
        };
        let Some(session) = a.session.as_mut() else {
            return Ok(());
        };
        let grant = session.grant(&grant_pt).map_err(|e| pairing_error(&e))?;
        // The device is ours now: record it durably before it learns so.
        let effects = self.commit_own_log(&log)?;
        self.seen.saw(&context_id, &name, 0);
        self.save_seen();
        if let Some(a) = &mut self.pairing.approval {
            a.granted = Some(ApproveReply {
                context_id: context_id.clone(),
                name: name.clone(),
                peer_id: peer.to_string(),
                did_log_len: log.len(),
                handover: false,
            });
        }
        let frame = Frame::Pairing {
            step: PairingStep::Grant,
            body: grant.encode(),
        };
        let _ = self.net.send(peer, frame.encode()).await;
        info!(%context_id, %name, "DID document updated with the new device; grant sent");
        self.execute(effects, Vec::new()).await;
        Ok(())
    }

    /// The recovery handover: the log unchanged and the key ring sealed to
    /// the recovery key. Nothing here changes; the new device lists itself
    /// with the words and its Hello brings that update.
    async fn hand_over(&mut self, peer: PeerId, name: String) -> Result<(), ApiError> {
        let pt = GrantPlaintext::handover(
            self.session.log(),
            self.session.secure().keys(),
            self.session.membership().epoch_grant(),
            &name,
        )
        .map_err(|e| ApiError::new(ErrorCode::CannotChangeDevices, nuwa_agent::explain(&e)))?
        .to_bytes()
        .map_err(|e| ApiError::new(ErrorCode::Internal, nuwa_agent::explain(&e)))?;
        let Some(a) = &mut self.pairing.approval else {
            return Ok(());
        };
        let Some(session) = a.session.as_mut() else {
            return Ok(());
        };
        let grant = session.grant(&pt).map_err(|e| pairing_error(&e))?;
        a.granted = Some(ApproveReply {
            context_id: nuwa_identity::keys::context_id_for(
                &public_from_peer_id(&peer).unwrap_or_default(),
            ),
            name: name.clone(),
            peer_id: peer.to_string(),
            did_log_len: self.session.log().len(),
            handover: true,
        });
        let frame = Frame::Pairing {
            step: PairingStep::Grant,
            body: grant.encode(),
        };
        let _ = self.net.send(peer, frame.encode()).await;
        info!(%name, "recovery handover sent: the log, and the keys sealed to the recovery key");
        Ok(())
    }
}
