//! The `status` report: shared by the daemon (which fills it) and the CLI
//! (which prints it).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub agent_did: String,
    pub device: DeviceStatus,
    pub listen_addrs: Vec<String>,
    pub api_url: String,
    pub peers: Vec<PeerStatus>,
    /// Peers refused because their clock is beyond the replay window.
    #[serde(default)]
    pub clock_skew: Vec<ClockSkewStatus>,
    pub rejections: Vec<RejectionStatus>,
    /// Containers whose records could not be read at start: moved aside
    /// (kept in the store's quarantine) and resynced from peers.
    #[serde(default)]
    pub quarantined: Vec<QuarantineStatus>,
    pub counters: BTreeMap<String, u64>,
    pub containers: Vec<ContainerStatus>,
    /// How others reach this device.
    #[serde(default)]
    pub reachability: ReachabilityStatus,
    /// Keepers configured for this device.
    #[serde(default)]
    pub keepers: Vec<KeeperStatus>,
    /// The daemon's version (`CARGO_PKG_VERSION`).
    #[serde(default)]
    pub version: String,
    /// Seconds since the daemon started.
    #[serde(default)]
    pub uptime_s: u64,
    /// The agent's current key epoch (raised by every revocation).
    #[serde(default)]
    pub key_epoch: u64,
    /// `true` when at least one peer is connected and every container is
    /// in sync with every connected peer (see [`PeerSyncStatus`]).
    #[serde(default)]
    pub in_sync: bool,
    /// Whole-document catch-ups running now (a cold sync), with progress.
    #[serde(default)]
    pub catch_ups: Vec<CatchUpStatus>,
    /// LAN discovery: whether mDNS is on and the interfaces it watches.
    #[serde(default)]
    pub mdns: MdnsStatus,
    /// Rendezvous servers configured for this device.
    #[serde(default)]
    pub rendezvous: Vec<InfraPeerStatus>,
    /// Size of the DID-log pointer this device publishes in the DHT.
    #[serde(default)]
    pub dht_pointer: Option<DhtPointerStatus>,
    /// Whether this home holds the agent's master key.
    #[serde(default)]
    pub master_key: bool,
    /// Whether this device is an admin: it holds a key with
    /// `capabilityDelegation` (the master key, or its own promoted key).
    #[serde(default)]
    pub admin: bool,
    /// Whether the DID document lists a recovery key (recovery words).
    #[serde(default)]
    pub recovery_key: bool,
}

/// A whole-document catch-up in progress.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CatchUpStatus {
    pub container: String,
    /// The peer whose document is being applied, when known.
    #[serde(default)]
    pub peer_id: String,
    /// Changes received so far in this catch-up.
    pub changes: u64,
    /// Bytes of changes received so far.
    pub bytes: u64,
    pub started_unix_ms: u64,
}

/// LAN discovery as the daemon runs it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MdnsStatus {
    pub enabled: bool,
    /// Interfaces mDNS announces and listens on; empty while enabled means
    /// it watches nothing.
    pub interfaces: Vec<String>,
    /// Why mDNS does not run though it was not switched off (`enabled` is
    /// false then): devices on the LAN cannot find this one.
    #[serde(default)]
    pub error: Option<String>,
}

/// A configured infrastructure node (rendezvous server).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct InfraPeerStatus {
    pub address: String,
    pub connected: bool,
}

/// The DHT pointer (this agent's DID log as a Kademlia record).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DhtPointerStatus {
    pub bytes: u64,
    /// Largest record the DHT carries.
    pub limit: u64,
}

/// One container's sync state against one connected peer.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PeerSyncStatus {
    pub container: String,
    /// `in_sync` (both hold the same heads), `behind` (the peer holds
    /// changes this device has not applied yet), `ahead` (this device holds
    /// changes the peer has not acknowledged), `syncing` (both), or
    /// `unknown` (no exchange yet).
    pub state: String,
    /// Changes this device still lacks, when known.
    #[serde(default)]
    pub behind: Option<u64>,
}

