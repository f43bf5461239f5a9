//! `nuwa-node pair`: the new device's side of pairing, as a shell around
//! the agent's [`JoinFlow`] (which decides every step).
//!
//! On a fresh home: make a device key and a one-time code, publish the
//! code's nameplate (mDNS, rendezvous), print the code and a QR, and wait
//! for an approving device. The flow runs the SPAKE2 exchange and opens
//! the grant; this writes the home it hands back, confirms, then runs the
//! initial sync. In a recovery that named no lost device it asks the person
//! on the terminal which of the devices the handover lists were lost (the
//! flow asks; this only reads the answer).

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use nuwa_agent::crypto::pairing::PairingCode;
use nuwa_agent::identity::keys::DeviceKey;
pub use nuwa_agent::join::RecoveryJoin;
use nuwa_agent::join::{JoinFlow, JoinStep, PairedHome};
use nuwa_discovery::{Mdns, MdnsConfig};
use nuwa_net::{Multiaddr, NetConfig, NetEvent, NetHandle, PeerId, peer_in};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::home;
use nuwa_agent::{ANNOUNCE_REFRESH_MS, RENDEZVOUS_TTL_SECS};

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
    /// `pair --expires`: ask to expire this many seconds after approval.
    pub expires_secs: Option<u64>,
}

/// What the pairing loop ended with.
struct Paired {
    approver: PeerId,
    approver_addrs: Vec<Multiaddr>,
}

/// The network of a device waiting to pair.
struct Waiting {
    net: NetHandle,
    events: mpsc::Receiver<NetEvent>,
    cancel: CancellationToken,
    mdns: Option<Mdns>,
    servers: Vec<(PeerId, Multiaddr)>,
    port: u16,
}

pub async fn run(dir: &Path, mut opts: PairOptions) -> Result<()> {
    home::create_dir_private(dir)?;
    // Held until the home is written; the daemon that syncs afterwards
    // takes it again.
    let lock = home::lock(dir)?;
    home::ensure_empty(dir)?;
    let device = DeviceKey::generate().context("cannot generate the device key")?;
    let ttl_secs = opts.code_ttl.as_secs().max(30);
    let code = PairingCode::generate_with_ttl(home::now_unix_secs() as u64, ttl_secs)
        .context("cannot generate a pairing code")?;
    let name = if opts.name.is_empty() {
        default_name()
    } else {
        opts.name.clone()
    };
    let local = nuwa_agent::peer::id_of(&device.public()).context("invalid device key")?;
    let recovery = opts.recovery.is_some();
    let shown = code.clone();
    let seed = DeviceKey::from_seed(&device.seed());
    let mut flow = JoinFlow::new(code, seed, name, local, opts.recovery.take())?
        .with_expiry(opts.expires_secs);
    print_code(&shown, ttl_secs, recovery);
    let mut w = start(&opts, &device, &flow).await?;
    let paired = wait_for_approval(&mut w, &mut flow, &device, dir).await;
    // Let the last frame (an abort, or the confirmation) reach the
    // approver before the network goes: it hangs up on it.
    if let Some(peer) = flow.last_peer() {
        linger(&mut w.events, peer).await;
    }
    if let Some(m) = w.mdns.take() {
        let _ = m.shutdown();
    }
    w.cancel.cancel();
    drop(w);
    let paired = paired?;
    drop(lock);
    initial_sync(dir, paired, opts.sync).await
}

/// The network, mDNS with the code's nameplate, and the rendezvous
/// servers dialed.
async fn start(opts: &PairOptions, device: &DeviceKey, flow: &JoinFlow) -> Result<Waiting> {
    let cancel = CancellationToken::new();
    let listen = if opts.listen.is_empty() {
        vec!["/ip4/0.0.0.0/tcp/0".parse().expect("valid multiaddr")]
    } else {
        opts.listen.clone()
    };
    let servers: Vec<(PeerId, Multiaddr)> = opts
        .rendezvous_servers
        .iter()
        .filter_map(|a| peer_in(a).map(|p| (p, a.clone())))
        .collect();
    let (net, mut events) = nuwa_net::spawn(
        device.seed(),
        NetConfig {
            listen: listen.clone(),
            features: nuwa_net::Features {
                kad: false,
                rendezvous_client: !servers.is_empty(),
                gossip: false,
                // Pairing is a short session a person starts: no hole
                // punching. It registers its addresses and holds a relay
                // circuit on each rendezvous server (the flow says so), so
                // an approver behind another NAT reaches it through one.
                nat_traversal: false,
                infrastructure: None,
            },
            ..NetConfig::default()
        },
        cancel.clone(),
    )
    .await
    .context("cannot start the network")?;
    let up = crate::daemon::wait_listening(&mut events, &listen).await?;
    let port = nuwa_agent::listen::mdns_port(&listen, &up)?;
    let mut w = Waiting {
        net,
        events,
        cancel,
        mdns: None,
        servers,
        port,
    };
    if opts.mdns {
        match Mdns::start(MdnsConfig {
            instance_name: w.net.local_peer_id().to_string(),
            port,
            interfaces: opts.mdns_interfaces.clone(),
            txt: flow.announcement(port, home::now_ms()),
            refresh_secs: 0,
        }) {
            // Browse events are not needed: the approver dials us.
            Ok((m, _events)) => w.mdns = Some(m),
            Err(e) => {
                eprintln!("warning: mDNS unavailable ({e}); only rendezvous can find this device")
            }
        }
    }
    if w.mdns.is_none() && w.servers.is_empty() {
        bail!(
            "nothing can find this device: mDNS is off or unavailable and no --rendezvous server is given"
        );
    }
    for (server, addr) in &w.servers {
        let _ = w.net.dial(Some(*server), vec![addr.clone()]).await;
    }
    Ok(w)
}

