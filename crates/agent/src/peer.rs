//! Who and where: the peer and address types the core speaks (see
//! [`nuwa_identity::peer`], shared with the network shell so that nothing
//! is converted at the boundary).

pub use nuwa_identity::peer::*;