/// One keeper, as this device sees it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct KeeperStatus {
    pub peer_id: String,
    pub connected: bool,
    /// Everything this device holds has been acknowledged by the keeper.
    pub pushed_all: bool,
    /// The last pull reached the end of what the keeper holds.
    pub pulled_all: bool,
    /// The keeper's sequence number this device has applied up to.
    pub cursor: u64,
    /// The last time the keeper held less than it had been seen to hold.
    #[serde(default)]
    pub rollback: Option<KeeperRollback>,
}

/// A keeper seen holding less than before: its store was rolled back (or
/// replaced), so writes it had acknowledged may be gone from it. The
/// device pushed everything it holds to it again.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeeperRollback {
    /// The highest sequence number it had been seen to hold.
    pub held_seq: u64,
    /// The newest it held when seen again.
    pub served_seq: u64,
    pub detected_unix_ms: u64,
}

/// How others reach this device: what it advertises, what AutoNAT found,
/// and the relays it holds a reservation on.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ReachabilityStatus {
    /// `public` (an address was dialed back by an AutoNAT server),
    /// `private` (tests failed and none succeeded) or `unknown`.
    pub nat: String,
    /// Addresses advertised to identify, rendezvous and the DHT.
    pub advertised: Vec<String>,
    /// Relays (PeerIds) holding a reservation for this device.
    pub relays: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceStatus {
    pub context_id: String,
    pub peer_id: String,
    pub name: String,
    /// Whether this device's key is an active member of the DID document.
    pub authorised: bool,
    /// Whether the DID chain removed this device (it was revoked): nothing
    /// written here reaches another device any more.
    #[serde(default)]
    pub revoked: bool,
    pub did_log_len: usize,
    /// Once this device knows it was revoked: the local changes it made
    /// from the revocation on, which never sync (see [`NeverSyncs`]).
    #[serde(default)]
    pub never_syncs: Option<NeverSyncs>,
    /// Size of the Hello this device sends on every connection (it carries
    /// the compact proof of the DID document, not the chain).
    #[serde(default)]
    pub hello_bytes: usize,
}

/// The local changes a revoked device made from its revocation on: no
/// peer takes them, so they never sync (`state export` still reads them).
/// Decided by `nuwa_agent::stranded`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NeverSyncs {
    /// The time of the DID entry that removed this device (the admin's
    /// clock); `None` when it was removed on a branch of the chain that
    /// lost, so no entry of its chain says when.
    pub revoked_at_unix_ms: Option<u64>,
    /// When this device learned it.
    pub learned_at_unix_ms: u64,
    /// Local changes made from the revocation on (one per write, batch
    /// or typed-state operation per container).
    pub changes: u64,
    /// The same per container.
    pub containers: BTreeMap<String, u64>,
    /// Whether the record of local changes reaches back to the revocation;
    /// if not, there may be more than these.
    pub complete: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PeerStatus {
    pub peer_id: String,
    pub context_id: String,
    pub address: String,
    pub verified_at_unix_ms: u64,
    /// The peer's clock minus ours, from its last Hello.
    #[serde(default)]
    pub clock_offset_ms: i64,
    /// `tcp`, `quic`, `websocket` or `other`.
    #[serde(default)]
    pub transport: String,
    /// Through a relay circuit rather than direct.
    #[serde(default)]
    pub relayed: bool,
    /// The device's name in the DID document (may be empty).
    #[serde(default)]
    pub name: String,
    /// Round-trip time from the last ping, in milliseconds.
    #[serde(default)]
    pub rtt_ms: Option<u64>,
    /// Per-container sync state against this peer.
    #[serde(default)]
    pub sync: Vec<PeerSyncStatus>,
}

/// A container moved aside at start because its records could not be read.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QuarantineStatus {
    /// Its name, when the name record itself was readable.
    pub container: Option<String>,
    /// Why it was moved aside.
    pub reason: String,
    /// Records moved.
    pub records: u64,
}

