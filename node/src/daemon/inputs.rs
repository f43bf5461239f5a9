//! What the world brought, as the agent's inputs: network events (a run of
//! them taken as one turn), mDNS sightings, and API requests (each waits
//! for its answer in the executor); and the two effects the loop answers
//! itself, `sync --once`'s progress and result.

use std::io::{IsTerminal as _, Write as _};

use nuwa_agent::api::Request;
use nuwa_agent::{MdnsEvent, NetEvent as AgentEvent, Registration, RequestId};
use nuwa_discovery::DiscoveryEvent;
use nuwa_net::NetEvent;
use tokio::sync::mpsc;

use super::exec::Executor;
use super::exec::Waiting;
use crate::api::ApiRequest;
use crate::metrics::Metrics;

/// Frames and gossip: the events whose effects may wait for the end of a
/// run of them.
fn carries_data(ev: &NetEvent) -> bool {
    matches!(ev, NetEvent::Frame { .. } | NetEvent::GossipMessage { .. })
}

/// `first` and, if it carries data, the frames and gossip already waiting
/// (up to `max`): one turn, one group commit (2,000 containers' deltas
/// arrive as 2,000 messages).
pub(super) fn net_run(
    first: NetEvent,
    rx: &mut mpsc::Receiver<NetEvent>,
    max: usize,
    exec: &mut Executor,
) -> Vec<AgentEvent> {
    let data = carries_data(&first);
    let mut run = vec![net(first, exec)];
    while data && run.len() < max {
        match rx.try_recv() {
            Ok(ev) if carries_data(&ev) => run.push(net(ev, exec)),
            Ok(ev) => {
                // Not data: it ends the run, in order.
                run.push(net(ev, exec));
                break;
            }
            Err(_) => break,
        }
    }
    run
}

/// One network event in the core's terms. Gossip waits for its verdict
/// under a token the executor keeps.
fn net(ev: NetEvent, exec: &mut Executor) -> AgentEvent {
    match ev {
        NetEvent::Listening(a) => AgentEvent::Listening(a),
        NetEvent::Connected {
            peer,
            public,
            remote,
        } => AgentEvent::Connected {
            peer,
            public,
            remote,
        },
        NetEvent::Disconnected { peer } => AgentEvent::Disconnected { peer },
        NetEvent::Frame { peer, frame } => AgentEvent::Frame { peer, bytes: frame },
        NetEvent::SendFailed { peer, reason } => AgentEvent::SendFailed { peer, reason },
        NetEvent::InboundError { peer, reason } => AgentEvent::InboundError { peer, reason },
        NetEvent::DialFailed { peer, reason } => AgentEvent::DialFailed { peer, reason },
        NetEvent::Identified { peer, listen_addrs } => {
            AgentEvent::Identified { peer, listen_addrs }
        }
        NetEvent::KadInboundRecord { from, key, value } => {
            AgentEvent::KadInboundRecord { from, key, value }
        }
        NetEvent::KadRecord { key, value } => AgentEvent::KadRecord { key, value },
        NetEvent::KadProviders { key, providers } => AgentEvent::KadProviders { key, providers },
        NetEvent::KadBootstrapped { ok, reason } => AgentEvent::KadBootstrapped { ok, reason },
        NetEvent::RendezvousDiscovered {
            server,
            registrations,
        } => AgentEvent::RendezvousDiscovered {
            server,
            registrations: registrations
                .into_iter()
                .map(|r| Registration {
                    peer: r.peer,
                    namespace: r.namespace,
                    addrs: r.addrs,
                })
                .collect(),
        },
        NetEvent::RendezvousRegistered {
            server,
            namespace,
            ttl_secs,
        } => AgentEvent::RendezvousRegistered {
            server,
            namespace,
            ttl_secs,
        },
        NetEvent::RendezvousFailed { server, reason } => {
            AgentEvent::RendezvousFailed { server, reason }
        }
        NetEvent::GossipMessage {
            id,
            author,
            topic,
            data,
        } => AgentEvent::Gossip {
            token: exec.hold_gossip(id),
            author,
            topic,
            data,
        },
        NetEvent::GossipSubscribed { peer, .. } => AgentEvent::Subscribed { peer },
        NetEvent::ExternalAddrs(a) => AgentEvent::ExternalAddrs(a),
        NetEvent::AutonatTested {
            server,
            addr,
            reachable,
            reason,
        } => AgentEvent::AutonatTested {
            server,
            addr,
            reachable,
            reason,
        },
        NetEvent::RelayReserved { relay, renewal } => AgentEvent::RelayReserved { relay, renewal },
        NetEvent::RelayClosed { relay, reason } => AgentEvent::RelayClosed { relay, reason },
        NetEvent::PathChanged { peer, remote } => AgentEvent::PathChanged { peer, remote },
        NetEvent::Rtt { peer, rtt } => AgentEvent::Rtt {
            peer,
            rtt_ms: rtt.as_millis() as u64,
        },
        NetEvent::HolePunch { peer, ok, reason } => AgentEvent::HolePunch { peer, ok, reason },
        // The network's events are non-exhaustive: one this build does not
        // know is told as what the agent can use of it, nothing.
        other => AgentEvent::Unknown(format!("{other:?}")),
    }
}

