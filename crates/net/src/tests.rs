//! The crate's tests over real swarms on loopback: ordering and caps of
//! frames, backpressure both ways, connection limits, dialing, relays and
//! hole punching; and the pure helpers.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeroize::Zeroizing;

use super::*;

// Goal: status can say whether a peer is reached directly or through a
// relay, and over which transport, from the connection's address.
#[test]
fn paths_name_the_transport_and_the_relay() {
    let p = |a: &str| path_of(&a.parse().unwrap());
    assert_eq!(
        p("/ip4/127.0.0.1/tcp/4001"),
        Path {
            transport: "tcp",
            relayed: false
        }
    );
    assert_eq!(
        p("/ip4/192.0.2.1/udp/4001/quic-v1"),
        Path {
            transport: "quic",
            relayed: false
        }
    );
    assert_eq!(
        p(
            "/ip4/192.0.2.1/tcp/4001/p2p/12D3KooWRBy97UB99e3J6hiPesre1MZeuNQvfan4gBziswrRJsNK/p2p-circuit"
        ),
        Path {
            transport: "tcp",
            relayed: true
        }
    );
}

fn loopback(max_frame_bytes: usize) -> NetConfig {
    NetConfig {
        listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()],
        max_frame_bytes,
        ..NetConfig::default()
    }
}

async fn node(
    seed: u8,
    max_frame_bytes: usize,
) -> (NetHandle, mpsc::Receiver<NetEvent>, Multiaddr) {
    node_with(seed, loopback(max_frame_bytes)).await
}

async fn node_with(
    seed: u8,
    config: NetConfig,
) -> (NetHandle, mpsc::Receiver<NetEvent>, Multiaddr) {
    let (h, mut rx) = spawn(Zeroizing::new([seed; 32]), config, CancellationToken::new())
        .await
        .unwrap();
    let addr = loop {
        match rx.recv().await.unwrap() {
            NetEvent::Listening(a) => break a,
            _ => continue,
        }
    };
    (h, rx, addr)
}

async fn next_matching<T>(
    rx: &mut mpsc::Receiver<NetEvent>,
    mut f: impl FnMut(NetEvent) -> Option<T>,
) -> T {
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(v) = f(rx.recv().await.expect("network stopped")) {
                return v;
            }
        }
    })
    .await
    .expect("event within 10 s")
}

/// Waits, up to 30 s, until `done` holds (polled every 20 ms).
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let polled = tokio::time::timeout(Duration::from_secs(30), async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(polled.is_ok(), "{what} within 30 s");
}

/// Reads `rx` in a task of its own from now on, as a daemon that keeps
/// up would, and passes on the events `keep` picks.
fn watch(
    mut rx: mpsc::Receiver<NetEvent>,
    keep: impl Fn(&NetEvent) -> bool + Send + 'static,
) -> mpsc::Receiver<NetEvent> {
    let (tx, kept) = mpsc::channel(1024);
    tokio::spawn(async move {
        while let Some(ev) = rx.recv().await {
            if keep(&ev) {
                let _ = tx.try_send(ev);
            }
        }
    });
    kept
}

/// Sends `frame` from one node to another until the receiver's owner
/// gets it. The receiver is still working through the flood and may
/// drop it; it then closes the frame's stream unanswered, the sender
/// hears of it (`SendFailed`) and sends again, as anti-entropy would.
/// The sender's queue may still be behind too: then it waits for room.
async fn deliver(
    (from, from_seen): (&NetHandle, &mut mpsc::Receiver<NetEvent>),
    (to, to_seen): (&NetHandle, &mut mpsc::Receiver<NetEvent>),
    frame: &[u8],
) {
    let (from_id, to_id) = (from.local_peer_id(), to.local_peer_id());
    loop {
        wait_until("room for a frame", || {
            from.try_send(to_id, frame.to_vec()).is_ok()
        })
        .await;
        tokio::select! {
            got = next_matching(to_seen, |e| match e {
                NetEvent::Frame { peer, frame } if peer == from_id => Some(frame),
                _ => None,
            }) => {
                assert_eq!(got, frame);
                return;
            }
            () = next_matching(from_seen, |e| match e {
                NetEvent::SendFailed { peer, .. } if peer == to_id => Some(()),
                _ => None,
            }) => {}
        }
    }
}

