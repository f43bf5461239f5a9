//! Discovery's doors, through the agent's public API: an mDNS announcement
//! or a DHT provider leads to a dial only when every check passes, what is
//! refused is counted and recorded under its source and label, the records
//! are bounded, and a frame that does not decode is only counted.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use nuwa_agent::announce::Announcement;
use nuwa_agent::api::{Reply, Request};
use nuwa_agent::peer::{self, Multiaddr, PeerId};
use nuwa_agent::status::{RejectionStatus, Status};
use nuwa_agent::sync::pointer::dht_key;
use nuwa_agent::{
    ANNOUNCE_MAX_AGE_SECS, Agent, Boot, Config, Count, Effect, Input, MdnsEvent, NetEvent,
    RequestId,
};
use nuwa_crypto::SyncKey;
use nuwa_crypto::epoch::KeyRing;
use nuwa_identity::chain::DidChain;
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_sync::Engine;

/// Where the clock stands (Unix ms): late 2026.
const NOW_MS: u64 = 1_800_000_000_000;
const NOW_SECS: i64 = (NOW_MS / 1000) as i64;
/// The sibling's TCP port, announced and reported by mDNS.
const PORT: u16 = 4001;
/// `MAX_REJECTIONS` in crates/agent/src/constants.rs (crate-private there).
const MAX_REJECTIONS: usize = 256;

/// A deterministic key from a number.
fn key(n: u64) -> DeviceKey {
    let mut seed = [0u8; 32];
    seed[..8].copy_from_slice(&n.to_le_bytes());
    seed[8] = 0xd1;
    DeviceKey::from_seed(&seed)
}

fn peer_of(k: &DeviceKey) -> PeerId {
    peer::id_of(&k.public()).expect("an ed25519 key")
}

/// One running device (`me`) of an agent that lists it and one sibling.
struct World {
    agent: Agent,
    did: String,
    sibling: DeviceKey,
    /// A key no DID document lists.
    stranger: DeviceKey,
}

impl World {
    fn new() -> World {
        World::with(Config::default(), BTreeMap::new())
    }

    /// `me` started with this configuration and these metadata records.
    fn with(config: Config, meta: BTreeMap<String, Vec<u8>>) -> World {
        let master = key(1);
        let recovery = key(2);
        let me = key(3);
        let sibling = key(4);
        let mut log = DidChain::genesis(&master, NOW_SECS).expect("genesis");
        nuwa_agent::lifecycle::first_update(&mut log, &master, &me, &recovery.public(), NOW_SECS)
            .expect("first update");
        let admin =
            nuwa_agent::lifecycle::admin_of(&log, &me, Some(&master), NOW_SECS).expect("admin");
        let x = nuwa_identity::did_key::x25519_public_from_ed25519(&sibling.public()).unwrap();
        nuwa_agent::lifecycle::add_device(&mut log, &admin, &sibling.public(), &x, NOW_SECS)
            .expect("add the sibling");
        let did = log.did().to_owned();
        let boot = Boot {
            device: DeviceKey::from_seed(&me.seed()),
            master: None,
            name: "me".to_owned(),
            log,
            keys: KeyRing::new(SyncKey::generate(0).expect("entropy")),
            grant: None,
            engine: Engine::new(me.public().to_vec(), nuwa_sync::Config::default()),
            quarantined: Vec::new(),
            meta,
            listen_addrs: vec!["/ip4/10.0.0.1/tcp/4001".parse().unwrap()],
            peer_id: peer_of(&me),
            mdns_watching: Vec::new(),
        };
        let mut agent = Agent::new(config, boot, NOW_MS);
        agent.handle(Input::Start, NOW_MS);
        World {
            agent,
            did,
            sibling,
            stranger: key(5),
        }
    }

    fn mdns(&mut self, txt: Vec<(String, String)>, instance: &str) -> Vec<Effect> {
        self.agent.handle(
            Input::Mdns(MdnsEvent::Resolved {
                instance: instance.to_owned(),
                txt,
                addrs: vec![sibling_socket()],
            }),
            NOW_MS,
        )
    }

    fn providers(&mut self, providers: Vec<(PeerId, Vec<Multiaddr>)>) -> Vec<Effect> {
        let key = dht_key(&self.did).to_vec();
        self.agent.handle(
            Input::Net(vec![NetEvent::KadProviders { key, providers }]),
            NOW_MS,
        )
    }

    fn status(&mut self) -> Status {
        let effects = self
            .agent
            .handle(Input::Api(vec![(RequestId(1), Request::Status)]), NOW_MS);
        for e in effects {
            if let Effect::Reply {
                result: Ok(Reply::Status(s)),
                ..
            } = e
            {
                return *s;
            }
        }
        panic!("no status reply");
    }