/// A peer whose genuine Hello was refused for clock skew.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClockSkewStatus {
    pub peer_id: String,
    /// The peer's clock minus ours.
    pub offset_ms: i64,
    /// The largest offset accepted either way.
    pub window_ms: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RejectionStatus {
    /// Where the rejected claim came from: `connection`, `mdns`, `dht`,
    /// `rendezvous` or `gossip`.
    pub source: String,
    /// Who: a PeerId, or an mDNS instance name.
    pub peer: String,
    pub label: String,
    pub reason: String,
    pub count: u64,
    pub last_unix_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContainerStatus {
    pub name: String,
    pub heads: Vec<String>,
    pub changes: usize,
}

impl NeverSyncs {
    /// One line for `status`: how many, where, and that export reads them.
    pub fn render(&self) -> String {
        if self.changes == 0 && self.complete {
            return "no local change was made after the revocation: nothing is lost".to_owned();
        }
        let per: Vec<String> = self
            .containers
            .iter()
            .map(|(c, n)| format!("{c} ({n})"))
            .collect();
        format!(
            "{}{} local change(s) made after this device was revoked are refused by every \
             device that knows of the revocation{}{}; a device that had not heard of it yet may \
             have taken some. `nuwa-node state export CONTAINER --out FILE` still reads them",
            if self.complete { "" } else { "at least " },
            self.changes,
            if per.is_empty() {
                String::new()
            } else {
                format!(": {}", per.join(", "))
            },
            match self.revoked_at_unix_ms {
                Some(t) => format!(" (revoked at {})", crate::devices::format_unix_ms(t)),
                None => " (no entry of this device's DID chain says when it was revoked)".into(),
            },
        )
    }
}

impl Status {
    /// One line answering "is this device in sync?".
    pub fn sync_summary(&self) -> String {
        if self.device.revoked {
            return "REVOKED: this device was removed from the agent; nothing written here \
                    reaches another device (`state export` still reads what it holds; to use \
                    this machine again, move the home aside and pair anew)"
                .to_owned();
        }
        if self.peers.is_empty() {
            return "no peer connected: nothing to compare with".to_owned();
        }
        if !self.catch_ups.is_empty() {
            return format!("catching up ({} container(s))", self.catch_ups.len());
        }
        if self.in_sync {
            return format!(
                "IN SYNC with {} peer(s) over {} container(s)",
                self.peers.len(),
                self.containers.len()
            );
        }
        let behind: Vec<&str> = self
            .peers
            .iter()
            .filter(|p| {
                p.sync
                    .iter()
                    .any(|c| c.state == "behind" || c.state == "syncing")
            })
            .map(|p| {
                if p.name.is_empty() {
                    p.context_id.as_str()
                } else {
                    p.name.as_str()
                }
            })
            .collect();
        if behind.is_empty() {
            "syncing (exchanging heads with peers)".to_owned()
        } else {
            format!("BEHIND {}", behind.join(", "))
        }
    }

    /// Human-readable rendering for `nuwa-node status`.
    pub fn render(&self) -> String {
        let mut out = String::new();
        self.render_device(&mut out);
        self.render_network(&mut out);
        self.render_peers(&mut out);
        self.render_notices(&mut out);
        self.render_records(&mut out);
        out
    }

    /// Whether it is in sync, and who this device and its daemon are.
    fn render_device(&self, out: &mut String) {
        let auth = if self.device.authorised {
            "authorised"
        } else {
            "NOT AUTHORISED (key not active in the DID document)"
        };
        out.push_str(&format!("sync       {}\n", self.sync_summary()));
        if let Some(n) = &self.device.never_syncs {
            out.push_str(&format!("unsynced   {}\n", n.render()));
        }
        out.push_str(&format!("agent      {}\n", self.agent_did));
        out.push_str(&format!(
            "device     {} ({}) {}\n",
            self.device.context_id,
            if self.device.name.is_empty() {
                "unnamed"
            } else {
                &self.device.name
            },
            auth
        ));
        out.push_str(&format!("peer id    {}\n", self.device.peer_id));
        if !self.version.is_empty() {
            out.push_str(&format!(
                "daemon     v{}, up {}, key epoch {}{}\n",
                self.version,
                humantime::format_duration(std::time::Duration::from_secs(self.uptime_s)),
                self.key_epoch,
                match (self.admin, self.master_key) {
                    (true, true) => ", admin (holds the master key)",
                    (true, false) => ", admin",
                    _ => "",
                }
            ));
        }
    }

    /// How this device finds others and is reached: discovery, addresses, keepers.
    fn render_network(&self, out: &mut String) {
        if self.mdns.enabled {
            if self.mdns.interfaces.is_empty() {
                out.push_str(
                    "mdns       WATCHING NO INTERFACE: finds no device (see `nuwa-node doctor`)\n",
                );
            } else {
                out.push_str(&format!(
                    "mdns       on {}\n",
                    self.mdns.interfaces.join(", ")
                ));
            }
        } else if let Some(reason) = &self.mdns.error {
            out.push_str(&format!(
                "mdns       FAILED: {reason} (see `nuwa-node doctor`)\n"
            ));
        } else {
            out.push_str("mdns       off\n");
        }
        for r in &self.rendezvous {
            out.push_str(&format!(
                "rendezvous {} {}\n",
                r.address,
                if r.connected {
                    "connected"
                } else {
                    "not connected"
                }
            ));
        }
        if let Some(p) = &self.dht_pointer {
            out.push_str(&format!(
                "dht        pointer {} of {} bytes\n",
                p.bytes, p.limit
            ));
        }
        for a in &self.listen_addrs {
            out.push_str(&format!("listening  {a}\n"));
        }
        if !self.reachability.nat.is_empty() {
            out.push_str(&format!("reachable  {}", self.reachability.nat));
            if !self.reachability.relays.is_empty() {
                out.push_str(&format!(
                    " (through {} relay(s))",
                    self.reachability.relays.len()
                ));
            }
            out.push('\n');
            for a in &self.reachability.advertised {
                out.push_str(&format!("advertised {a}\n"));
            }
        }
        for k in &self.keepers {
            out.push_str(&format!(
                "keeper     {} {}{}{}\n",
                k.peer_id,
                if k.connected {
                    "connected"
                } else {
                    "not connected"
                },
                if k.pushed_all {
                    ", everything pushed"
                } else {
                    ""
                },
                if k.pulled_all {
                    ", everything pulled"
                } else {
                    ""
                },
            ));
            if let Some(r) = &k.rollback {
                out.push_str(&format!(
                    "           ROLLED BACK: it held entries up to #{} and later only up to #{} \
                     (seen {}); writes it had acknowledged may be gone from it, so this device \
                     pushed everything it holds to it again\n",
                    r.held_seq,
                    r.served_seq,
                    crate::devices::format_unix_ms(r.detected_unix_ms),
                ));
            }
        }
    }

    /// Each verified peer and its sync state.
    fn render_peers(&self, out: &mut String) {
        out.push_str(&format!("\nverified peers ({}):\n", self.peers.len()));
        for p in &self.peers {
            out.push_str(&format!(
                "  {} {}  {}  {} ({} {}{})\n",
                p.context_id,
                if p.name.is_empty() {
                    String::new()
                } else {
                    format!("({})", p.name)
                },
                p.peer_id,
                p.address,
                if p.relayed { "relayed" } else { "direct" },
                p.transport,
                p.rtt_ms
                    .map(|r| format!(", rtt {r} ms"))
                    .unwrap_or_default()
            ));
            out.push_str(&format!("      {}\n", peer_sync_line(&p.sync)));
        }
    }

    /// What is under way or wrong: catch-ups, clock skew, quarantined containers.
    fn render_notices(&self, out: &mut String) {
        for c in &self.catch_ups {
            out.push_str(&format!(
                "\ncatching up {} from {}: {} changes, {} so far\n",
                c.container,
                if c.peer_id.is_empty() {
                    "a peer"
                } else {
                    &c.peer_id
                },
                c.changes,
                human_bytes(c.bytes)
            ));
        }
        for c in &self.clock_skew {
            out.push_str(&format!(
                "\nCLOCK SKEW: peer {} is {:+.1} s off this device's clock (at most ±{} s is accepted); \
                 sync with it is refused until the wrong clock is fixed (enable NTP)\n",
                c.peer_id,
                c.offset_ms as f64 / 1000.0,
                c.window_ms / 1000
            ));
        }
        for q in &self.quarantined {
            out.push_str(&format!(
                "\nQUARANTINED: container {} could not be read ({}); its {} records were moved \
                 aside and it is resynced from peers\n",
                q.container.as_deref().unwrap_or("(name unreadable)"),
                q.reason,
                q.records
            ));
        }
    }

    /// The rejections, the containers and the counters.
    fn render_records(&self, out: &mut String) {
        out.push_str(&format!("\nrejections ({}):\n", self.rejections.len()));
        for r in &self.rejections {
            out.push_str(&format!(
                "  [{}] {}  {} (x{})\n",
                r.source, r.peer, r.reason, r.count
            ));
        }
        out.push_str(&format!("\ncontainers ({}):\n", self.containers.len()));
        for c in &self.containers {
            let heads: Vec<&str> = c.heads.iter().map(|h| &h[..h.len().min(12)]).collect();
            out.push_str(&format!(
                "  {}  {} changes  heads {}\n",
                c.name,
                c.changes,
                heads.join(",")
            ));
        }
        if !self.counters.is_empty() {
            out.push_str("\ncounters:\n");
            for (k, v) in &self.counters {
                out.push_str(&format!("  {k} {v}\n"));
            }
        }
    }
}

/// "in sync over N containers", or the containers that are not.
fn peer_sync_line(sync: &[PeerSyncStatus]) -> String {
    if sync.is_empty() {
        return "no container exchanged yet".to_owned();
    }
    let not: Vec<&PeerSyncStatus> = sync.iter().filter(|c| c.state != "in_sync").collect();
    if not.is_empty() {
        return format!("in sync over {} container(s)", sync.len());
    }
    let mut parts: Vec<String> = not
        .iter()
        .take(8)
        .map(|c| match (c.state.as_str(), c.behind) {
            ("behind", Some(n)) => format!("{} {} changes behind", c.container, n),
            (state, _) => format!("{} {}", c.container, state.replace('_', " ")),
        })
        .collect();
    if not.len() > 8 {
        parts.push(format!("and {} more", not.len() - 8));
    }
    format!(
        "{} of {} in sync; {}",
        sync.len() - not.len(),
        sync.len(),
        parts.join("; ")
    )
}

fn human_bytes(n: u64) -> String {
    if n >= 1 << 20 {
        format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
    } else if n >= 1 << 10 {
        format!("{:.1} KiB", n as f64 / 1024.0)
    } else {
        format!("{n} B")
    }
}

#[cfg(test)]
mod tests {
    //! Goal: `status` says plainly whether mDNS runs, watches nothing, was
    //! switched off, or failed and why. Method: one status per case,
    //! rendered; a status from a daemon without `error` still reads.
    use super::*;

    fn with_mdns(mdns: serde_json::Value) -> Status {
        serde_json::from_value(serde_json::json!({
            "agent_did": "did:key:z", "listen_addrs": [], "api_url": "http://127.0.0.1:1",
            "peers": [], "rejections": [], "counters": {}, "containers": [],
            "device": {"context_id": "c", "peer_id": "p", "name": "", "authorised": true,
                       "did_log_len": 1},
            "mdns": mdns,
        }))
        .expect("a status")
    }

    #[test]
    fn the_mdns_line_tells_failed_from_off() {
        let cases = [
            (
                serde_json::json!({"enabled": true, "interfaces": ["eth0", "lo"]}),
                "mdns       on eth0, lo\n",
            ),
            (
                serde_json::json!({"enabled": true, "interfaces": []}),
                "mdns       WATCHING NO INTERFACE",
            ),
            (
                serde_json::json!({"enabled": false, "interfaces": []}),
                "mdns       off\n",
            ),
            (
                serde_json::json!({"enabled": false, "interfaces": [], "error": null}),
                "mdns       off\n",
            ),
            (
                serde_json::json!({"enabled": false, "interfaces": [],
                                   "error": "no TCP listener came up"}),
                "mdns       FAILED: no TCP listener came up (see `nuwa-node doctor`)\n",
            ),
        ];
        for (mdns, line) in cases {
            let text = with_mdns(mdns.clone()).render();
            assert!(text.contains(line), "{mdns}: wanted {line:?} in\n{text}");
            assert_eq!(
                text.contains("mdns       off"),
                line.contains(" off"),
                "{mdns}:\n{text}"
            );
        }
    }
}