fn infra_config() -> NetConfig {
    NetConfig {
        listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()],
        features: Features {
            kad: false,
            rendezvous_client: false,
            gossip: false,
            nat_traversal: false,
            infrastructure: Some(InfraLimits::default()),
        },
        ..NetConfig::default()
    }
}

fn device_config(advertise: Vec<Scope>) -> NetConfig {
    NetConfig {
        listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()],
        features: Features {
            kad: false,
            rendezvous_client: false,
            gossip: false,
            ..Features::default()
        },
        advertise_listen: Some(advertise),
        ..NetConfig::default()
    }
}

// Goal: a device is reached through its relay reservation; a big frame
// waits for the direct connection instead of using up the circuit;
// DCUtR makes the connection direct, the relayed one is closed, and the
// change is reported. (What is advertised where: `reach`'s tests and
// the NAT lab.)
// Method: three swarms on loopback: an infrastructure node (relay and
// AutoNAT server), device a that vouches for no scope and reserves a
// circuit, and device b that dials a only through the circuit. b queues
// a 100 KiB frame before it dials, so that the frame meets the relayed
// connection first (queued once it was up, the frame raced the hole punch:
// a direct connection that won took it undeferred, a CI failure on a
// busy machine): it must be counted as deferred, then arrive after a hole
// punch, sent over a direct connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_first_then_direct_by_hole_punch() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let (infra, mut infra_rx, infra_addr) = node_with(30, infra_config()).await;
    let infra_id = infra.local_peer_id();
    let _infra_events = watch(std::mem::replace(&mut infra_rx, mpsc::channel(1).1), |_| {
        false
    });
    // Nothing vouched for: a advertises no direct address, so its
    // observed one is a hole-punching candidate (on loopback the circuit
    // itself is not advertised either; b is given it below).
    let (a, mut a_rx, _) = node_with(31, device_config(vec![])).await;
    let (b, mut b_rx, _) = node_with(32, device_config(vec![])).await;
    a.dial_infra(infra_id, vec![infra_addr.clone()])
        .await
        .unwrap();
    b.dial_infra(infra_id, vec![infra_addr.clone()])
        .await
        .unwrap();
    for rx in [&mut a_rx, &mut b_rx] {
        next_matching(rx, |e| match e {
            NetEvent::Connected { peer, .. } if peer == infra_id => Some(()),
            _ => None,
        })
        .await;
    }
    // Reserved over the connection just made (a reservation asked for
    // while the dial is underway is refused: libp2p's relay client
    // dials again and the swarm refuses a second dial).
    a.reserve_relay(infra_id, infra_addr.clone()).await.unwrap();
    next_matching(&mut a_rx, |e| match e {
        NetEvent::RelayReserved { relay, .. } if relay == infra_id => Some(()),
        _ => None,
    })
    .await;
    let circuit = infra_addr
        .clone()
        .with(Protocol::P2p(infra_id))
        .with(Protocol::P2pCircuit)
        .with(Protocol::P2p(a.local_peer_id()));
    let big = vec![7u8; 100 * 1024];
    b.try_send(a.local_peer_id(), big.clone()).unwrap();
    b.dial(Some(a.local_peer_id()), vec![circuit])
        .await
        .unwrap();
    let remote = next_matching(&mut b_rx, |e| match e {
        NetEvent::Connected { peer, remote, .. } if peer == a.local_peer_id() => Some(remote),
        _ => None,
    })
    .await;
    assert!(path_of(&remote).relayed, "first over the relay: {remote}");
    wait_until("the big frame is deferred", || {
        b.counters().get(NetCount::FramesDeferredForDirect) == 1
    })
    .await;
    assert_eq!(
        b.counters().get(NetCount::BytesSentRelayed),
        0,
        "nothing big over the relay"
    );
    let got = next_matching(&mut a_rx, |e| match e {
        NetEvent::Frame { frame, .. } => Some(frame),
        _ => None,
    });
    let got = tokio::time::timeout(Duration::from_secs(30), got).await;
    assert_eq!(got.expect("frame within 30 s").len(), big.len());
    let (sa, sb) = (a.counters(), b.counters());
    assert!(
        sa.get(NetCount::HolePunchesOk) + sb.get(NetCount::HolePunchesOk) >= 1,
        "a hole punch made the link direct: {sa:?} {sb:?}"
    );
    assert!(
        sb.get(NetCount::BytesSentDirect) >= big.len() as u64,
        "{sb:?}"
    );
    let path = next_matching(&mut b_rx, |e| match e {
        NetEvent::PathChanged { peer, remote } if peer == a.local_peer_id() => Some(remote),
        _ => None,
    })
    .await;
    assert!(!path_of(&path).relayed, "now direct: {path}");
    assert!(infra.counters().get(NetCount::RelayReservationsAccepted) >= 1);
    assert!(infra.counters().get(NetCount::RelayCircuitsAccepted) >= 1);
}

