//! Who and where: the peer and address types the core speaks, and the few
//! facts it reads off them.
//!
//! A device's Ed25519 key is its libp2p identity, so a [`PeerId`] names a
//! device and carries its key. The types are libp2p's own format crates
//! (`libp2p-identity`'s `PeerId`, `multiaddr`): plain data with no IO, the
//! same values the network crate (`nuwa-net`) uses, and it reads them with
//! these same functions.

pub use libp2p_identity::PeerId;
pub use multiaddr::{Multiaddr, Protocol};

/// The PeerId of a device's Ed25519 public key, if it is a valid point.
pub fn id_of(public: &[u8; 32]) -> Option<PeerId> {
    let key = libp2p_identity::ed25519::PublicKey::try_from_bytes(public).ok()?;
    Some(libp2p_identity::PublicKey::from(key).to_peer_id())
}

/// The Ed25519 public key behind a PeerId, if it is an inlined Ed25519 key.
pub fn public_of(peer: &PeerId) -> Option<[u8; 32]> {
    let mh = peer.as_ref();
    // Code 0 is the identity multihash: the digest is the encoded key itself.
    if mh.code() != 0 {
        return None;
    }
    let key = libp2p_identity::PublicKey::try_decode_protobuf(mh.digest()).ok()?;
    Some(key.try_into_ed25519().ok()?.to_bytes())
}

/// The PeerId in an address's `/p2p/` component, if any.
pub fn peer_in(addr: &Multiaddr) -> Option<PeerId> {
    addr.iter().find_map(|p| match p {
        Protocol::P2p(id) => Some(id),
        _ => None,
    })
}

/// How a connection travels: its transport and whether a relay carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Path {
    /// `tcp`, `quic`, `websocket`, or `other`.
    pub transport: &'static str,
    /// Through a `/p2p-circuit` relay.
    pub relayed: bool,
}

/// The [`Path`] of a connection from its remote address.
pub fn path_of(addr: &Multiaddr) -> Path {
    let mut transport = "other";
    let mut relayed = false;
    for p in addr.iter() {
        match p {
            Protocol::P2pCircuit => relayed = true,
            // The first transport is the one to the relay, if any.
            Protocol::Tcp(_) if transport == "other" => transport = "tcp",
            Protocol::Quic | Protocol::QuicV1 if transport == "other" => transport = "quic",
            Protocol::Ws(_) | Protocol::Wss(_) => transport = "websocket",
            _ => {}
        }
    }
    Path { transport, relayed }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: a device key and its PeerId convert both ways, and addresses
    // read as the transport and relay they name.
    #[test]
    fn keys_peers_and_paths() {
        let key = crate::keys::DeviceKey::generate().unwrap();
        let peer = id_of(&key.public()).unwrap();
        assert_eq!(public_of(&peer), Some(key.public()));
        let addr: Multiaddr = format!("/ip4/10.0.0.1/tcp/4001/p2p/{peer}")
            .parse()
            .unwrap();
        assert_eq!(peer_in(&addr), Some(peer));
        assert_eq!(
            path_of(&addr),
            Path {
                transport: "tcp",
                relayed: false
            }
        );
        let relayed: Multiaddr =
            format!("/ip4/10.0.0.1/udp/4001/quic-v1/p2p/{peer}/p2p-circuit/p2p/{peer}")
                .parse()
                .unwrap();
        assert_eq!(
            path_of(&relayed),
            Path {
                transport: "quic",
                relayed: true
            }
        );
    }
}