fn print_code(code: &PairingCode, ttl_secs: u64, recovery: bool) {
    let shown = code.to_string();
    println!("pairing code: {shown}");
    println!("{}", qr(&format!("nuwa-pair:{shown}")));
    let expires = humantime::format_duration(Duration::from_secs(ttl_secs));
    if recovery {
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
}

/// Drives the flow with what the network brings until it pairs or fails.
async fn wait_for_approval(
    w: &mut Waiting,
    flow: &mut JoinFlow,
    device: &DeviceKey,
    dir: &Path,
) -> Result<Paired> {
    let namespace = flow.namespace();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let mut announce = tokio::time::interval(Duration::from_millis(ANNOUNCE_REFRESH_MS));
    announce.tick().await;
    let shutdown = tokio::signal::ctrl_c();
    tokio::pin!(shutdown);
    loop {
        let steps = tokio::select! {
            _ = &mut shutdown => bail!("pairing cancelled; nothing was written"),
            _ = announce.tick() => {
                if let Some(m) = &w.mdns {
                    let _ = m.update_txt(flow.announcement(w.port, home::now_ms()));
                }
                continue;
            }
            _ = tick.tick() => flow.tick(home::now_ms()),
            ev = w.events.recv() => {
                let Some(ev) = ev else { bail!("the network stopped") };
                match on_event(w, flow, ev).await {
                    Some(steps) => steps,
                    None => continue,
                }
            }
        };
        if let Some(paired) = perform(w, flow, steps, device, dir, &namespace).await? {
            return Ok(paired);
        }
    }
}

/// A network event: registrations, addresses, and the pairing steps the
/// flow decides on.
async fn on_event(w: &Waiting, flow: &mut JoinFlow, ev: NetEvent) -> Option<Vec<JoinStep>> {
    match ev {
        NetEvent::Connected { peer, .. } => {
            let (_, addr) = w.servers.iter().find(|(p, _)| *p == peer)?;
            Some(flow.on_server_connected(peer, addr.clone()))
        }
        NetEvent::Disconnected { peer, .. } if w.servers.iter().any(|(p, _)| *p == peer) => {
            flow.on_server_lost(peer);
            None
        }
        NetEvent::ExternalAddrs(_) => Some(flow.on_addresses_changed()),
        NetEvent::Identified { peer, listen_addrs } => {
            flow.on_identified(peer, listen_addrs);
            None
        }
        NetEvent::Frame { peer, frame } => Some(flow.on_frame(peer, &frame, home::now_ms())),
        NetEvent::RendezvousFailed { server, reason } => {
            eprintln!("warning: rendezvous server {server} refused the registration: {reason}");
            None
        }
        _ => None,
    }
}

/// Does what the flow said; returns the approver once the home is written.
async fn perform(
    w: &Waiting,
    flow: &mut JoinFlow,
    steps: Vec<JoinStep>,
    device: &DeviceKey,
    dir: &Path,
    namespace: &str,
) -> Result<Option<Paired>> {
    let mut steps: std::collections::VecDeque<JoinStep> = steps.into();
    while let Some(step) = steps.pop_front() {
        match step {
            JoinStep::Send { peer, frame } => {
                let _ = w.net.send(peer, frame.encode()).await;
            }
            JoinStep::Say(line) => eprintln!("{line}"),
            JoinStep::Register { server } => {
                let ns = namespace.to_owned();
                let _ = w
                    .net
                    .rendezvous_register(server, ns, RENDEZVOUS_TTL_SECS)
                    .await;
            }
            JoinStep::ReserveRelay { server, addr } => {
                let _ = w.net.reserve_relay(server, addr).await;
            }
            JoinStep::Failed(reason) => bail!(reason),
            JoinStep::ChooseLost { devices } => {
                let lost = choose_lost(&devices).await?;
                steps.extend(flow.lost_chosen(lost, home::now_ms()));
            }
            JoinStep::Paired {
                peer,
                home: paired,
                confirm,
                dial,
            } => {
                write_home(dir, device, &paired)?;
                if let Some(confirm) = confirm {
                    let _ = w.net.send(peer, confirm.encode()).await;
                }
                return Ok(Some(Paired {
                    approver: peer,
                    approver_addrs: dial,
                }));
            }
        }
    }
    Ok(None)
}

/// Most bytes of an answer to the lost-devices question.
const MAX_ANSWER_BYTES: u64 = 4096;
/// How many unreadable answers before giving up.
const CHOOSE_TRIES: usize = 3;

/// Shows the devices the handover lists and asks which were lost (the
/// flow asks only when stdin is a terminal). Ctrl-C stops it; nothing is
/// written then.
async fn choose_lost(devices: &[nuwa_agent::join::LostCandidate]) -> Result<Vec<String>> {
    if devices.is_empty() {
        println!("the handover lists no other device; none can be lost");
        return Ok(Vec::new());
    }
    println!(
        "the agent's other devices, as the handing device knows them:\n{}",
        nuwa_agent::join::render_candidates(devices, home::now_ms())
    );
    for attempt in 1..=CHOOSE_TRIES {
        let answer = read_line(
            "which of them were lost? Row numbers or context ids, separated by commas; \
             they are removed from the agent and read nothing written from now on \
             (empty: none): ",
        )
        .await?;
        match nuwa_agent::join::parse_lost_choice(&answer, devices) {
            Ok(lost) => return Ok(lost),
            Err(e) if attempt < CHOOSE_TRIES => eprintln!("{e}; try again"),
            Err(e) => bail!("{e}; nothing was written. Run `nuwa-node recover` again"),
        }
    }
    unreachable!("the last try returns")
}

/// One line from the terminal, read on a thread of its own so that Ctrl-C
/// (which the pairing loop took over) still stops the command: a blocked
/// read cannot be cancelled, and the process ends without it.
async fn read_line(question: &str) -> Result<String> {
    eprint!("{question}");
    std::io::stderr().flush().ok();
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        use std::io::{BufRead as _, Read as _};
        let mut line = String::new();
        let n = std::io::stdin()
            .lock()
            .take(MAX_ANSWER_BYTES)
            .read_line(&mut line);
        let _ = tx.send(n.map(|n| (n, line)));
    });
    tokio::select! {
        _ = tokio::signal::ctrl_c() => bail!("recovery cancelled; nothing was written"),
        r = rx => match r.context("the terminal reader stopped")? {
            Ok((0, _)) => bail!("no answer (end of input); nothing was written"),
            Ok((_, line)) => Ok(line),
            Err(e) => Err(e).context("cannot read from the terminal"),
        },
    }
}