// Goal: never dial ourselves, by PeerId or through one of our own
// listening sockets (a peer advertising a loopback address).
#[tokio::test]
async fn never_dials_itself() {
    let (a, _a_rx, a_addr) = node(33, 1024).await;
    a.dial(Some(a.local_peer_id()), vec![a_addr.clone()])
        .await
        .unwrap();
    let other = libp2p::identity::Keypair::generate_ed25519()
        .public()
        .to_peer_id();
    a.dial(Some(other), vec![a_addr.clone()]).await.unwrap();
    wait_until("both dials skipped", || {
        a.counters().get(NetCount::SelfDialsSkipped) == 2
    })
    .await;
}

// Goal: the net actor never waits on its owner and the owner never waits
// on the actor for data, so a flood both ways while neither owner reads
// its events stalls neither side, and what is dropped is counted. The
// old hand-over (`events.send(..).await` against `net.send(..).await`)
// deadlocked here: each actor waited on its unread event channel, and
// each owner on the actor's full command queue.
// Method: a and b connect. Reading no events any more, each sends the
// other FLOOD frames, which must return within the deadline; both must
// then count dropped inbound frames. Still unread, a third node c
// connects to both and must get their identify answers (their swarms
// still run). Then a and b read again: each must report c's connection
// (lifecycle events wait, in order, rather than drop), and frames
// between c and them, sent after the flood, must arrive (resent when a
// receiver still busy with the flood drops one and says so).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flood_both_ways_unread_stalls_nobody() {
    const FLOOD: usize = 20_000;
    let (a, mut a_rx, a_addr) = node(40, 1024).await;
    let (b, mut b_rx, b_addr) = node(41, 1024).await;
    let (c, mut c_rx, _) = node(42, 1024).await;
    let (a_id, b_id, c_id) = (a.local_peer_id(), b.local_peer_id(), c.local_peer_id());
    a.dial(Some(b_id), vec![b_addr.clone()]).await.unwrap();
    for rx in [&mut a_rx, &mut b_rx] {
        next_matching(rx, |e| {
            matches!(e, NetEvent::Connected { .. }).then_some(())
        })
        .await;
    }

    // The flood; a_rx and b_rx stay unread from here on.
    let flood = async {
        for i in 0..FLOOD {
            let frame = (i as u64).to_be_bytes().to_vec();
            let _ = a.send(b_id, frame.clone()).await;
            let _ = b.send(a_id, frame).await;
            if i % 64 == 0 {
                // As a daemon loop would between turns.
                tokio::task::yield_now().await;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), flood)
        .await
        .expect("the owners' sends returned within 60 s");
    wait_until("both sides dropping inbound frames", || {
        a.counters().get(NetCount::FramesDropped) > 0
            && b.counters().get(NetCount::FramesDropped) > 0
    })
    .await;

    // Still unread: a and b keep serving their swarms.
    c.dial(Some(a_id), vec![a_addr]).await.unwrap();
    c.dial(Some(b_id), vec![b_addr]).await.unwrap();
    let mut identified = BTreeMap::new();
    while identified.len() < 2 {
        let peer = next_matching(&mut c_rx, |e| match e {
            NetEvent::Identified { peer, .. } => Some(peer),
            _ => None,
        })
        .await;
        identified.insert(peer, ());
    }
    assert!(identified.contains_key(&a_id) && identified.contains_key(&b_id));

    // a and b read again. c's connection was held for them.
    let about_c = move |e: &NetEvent| match e {
        NetEvent::Connected { peer, .. }
        | NetEvent::Frame { peer, .. }
        | NetEvent::SendFailed { peer, .. } => *peer == c_id,
        _ => false,
    };
    let mut a_seen = watch(a_rx, about_c);
    let mut b_seen = watch(b_rx, about_c);
    let mut c_seen = watch(c_rx, |e| {
        matches!(e, NetEvent::Frame { .. } | NetEvent::SendFailed { .. })
    });
    for seen in [&mut a_seen, &mut b_seen] {
        next_matching(seen, |e| {
            matches!(e, NetEvent::Connected { .. }).then_some(())
        })
        .await;
    }
    // Frames sent after the flood arrive, both ways.
    deliver((&c, &mut c_seen), (&a, &mut a_seen), b"late to a").await;
    deliver((&c, &mut c_seen), (&b, &mut b_seen), b"late to b").await;
    deliver((&a, &mut a_seen), (&c, &mut c_seen), b"late from a").await;
    deliver((&b, &mut b_seen), (&c, &mut c_seen), b"late from b").await;
    for h in [&a, &b] {
        let s = h.counters();
        assert!(s.get(NetCount::FramesDropped) > 0, "{s:?}");
        assert_eq!(s.get(NetCount::ConnectionsRefused), 0, "{s:?}");
    }
}

