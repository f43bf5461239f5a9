//! `nuwa-node pair`: the new device's side of pairing.
//!
//! On a fresh home: make a device key and a one-time code, publish the
//! code's nameplate (mDNS, rendezvous), print the code and a QR, and wait
//! for an approving device. Run the SPAKE2 exchange, open the grant (DID log
//! and key ring), write the home, confirm, then run the initial sync.
//! A wrong code fails closed: the attempt is refused and counted; three
//! failures burn the code.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use nuwa_agent::announce::Announcement;
use nuwa_crypto::pairing::{
    ApproverConfirm, AttemptLimiter, Grant, Joiner, JoinerOutcome, JoinerPublicKeys, PairingCode,
};
use nuwa_discovery::{Mdns, MdnsConfig};
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_net::{Multiaddr, NetConfig, NetEvent, PeerId, peer_of};
use nuwa_proto::{Frame, PairingStep};
use tokio_util::sync::CancellationToken;

use crate::home;
use nuwa_agent::pairing::{GrantPlaintext, mdns_agent, rendezvous_namespace};

/// Registration TTL at rendezvous servers (their minimum is two hours).
use nuwa_agent::RENDEZVOUS_TTL_SECS;
/// Re-sign the mDNS announcement this often (accepted for 10 minutes).
const ANNOUNCE_REFRESH: Duration = Duration::from_secs(120);
/// An exchange that stalls this long is abandoned (the code stays usable).
const SESSION_TIMEOUT_MS: u64 = 30_000;

pub struct PairOptions {
    pub name: String,
    pub listen: Vec<Multiaddr>,
    pub mdns: bool,
    pub mdns_interfaces: Vec<String>,
    pub rendezvous_servers: Vec<Multiaddr>,
    pub code_ttl: Duration,
    /// Run options for the initial sync (None: skip it).
    pub sync: Option<crate::daemon::RunOptions>,
    /// `recover` on a fresh home: take a recovery handover instead of a
    /// grant, and list this device with the words.
    pub recovery: Option<RecoveryJoin>,
}

/// What `recover` on a fresh home brings to pairing.
pub struct RecoveryJoin {
    /// The key of the recovery words.
    pub key: DeviceKey,
    /// Lost devices to remove (context ids).
    pub lost: Vec<String>,
    /// The public key of the new recovery words (already shown and confirmed).
    pub next_public: [u8; 32],
}

struct Session {
    peer: PeerId,
    joiner: Joiner,
    started_ms: u64,
}

/// What the pairing loop ended with.
struct Paired {
    approver: PeerId,
    approver_addrs: Vec<Multiaddr>,
}