    fn rejections(&mut self) -> Vec<RejectionStatus> {
        self.status().rejections
    }
}

fn sibling_socket() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)), PORT)
}

fn sibling_multiaddr() -> Multiaddr {
    format!("/ip4/10.0.0.2/tcp/{PORT}").parse().unwrap()
}

/// An announcement of agent `did` by device `ctx_key`, naming `peer`,
/// signed by `signer` at `ts`.
fn announcement(
    did: &str,
    ctx_key: &DeviceKey,
    peer: &PeerId,
    ts: i64,
    signer: &DeviceKey,
) -> Announcement {
    Announcement::new_signed(
        did,
        context_id_for(&ctx_key.public()),
        peer.to_string(),
        PORT,
        ts,
        |bytes| signer.sign(bytes),
    )
}

/// The sibling's own, fresh announcement.
fn valid(w: &World) -> Announcement {
    announcement(
        &w.did,
        &w.sibling,
        &peer_of(&w.sibling),
        NOW_SECS,
        &w.sibling,
    )
}

fn dials(effects: &[Effect]) -> Vec<(Option<PeerId>, Vec<Multiaddr>)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Dial { peer, addrs } => Some((*peer, addrs.clone())),
            _ => None,
        })
        .collect()
}

fn counted_rejections(effects: &[Effect]) -> Vec<(&'static str, &'static str)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::CountRejection { source, reason } => Some((*source, *reason)),
            _ => None,
        })
        .collect()
}

/// Asserts that `effects` are exactly one counted rejection at `source`
/// for `label` (no dial, nothing else), and that `status` lists exactly one
/// record: `source`, `who`, `label`, a reason starting with
/// `reason_prefix`, counted once.
fn assert_refused(
    w: &mut World,
    effects: &[Effect],
    source: &str,
    who: &str,
    label: &str,
    reason_prefix: &str,
) {
    assert!(dials(effects).is_empty(), "dialed: {effects:?}");
    assert_eq!(effects.len(), 1, "only the rejection: {effects:?}");
    assert_eq!(counted_rejections(effects), vec![(source, label)]);
    let records = w.rejections();
    assert_eq!(records.len(), 1, "{records:?}");
    let r = &records[0];
    assert_eq!(r.source, source);
    assert_eq!(r.peer, who);
    assert_eq!(r.label, label);
    assert!(
        r.reason.starts_with(reason_prefix),
        "reason {:?} does not start with {reason_prefix:?}",
        r.reason
    );
    assert_eq!(r.count, 1);
    assert_eq!(r.last_unix_ms, NOW_MS);
}

#[test]
fn a_valid_announcement_of_a_listed_device_is_dialed() {
    // Goal: an mDNS announcement of a listed device, signed by it, naming
    // its own PeerId and fresh, leads to a dial of exactly that PeerId at
    // the announced address (and is counted as verified), with nothing
    // rejected; the same holds at exactly ANNOUNCE_MAX_AGE_SECS old.
    let mut w = World::new();
    let sibling = peer_of(&w.sibling);
    let effects = w.mdns(valid(&w).to_txt(), &sibling.to_string());
    assert_eq!(effects.len(), 2, "{effects:?}");
    assert!(matches!(
        effects[0],
        Effect::Count(Count::MdnsAnnouncementsVerified)
    ));
    assert_eq!(
        dials(&effects),
        vec![(Some(sibling), vec![sibling_multiaddr()])]
    );
    assert!(w.rejections().is_empty());

    let mut w = World::new();
    let edge = announcement(
        &w.did,
        &w.sibling,
        &sibling,
        NOW_SECS - ANNOUNCE_MAX_AGE_SECS,
        &w.sibling,
    );
    let effects = w.mdns(edge.to_txt(), &sibling.to_string());
    assert_eq!(
        dials(&effects),
        vec![(Some(sibling), vec![sibling_multiaddr()])]
    );
}

#[test]
fn an_announcement_naming_another_peer_id_is_refused() {
    // Goal: an announcement signed by a listed device but naming the PeerId
    // of another key is not dialed; it is counted as (mdns,
    // context_mismatch) and recorded under the claimed PeerId.
    let mut w = World::new();
    let claimed = peer_of(&w.stranger);
    let ann = announcement(&w.did, &w.sibling, &claimed, NOW_SECS, &w.sibling);
    // The reason names the context id it claims and the one of the key
    // behind the PeerId it names.
    let (ctx, named) = (
        context_id_for(&w.sibling.public()),
        context_id_for(&w.stranger.public()),
    );
    let effects = w.mdns(ann.to_txt(), &claimed.to_string());
    assert_refused(
        &mut w,
        &effects,
        "mdns",
        &claimed.to_string(),
        "context_mismatch",
        &format!("claimed context id \"{ctx}\" does not match its key (\"{named}\")"),
    );
}

