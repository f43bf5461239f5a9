//! Short-lived devices (`device provision --expires`) against the limits
//! of what a `Hello` and a DHT pointer carry (issue 24, done-when 5).
//!
//! Run with `-- --nocapture` to see the figures.

mod sim;

use nuwa_agent::api::{ProvisionBody, Request};
use nuwa_agent::count::Count;
use nuwa_agent::{Agent, Effect, Input, RequestId};
use nuwa_identity::chain::MAX_PROOF_BYTES;
use nuwa_identity::document::EXPIRY_GRACE_SECS;
use nuwa_identity::keys::DeviceKey;
use nuwa_sync::pointer::{AgentPointer, MAX_POINTER_BYTES};
use sim::{Knobs, Sim};

/// Ten minutes, the expiry of every CI device here.
const TEN_MIN_SECS: u64 = 600;

/// What the admin's proof costs now: the `did_proof` of its `Hello` and
/// its encoded DHT pointer, in bytes.
fn sizes(agent: &Agent, now_ms: u64) -> (usize, usize) {
    let m = agent.session().membership();
    let hello = m.hello(now_ms).expect("hello");
    let pointer = AgentPointer::new_signed(
        m.log(),
        m.context_id(),
        &agent.peer_id().to_string(),
        m.device(),
        (now_ms / 1000) as i64,
    )
    .and_then(|p| p.encode())
    .map(|b| b.len())
    .unwrap_or(usize::MAX);
    (hello.did_proof.len(), pointer)
}

/// Provisions one device expiring in `secs` on `agent`; whether it was
/// listed, and the devices pruned on the way.
fn provision(agent: &mut Agent, n: u64, secs: u64, now_ms: u64) -> (bool, u64) {
    let body = ProvisionBody {
        out: format!("/ci/job-{n}"),
        name: format!("ci-{n}"),
        expires_secs: Some(secs),
    };
    let device = DeviceKey::generate().expect("entropy");
    let id = RequestId(n);
    let effects = agent.handle(
        Input::Api(vec![(id, Request::Provision { body, device })]),
        now_ms,
    );
    let mut ok = false;
    let mut pruned = 0;
    for e in effects {
        match e {
            Effect::WriteHome { .. } => ok = true,
            Effect::Reply { result: Ok(_), .. } => ok = true,
            Effect::CountBy(Count::ExpiredDevicesPruned, k) => pruned += k,
            _ => {}
        }
    }
    (ok, pruned)
}

fn tick(agent: &mut Agent, now_ms: u64) -> u64 {
    agent
        .handle(Input::Tick { rss_bytes: None }, now_ms)
        .into_iter()
        .map(|e| match e {
            Effect::CountBy(Count::ExpiredDevicesPruned, k) => k,
            _ => 0,
        })
        .sum()
}

fn listed_devices(agent: &Agent) -> usize {
    agent
        .session()
        .log()
        .current()
        .verification_method
        .iter()
        .filter(|m| m.id.contains("#device-") && !m.id.ends_with("-x25519"))
        .count()
}

fn line(what: &str, agent: &Agent, now_ms: u64) -> (usize, usize) {
    let (proof, pointer) = sizes(agent, now_ms);
    println!(
        "  {what:<44} devices listed {:>4}   Hello did_proof {proof:>6} B   DHT pointer {pointer:>6} B",
        listed_devices(agent)
    );
    (proof, pointer)
}

