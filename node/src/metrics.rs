//! The daemon's metrics: one `prometheus-client` registry of typed
//! counters, gauges and histograms, exported as OpenMetrics text at
//! `GET /metrics` (token-protected like the rest of the API). `status`
//! reads the same registry, so the two never disagree.
//!
//! Every counted event of the shell is a variant of [`Event`]: adding one
//! is one line in its table (name, help). Rejections are counted by (source, reason)
//! and refused envelopes by reason, both as labelled families. The
//! network's counters are declared once, in `nuwa_net::NetCount`, kept by
//! `nuwa-net`, and registered here as a whole table (`TableCollector`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use nuwa_counters::{Counters, Table};
use nuwa_net::NetCount;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

nuwa_counters::table! {
    /// A counted event of the shell.
    pub enum Event {
        ContainersQuarantined => "containers_quarantined", "Containers moved aside at start because their records could not be read";
        ContainersLoaded => "containers_loaded", "Evicted containers loaded back into memory on use";
        ContainersLoadedOffLoop => "containers_loaded_off_loop", "Evicted containers that a peer's input needed, read back on a worker thread instead of the daemon loop (also counted in containers_loaded)";
        CompactionsOffLoop => "compactions_off_loop", "Containers compacted on a low-priority thread because their log weighed half their snapshot or more (the loop only copies the document)";
        CatchUpsOffLoop => "catch_ups_off_loop", "Big sync messages (a whole document, a long partition) applied on a worker thread instead of the daemon loop";
        ApiConnectionsEvicted => "api_connections_evicted", "Idle API connections closed to make room at the connection cap";
        ApiConnectionsRefused => "api_connections_refused", "API connections refused at the cap because every open one was busy";
        ApiConnectionsIdleClosed => "api_connections_idle_closed", "API connections closed after the idle timeout";
        ApiHeaderTimeouts => "api_header_timeouts", "API connections closed because a request's headers did not all arrive within the header-read timeout of its first byte";
        ApiSocketConnections => "api_socket_connections", "Connections accepted on the local API socket (HOME/api.sock) from the daemon's own user";
        ApiSocketRefused => "api_socket_refused", "Connections on the local API socket refused because the peer runs as another user";
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct RejectionLabels {
    source: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: String,
}

/// A counter table kept by another crate, read into every scrape: its
/// counters are exported under their table names and help, with values
/// read at the moment of the scrape (nothing is copied in between). They
/// read as zeros until the crate that counts hands over its set.
#[derive(Debug)]
struct TableCollector<T: Table>(Arc<OnceLock<Counters<T>>>);

impl<T: Table> TableCollector<T> {
    fn get(&self, counter: T) -> u64 {
        self.0.get().map_or(0, |c| c.get(counter))
    }
}

impl<T: Table> Collector for TableCollector<T> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        for counter in T::ALL {
            let value = ConstCounter::new(self.get(*counter));
            // `Registry::register` ends help with a period; so does this,
            // so that the text is the same whichever way a counter came in.
            let help = format!("{}.", counter.help());
            let metric =
                encoder.encode_descriptor(counter.name(), &help, None, value.metric_type())?;
            value.encode(metric)?;
        }
        Ok(())
    }
}

fn latency_histogram() -> Histogram {
    // 100 µs to ~13 s in factors of 2.
    Histogram::new(exponential_buckets(0.0001, 2.0, 18))
}

/// Registers one crate's counter table, each counter under its declared
/// name and help.
fn register_table<T: Table>(registry: &mut Registry) -> Vec<Counter> {
    T::ALL
        .iter()
        .map(|c| {
            let counter = Counter::default();
            registry.register(c.name(), c.help(), counter.clone());
            counter
        })
        .collect()
}

/// The registry and every metric in it.
pub struct Metrics {
    registry: Registry,
    counters: Vec<Counter>,
    /// The agent's table (`nuwa_agent::Count`) and the sync session's
    /// (`nuwa_agent::sync::Count`), in their declaration order.
    agent: Vec<Counter>,
    sync: Vec<Counter>,
    rejections: Family<RejectionLabels, Counter>,
    envelopes_rejected: Family<ReasonLabels, Counter>,
    /// Label sets seen so far (families cannot be iterated), for `status`.
    seen: Mutex<(
        std::collections::BTreeSet<RejectionLabels>,
        std::collections::BTreeSet<String>,
    )>,
    write_ack: Histogram,
    propagation_apply: Histogram,
    /// How long turns of the daemon loop held it.
    turns: Turns,
    api_requests: Family<RouteLabels, Histogram>,
    api_errors: Family<CodeLabels, Counter>,
    /// What the daemon holds now, set every tick.
    pub gauges: Gauges,
    /// The network's own counters (set once the swarm runs), read by the
    /// registry's collector and by `counters`.
    net: Arc<OnceLock<Counters<NetCount>>>,
}