// Goal: connections beyond the per-peer cap are refused and counted, and
// the ones within it keep working. Method: b allows 2 connections per
// peer; a dials b's address 4 times (no peer condition, so each dial is
// a new connection); b must refuse exactly 2, and a frame from a must
// still reach b.
#[tokio::test]
async fn connections_over_the_per_peer_cap_are_refused() {
    let (a, mut a_rx, _) = node(43, 1024).await;
    let (b, mut b_rx, b_addr) = node_with(
        44,
        NetConfig {
            connection_limits: Some(ConnectionLimits {
                max_established_per_peer: 2,
                ..ConnectionLimits::device()
            }),
            ..loopback(1024)
        },
    )
    .await;
    for _ in 0..4 {
        a.dial(None, vec![b_addr.clone()]).await.unwrap();
    }
    wait_until("b refusing a's extra connections", || {
        b.counters().get(NetCount::ConnectionsRefused) >= 2
    })
    .await;
    // A refused connection may still look open to a for a moment, and a
    // frame sent on it fails: resend until one lands, as the daemon's
    // anti-entropy would.
    let landed = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            a.try_send(b.local_peer_id(), vec![7; 8]).unwrap();
            let outcome = tokio::select! {
                f = next_matching(&mut b_rx, |e| match e {
                    NetEvent::Frame { peer, frame } => Some((peer, frame)),
                    _ => None,
                }) => Some(f),
                _ = next_matching(&mut a_rx, |e| matches!(e, NetEvent::SendFailed { .. }).then_some(())) => None,
            };
            if let Some(f) = outcome {
                return f;
            }
        }
    })
    .await
    .expect("a frame from a reaches b within 30 s");
    assert_eq!(landed, (a.local_peer_id(), vec![7; 8]));
    assert_eq!(b.counters().get(NetCount::ConnectionsRefused), 2);
    assert_eq!(a.counters().get(NetCount::ConnectionsRefused), 0);
}

