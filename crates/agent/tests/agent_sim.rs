//! Goal: whole agents keep their membership and sync promises through
//! what real life does to them. Method: a seeded world (`sim/`) of 3 to 6
//! devices running the real `Agent` over a lossy, delayed, partitioned
//! in-memory network, with crashes and restarts (some inside a handle
//! that sent its changes before they were durable), writes, pairing,
//! provisioning, promotion, revocation (with devices offline), key
//! rotation, recovery by words with a handover, a keeper between devices
//! never online together, homes copied while running and restored later
//! (used offline before they meet a peer), a revoked device handing its
//! stale chain to a recovering home, short-lived devices that expire
//! (`--expires`) and are pruned, and mDNS-style discovery. Checked after
//! every step: a revoked (or expired) device never holds a key sealed
//! after its revocation from a device that had heard of it, no device
//! holds an expired device as a verified peer, and no device lists again
//! a device its chain removed.
//! Checked at the end, once the world healed: every acknowledged write of
//! a device never revoked is on every device never revoked, all of them
//! end on one DID chain head, and none lists a revoked device.
//!
//! `AGENT_SIM_SEEDS=N` runs N seeds (default 200); `SEED=s` replays one
//! seed and prints its trace.

mod sim;

use sim::{Knobs, Sim};

const CONTAINERS: [&str; 3] = ["notes", "tasks", "memory"];

