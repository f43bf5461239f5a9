//! App capabilities across devices (issue 25): a capability an admin
//! issued, and its revocation made on another device, reach every device
//! of the agent, also one that was offline when it happened and meets the
//! others only through the keeper; each device's access view then refuses
//! the capability. Seeded: `SEED=s` replays one seed, `APP_SIM_SEEDS=n`
//! runs n (default 20).

mod sim;

use sim::{Knobs, Sim};

fn seeds() -> Vec<u64> {
    if let Ok(s) = std::env::var("SEED") {
        return vec![s.parse().expect("SEED is a number")];
    }
    let n: u64 = std::env::var("APP_SIM_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    (0..n).collect()
}

/// The app's key: seed byte 7, as the daemon test's app.
fn app_did() -> String {
    let key = nuwa_agent::identity::keys::DeviceKey::from_seed(&[7; 32]);
    nuwa_agent::identity::did_key::did_key_from_ed25519(&key.public())
}

// Goal: a revocation made on a non-admin device while a third device is
// offline reaches that device once it is back (through the keeper, the
// revoking device gone by then), and every device's access view refuses
// the capability: its chain no longer verifies. Method: the seeded
// simulator with loss, three devices and a keeper.
#[test]
fn an_app_revoked_on_one_device_is_refused_on_every_device() {
    for seed in seeds() {
        let mut s = Sim::new(
            seed,
            3,
            Knobs {
                keeper: true,
                ..Knobs::default()
            },
        );
        for i in 0..3 {
            s.start(i);
        }
        s.run_for(3_000);
        s.app_grant(0, &app_did(), "did:nuwa:cap:weather:");
        s.run_for(2_000);
        let list = s.devices[0].agent.as_ref().expect("d0 runs").app_list();
        assert_eq!(list.len(), 1, "seed {seed}: the grant is listed");
        let id = list[0].id.clone();
        let grant = {
            // The capability as issued, from the grant record.
            let c = s.devices[0]
                .agent
                .as_ref()
                .unwrap()
                .session()
                .engine()
                .container(nuwa_agent::apps::APPS_CONTAINER)
                .expect("the apps container")
                .to_json();
            c[format!("grant:{id}")].as_str().unwrap().to_owned()
        };
        let verify = |s: &Sim, i: usize| {
            let view = s.devices[i].agent.as_ref().unwrap().access(s.now_ms);
            nuwa_caps::verify(
                grant.as_bytes(),
                (s.now_ms / 1000) as i64,
                |k| view.is_admin(k),
                |id| view.is_revoked(id),
            )
        };
        for i in 0..3 {
            assert!(verify(&s, i).is_ok(), "seed {seed}: d{i} takes the grant");
        }
        s.crash(2);
        s.app_revoke(1, &id);
        s.run_for(3_000);
        s.crash(1);
        s.start(2);
        s.run_for(8_000);
        for i in [0, 2] {
            let e = verify(&s, i).expect_err("refused");
            assert_eq!(
                e.code(),
                "capability_revoked",
                "seed {seed}: d{i}: {e}\n{}",
                s.trace_tail()
            );
        }
        s.heal(5_000);
        assert!(verify(&s, 1).is_err(), "seed {seed}: d1 after heal");
    }
}