// Goal: the role picks the connection caps unless they are configured.
#[test]
fn connection_limits_by_role() {
    let device = NetConfig::default();
    assert_eq!(device.connection_limits(), ConnectionLimits::device());
    let mut infra = NetConfig::default();
    infra.features.infrastructure = Some(InfraLimits::default());
    assert_eq!(
        infra.connection_limits(),
        ConnectionLimits::infrastructure()
    );
    let mine = ConnectionLimits {
        max_established_per_peer: 1,
        ..ConnectionLimits::device()
    };
    infra.connection_limits = Some(mine);
    assert_eq!(infra.connection_limits(), mine);
    let (d, i) = (
        ConnectionLimits::device(),
        ConnectionLimits::infrastructure(),
    );
    assert!(d.max_established_total >= d.max_established_incoming);
    assert!(i.max_established_total >= i.max_established_incoming);
    assert!(i.max_established_incoming > d.max_established_incoming);
}

// Goal: a dial leaves from a fresh port, never from the listening port.
// With libp2p's default port reuse, two devices that discover each
// other at the same instant and dial each other (mDNS makes that
// common) can have their SYNs cross: TCP then makes one connection in
// which both ends are the Noise initiator, and both handshakes fail
// ("input error"); CI saw exactly that. Method: a dials b on loopback;
// the address b sees the connection come from must not be a's listening
// port; then, ten times, two fresh nodes dial each other at once and
// both connect.
#[tokio::test]
async fn dials_leave_from_a_fresh_port() {
    let (a, _a_rx, a_addr) = node(3, 1024).await;
    let (b, mut b_rx, b_addr) = node(4, 1024).await;
    a.dial(Some(b.local_peer_id()), vec![b_addr.clone()])
        .await
        .unwrap();
    let from = next_matching(&mut b_rx, |e| match e {
        NetEvent::Connected { remote, .. } => Some(remote),
        _ => None,
    })
    .await;
    let port = |m: &Multiaddr| {
        m.iter().find_map(|p| match p {
            Protocol::Tcp(port) => Some(port),
            _ => None,
        })
    };
    assert_ne!(
        port(&from),
        port(&a_addr),
        "a dialed from its listening port"
    );
    for round in 0..10u8 {
        let (a, mut a_rx, a_addr) = node(10 + 2 * round, 1024).await;
        let (b, mut b_rx, b_addr) = node(11 + 2 * round, 1024).await;
        let (ra, rb) = tokio::join!(
            a.dial(Some(b.local_peer_id()), vec![b_addr]),
            b.dial(Some(a.local_peer_id()), vec![a_addr]),
        );
        ra.unwrap();
        rb.unwrap();
        for rx in [&mut a_rx, &mut b_rx] {
            let got = next_matching(rx, |e| match e {
                NetEvent::Connected { .. } => Some(Ok(())),
                NetEvent::DialFailed { reason, .. } => Some(Err(reason)),
                _ => None,
            })
            .await;
            assert_eq!(got, Ok(()), "round {round}");
        }
    }
}