fn seeds() -> Vec<u64> {
    if let Ok(s) = std::env::var("SEED") {
        return vec![s.parse().expect("SEED is a number")];
    }
    let n: u64 = std::env::var("AGENT_SIM_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let first: u64 = std::env::var("AGENT_SIM_FIRST")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (first..first + n).collect()
}

/// The running devices that are not gone.
fn live(s: &Sim) -> Vec<usize> {
    (0..s.devices.len())
        .filter(|&i| s.devices[i].running() && !s.devices[i].gone)
        .collect()
}

fn pick(s: &mut Sim, from: &[usize]) -> Option<usize> {
    if from.is_empty() {
        None
    } else {
        Some(from[s.rng.usize(0..from.len())])
    }
}

/// The device that signs membership changes now (the one holding admin
/// rights that the scenario uses: the master's home, then whoever
/// recovered).
struct Roles {
    admin: usize,
    recovered: bool,
    revocations: usize,
    rotations: usize,
}

fn admin_up(s: &Sim, r: &Roles) -> bool {
    s.devices[r.admin].running() && !s.devices[r.admin].gone
}

/// One random phase of the scenario.
fn phase(s: &mut Sim, r: &mut Roles) {
    let roll = s.rng.u32(0..100);
    let up = live(s);
    match roll {
        0..=29 => {
            let n = 1 + s.rng.usize(0..4);
            for _ in 0..n {
                if let Some(i) = pick(s, &up) {
                    let c = CONTAINERS[s.rng.usize(0..CONTAINERS.len())];
                    s.write(i, c);
                }
            }
        }
        30..=54 => {
            let ms = 100 + s.rng.u64(0..3_000);
            s.run_for(ms);
        }
        55..=61 => {
            // A crash of anyone but the admin (whose loss is recovery's).
            let others: Vec<usize> = up.iter().copied().filter(|&i| i != r.admin).collect();
            if let Some(i) = pick(s, &others) {
                // Or inside a handle that sent its changes before they
                // were durable.
                if s.rng.bool() {
                    s.crash(i);
                } else {
                    s.tear(i);
                }
            }
        }
        62..=71 => {
            let down: Vec<usize> = (0..s.devices.len())
                .filter(|&i| !s.devices[i].running() && !s.devices[i].gone)
                .filter(|&i| s.devices[i].joining.is_none() && s.devices[i].disk.is_some())
                .collect();
            if let Some(i) = pick(s, &down) {
                s.start(i);
            }
        }
        72..=76 => {
            if let Some(i) = pick(s, &up) {
                let lan = s.rng.usize(0..2);
                s.move_to(i, lan);
            }
        }
        77..=80 => {
            for i in 0..s.devices.len() {
                s.move_to(i, 0);
            }
        }
        81 => partitioned_revocations(s, r),
        82..=83 => revoke_one(s, r),
        84..=86 => {
            let others: Vec<usize> = up.iter().copied().filter(|&i| i != r.admin).collect();
            if let (true, Some(i)) = (admin_up(s, r), pick(s, &others)) {
                s.promote(r.admin, i);
            }
        }
        87..=89 => {
            if admin_up(s, r) && s.devices.len() < 8 {
                s.provision(r.admin);
            }
        }
        90..=92 => {
            if admin_up(s, r) && s.devices.len() < 8 {
                let lan = s.devices[r.admin].lan;
                s.pair(r.admin, lan, None);
                s.run_for(3_000);
            }
        }
        93..=94 => rotate_admin(s, r),
        95 => back_up(s, r),
        96..=97 => restore(s, r),
        98 => recover(s, r),
        _ => stale_handover(s, r),
    }
}

/// A home other than the admin's is copied while its daemon runs (a
/// backup, or a new laptop cloned from the old one).
fn back_up(s: &mut Sim, r: &Roles) {
    let candidates: Vec<usize> = live(s)
        .into_iter()
        .filter(|&i| i != r.admin && !s.backups.contains_key(&i))
        .collect();
    if let Some(i) = pick(s, &candidates) {
        s.back_up(i);
    }
}

/// A device is restored from its copy and used before it meets any peer
/// (on a network of its own), then comes back: what it wrote before and
/// after must reach everyone, and what its peers hold must reach it.
fn restore(s: &mut Sim, r: &Roles) {
    let candidates: Vec<usize> = s
        .backups
        .keys()
        .copied()
        .filter(|&i| i != r.admin && !s.devices[i].gone && s.devices[i].joining.is_none())
        .collect();
    let Some(i) = pick(s, &candidates) else {
        return;
    };
    if !s.restore(i) {
        return;
    }
    s.move_to(i, 2);
    s.start(i);
    for _ in 0..1 + s.rng.usize(0..4) {
        let c = CONTAINERS[s.rng.usize(0..CONTAINERS.len())];
        s.write(i, c);
    }
    let ms = 200 + s.rng.u64(0..2_000);
    s.run_for(ms);
    s.move_to(i, 0);
}

/// The admin revokes a device that is not itself (the target may be
/// offline: it learns when it next meets a peer).
fn revoke_one(s: &mut Sim, r: &mut Roles) {
    if !admin_up(s, r) || r.revocations >= 2 {
        return;
    }
    let candidates: Vec<usize> = (0..s.devices.len())
        .filter(|&i| i != r.admin && !s.devices[i].gone && s.devices[i].disk.is_some())
        .filter(|&i| s.devices[i].joining.is_none())
        .collect();
    let Some(target) = pick(s, &candidates) else {
        return;
    };
    let id = s.revoke(r.admin, target);
    s.run_for(200);
    if s.note_revocation(r.admin, id, target) {
        r.revocations += 1;
    }
}

/// Whether device `i`'s own chain makes it an admin.
fn is_admin(s: &Sim, i: usize) -> bool {
    let ctx = s.devices[i].context_id();
    s.devices[i].agent.as_ref().is_some_and(|a| {
        a.session()
            .log()
            .current()
            .capability_delegation
            .iter()
            .any(|id| nuwa_identity::document::DidDocument::fragment(id) == ctx)
    })
}

/// Two admins revoke different devices while partitioned (issue 24): the
/// admin promotes a second device, the two end up on networks of their
/// own with one other device each, each revokes that device, both write,
/// and the world heals. Both revocations must stand on every device (the
/// end checks), no device that heard of a revocation seals a key to the
/// revoked device (checked after every step), and the live devices end
/// on one key epoch.
fn partitioned_revocations(s: &mut Sim, r: &mut Roles) {
    if !admin_up(s, r) || r.revocations > 0 || r.recovered {
        return;
    }
    let mut others: Vec<usize> = live(s)
        .into_iter()
        .filter(|&i| i != r.admin && s.devices[i].joining.is_none())
        .collect();
    if others.len() < 3 {
        return;
    }
    s.heal(5_000);
    let a2 = others.remove(s.rng.usize(0..others.len()));
    let v1 = others.remove(s.rng.usize(0..others.len()));
    let v2 = others.remove(s.rng.usize(0..others.len()));
    s.promote(r.admin, a2);
    s.run_for(3_000);
    if !is_admin(s, a2) || !s.devices[v1].running() || !s.devices[v2].running() {
        return;
    }
    for (i, lan) in [(r.admin, 1), (v1, 1), (a2, 2), (v2, 2)] {
        s.move_to(i, lan);
    }
    s.run_for(500);
    let id1 = s.revoke(r.admin, v1);
    let id2 = s.revoke(a2, v2);
    s.run_for(1_000);
    let first = s.note_revocation(r.admin, id1, v1);
    let second = s.note_revocation(a2, id2, v2);
    r.revocations += usize::from(first) + usize::from(second);
    s.write(r.admin, "notes");
    s.write(a2, "notes");
    s.run_for(1_000);
    s.heal(20_000);
    if first && second {
        s.count("partitioned revocations");
    }
}

/// The admin's own key is replaced (`device rotate` on its stopped home):
/// a new key, the same store, a new key epoch.
fn rotate_admin(s: &mut Sim, r: &mut Roles) {
    if !admin_up(s, r) || r.rotations >= 1 || r.recovered {
        return;
    }
    let a = r.admin;
    s.crash(a);
    let now_secs = (s.now_ms / 1000) as i64;
    let new = nuwa_identity::keys::DeviceKey::generate().expect("entropy");
    let d = &mut s.devices[a];
    let disk = d.disk.as_mut().expect("admin home");
    let device = nuwa_identity::keys::DeviceKey::from_seed(&disk.device_seed);
    let master = disk
        .master_seed
        .map(|m| nuwa_identity::keys::DeviceKey::from_seed(&m));
    let admin = nuwa_agent::lifecycle::admin_of(&disk.log, &device, master.as_ref(), now_secs)
        .expect("the admin's home holds an admin key");
    let rot = nuwa_agent::lifecycle::rotate(&disk.log, &disk.keys, &admin, &device, &new, now_secs)
        .expect("rotation");
    disk.log = rot.log;
    disk.keys = rot.keys;
    disk.grant = Some(rot.grant);
    disk.device_seed = *new.seed();
    d.peer = nuwa_agent::peer::id_of(&new.public()).expect("valid key");
    d.key = new;
    r.rotations += 1;
    s.note(format!("d{a} rotated its key"));
    s.start(a);
}

/// Every admin device is lost; a fresh device recovers the agent with the
/// words, handed the chain and keys by a surviving device. Done once, on a
/// world that has settled (a stale one is `stale_handover`).
fn recover(s: &mut Sim, r: &mut Roles) {
    if r.recovered || !admin_up(s, r) {
        return;
    }
    s.heal(20_000);
    let survivors: Vec<usize> = live(s).into_iter().filter(|&i| i != r.admin).collect();
    let Some(helper) = pick(s, &survivors) else {
        return;
    };
    let lost = r.admin;
    let lost_ctx = s.devices[lost].context_id();
    s.crash(lost);
    s.devices[lost].gone = true;
    s.note(format!("d{lost} (the admin) is lost; recovering by words"));
    let next = nuwa_identity::keys::DeviceKey::generate().expect("entropy");
    let join = nuwa_agent::join::RecoveryJoin {
        key: nuwa_identity::keys::DeviceKey::from_seed(&s.recovery.seed()),
        lost: Some(vec![lost_ctx]),
        next_public: next.public(),
    };
    let lan = s.devices[helper].lan;
    let j = s.pair(helper, lan, Some(join));
    s.run_for(5_000);
    if s.devices[j].running() {
        r.admin = j;
        r.recovered = true;
        s.recovery = next;
    }
}

/// The attack of issue 24 (strong removal): a device is revoked while it
/// is offline, so its home still holds the chain from before; the admin
/// writes after the revocation; every admin device is then lost, and the
/// revoked device, on a network of its own, hands its stale chain to a
/// fresh home recovering with the words. The recovery branch wins the
/// fork rule, but once the world heals the revoked device must be out on
/// every device (and in the recovered chain itself), and it never holds a
/// key but the recovery's own: what the recovering home sealed before
/// anyone could tell it.
fn stale_handover(s: &mut Sim, r: &mut Roles) {
    if r.recovered || !admin_up(s, r) || r.revocations >= 2 {
        return;
    }
    let candidates: Vec<usize> = (0..s.devices.len())
        .filter(|&i| i != r.admin && !s.devices[i].gone && s.devices[i].disk.is_some())
        .filter(|&i| s.devices[i].joining.is_none())
        .collect();
    let Some(v) = pick(s, &candidates) else {
        return;
    };
    s.crash(v);
    s.note(format!("d{v} goes offline with its chain"));
    let id = s.revoke(r.admin, v);
    s.run_for(200);
    if !s.note_revocation(r.admin, id, v) || !s.revoked.contains_key(&s.devices[v].context_id()) {
        return;
    }
    r.revocations += 1;
    for _ in 0..2 {
        s.write(r.admin, "notes");
    }
    // The others hear of it (a revocation only the lost admin held died
    // with it: nothing could bring it back).
    s.heal(5_000);
    let v_ctx = s.devices[v].context_id();
    let stale_listed: Vec<String> = s.devices[v]
        .disk
        .as_ref()
        .map(|d| {
            d.log
                .current()
                .verification_method
                .iter()
                .map(|m| nuwa_identity::document::DidDocument::fragment(&m.id).to_owned())
                .collect()
        })
        .unwrap_or_default();
    // A witness that stays a member: one added after the stale chain is
    // out once the recovery wins, and may never run again. It heard of the
    // revocation when its chain once listed the device and no longer does
    // (a home restored from a copy taken before the device was added
    // lists it nowhere without having heard anything: seed 4108).
    let witnesses: Vec<usize> = live(s)
        .into_iter()
        .filter(|&i| {
            i != r.admin
                && stale_listed.contains(&s.devices[i].context_id())
                && s.devices[i].agent.as_ref().is_some_and(|a| {
                    let log = a.session().log();
                    log.current().find_method(&v_ctx).is_none()
                        && log.documents().any(|d| d.find_method(&v_ctx).is_some())
                })
        })
        .collect();
    s.witnesses.insert(v_ctx.clone(), witnesses.clone());
    if witnesses.is_empty() {
        // Only the admin holds the revocation: losing it would lose the
        // revocation with it, which no rule can bring back.
        return;
    }
    let lost = r.admin;
    let lost_ctx = s.devices[lost].context_id();
    s.crash(lost);
    s.devices[lost].gone = true;
    s.note(format!(
        "d{lost} (the admin) is lost; revoked d{v} hands its stale chain to a recovering home"
    ));
    s.move_to(v, 3);
    s.devices[v].gone = false;
    s.start(v);
    s.devices[v].gone = true;
    let next = nuwa_identity::keys::DeviceKey::generate().expect("entropy");
    let join = nuwa_agent::join::RecoveryJoin {
        key: nuwa_identity::keys::DeviceKey::from_seed(&s.recovery.seed()),
        lost: Some(vec![lost_ctx]),
        next_public: next.public(),
    };
    let j = s.pair(v, 3, Some(join));
    s.run_for(5_000);
    if !s.devices[j].running() {
        return;
    }
    // Devices added after the handing device's chain was current are on
    // the branch the recovery replaces: additions are not carried over
    // (only removals are), so they are out until paired again.
    for i in 0..s.devices.len() {
        if i != v
            && i != j
            && !s.devices[i].gone
            && !stale_listed.contains(&s.devices[i].context_id())
        {
            s.devices[i].gone = true;
            s.note(format!(
                "d{i} was added on the branch the recovery replaces"
            ));
        }
    }
    r.admin = j;
    r.recovered = true;
    s.recovery = next;
    s.count("stale handovers");
    // The pair meets the rest of the world after a while.
    let ms = s.rng.u64(0..3_000);
    s.run_for(ms);
    s.move_to(v, 0);
    s.move_to(j, 0);
}

/// A short-lived device (a CI job, `device provision --expires`): it
/// syncs while its time runs; then every peer refuses it with no
/// revocation (checked after every step: no device holds it as a verified
/// peer), no epoch opened since reaches it, and the admin prunes it from
/// the chain with a new key epoch. From its expiry on the invariants
/// treat it as revoked.
fn expiry(s: &mut Sim, r: &mut Roles) {
    if !admin_up(s, r) || s.devices.len() >= 8 {
        return;
    }
    let secs = 3 + s.rng.u64(0..10);
    let n = s.devices.len();
    // Provisioned, or paired (`pair --expires` and `approve --expires`:
    // the shorter wins).
    let want = if s.rng.bool() {
        s.provision_expiring(r.admin, Some(secs));
        s.run_for(100);
        if s.devices.len() == n {
            return;
        }
        s.start(n);
        secs
    } else {
        let other = [None, Some(2 + s.rng.u64(0..12))][s.rng.usize(0..2)];
        let (joiner, approver) = if s.rng.bool() {
            (Some(secs), other)
        } else {
            (other, Some(secs))
        };
        let lan = s.devices[r.admin].lan;
        s.pair_expiring(r.admin, lan, None, (joiner, approver));
        s.run_for(3_000);
        if !s.devices[n].running() {
            return;
        }
        joiner.into_iter().chain(approver).min().unwrap_or(secs)
    };
    let ctx = s.devices[n].context_id();
    let listed = s.devices[r.admin]
        .agent
        .as_ref()
        .and_then(|a| a.session().log().current().find_method(&ctx).cloned());
    let Some(expires) = listed.and_then(|m| m.expires_unix_secs().ok().flatten()) else {
        return;
    };
    let added = (s.now_ms / 1000) as i64;
    assert!(
        (added - 4..=added).contains(&(expires - want as i64)),
        "seed {}: {ctx} expires at {expires}, {want} s after it was added (by {added})",
        s.seed
    );
    let grace = nuwa_identity::document::EXPIRY_GRACE_SECS;
    // Refused from the first second past expiry and grace; a step more
    // for the peers' next tick.
    let refused_ms = (expires + grace + 2) as u64 * 1000;
    s.expiring.insert(ctx.clone(), refused_ms);
    for _ in 0..2 {
        s.write(n, "notes");
    }
    s.run_for(2_000);
    s.run_for(refused_ms.saturating_sub(s.now_ms));
    s.count("expiries");
    // The first admin prunes at once (its first prune); one that
    // recovered waits for the first admin an hour, beyond this run.
    if r.recovered {
        return;
    }
    let deadline = s.now_ms + 10_000;
    let listed = |s: &Sim| {
        s.devices[r.admin].agent.as_ref().is_some_and(|a| {
            a.session()
                .log()
                .chain_document()
                .find_method(&ctx)
                .is_some()
        })
    };
    while listed(s) && s.now_ms < deadline && admin_up(s, r) {
        s.run_for(200);
    }
    if admin_up(s, r) {
        assert!(
            !listed(s),
            "seed {}: the admin did not prune expired {ctx} within 10 s\n{}",
            s.seed,
            s.trace_tail()
        );
        s.count("expiry prunes");
    }
}

/// Two devices never online together meet only through the keeper.
fn keeper_handoff(s: &mut Sim) {
    let (a, b) = (1, 2);
    s.crash(b);
    for _ in 0..5 {
        s.write(a, "notes");
    }
    s.run_for(4_000);
    s.crash(a);
    s.start(b);
    s.run_for(6_000);
    s.start(a);
}

/// A device that meets the others only through the keeper across a key
/// epoch change (issue 24): it is away while the admin revokes another
/// device and writes under the new epoch; back on a network of its own,
/// with only the keeper, it must read every one of those writes (the
/// keeper serves the chain and the grant), while the revoked device holds
/// no key of the new epoch (checked after every step).
fn keeper_across_epoch(s: &mut Sim, r: &mut Roles) {
    if !s.has_keeper() || !admin_up(s, r) || r.revocations >= 2 {
        return;
    }
    let others: Vec<usize> = live(s).into_iter().filter(|&i| i != r.admin).collect();
    let Some(b) = pick(s, &others) else { return };
    let victims: Vec<usize> = others.into_iter().filter(|&i| i != b).collect();
    let Some(v) = pick(s, &victims) else { return };
    s.heal(5_000);
    s.crash(b);
    s.note(format!("d{b} goes away; it will meet only the keeper"));
    let id = s.revoke(r.admin, v);
    s.run_for(500);
    if !s.note_revocation(r.admin, id, v) || !s.revoked.contains_key(&s.devices[v].context_id()) {
        return;
    }
    r.revocations += 1;
    let from = s.acked.len();
    for _ in 0..3 {
        s.write(r.admin, "notes");
    }
    s.run_for(6_000);
    let writes: Vec<_> = s.acked[from..]
        .iter()
        .filter(|w| w.device == r.admin)
        .cloned()
        .collect();
    s.move_to(b, 4);
    s.start(b);
    s.run_for(8_000);
    let lacking = s.first_lacking(b, &writes);
    assert!(
        lacking.is_none(),
        "seed {}: d{b}, meeting only the keeper, lacks {:?} written after the revocation of d{v}\n{}",
        s.seed,
        lacking.map(|w| &w.key),
        s.trace_tail()
    );
    if !writes.is_empty() {
        s.count("keeper epoch handoffs");
    }
    s.move_to(b, 0);
}

fn run(seed: u64) -> std::collections::BTreeMap<&'static str, u64> {
    run_sim(seed).tally
}