/// Turns of the daemon loop: their durations, and the longest so far.
struct Turns {
    histogram: Histogram,
    /// Longest loop turn since start, in microseconds.
    longest_us: Gauge,
    /// What the longest loop turn handled.
    longest_what: Mutex<&'static str>,
}

/// What the daemon holds now.
pub struct Gauges {
    pub peers_verified: Gauge,
    pub containers: Gauge,
    pub envelopes_held: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("nuwa");
        let counters = register_table::<Event>(&mut registry);
        let agent = register_table::<nuwa_agent::Count>(&mut registry);
        let sync = register_table::<nuwa_agent::sync::Count>(&mut registry);
        let net = Arc::new(OnceLock::new());
        registry.register_collector(Box::new(TableCollector::<NetCount>(net.clone())));
        let rejections = Family::<RejectionLabels, Counter>::default();
        registry.register(
            "rejections",
            "Refused claims by where they came from (connection, gossip, mdns, dht, rendezvous) and why",
            rejections.clone(),
        );
        let envelopes_rejected = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "envelopes_rejected",
            "Envelopes that did not open, by reason",
            envelopes_rejected.clone(),
        );
        let write_ack = latency_histogram();
        registry.register(
            "write_ack_seconds",
            "From the daemon taking a write to acknowledging it durable",
            write_ack.clone(),
        );
        let propagation_apply = latency_histogram();
        registry.register(
            "propagation_apply_seconds",
            "From a peer sealing changes (its clock) to their being durable here",
            propagation_apply.clone(),
        );
        let loop_turn = latency_histogram();
        registry.register(
            "loop_turn_seconds",
            "How long one turn of the daemon loop held it (no other input is taken meanwhile)",
            loop_turn.clone(),
        );
        let loop_turn_longest_us = Gauge::default();
        registry.register(
            "loop_turn_longest_us",
            "The longest turn of the daemon loop since start, in microseconds",
            loop_turn_longest_us.clone(),
        );
        let api_requests =
            Family::<RouteLabels, Histogram>::new_with_constructor(latency_histogram as fn() -> _);
        registry.register(
            "api_request_seconds",
            "Local API request latency by route",
            api_requests.clone(),
        );
        let api_errors = Family::<CodeLabels, Counter>::default();
        registry.register(
            "api_errors",
            "Local API requests answered with an error, by code",
            api_errors.clone(),
        );
        let peers_verified = Gauge::default();
        // Not `peers_verified`: that is the session's counter of
        // verifications, and one name may name one family only.
        registry.register(
            "verified_peers",
            "Verified peers now",
            peers_verified.clone(),
        );
        let containers = Gauge::default();
        registry.register("containers", "Containers held", containers.clone());
        let envelopes_held = Gauge::default();
        registry.register(
            "envelopes_held",
            "Envelopes waiting for their epoch's grant",
            envelopes_held.clone(),
        );
        Metrics {
            registry,
            counters,
            agent,
            sync,
            rejections,
            envelopes_rejected,
            seen: Mutex::new(Default::default()),
            write_ack,
            propagation_apply,
            turns: Turns {
                histogram: loop_turn,
                longest_us: loop_turn_longest_us,
                longest_what: Mutex::new("nothing yet"),
            },
            api_requests,
            api_errors,
            gauges: Gauges {
                peers_verified,
                containers,
                envelopes_held,
            },
            net,
        }
    }

    pub fn inc(&self, e: Event) {
        self.add(e, 1);
    }

    pub fn add(&self, e: Event, n: u64) {
        if let Some(c) = self.counters.get(e.index()) {
            c.inc_by(n);
        }
    }

    pub fn get(&self, e: Event) -> u64 {
        self.counters.get(e.index()).map(Counter::get).unwrap_or(0)
    }

    /// Counts `n` of an agent counter.
    pub fn agent(&self, c: nuwa_agent::Count, n: u64) {
        if let Some(counter) = self.agent.get(c.index()) {
            counter.inc_by(n);
        }
    }

    /// Counts one of a sync session counter.
    pub fn sync(&self, c: nuwa_agent::sync::Count) {
        if let Some(counter) = self.sync.get(c.index()) {
            counter.inc();
        }
    }

    pub fn rejected(&self, source: &str, reason: &str) {
        let labels = RejectionLabels {
            source: source.to_owned(),
            reason: reason.to_owned(),
        };
        self.rejections.get_or_create(&labels).inc();
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.0.insert(labels);
    }

    pub fn envelope_rejected(&self, reason: &str) {
        let labels = ReasonLabels {
            reason: reason.to_owned(),
        };
        self.envelopes_rejected.get_or_create(&labels).inc();
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.1.insert(reason.to_owned());
    }

    /// One API request answered with error `code` (a wire name).
    pub fn api_error(&self, code: &'static str) {
        self.api_errors.get_or_create(&CodeLabels { code }).inc();
    }

    pub fn observe_write_ack(&self, d: Duration) {
        self.write_ack.observe(d.as_secs_f64());
    }

    /// One turn of the daemon loop, handling `what`, took `d`.
    pub fn observe_loop_turn(&self, what: &'static str, d: Duration) {
        self.turns.histogram.observe(d.as_secs_f64());
        let us = i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        if us > self.turns.longest_us.get() {
            self.turns.longest_us.set(us);
            *self
                .turns
                .longest_what
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = what;
        }
    }

    /// The longest loop turn since start, in microseconds, and what it
    /// handled.
    pub fn loop_turn_longest(&self) -> (i64, &'static str) {
        let what = *self
            .turns
            .longest_what
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        (self.turns.longest_us.get(), what)
    }

    pub fn observe_propagation_apply(&self, d: Duration) {
        self.propagation_apply.observe(d.as_secs_f64());
    }

    pub fn observe_api_request(&self, route: &str, d: Duration) {
        self.api_requests
            .get_or_create(&RouteLabels {
                route: route.to_owned(),
            })
            .observe(d.as_secs_f64());
    }

    /// Reads the network's counters from `net` from now on.
    pub fn watch_net(&self, net: nuwa_net::NetHandle) {
        let _ = self.net.set(net.counters());
    }

    /// Every non-zero counter by its `status` name: events and the
    /// network's counters by name, rejections as
    /// `rejected_<source>_<reason>`, refused envelopes as
    /// `envelope_rejected_<reason>`.
    pub fn counters(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for e in Event::ALL {
            let v = self.get(*e);
            if v > 0 {
                out.insert(e.name().to_owned(), v);
            }
        }
        let tables = nuwa_agent::Count::ALL
            .iter()
            .map(|c| c.name())
            .zip(&self.agent)
            .chain(
                nuwa_agent::sync::Count::ALL
                    .iter()
                    .map(|c| c.name())
                    .zip(&self.sync),
            );
        for (name, counter) in tables {
            if counter.get() > 0 {
                out.insert(name.to_owned(), counter.get());
            }
        }
        if let Some(net) = self.net.get() {
            out.extend(
                net.values()
                    .filter(|(_, v)| *v > 0)
                    .map(|(name, v)| (name.to_owned(), v)),
            );
        }
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        for l in &seen.0 {
            let v = self.rejections.get_or_create(l).get();
            out.insert(format!("rejected_{}_{}", l.source, l.reason), v);
        }
        for r in &seen.1 {
            let v = self
                .envelopes_rejected
                .get_or_create(&ReasonLabels { reason: r.clone() })
                .get();
            out.insert(format!("envelope_rejected_{r}"), v);
        }
        out
    }

    /// The registry as OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Times one turn of the daemon loop: records it in the metrics when