#[test]
fn a_stale_announcement_is_refused() {
    // Goal: an announcement signed ANNOUNCE_MAX_AGE_SECS + 1 (601) seconds
    // ago, or as far ahead, is not dialed; it is counted as (mdns,
    // malformed) (the code wraps the announcement's error in
    // Rejection::Malformed) with the stale-timestamp reason.
    assert_eq!(ANNOUNCE_MAX_AGE_SECS, 600);
    for ts in [
        NOW_SECS - ANNOUNCE_MAX_AGE_SECS - 1,
        NOW_SECS + ANNOUNCE_MAX_AGE_SECS + 1,
    ] {
        let mut w = World::new();
        let sibling = peer_of(&w.sibling);
        let ann = announcement(&w.did, &w.sibling, &sibling, ts, &w.sibling);
        let effects = w.mdns(ann.to_txt(), &sibling.to_string());
        assert_refused(
            &mut w,
            &effects,
            "mdns",
            &sibling.to_string(),
            "malformed",
            &format!(
                "malformed: announcement timestamp {ts} is more than 600 s away from now ({NOW_SECS})"
            ),
        );
    }
}

#[test]
fn an_announcement_with_a_tampered_signature_is_refused() {
    // Goal: an otherwise valid announcement whose signature was altered (one
    // bit), or which was signed by a key other than the one its context id
    // names, is not dialed; it is counted as (mdns, malformed) with the
    // bad-signature reason.
    let mut w = World::new();
    let sibling = peer_of(&w.sibling);
    let mut ann = valid(&w);
    ann.signature[0] ^= 0x01;
    let effects = w.mdns(ann.to_txt(), &sibling.to_string());
    assert_refused(
        &mut w,
        &effects,
        "mdns",
        &sibling.to_string(),
        "malformed",
        "malformed: announcement signature does not verify under the given public key",
    );

    let mut w = World::new();
    let forged = announcement(&w.did, &w.sibling, &sibling, NOW_SECS, &w.stranger);
    let effects = w.mdns(forged.to_txt(), &sibling.to_string());
    assert_refused(
        &mut w,
        &effects,
        "mdns",
        &sibling.to_string(),
        "malformed",
        "malformed: announcement signature does not verify under the given public key",
    );
}

#[test]
fn an_announcement_of_another_agent_is_refused() {
    // Goal: an announcement naming another agent's DID (signed by a device
    // of that agent, fresh) is not dialed; it is counted as (mdns,
    // different_agent) and the record names that DID.
    let mut w = World::new();
    let other_master = key(10);
    let other_device = key(11);
    let other_did = DidChain::genesis(&other_master, NOW_SECS)
        .expect("genesis")
        .did()
        .to_owned();
    assert_ne!(other_did, w.did);
    let other_peer = peer_of(&other_device);
    let ann = announcement(
        &other_did,
        &other_device,
        &other_peer,
        NOW_SECS,
        &other_device,
    );
    let effects = w.mdns(ann.to_txt(), &other_peer.to_string());
    assert_refused(
        &mut w,
        &effects,
        "mdns",
        &other_peer.to_string(),
        "different_agent",
        &format!("belongs to a different agent ({other_did})"),
    );
}

#[test]
fn dht_providers_are_dialed_only_when_listed() {
    // Goal: a DHT provider whose PeerId is not a device of our DID document
    // is not dialed and is counted as (dht, unknown_key) and recorded under
    // its PeerId; a listed device's PeerId is counted as DhtPeersFound, its
    // address added and dialed; providers under another key are ignored.
    let mut w = World::new();
    let stranger = peer_of(&w.stranger);
    let addr: Multiaddr = "/ip4/192.0.2.7/tcp/4001".parse().unwrap();
    let effects = w.providers(vec![(stranger, vec![addr.clone()])]);
    assert_refused(
        &mut w,
        &effects,
        "dht",
        &stranger.to_string(),
        "unknown_key",
        "key is not in the agent's DID document",
    );

    let sibling = peer_of(&w.sibling);
    let effects = w.providers(vec![(sibling, vec![addr.clone()])]);
    assert_eq!(effects.len(), 3, "{effects:?}");
    assert!(matches!(effects[0], Effect::Count(Count::DhtPeersFound)));
    assert!(
        matches!(&effects[1], Effect::AddAddress { peer, addr: a } if *peer == sibling && *a == addr)
    );
    assert_eq!(dials(&effects), vec![(Some(sibling), vec![addr.clone()])]);
    // Only the stranger's refusal is on record.
    assert_eq!(w.rejections().len(), 1);

    // Another key than our agent's: nothing at all.
    let effects = w.agent.handle(
        Input::Net(vec![NetEvent::KadProviders {
            key: dht_key("did:example:another").to_vec(),
            providers: vec![(sibling, vec![addr])],
        }]),
        NOW_MS,
    );
    assert!(effects.is_empty(), "{effects:?}");
}