fn run_sim(seed: u64) -> Sim {
    let _entropy = nuwa_entropy::deterministic_for_simulation(seed);
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed);
    let n = 3 + rng.usize(0..4);
    let knobs = Knobs {
        loss_per_mille: rng.u32(0..60),
        max_delay_ms: 5 + rng.u64(0..80),
        keeper: rng.u32(0..3) == 0,
    };
    let keeper = knobs.keeper;
    let mut s = Sim::new(seed, n, knobs);
    s.note(format!("{n} devices, keeper {keeper}"));
    for i in 0..n {
        s.start(i);
    }
    s.run_for(2_000);
    let mut roles = Roles {
        admin: 0,
        recovered: false,
        revocations: 0,
        rotations: 0,
    };
    if keeper {
        keeper_handoff(&mut s);
        if rng.bool() {
            keeper_across_epoch(&mut s, &mut roles);
        }
    }
    if rng.u32(0..3) == 0 {
        // A copy early on, so that many seeds restore one later.
        back_up(&mut s, &roles);
    }
    let phases = 20 + rng.usize(0..20);
    // A stream of its own, so that seeds without it replay as before.
    let mut xr = fastrand::Rng::with_seed(seed ^ 0xe8b1);
    // One seed in three: the wait for expiry and grace (over a minute of
    // virtual time) is the costliest step of a seed.
    let expiry_at = (xr.u32(0..3) == 0).then(|| xr.usize(0..phases));
    for k in 0..phases {
        if expiry_at == Some(k) {
            expiry(&mut s, &mut roles);
        }
        phase(&mut s, &mut roles);
    }
    s.heal(90_000);
    s.check_converged();
    if r_rotated(&roles) {
        s.count("rotations");
    }
    s
}