fn write_home(dir: &Path, device: &DeviceKey, paired: &PairedHome) -> Result<()> {
    home::write_paired(
        dir,
        device,
        &paired.name,
        &paired.keys,
        paired.grant.as_deref(),
        &paired.log,
    )?;
    if !paired.seen.is_empty() {
        // The names and last-seen times the handover carried, so that
        // `device list` names the devices at once. The home is written
        // already: a failure here loses only names, which come back with
        // the peers' Hellos.
        if let Err(e) = save_seen(dir, &paired.seen) {
            eprintln!(
                "warning: the devices' names were not stored ({e:#}); they come back as peers connect"
            );
        }
    }
    if let Some(said) = &paired.recovered {
        println!("{said}");
    }
    Ok(())
}

/// Stores `seen` as the home's record of names and last-seen times, in
/// its store (encrypted at rest) where the daemon keeps it. The caller
/// holds the home's lock.
fn save_seen(dir: &Path, seen: &nuwa_agent::devices::Seen) -> Result<()> {
    use nuwa_store::Storage as _;
    let h = home::load(dir)?;
    let store = nuwa_store::SledStore::open(&h.dir.join(home::STORE_DIR), h.at_rest.clone())
        .with_context(|| format!("cannot open the store in {}", h.dir.display()))?;
    store
        .put_meta(
            nuwa_agent::devices::SEEN_META,
            &seen.to_bytes(home::now_ms()),
        )
        .context("cannot write the record")
}

/// Waits up to 3 s for `peer` to hang up.
async fn linger(events: &mut mpsc::Receiver<NetEvent>, peer: PeerId) {
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    while let Ok(Some(ev)) = tokio::time::timeout_at(until, events.recv()).await {
        if matches!(ev, NetEvent::Disconnected { peer: p } if p == peer) {
            break;
        }
    }
}

/// After pairing: a first `sync --once` with the approver.
async fn initial_sync(
    dir: &Path,
    paired: Paired,
    sync: Option<crate::daemon::RunOptions>,
) -> Result<()> {
    let h = home::load(dir)?;
    println!(
        "paired: this device is {} (\"{}\") of agent {}",
        h.info.context_id,
        h.info.name,
        h.log.did()
    );
    let Some(mut sync) = sync else {
        println!("next: nuwa-node --home {} run", dir.display());
        return Ok(());
    };
    for a in paired.approver_addrs {
        sync.agent.static_peers.push((Some(paired.approver), a));
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