#[test]
fn rejection_records_keep_the_newest_max_rejections() {
    // Goal: the rejection records shown by `status` hold at most
    // MAX_REJECTIONS (256) entries, one per (source, who): every refusal is
    // still counted, and the oldest record is dropped first, so the newest
    // 256 remain, oldest first. A repeat of a kept record counts up in
    // place without dropping anything.
    let mut w = World::new();
    let total = MAX_REJECTIONS + 44;
    let strangers: Vec<PeerId> = (0..total as u64).map(|i| peer_of(&key(1000 + i))).collect();
    let addr: Multiaddr = "/ip4/192.0.2.7/tcp/4001".parse().unwrap();
    let effects = w.providers(strangers.iter().map(|p| (*p, vec![addr.clone()])).collect());
    assert!(dials(&effects).is_empty());
    assert_eq!(
        counted_rejections(&effects),
        vec![("dht", "unknown_key"); total]
    );
    let records = w.rejections();
    assert_eq!(records.len(), MAX_REJECTIONS);
    let kept: Vec<String> = records.iter().map(|r| r.peer.clone()).collect();
    let newest: Vec<String> = strangers[total - MAX_REJECTIONS..]
        .iter()
        .map(|p| p.to_string())
        .collect();
    assert_eq!(kept, newest);
    assert!(records.iter().all(|r| r.source == "dht" && r.count == 1));

    // The oldest kept one, refused again: counted up, nothing dropped.
    let again = strangers[total - MAX_REJECTIONS];
    let effects = w.providers(vec![(again, vec![addr])]);
    assert_eq!(counted_rejections(&effects), vec![("dht", "unknown_key")]);
    let records = w.rejections();
    assert_eq!(records.len(), MAX_REJECTIONS);
    assert_eq!(records[0].peer, again.to_string());
    assert_eq!(records[0].count, 2);
}

#[test]
fn a_frame_that_does_not_decode_is_only_counted() {
    // Goal: a frame from a peer that does not decode is counted as
    // Count::MalformedFrame and nothing else happens: no Persist, no Reply,
    // no Send, no rejection record.
    let mut w = World::new();
    let sibling = peer_of(&w.sibling);
    for bytes in [Vec::new(), vec![0xff; 32], b"not a frame".to_vec()] {
        let effects = w.agent.handle(
            Input::Net(vec![NetEvent::Frame {
                peer: sibling,
                bytes,
            }]),
            NOW_MS,
        );
        assert_eq!(effects.len(), 1, "{effects:?}");
        assert!(matches!(effects[0], Effect::Count(Count::MalformedFrame)));
    }
    assert!(w.rejections().is_empty());
}

// Goal: a device's address given with `--peer` is dialed even when the
// known-peers cache holds a stale address of the same device. Method: start
// with both; every dial of the sibling must carry both addresses, the given
// one first, in one dial (a second dial of a peer being dialed is refused by
// the network, so two dials let the stale one hold up the right one for
// good). Seen on real daemons: a restarted peer on a new port was never
// reached through its `--peer`.
#[test]
fn a_given_address_and_a_cached_one_of_a_peer_go_out_in_one_dial() {
    let sibling = key(4);
    let cached: Multiaddr = "/ip4/10.0.0.2/tcp/4999".parse().unwrap();
    let given: Multiaddr = format!("/ip4/10.0.0.2/tcp/{PORT}/p2p/{}", peer_of(&sibling))
        .parse()
        .unwrap();
    let known = serde_json::json!([{
        "peer_id": peer_of(&sibling).to_string(),
        "addrs": [cached.to_string()],
    }]);
    let meta = BTreeMap::from([(
        nuwa_agent::KNOWN_PEERS_META.to_owned(),
        serde_json::to_vec(&known).unwrap(),
    )]);
    let config = Config {
        static_peers: vec![(Some(peer_of(&sibling)), given.clone())],
        ..Config::default()
    };
    let mut w = World::with(config, meta);
    let mut seen = Vec::new();
    for s in 0..3 {
        let effects = w
            .agent
            .handle(Input::Tick { rss_bytes: None }, NOW_MS + 6_000 * (s + 1));
        seen.extend(dials(&effects));
    }
    let of_sibling: Vec<_> = seen
        .iter()
        .filter(|(p, _)| *p == Some(peer_of(&sibling)))
        .collect();
    assert!(
        !of_sibling.is_empty(),
        "the sibling is never dialed: {seen:?}"
    );
    for (_, addrs) in &of_sibling {
        assert_eq!(addrs, &vec![given.clone(), cached.clone()], "{seen:?}");
    }
}