pub(super) fn mdns(ev: DiscoveryEvent) -> MdnsEvent {
    match ev {
        DiscoveryEvent::Discovered {
            instance,
            txt,
            addrs,
        } => MdnsEvent::Resolved {
            instance,
            txt,
            addrs,
        },
        DiscoveryEvent::Expired { instance } => MdnsEvent::Expired { instance },
    }
}

/// `first` and the API requests already waiting (up to `max`), as
/// requests for the agent; each one's reply channel waits in the executor.
/// A request answered before it reaches the agent (a read sent here by
/// mistake, a provision whose new home cannot be made) is not in the batch.
pub(super) fn api_batch(
    first: ApiRequest,
    rx: &mut mpsc::Receiver<ApiRequest>,
    max: usize,
    exec: &mut Executor,
) -> Vec<(RequestId, Request)> {
    let mut batch = Vec::new();
    let mut next = Some(first);
    while let Some(req) = next.take() {
        if let Some(r) = request(req, exec) {
            batch.push(r);
        }
        if batch.len() < max {
            next = rx.try_recv().ok();
        }
    }
    batch
}

fn request(req: ApiRequest, exec: &mut Executor) -> Option<(RequestId, Request)> {
    let replies = &mut exec.replies;
    let (id, r) = match req {
        ApiRequest::Status(tx) => (replies.wait(Waiting::Status(tx)), Request::Status),
        ApiRequest::Devices(tx) => (replies.wait(Waiting::Devices(tx)), Request::Devices),
        ApiRequest::Put(b, tx) => (replies.wait(Waiting::Put(tx)), Request::Put(b)),
        ApiRequest::Revoke(b, tx) => (replies.wait(Waiting::Revoke(tx)), Request::Revoke(b)),
        ApiRequest::Admin(c, tx) => (replies.wait(Waiting::Value(tx)), Request::Admin(c)),
        ApiRequest::Approve(b, tx) => (replies.wait(Waiting::Approve(tx)), Request::Approve(b)),
        ApiRequest::Tool(t, tx) => (replies.wait(Waiting::Value(tx)), Request::Tool(t)),
        ApiRequest::Batch(b, tx) => (replies.wait(Waiting::Batch(tx)), Request::Batch(b)),
        ApiRequest::App(a, tx) => (
            replies.wait(Waiting::Value(tx)),
            match a {
                crate::api::AppRequest::Grant(b) => Request::AppGrant(b),
                crate::api::AppRequest::Revoke(b) => Request::AppRevoke(b),
                crate::api::AppRequest::List => Request::AppList,
            },
        ),
        ApiRequest::Provision(body, tx) => {
            if let Err(e) = body.check() {
                let _ = tx.send(Err(e));
                return None;
            }
            let id = exec.replies.wait(Waiting::Value(tx));
            match exec.prepare_home(id, &body.out) {
                Ok(device) => (id, Request::Provision { body, device }),
                Err(e) => {
                    exec.replies.answer(id, Err(e));
                    return None;
                }
            }
        }
        // Reads have their own lane to the reader; the server never sends
        // them here.
        ApiRequest::Get(_, tx) => {
            let _ = tx.send(Err(misrouted()));
            return None;
        }
        ApiRequest::Export(_, tx) => {
            let _ = tx.send(Err(misrouted()));
            return None;
        }
    };
    Some((id, r))
}

fn misrouted() -> nuwa_agent::api::ApiError {
    nuwa_agent::api::ApiError::new(
        nuwa_agent::api::ErrorCode::Internal,
        "a read was routed to the daemon loop instead of the reader",
    )
}

/// `sync --once`'s progress line: redrawn in place on a terminal, one line
/// each otherwise.
pub(super) fn progress(line: &str, tty: bool) {
    if tty {
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[2K{line}");
        let _ = err.flush();
    } else {
        crate::logging::stderr_line(format_args!("{line}"));
    }
}

/// `sync --once` ended: says how (with the longest loop turn, which a
/// catch-up must not hold for long), with `--json` as one JSON document on
/// stdout whether it converged or not.
pub(super) fn finished(
    result: nuwa_agent::OnceResult,
    opts: &super::RunOptions,
    metrics: &Metrics,
) -> Result<(), nuwa_agent::once::Failed> {
    if opts.agent.once_tty {
        crate::logging::stderr_line(format_args!(""));
    }
    let (us, what) = metrics.loop_turn_longest();
    let peak_mb = super::exec::open::peak_rss_bytes().map(|b| b as f64 / 1e6);
    if opts.once_json {
        let mut v = serde_json::to_value(&result).unwrap_or_default();
        v["longest_loop_turn_ms"] = serde_json::json!(us as f64 / 1e3);
        v["peak_rss_mb"] = serde_json::json!(peak_mb);
        let _ = crate::client::print_json(&v);
    } else if result.converged {
        let longest = format!("longest loop turn {:.1} ms ({what})", us as f64 / 1e3);
        let peak = peak_mb.map_or(String::new(), |mb| format!("; peak RSS {mb:.1} MB"));
        crate::logging::stderr_line(format_args!("{}; {longest}{peak}", result.message));
    }
    result.into_result()
}

/// Whether stderr is a terminal (`sync --once` then redraws its line).
pub(crate) fn stderr_is_tty() -> bool {
    std::io::stderr().is_terminal()
}
