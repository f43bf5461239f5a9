//! The owner's side of the network: [`NetHandle`], whose methods become
//! `Command`s on the actor's bounded queue. Control commands wait for
//! room; data (frames, publishes) never waits and is dropped and counted
//! when the queue holds its share already (see `outbox`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use libp2p::{Multiaddr, PeerId};
use nuwa_counters::Counters;
use tokio::sync::mpsc::{self, error::TrySendError};

use crate::{GossipId, NetCount, NetError, outbox};

/// What the owner asks of the actor, by the part of the swarm it concerns.
pub(crate) enum Command {
    Dial {
        peer: Option<PeerId>,
        addrs: Vec<Multiaddr>,
        /// Dial from the listening port (see [`NetHandle::dial_infra`]).
        reuse_port: bool,
    },
    Send {
        peer: PeerId,
        frame: Vec<u8>,
    },
    Disconnect {
        peer: PeerId,
    },
    AddAddress {
        peer: PeerId,
        addr: Multiaddr,
    },
    Relay(RelayCommand),
    Kad(KadCommand),
    Rendezvous(RendezvousCommand),
    Gossip(GossipCommand),
}

/// Our reservations on relays (the relay client).
pub(crate) enum RelayCommand {
    Reserve { relay: PeerId, addr: Multiaddr },
    Release { relay: PeerId },
}

/// The private DHT.
pub(crate) enum KadCommand {
    Bootstrap,
    Put { key: Vec<u8>, value: Vec<u8> },
    Store { key: Vec<u8>, value: Vec<u8> },
    Get { key: Vec<u8> },
    Provide { key: Vec<u8> },
    GetProviders { key: Vec<u8> },
}

/// The rendezvous client.
pub(crate) enum RendezvousCommand {
    Register {
        server: PeerId,
        namespace: String,
        ttl_secs: u64,
    },
    Discover {
        server: PeerId,
        namespace: String,
    },
}

/// Gossipsub.
pub(crate) enum GossipCommand {
    Subscribe { topic: String },
    Publish { topic: String, data: Vec<u8> },
    Report { id: GossipId, accept: bool },
}

/// Handle to the network actor. Dropping every handle stops the actor.
#[derive(Clone)]
pub struct NetHandle {
    tx: mpsc::Sender<Command>,
    local_peer_id: PeerId,
    counters: Counters<NetCount>,
    /// Commands issued through any handle: not an operator's metric, but
    /// how a test sees whether its code drove the network at a given moment.
    commands: Arc<AtomicU64>,
}

impl NetHandle {
    pub fn local_peer_id(&self) -> PeerId {
        self.local_peer_id
    }

    /// The network's counters (see [`NetCount`]), live: the returned set
    /// shares its values with the actor.
    pub fn counters(&self) -> Counters<NetCount> {
        self.counters.clone()
    }

    /// Commands the owner issued through the handle (sends, dials, ...),
    /// counted as they are issued, before the actor sees them.
    pub fn commands_issued(&self) -> u64 {
        self.commands.load(Ordering::Relaxed)
    }

    /// The handle of an actor reading `tx`, counting into `counters`.
    pub(crate) fn new(
        tx: mpsc::Sender<Command>,
        local_peer_id: PeerId,
        counters: Counters<NetCount>,
    ) -> NetHandle {
        NetHandle {
            tx,
            local_peer_id,
            counters,
            commands: Arc::default(),
        }
    }

    /// A handle with no swarm behind it: commands are counted
    /// ([`NetHandle::commands_issued`]) and dropped. For tests of code that
    /// drives the network and must be observed doing so (or not) at a given
    /// moment. Needs a tokio runtime.
    pub fn detached(local_peer_id: PeerId) -> NetHandle {
        let (tx, mut rx) = mpsc::channel::<Command>(outbox::COMMAND_QUEUE);
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        NetHandle::new(tx, local_peer_id, Counters::new())
    }

    /// A control command: never dropped, and queued behind everything sent
    /// before it. It waits only if the command queue is full of control
    /// commands (data fills at most `DATA_SHARE` of it), and that wait ends
    /// because the actor never waits on its owner (see `outbox`).
    async fn cmd(&self, c: Command) -> Result<(), NetError> {
        // Counted when issued, before the actor sees it.
        self.commands.fetch_add(1, Ordering::Relaxed);
        self.tx.send(c).await.map_err(|_| NetError::Stopped)
    }