// Goal: 1,000 CI devices that expire in 10 minutes keep the Hello's proof
// and the DHT pointer within their limits once they expired, and an
// expired device is refused and counted as expired. Method: the real
// `Agent` of an admin on a test clock; (1) a burst of 1,000 provisions
// inside 10 minutes (the document cannot hold them all: the rest are
// refused, never an oversize proof), then past the expiry, then the
// admin's prune; (2) 1,000 provisions over 10 hours, one every 36 s, with
// the admin ticking: every one is listed and the figures stay bounded;
// (3) in the seeded world, a device provisioned with a short expiry syncs,
// then its peer refuses it and counts it as expired.
#[test]
fn a_thousand_ci_devices_stay_within_the_hello_and_pointer_limits() {
    let _entropy = nuwa_entropy::deterministic_for_simulation(24);
    let mut s = Sim::new(24, 2, Knobs::default());
    s.start(0);
    let mut now = s.now_ms;
    let agent = s.devices[0].agent.as_mut().expect("admin runs");

    println!("burst: 1,000 provisions --expires 10m, one every 500 ms");
    let (mut listed, mut refused) = (0, 0);
    let mut peak = (0, 0);
    for n in 0..1_000 {
        now += 500;
        match provision(agent, n, TEN_MIN_SECS, now) {
            (true, _) => listed += 1,
            (false, _) => refused += 1,
        }
        let (p, q) = sizes(agent, now);
        peak = (peak.0.max(p), peak.1.max(q));
    }
    println!(
        "  {listed} listed, {refused} refused (the document is full), peak proof {} B, peak pointer {} B",
        peak.0, peak.1
    );
    assert!(
        peak.0 <= MAX_PROOF_BYTES && peak.1 <= MAX_POINTER_BYTES,
        "{peak:?}"
    );
    let before = line("before expiry:", agent, now);
    let past_ms = now + (TEN_MIN_SECS as i64 + EXPIRY_GRACE_SECS + 2) as u64 * 1000;
    // Past the expiry, before the admin's next tick: still listed, but
    // every device refuses them.
    let expired = line("after expiry (not pruned yet):", agent, past_ms);
    let pruned = tick(agent, past_ms);
    let after = line("after the admin's prune:", agent, past_ms);
    println!("  one prune removed {pruned} devices");
    assert_eq!(
        pruned, listed as u64,
        "every expired device is pruned at once"
    );
    assert_eq!(
        before, expired,
        "expiry alone changes no byte; the prune does"
    );
    assert!(after.0 < before.0 && after.1 < before.1);
    assert!(after.0 <= MAX_PROOF_BYTES && after.1 <= MAX_POINTER_BYTES);

    println!(
        "stream: 1,000 provisions --expires 10m, one every 36 s (10 hours), admin ticking every 10 s"
    );
    let mut now = past_ms;
    let (mut pruned, mut prunes) = (0, 0);
    let mut peak = (0, 0);
    for n in 1_000..2_000 {
        let (ok, p) = provision(agent, n, TEN_MIN_SECS, now);
        assert!(ok, "provision {n} was refused");
        pruned += p;
        prunes += u64::from(p > 0);
        // Largest right after a provision: a tick only ever prunes.
        let (a, b) = sizes(agent, now);
        peak = (peak.0.max(a), peak.1.max(b));
        for _ in 0..4 {
            now += 9_000;
            let p = tick(agent, now);
            pruned += p;
            prunes += u64::from(p > 0);
        }
    }
    println!(
        "  1000 listed, {pruned} pruned in {prunes} updates, peak proof {} B, peak pointer {} B",
        peak.0, peak.1
    );
    // The rate: 10 hours at most one prune per 10 minutes.
    assert!(prunes <= 61, "{prunes} prunes in 10 hours");
    assert!(
        peak.0 <= MAX_PROOF_BYTES && peak.1 <= MAX_POINTER_BYTES,
        "{peak:?}"
    );
    let before = line("last device provisioned, before expiry:", agent, now);
    let past_ms = now + (TEN_MIN_SECS as i64 + EXPIRY_GRACE_SECS + 2) as u64 * 1000;
    line("all expired, not pruned yet:", agent, past_ms);
    // The rate: at most one prune per 10 minutes unless near the limit.
    let mut t = past_ms;
    while listed_devices(agent) > 2 && t < past_ms + 11 * 60_000 {
        tick(agent, t);
        t += 10_000;
    }
    let after = line("after the admin's prune:", agent, t);
    assert_eq!(
        listed_devices(agent),
        2,
        "only the two devices that do not expire are left"
    );
    assert!(after.0 < before.0 && after.0 <= MAX_PROOF_BYTES && after.1 <= MAX_POINTER_BYTES);

    // (3) An expired device is refused, and counted as expired.
    drop(s);
    let _entropy = nuwa_entropy::deterministic_for_simulation(25);
    let quiet = Knobs {
        loss_per_mille: 0,
        ..Knobs::default()
    };
    let mut s = Sim::new(25, 1, quiet);
    s.start(0);
    s.run_for(500);
    s.provision_expiring(0, Some(5));
    s.run_for(100);
    assert_eq!(s.devices.len(), 2, "provisioned");
    s.start(1);
    s.write(1, "notes");
    let synced = |s: &Sim| {
        s.devices[0]
            .agent
            .as_ref()
            .is_some_and(|a| a.session().verified().count() == 1)
    };
    let deadline = s.now_ms + 10_000;
    while !synced(&s) && s.now_ms < deadline {
        s.run_for(100);
    }
    assert!(
        synced(&s),
        "the short-lived device syncs while its time runs"
    );
    s.run_for((5 + EXPIRY_GRACE_SECS as u64 + 5) * 1000);
    assert!(!synced(&s), "its peer no longer syncs with it");
    assert!(
        s.refused_expired.contains(&0),
        "the peer refused it and counted it as expired"
    );
    let refused = s.tally.get("expired refusals").copied().unwrap_or(0);
    println!(
        "expired device: refused {refused} time(s) by its peer, counted as peers_refused_expired"
    );
}

// Goal: only the document's first admin prunes at the rate; another admin
// prunes only devices the first left for an hour (it may be gone), so two
// admins do not fork the chain over one prune. Method: the master's home
// promotes d1, provisions a device expiring in 5 s and goes away; d1 ticks
// past the expiry, then an hour later (the clock jumps).
#[test]
fn a_second_admin_prunes_only_what_the_first_left_for_an_hour() {
    let _entropy = nuwa_entropy::deterministic_for_simulation(26);
    let quiet = Knobs {
        loss_per_mille: 0,
        ..Knobs::default()
    };
    let mut s = Sim::new(26, 2, quiet);
    s.start(0);
    s.start(1);
    s.run_for(2_000);
    s.promote(0, 1);
    s.provision_expiring(0, Some(5));
    s.run_for(3_000);
    let ci = s.devices[2].context_id();
    let lists = |s: &Sim| {
        let log = s.devices[1]
            .agent
            .as_ref()
            .expect("d1 runs")
            .session()
            .log();
        let doc = log.current();
        let admin = doc.key_id(&s.devices[1].context_id());
        assert!(doc.capability_delegation.contains(&admin), "d1 is an admin");
        doc.find_method(&ci).is_some()
    };
    assert!(lists(&s), "d1 holds the chain that lists the CI device");
    s.crash(0);
    s.run_for((5 + EXPIRY_GRACE_SECS as u64 + 5) * 1000);
    assert!(lists(&s), "the second admin leaves the prune to the first");
    s.now_ms += 3_600 * 1000;
    s.handle(1, Input::Tick { rss_bytes: None });
    assert!(!lists(&s), "an hour on, the second admin prunes");
}