fn r_rotated(r: &Roles) -> bool {
    r.rotations > 0
}

#[test]
fn agents_keep_their_promises_under_seeded_faults() {
    let seeds = seeds();
    let replay = std::env::var("SEED").is_ok();
    if replay {
        // A replayed seed shows what every agent logged (RUST_LOG picks).
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "info".into()),
            )
            .without_time()
            .with_ansi(false)
            .with_target(false)
            .try_init();
    }
    let started = std::time::Instant::now();
    let mut tally: std::collections::BTreeMap<&'static str, (u64, u64)> = Default::default();
    for seed in &seeds {
        match std::panic::catch_unwind(|| run(*seed)) {
            Ok(t) => {
                for (k, v) in t {
                    let e = tally.entry(k).or_default();
                    e.0 += v;
                    e.1 += u64::from(v > 0);
                }
            }
            Err(e) => {
                eprintln!("seed {seed} failed; replay with SEED={seed}");
                std::panic::resume_unwind(e);
            }
        }
    }
    eprintln!(
        "{} seeds passed in {:.1} s; what they exercised (total, seeds):",
        seeds.len(),
        started.elapsed().as_secs_f64()
    );
    for (k, (total, in_seeds)) in &tally {
        eprintln!("  {k}: {total} in {in_seeds} seeds");
    }
    if !replay {
        // The scenarios must actually happen, or the invariants prove
        // nothing about them.
        if seeds.len() >= 100 {
            for k in [
                "revoke",
                "promote",
                "provision",
                "pairings",
                "recoveries",
                "stale handovers",
                "partitioned revocations",
                "rotations",
                "backups",
                "restores",
                "keeper requests",
                "keeper epoch handoffs",
                "crashes",
                "torn handles",
                "loads off the loop",
                "expiries",
                "expiry prunes",
                "expired refusals",
            ] {
                assert!(
                    tally.get(k).is_some_and(|t| t.1 > 0),
                    "no seed exercised {k}: {tally:?}"
                );
            }
        }
    }
}

// Goal: a seed replays exactly (the point of seeding: a failing seed can
// be studied). Method: run the same seeds twice; the traces, every
// acknowledged write and every device's chain head must be identical.
#[test]
fn a_seed_replays_exactly() {
    for seed in [3u64, 44, 1_000_003] {
        let summary = |s: &Sim| {
            let heads: Vec<String> = s
                .devices
                .iter()
                .filter_map(|d| d.disk.as_ref().map(|disk| disk.log.head_hash().to_owned()))
                .collect();
            let acked: Vec<String> = s.acked.iter().map(|w| format!("{w:?}")).collect();
            (s.trace.clone(), acked, heads)
        };
        let a = summary(&run_sim(seed));
        let b = summary(&run_sim(seed));
        assert_eq!(a, b, "seed {seed} did not replay exactly");
    }
}