    /// A data command (a frame, a publish): queued at once or dropped and
    /// counted in `dropped`, never waited for.
    fn data(&self, c: Command, what: &'static str, dropped: NetCount) -> Result<(), NetError> {
        self.commands.fetch_add(1, Ordering::Relaxed);
        let queued = self.tx.max_capacity() - self.tx.capacity();
        if queued >= outbox::DATA_SHARE {
            self.counters.inc(dropped);
            return Err(NetError::Behind(what));
        }
        match self.tx.try_send(c) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                self.counters.inc(dropped);
                Err(NetError::Behind(what))
            }
            Err(TrySendError::Closed(_)) => Err(NetError::Stopped),
        }
    }

    /// Dials `addrs` (of `peer`, when known; a connected or dialing peer is
    /// not dialed again). Every command method is cancel safe: a cancelled
    /// call sends nothing.
    pub async fn dial(&self, peer: Option<PeerId>, addrs: Vec<Multiaddr>) -> Result<(), NetError> {
        self.cmd(Command::Dial {
            peer,
            addrs,
            reuse_port: false,
        })
        .await
    }

    /// Dials an infrastructure node from our listening port, so that the
    /// NAT mapping it observes (identify) is the one hole punching needs,
    /// and over every transport in `addrs` we are not connected on yet (a
    /// QUIC connection next to a TCP one gives a UDP mapping to punch
    /// with).
    pub async fn dial_infra(&self, peer: PeerId, addrs: Vec<Multiaddr>) -> Result<(), NetError> {
        self.cmd(Command::Dial {
            peer: Some(peer),
            addrs,
            reuse_port: true,
        })
        .await
    }

    /// Reserves a circuit on `relay` (reached at `addr`), so that peers that
    /// cannot dial us directly reach us through it. The circuit address is
    /// advertised once the relay accepts
    /// ([`NetEvent::RelayReserved`](crate::NetEvent::RelayReserved)).
    pub async fn reserve_relay(&self, relay: PeerId, addr: Multiaddr) -> Result<(), NetError> {
        self.cmd(Command::Relay(RelayCommand::Reserve { relay, addr }))
            .await
    }

    /// Gives up our reservation on `relay`.
    pub async fn release_relay(&self, relay: PeerId) -> Result<(), NetError> {
        self.cmd(Command::Relay(RelayCommand::Release { relay }))
            .await
    }

    /// Queues `frame` for `peer` on `/nuwa/sync/1`; the same as
    /// [`NetHandle::try_send`], for callers that `.await` every command.
    /// Never waits.
    pub async fn send(&self, peer: PeerId, frame: Vec<u8>) -> Result<(), NetError> {
        self.try_send(peer, frame)
    }

    /// Queues `frame` for `peer` without waiting. When the network is behind
    /// (the command queue holds its share of data already) the frame is
    /// dropped, counted in [`NetCount::OutboundFramesDropped`], and
    /// [`NetError::Behind`] returned: frames carry state that anti-entropy
    /// re-sends, so dropping one is cheaper than stalling the caller.
    pub fn try_send(&self, peer: PeerId, frame: Vec<u8>) -> Result<(), NetError> {
        self.data(
            Command::Send { peer, frame },
            "frame",
            NetCount::OutboundFramesDropped,
        )
    }

    /// Closes every connection to `peer`.
    pub async fn disconnect(&self, peer: PeerId) -> Result<(), NetError> {
        self.cmd(Command::Disconnect { peer }).await
    }

    /// Tells the swarm and the DHT where `peer` can be reached.
    pub async fn add_address(&self, peer: PeerId, addr: Multiaddr) -> Result<(), NetError> {
        self.cmd(Command::AddAddress { peer, addr }).await
    }

    pub async fn kad_bootstrap(&self) -> Result<(), NetError> {
        self.cmd(Command::Kad(KadCommand::Bootstrap)).await
    }

    /// Stores a record locally and replicates it to the closest peers.
    pub async fn kad_put_record(&self, key: Vec<u8>, value: Vec<u8>) -> Result<(), NetError> {
        self.cmd(Command::Kad(KadCommand::Put { key, value })).await
    }

    /// Stores an inbound record the caller has verified.
    pub async fn kad_store(&self, key: Vec<u8>, value: Vec<u8>) -> Result<(), NetError> {
        self.cmd(Command::Kad(KadCommand::Store { key, value }))
            .await
    }

    pub async fn kad_get_record(&self, key: Vec<u8>) -> Result<(), NetError> {
        self.cmd(Command::Kad(KadCommand::Get { key })).await
    }

    pub async fn kad_start_providing(&self, key: Vec<u8>) -> Result<(), NetError> {
        self.cmd(Command::Kad(KadCommand::Provide { key })).await
    }

    pub async fn kad_get_providers(&self, key: Vec<u8>) -> Result<(), NetError> {
        self.cmd(Command::Kad(KadCommand::GetProviders { key }))
            .await
    }

    pub async fn rendezvous_register(
        &self,
        server: PeerId,
        namespace: String,
        ttl_secs: u64,
    ) -> Result<(), NetError> {
        self.cmd(Command::Rendezvous(RendezvousCommand::Register {
            server,
            namespace,
            ttl_secs,
        }))
        .await
    }

    pub async fn rendezvous_discover(
        &self,
        server: PeerId,
        namespace: String,
    ) -> Result<(), NetError> {
        self.cmd(Command::Rendezvous(RendezvousCommand::Discover {
            server,
            namespace,
        }))
        .await
    }

    pub async fn gossip_subscribe(&self, topic: String) -> Result<(), NetError> {
        self.cmd(Command::Gossip(GossipCommand::Subscribe { topic }))
            .await
    }

    /// Publishes on `topic`. Before any peer has subscribed the message is
    /// held (bounded) and published when one does. Never waits: like
    /// [`NetHandle::try_send`], a publish is dropped when the network is
    /// behind, counted in [`NetCount::GossipPublishDropped`].
    pub async fn gossip_publish(&self, topic: String, data: Vec<u8>) -> Result<(), NetError> {
        self.data(
            Command::Gossip(GossipCommand::Publish { topic, data }),
            "gossip publish",
            NetCount::GossipPublishDropped,
        )
    }

    /// The verdict on a gossip message: accepted messages are forwarded,
    /// rejected ones are dropped and their sender penalised.
    pub async fn gossip_report(&self, id: GossipId, accept: bool) -> Result<(), NetError> {
        self.cmd(Command::Gossip(GossipCommand::Report { id, accept }))
            .await
    }
}