pub async fn run(dir: &Path, opts: PairOptions) -> Result<()> {
    home::create_dir_private(dir)?;
    // Held until the home is written; the daemon that syncs afterwards
    // takes it again.
    let lock = home::lock(dir)?;
    home::ensure_empty(dir)?;
    let device = DeviceKey::generate().context("cannot generate the device key")?;
    let now_secs = home::now_unix_secs() as u64;
    let code = PairingCode::generate_with_ttl(now_secs, opts.code_ttl.as_secs().max(30))
        .context("cannot generate a pairing code")?;
    let keys = JoinerPublicKeys {
        ed25519_public: device.public(),
        x25519_public: nuwa_identity::did_key::x25519_public_from_ed25519(&device.public())
            .context("cannot derive the key-agreement key")?,
    };
    let name = if opts.name.is_empty() {
        default_name()
    } else {
        opts.name.clone()
    };

    let cancel = CancellationToken::new();
    let listen = if opts.listen.is_empty() {
        vec!["/ip4/0.0.0.0/tcp/0".parse().expect("valid multiaddr")]
    } else {
        opts.listen.clone()
    };
    let servers: Vec<(PeerId, Multiaddr)> = opts
        .rendezvous_servers
        .iter()
        .filter_map(|a| peer_of(a).map(|p| (p, a.clone())))
        .collect();
    let (net, mut events) = nuwa_net::spawn(
        device.seed(),
        NetConfig {
            listen: listen.clone(),
            features: nuwa_net::Features {
                kad: false,
                rendezvous_client: !servers.is_empty(),
                gossip: false,
                // Pairing is a short session a person starts; it registers
                // its private addresses (the approving device is expected
                // on the same network) and does not reserve relays.
                nat_traversal: false,
                infrastructure: None,
            },
            ..NetConfig::default()
        },
        cancel.clone(),
    )
    .await
    .context("cannot start the network")?;
    let local = net.local_peer_id();
    let mut listen_addrs = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while listen_addrs.len() < listen.len() {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(NetEvent::Listening(a))) => listen_addrs.push(a),
            Ok(Some(_)) => {}
            Ok(None) => bail!("the network stopped during start-up"),
            Err(_) => break,
        }
    }
    let port = listen_addrs
        .iter()
        .find_map(|a| {
            a.iter().find_map(|p| match p {
                nuwa_net::Protocol::Tcp(port) => Some(port),
                _ => None,
            })
        })
        .context("no TCP listen address came up within 5 s; check --listen")?;

    let nameplate = code.nameplate();
    let sign_announcement = |device: &DeviceKey| {
        Announcement::new_signed(
            &mdns_agent(&nameplate),
            context_id_for(&device.public()),
            local.to_string(),
            port,
            home::now_unix_secs(),
            |b| device.sign(b),
        )
    };
    let mut mdns = None;
    if opts.mdns {
        match Mdns::start(MdnsConfig {
            instance_name: local.to_string(),
            port,
            interfaces: opts.mdns_interfaces.clone(),
            txt: sign_announcement(&device).to_txt(),
            refresh_secs: 0,
        }) {
            // Browse events are not needed: the approver dials us.
            Ok((m, _events)) => mdns = Some(m),
            Err(e) => {
                eprintln!("warning: mDNS unavailable ({e}); only rendezvous can find this device")
            }
        }
    }
    if mdns.is_none() && servers.is_empty() {
        bail!(
            "nothing can find this device: mDNS is off or unavailable and no --rendezvous server is given"
        );
    }
    for (server, addr) in &servers {
        let _ = net.dial(Some(*server), vec![addr.clone()]).await;
    }

    let shown = code.to_string();
    println!("pairing code: {shown}");
    println!("{}", qr(&format!("nuwa-pair:{shown}")));
    let expires = humantime::format_duration(Duration::from_secs(opts.code_ttl.as_secs().max(30)));
    if opts.recovery.is_some() {
        println!(
            "On any device of the agent that still runs (admin or not), hand this machine \
             the agent's DID log and keys (sealed to the recovery words):\n\
             \x20 nuwa-node --home <HOME of that device> device approve --recovery {shown}\n\
             The code expires in {expires}. Waiting (Ctrl-C to cancel)..."
        );
    } else {
        println!(
            "Approve it on an admin device of the agent (the home where `nuwa-node init` ran, \
             or a device promoted since), with its daemon running:\n\
             \x20 nuwa-node --home <HOME of that device> device approve {shown}\n\
             The code expires in {expires}. Waiting for approval (Ctrl-C to cancel)..."
        );
    }
    std::io::stdout().flush().ok();

    let mut limiter = AttemptLimiter::default();
    let mut session: Option<Session> = None;
    let mut identified: std::collections::BTreeMap<PeerId, Vec<Multiaddr>> = Default::default();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let mut announce = tokio::time::interval(ANNOUNCE_REFRESH);
    announce.tick().await;
    let shutdown = tokio::signal::ctrl_c();
    tokio::pin!(shutdown);
    let mut outcome: Option<Result<Paired>> = None;
    let mut last_peer: Option<PeerId> = None;
    while outcome.is_none() {
        tokio::select! {
            _ = &mut shutdown => outcome = Some(Err(anyhow::anyhow!("pairing cancelled; nothing was written"))),
            _ = announce.tick() => {
                if let Some(m) = &mdns {
                    let _ = m.update_txt(sign_announcement(&device).to_txt());
                }
            }
            _ = tick.tick() => {
                let now = home::now_ms();
                if code.is_expired(now / 1000) {
                    outcome = Some(Err(anyhow::anyhow!(
                        "the pairing code expired before a device approved it; run `nuwa-node pair` again"
                    )));
                }
                if session.as_ref().is_some_and(|s| now.saturating_sub(s.started_ms) > SESSION_TIMEOUT_MS) {
                    eprintln!("a pairing exchange stalled; waiting for a new approval");
                    session = None;
                }
            }
            ev = events.recv() => {
                let Some(ev) = ev else {
                    outcome = Some(Err(anyhow::anyhow!("the network stopped")));
                    continue;
                };
                match ev {
                    NetEvent::Connected { peer, .. } => {
                        if servers.iter().any(|(p, _)| *p == peer) {
                            let _ = net
                                .rendezvous_register(peer, rendezvous_namespace(&nameplate), RENDEZVOUS_TTL_SECS)
                                .await;
                        }
                    }
                    NetEvent::Identified { peer, listen_addrs } => {
                        identified.insert(peer, listen_addrs.into_iter().take(16).collect());
                    }
                    NetEvent::Frame { peer, frame } => {
                        let Ok(Frame::Pairing { step, body }) = Frame::decode(&frame) else {
                            continue; // the approver's Hello and the like
                        };
                        last_peer = Some(peer);
                        let step_result = on_step(
                            peer, step, &body, &net, &code, &keys, &name, &local,
                            &mut limiter, &mut session, &device, dir, opts.recovery.as_ref(),
                        )
                        .await;
                        match step_result {
                            Ok(true) => {
                                outcome = Some(Ok(Paired {
                                    approver: peer,
                                    approver_addrs: identified.get(&peer).cloned().unwrap_or_default(),
                                }));
                            }
                            Ok(false) => {}
                            Err(e) => outcome = Some(Err(e)),
                        }
                    }
                    NetEvent::RendezvousFailed { server, reason } => {
                        eprintln!("warning: rendezvous server {server} refused the registration: {reason}");
                    }
                    _ => {}
                }
            }
        }
    }
    let paired = outcome.expect("loop ends with an outcome");
    let paired = match paired {
        Ok(p) => p,
        Err(e) => {
            // Let a final abort reach the approver (it hangs up on it).
            if let Some(peer) = last_peer {
                let linger = tokio::time::Instant::now() + Duration::from_secs(3);
                while let Ok(Some(ev)) = tokio::time::timeout_at(linger, events.recv()).await {
                    if matches!(ev, NetEvent::Disconnected { peer: p } if p == peer) {
                        break;
                    }
                }
            }
            cancel.cancel();
            if let Some(m) = mdns {
                let _ = m.shutdown();
            }
            return Err(e);
        }
    };
    // Let the confirmation reach the approver before the network goes.
    let linger = tokio::time::Instant::now() + Duration::from_secs(3);
    while let Ok(Some(ev)) = tokio::time::timeout_at(linger, events.recv()).await {
        if matches!(ev, NetEvent::Disconnected { peer } if peer == paired.approver) {
            break;
        }
    }
    if let Some(m) = mdns {
        let _ = m.shutdown();
    }
    cancel.cancel();
    drop(net);
    drop(lock);

    let h = home::load(dir)?;
    println!(
        "paired: this device is {} (\"{}\") of agent {}",
        h.info.context_id,
        h.info.name,
        h.log.did()
    );
    let Some(mut sync) = opts.sync else {
        println!("next: nuwa-node --home {} run", dir.display());
        return Ok(());
    };
    for a in &paired.approver_addrs {
        let with_p2p = if peer_of(a).is_some() {
            a.clone()
        } else {
            a.clone().with(nuwa_net::Protocol::P2p(paired.approver))
        };
        sync.agent
            .static_peers
            .push((Some(paired.approver), with_p2p));
    }
    println!("initial sync...");
    std::io::stdout().flush().ok();
    match crate::daemon::run(h, sync).await {
        Ok(()) => println!(
            "initial sync done; keep this device in sync with: nuwa-node --home {} run",
            dir.display()
        ),
        Err(e) => eprintln!(
            "warning: the initial sync did not finish ({e:#}); the device is paired, \
             start it with: nuwa-node --home {} run",
            dir.display()
        ),
    }
    Ok(())
}