/// dropped at the end of the turn.
pub struct TurnTimer<'a> {
    metrics: &'a Metrics,
    what: &'static str,
    started: std::time::Instant,
}

impl<'a> TurnTimer<'a> {
    /// Starts timing a turn that handles `what` (for `status`).
    pub fn start(metrics: &'a Metrics, what: &'static str) -> Self {
        TurnTimer {
            metrics,
            what,
            started: std::time::Instant::now(),
        }
    }
}

/// A turn this long is logged (at debug: it names what held the loop).
const LONG_TURN: Duration = Duration::from_millis(50);

impl Drop for TurnTimer<'_> {
    fn drop(&mut self) {
        let took = self.started.elapsed();
        if took >= LONG_TURN {
            tracing::debug!(
                what = self.what,
                ms = took.as_millis() as u64,
                "long loop turn"
            );
        }
        self.metrics.observe_loop_turn(self.what, took);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: every metric family has its own name (OpenMetrics requires
    /// it; one name used by a counter and a gauge is two families), and
    /// every counter of every table is exported under its declared name
    /// and help.
    #[test]
    fn every_family_is_named_once_and_every_table_is_exported() {
        fn exported<T: Table>(text: &str) {
            for c in T::ALL {
                let help = format!("# HELP nuwa_{} {}.\n", c.name(), c.help());
                assert!(text.contains(&help), "missing {help:?}");
            }
        }
        let text = Metrics::new().encode();
        let mut families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        let all = families.len();
        families.sort_unstable();
        families.dedup();
        assert_eq!(families.len(), all, "a family name is used twice: {text}");
        exported::<Event>(&text);
        exported::<nuwa_agent::Count>(&text);
        exported::<nuwa_agent::sync::Count>(&text);
        exported::<NetCount>(&text);
    }

    /// Goal: the export is OpenMetrics a Prometheus parser reads, and it
    /// agrees with what `status` shows. Method: count a few events, parse
    /// the text with `prometheus-parse`, compare.
    #[test]
    fn export_parses_and_agrees_with_status() {
        let m = Metrics::new();
        m.sync(nuwa_agent::sync::Count::PeersVerified);
        m.agent(nuwa_agent::Count::BytesSent, 1234);
        m.rejected("connection", "unknown_key");
        m.rejected("connection", "unknown_key");
        m.envelope_rejected("replay");
        m.observe_write_ack(Duration::from_millis(3));
        m.observe_api_request("/v1/state/put", Duration::from_millis(5));
        let text = m.encode();
        assert!(
            text.ends_with("# EOF\n"),
            "OpenMetrics ends with EOF: {text}"
        );
        let lines = text.lines().map(|l| Ok(l.to_owned()));
        let scrape = prometheus_parse::Scrape::parse(lines).expect("parses");
        let value = |name: &str, label: Option<(&str, &str)>| {
            scrape
                .samples
                .iter()
                .find(|s| s.metric == name && label.is_none_or(|(k, v)| s.labels.get(k) == Some(v)))
                .map(|s| match s.value {
                    prometheus_parse::Value::Counter(v)
                    | prometheus_parse::Value::Gauge(v)
                    | prometheus_parse::Value::Untyped(v) => v,
                    _ => f64::NAN,
                })
        };
        assert_eq!(value("nuwa_peers_verified_total", None), Some(1.0));
        assert_eq!(value("nuwa_bytes_sent_total", None), Some(1234.0));
        assert_eq!(
            value("nuwa_rejections_total", Some(("reason", "unknown_key"))),
            Some(2.0)
        );
        assert!(
            scrape
                .samples
                .iter()
                .any(|s| s.metric.starts_with("nuwa_write_ack_seconds")),
            "histogram exported"
        );
        let status = m.counters();
        assert_eq!(status["peers_verified"], 1);
        assert_eq!(status["bytes_sent"], 1234);
        assert_eq!(status["rejected_connection_unknown_key"], 2);
        assert_eq!(status["envelope_rejected_replay"], 1);
    }

    /// Goal: the network's counters reach `/metrics` and `status` under the
    /// names and help of `nuwa_net::NetCount`'s table, with the values the
    /// network holds at the moment of reading, and a table that is not
    /// watched yet reads as zeros. Method: a detached network handle; count
    /// through its shared counters, then read both views.
    #[tokio::test]
    async fn net_counters_are_registered_by_table() {
        let m = Metrics::new();
        let before = m.encode();
        for c in NetCount::ALL {
            assert!(
                before.contains(&format!("# HELP nuwa_{} {}.\n", c.name(), c.help())),
                "{c:?} described: {before}"
            );
            assert!(before.contains(&format!("# TYPE nuwa_{} counter\n", c.name())));
            assert!(before.contains(&format!("nuwa_{}_total 0\n", c.name())));
        }
        let peer = nuwa_net::PeerId::random();
        let net = nuwa_net::NetHandle::detached(peer);
        m.watch_net(net.clone());
        net.counters().add(NetCount::BytesSentRelayed, 4096);
        net.counters().inc(NetCount::HolePunchesOk);
        let text = m.encode();
        assert!(
            text.contains("nuwa_bytes_sent_relayed_total 4096\n"),
            "{text}"
        );
        assert!(text.contains("nuwa_hole_punches_ok_total 1\n"), "{text}");
        let status = m.counters();
        assert_eq!(status["bytes_sent_relayed"], 4096);
        assert_eq!(status["hole_punches_ok"], 1);
        assert!(
            !status.contains_key("hole_punches_failed"),
            "zero counters stay out of status"
        );
    }
}