// Goal: over a real loopback connection, frames to one peer arrive in the
// order sent, and a frame over the receiver's cap is refused by its codec
// (an inbound error there, a send failure here) without stopping later
// frames. Method: two swarms in one process; the receiver caps frames at
// 1 KiB.
#[tokio::test]
async fn ordered_frames_and_oversize_refused() {
    let (a, mut a_rx, _) = node(1, 8 * 1024 * 1024).await;
    let (b, mut b_rx, b_addr) = node(2, 1024).await;
    a.dial(Some(b.local_peer_id()), vec![b_addr]).await.unwrap();
    let connected = next_matching(&mut a_rx, |e| match e {
        NetEvent::Connected { peer, public, .. } => Some((peer, public)),
        _ => None,
    })
    .await;
    assert_eq!(connected.0, b.local_peer_id());
    assert_eq!(connected.1, Some(public_of(&b.local_peer_id()).unwrap()));

    for i in 0u8..20 {
        a.send(b.local_peer_id(), vec![i; 100]).await.unwrap();
    }
    a.send(b.local_peer_id(), vec![0xee; 4096]).await.unwrap();
    a.send(b.local_peer_id(), vec![0xff; 10]).await.unwrap();

    let mut got = Vec::new();

    while got.len() < 21 {
        if let NetEvent::Frame { frame, .. } = next_matching(&mut b_rx, Some).await {
            got.push(frame);
        }
    }
    let firsts: Vec<u8> = got.iter().map(|f| f[0]).collect();
    let mut want: Vec<u8> = (0u8..20).collect();
    want.push(0xff);
    assert_eq!(
        firsts, want,
        "frames out of order or the oversized one got through"
    );
    assert_eq!(b.counters().get(NetCount::OversizedFramesRefused), 1);
    assert_eq!(a.counters().get(NetCount::OversizedFramesRefused), 0);
    let failed = next_matching(&mut a_rx, |e| match e {
        NetEvent::SendFailed { peer, .. } => Some(peer),
        _ => None,
    })
    .await;
    assert_eq!(failed, b.local_peer_id());
}

// Goal: the codec refuses an oversized length prefix before reading the
// body. Method: feed a prefix claiming cap+1 bytes.
#[tokio::test]
async fn codec_refuses_oversized_prefix() {
    let mut bytes = (1025u32).to_be_bytes().to_vec();
    bytes.extend([0u8; 16]);
    let err = codec::read_frame(&mut futures::io::Cursor::new(bytes), 1024)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
    assert!(err.to_string().contains("exceeds the cap"), "{err}");
}

// Goal: a device key maps to a PeerId and back to the same key.
#[test]
fn peer_id_round_trip() {
    let seed = [7u8; 32];
    let mut s = seed;
    let kp = libp2p::identity::Keypair::ed25519_from_bytes(&mut s).unwrap();
    let public = kp.public().try_into_ed25519().unwrap().to_bytes();
    let peer = id_of(&public).unwrap();
    assert_eq!(peer, kp.public().to_peer_id());
    assert_eq!(public_of(&peer), Some(public));
}

// Goal: an empty frame is a probe (see `actor/liveness.rs`): the network
// actor of the receiver answers it and never hands it to its owner, and
// the sender gets its receipt, so a probe proves a path alive without
// touching the sync protocol. Method: a probe, then a frame; the
// receiver's owner sees only the frame.
#[tokio::test]
async fn a_probe_is_answered_by_the_network_and_never_reaches_the_owner() {
    let (a, mut a_rx, _) = node(3, 1024 * 1024).await;
    let (b, mut b_rx, b_addr) = node(4, 1024 * 1024).await;
    a.dial(Some(b.local_peer_id()), vec![b_addr]).await.unwrap();
    next_matching(&mut a_rx, |e| match e {
        NetEvent::Connected { .. } => Some(()),
        _ => None,
    })
    .await;
    a.send(b.local_peer_id(), Vec::new()).await.unwrap();
    a.send(b.local_peer_id(), vec![7; 10]).await.unwrap();
    let first = next_matching(&mut b_rx, |e| match e {
        NetEvent::Frame { frame, .. } => Some(frame),
        _ => None,
    })
    .await;
    assert_eq!(first, vec![7; 10], "the probe reached the owner");
    // One frame is in flight per peer and the next leaves on the receipt
    // of the one before: the frame's arrival is the probe's receipt.
    assert_eq!(a.counters().get(NetCount::BytesSentDirect), 10);
}