async fn send_step(net: &nuwa_net::NetHandle, peer: PeerId, step: PairingStep, body: Vec<u8>) {
    let _ = net.send(peer, Frame::Pairing { step, body }.encode()).await;
}

/// Handles one pairing step; `Ok(true)` once paired and the home written.
#[allow(clippy::too_many_arguments)]
async fn on_step(
    peer: PeerId,
    step: PairingStep,
    body: &[u8],
    net: &nuwa_net::NetHandle,
    code: &PairingCode,
    keys: &JoinerPublicKeys,
    name: &str,
    local: &PeerId,
    limiter: &mut AttemptLimiter,
    session: &mut Option<Session>,
    device: &DeviceKey,
    dir: &Path,
    recovery: Option<&RecoveryJoin>,
) -> Result<bool> {
    let now_secs = home::now_unix_secs() as u64;
    let in_session = session.as_ref().is_some_and(|s| s.peer == peer);
    match step {
        PairingStep::Offer => {
            if session.is_some() && !in_session {
                send_step(
                    net,
                    peer,
                    PairingStep::Abort,
                    b"the new device is busy pairing with another device".to_vec(),
                )
                .await;
                return Ok(false);
            }
            if let Err(e) = limiter.begin_attempt(code, now_secs) {
                send_step(net, peer, PairingStep::Abort, e.to_string().into_bytes()).await;
                bail!("{e}");
            }
            let mut joiner = Joiner::new(code.clone(), &local.to_string(), *keys, name)
                .context("cannot start pairing")?;
            let req = joiner.start(&peer.to_string(), now_secs)?;
            eprintln!("device {peer} is approving; checking the code...");
            *session = Some(Session {
                peer,
                joiner,
                started_ms: home::now_ms(),
            });
            send_step(net, peer, PairingStep::JoinRequest, req.encode()).await;
        }
        PairingStep::ApproverConfirm if in_session => {
            let s = session.as_mut().expect("in session");
            let result = ApproverConfirm::decode(body)
                .and_then(|m| s.joiner.on_approver_confirm(&m, now_secs));
            match result {
                Ok(confirm) => {
                    send_step(net, peer, PairingStep::JoinerConfirm, confirm.encode()).await
                }
                Err(e) => {
                    *session = None;
                    send_step(net, peer, PairingStep::Abort, e.to_string().into_bytes()).await;
                    if e.counts_as_failed_attempt() {
                        limiter.record_failure(code);
                    }
                    let left = limiter.remaining_attempts(code);
                    if left == 0 {
                        bail!(
                            "pairing failed: {e}. The code is now burned after too many failed \
                             attempts; run `nuwa-node pair` again for a new code"
                        );
                    }
                    eprintln!("pairing attempt from {peer} failed: {e} ({left} attempts left)");
                }
            }
        }
        PairingStep::Grant if in_session => {
            let s = session.as_mut().expect("in session");
            let opened = Grant::decode(body).and_then(|g| s.joiner.on_grant(&g));
            let plaintext = match opened {
                Ok(JoinerOutcome::Granted(pt)) => pt,
                Ok(other) => bail!("unexpected pairing outcome {other:?}"),
                Err(e) => {
                    *session = None;
                    send_step(net, peer, PairingStep::Abort, e.to_string().into_bytes()).await;
                    eprintln!("pairing attempt from {peer} failed: {e}");
                    return Ok(false);
                }
            };
            let dev = DeviceKey::from_seed(&device.seed());
            if let Some(r) = recovery {
                // A handover (`approve --recovery`), or a plain grant from an
                // admin that added this device already: the words then only
                // make it the admin.
                let handover = serde_json::from_slice::<GrantPlaintext>(&plaintext)
                    .is_ok_and(|g| g.is_handover());
                let opened = if handover {
                    GrantPlaintext::open_handover(&plaintext, &r.key, now_secs as i64)
                } else {
                    GrantPlaintext::open(&plaintext, &device.public(), now_secs as i64)
                };
                let recovered = opened.map_err(anyhow::Error::new).and_then(|(g, ring)| {
                    let rec = nuwa_agent::lifecycle::recover(
                        &g.did_log,
                        &ring,
                        &r.key,
                        &dev,
                        &r.lost,
                        &r.next_public,
                        now_secs as i64,
                    )?;
                    Ok((g.name.clone(), rec))
                });
                let (name, rec) = match recovered {
                    Ok(x) => x,
                    Err(e) => {
                        *session = None;
                        send_step(net, peer, PairingStep::Abort, format!("{e:#}").into_bytes())
                            .await;
                        bail!("recovery failed: {e:#}");
                    }
                };
                home::write_paired(dir, &dev, &name, &rec.keys, Some(&rec.grant), &rec.log)?;
                println!(
                    "recovered: this device ({}) is an admin of {}; removed {}; new key epoch {} \
                     sealed to {}",
                    context_id_for(&dev.public()),
                    rec.log.did(),
                    if rec.removed.is_empty() {
                        "nothing".to_owned()
                    } else {
                        rec.removed
                            .iter()
                            .map(|r| nuwa_agent::lifecycle::describe_removed(r))
                            .collect::<Vec<_>>()
                            .join(", ")
                    },
                    rec.epoch,
                    rec.remaining.join(", ")
                );
            } else {
                let (g, ring) =
                    match GrantPlaintext::open(&plaintext, &device.public(), now_secs as i64) {
                        Ok(x) => x,
                        Err(e) => {
                            *session = None;
                            send_step(net, peer, PairingStep::Abort, format!("{e:#}").into_bytes())
                                .await;
                            bail!("the approving device sent an unusable grant: {e:#}");
                        }
                    };
                let grant = hex::decode(&g.epoch_grant_hex).unwrap_or_default();
                home::write_paired(
                    dir,
                    &dev,
                    &g.name,
                    &ring,
                    (!grant.is_empty()).then_some(grant.as_slice()),
                    &g.did_log,
                )?;
            }
            limiter.record_success(code);
            send_step(net, peer, PairingStep::Done, Vec::new()).await;
            return Ok(true);
        }
        PairingStep::Abort if in_session => {
            *session = None;
            let reason = String::from_utf8_lossy(&body[..body.len().min(256)]).into_owned();
            eprintln!("the approving device stopped: {reason}; still waiting");
        }
        _ => {}
    }
    Ok(false)
}

fn default_name() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty() && s.len() <= 64 && !s.chars().any(char::is_control));
    host.unwrap_or_else(|| "new device".to_owned())
}

/// The QR code of `text` as terminal text (two rows per line).
fn qr(text: &str) -> String {
    match qrcode::QrCode::new(text.as_bytes()) {
        Ok(code) => code
            .render::<qrcode::render::unicode::Dense1x2>()
            .quiet_zone(true)
            .build(),
        Err(_) => String::new(),
    }
}
