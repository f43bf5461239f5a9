//! The keeper's storage contract (`nuwa_keeper::KeeperStore`), checked case by case on both
//! stores (`MemKeeperStore` and `SledKeeperStore`), then against a `BTreeMap` model with
//! random operations and reopens; and, on sled alone, what must survive a reopen, that a
//! keeper directory written before the store trait still opens, and that the files hold no
//! plaintext. Replay a model failure with `SEED=<n>`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use common::{Rng, seeds};
use nuwa_crypto::{Envelope, SyncKey};
use nuwa_identity::chain::DidChain;
use nuwa_identity::document::Relationship;
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_keeper::{
    AgentDoc, AgentHash, AgentRecord, AgentState, Entry, Keeper, KeeperConfig, KeeperStore,
    KeeperStoreError, MemKeeperStore, Page, Pushed, Usage, agent_hash, sign_request,
};
use nuwa_proto::keeper::{KeeperBody, KeeperResponse, RefusalCode, envelope_from_bytes};
use nuwa_store::SledKeeperStore;

const A: AgentHash = [0; 32];
/// Right after `A` in key order, so a prefix scan that overreaches shows.
const B: AgentHash = {
    let mut h = [0; 32];
    h[31] = 1;
    h
};
const C: AgentHash = [0xff; 32];

/// Runs `check` against a fresh store of each kind.
fn each_store(check: impl Fn(&str, &mut dyn KeeperStore)) {
    check("mem", &mut MemKeeperStore::new());
    let dir = tempfile::tempdir().expect("tempdir");
    let mut sled = SledKeeperStore::open(dir.path()).expect("open");
    check("sled", &mut sled);
}

fn entry(received_ms: u64, tag: &str, pad: usize) -> Entry {
    let mut envelope = tag.as_bytes().to_vec();
    envelope.resize(tag.len() + pad, b'.');
    Entry {
        received_ms,
        envelope,
    }
}

fn entries(received_ms: u64, tags: std::ops::RangeInclusive<u32>) -> Vec<Entry> {
    tags.map(|i| entry(received_ms, &format!("e{i}"), i as usize))
        .collect()
}

fn record(did: &str) -> AgentRecord {
    AgentRecord {
        did: did.to_owned(),
        doc: None,
        last_push_ms: BTreeMap::new(),
    }
}

fn usage_of(es: &[Entry]) -> Usage {
    Usage {
        bytes: es.iter().map(Entry::size).sum(),
        envelopes: es.len() as u64,
    }
}

fn seqs(page: &Page) -> Vec<u64> {
    page.entries.iter().map(|(s, _)| *s).collect()
}

/// Every entry of `agent` after `since`, page by page.
fn pull_all(s: &dyn KeeperStore, agent: &AgentHash, since: u64) -> Vec<(u64, Entry)> {
    let mut out = Vec::new();
    let mut cursor = since;
    loop {
        let page = s.pull(agent, cursor, 1000, 7).expect("pull");
        if let Some((seq, _)) = page.entries.last() {
            cursor = *seq;
        }
        out.extend(page.entries);
        if !page.more {
            return out;
        }
    }
}

// Goal: a push stores its entries under the next sequence numbers, with the record, and
// the store reports the agent's log head and usage. Method: an empty store, two pushes, one
// of them without entries (a record update).
#[test]
fn a_push_is_stored_and_numbered() {
    each_store(|name, s| {
        assert_eq!(s.agent_count(), 0, "{name}");
        assert_eq!(s.agent(&A), None, "{name}");
        assert_eq!(s.pull(&A, 0, 1000, 10).expect("pull"), Page::default());
        assert_eq!(s.usage_through(&A, 10).expect("usage"), Usage::default());

        let first = entries(100, 1..=3);
        let pushed = s.push(&A, &record("a"), &first, 0).expect("push");
        assert_eq!(
            pushed,
            Pushed {
                first_seq: 1,
                usage: usage_of(&first)
            },
            "{name}"
        );
        let mut newer = record("a");
        newer.last_push_ms.insert("dev".into(), 7);
        let pushed = s.push(&A, &newer, &[], 0).expect("record only");
        assert_eq!(pushed.first_seq, 4, "{name}: where the next entry goes");
        assert_eq!(
            s.agent(&A),
            Some(AgentState {
                record: newer,
                next_seq: 4,
                usage: usage_of(&first)
            }),
            "{name}"
        );
        assert_eq!(s.agent_count(), 1, "{name}");
        assert_eq!(s.agent_hashes(), vec![A], "{name}");
        let got = pull_all(s, &A, 0);
        assert_eq!(got, (1..=3).zip(first).collect::<Vec<_>>(), "{name}");
    });
}

// Goal: a push is all or nothing: one that cannot be stored whole leaves no entry, no
// record and no agent behind. Method: pushes that replace entries not yet stored, for a new
// agent and for one with entries.
#[test]
fn a_refused_push_leaves_nothing() {
    each_store(|name, s| {
        let r = s.push(&A, &record("a"), &entries(1, 1..=2), 1);
        assert!(
            matches!(
                r,
                Err(KeeperStoreError::ReplacesAhead {
                    replaces_through: 1,
                    newest: 0
                })
            ),
            "{name}: {r:?}"
        );
        assert_eq!((s.agent_count(), s.agent(&A)), (0, None), "{name}");

        let first = entries(1, 1..=3);
        s.push(&A, &record("a"), &first, 0).expect("push");
        let before = s.agent(&A);
        let mut other = record("a");
        other.last_push_ms.insert("dev".into(), 9);
        let r = s.push(&A, &other, &entries(2, 4..=5), 4);
        assert!(
            matches!(r, Err(KeeperStoreError::ReplacesAhead { newest: 3, .. })),
            "{name}: {r:?}"
        );
        assert_eq!(s.agent(&A), before, "{name}: record and usage unchanged");
        assert_eq!(
            pull_all(s, &A, 0),
            (1..=3).zip(first).collect::<Vec<_>>(),
            "{name}: no entry added or dropped"
        );
    });
}

// Goal: `replaces_through = N` drops exactly the entries numbered up to N, in the same
// push, and frees what they took; later entries stay. Method: five entries, a snapshot
// replacing three, then one replacing everything, then one naming a range already gone.
#[test]
fn replaces_through_drops_exactly_up_to_n() {
    each_store(|name, s| {
        let first = entries(1, 1..=5);
        s.push(&A, &record("a"), &first, 0).expect("push");
        s.push(&B, &record("b"), &entries(1, 1..=5), 0)
            .expect("push B");
        assert_eq!(
            s.usage_through(&A, 3).expect("usage"),
            usage_of(&first[..3]),
            "{name}"
        );
        let snap = entries(2, 6..=7);
        let pushed = s.push(&A, &record("a"), &snap, 3).expect("snapshot");
        let kept: Vec<Entry> = first[3..].iter().chain(&snap).cloned().collect();
        assert_eq!(
            pushed,
            Pushed {
                first_seq: 6,
                usage: usage_of(&kept)
            },
            "{name}"
        );
        assert_eq!(
            seqs(&s.pull(&A, 0, u64::MAX, 100).expect("pull")),
            vec![4, 5, 6, 7],
            "{name}"
        );
        // Everything, up to the newest.
        let all = entries(3, 8..=8);
        let pushed = s.push(&A, &record("a"), &all, 7).expect("replace all");
        assert_eq!((pushed.first_seq, pushed.usage), (8, usage_of(&all)));
        // Entries already gone free nothing and are no error.
        let pushed = s.push(&A, &record("a"), &[], 5).expect("gone already");
        assert_eq!(pushed.usage, usage_of(&all), "{name}");
        assert_eq!(pull_all(s, &A, 0), vec![(8, all[0].clone())], "{name}");
        // The other agent's entries, numbered alike, are untouched.
        assert_eq!(
            seqs(&s.pull(&B, 0, u64::MAX, 100).expect("pull")),
            vec![1, 2, 3, 4, 5],
            "{name}"
        );
    });
}

// Goal: pulls page by cursor: a page ends before the entry that would take it past its
// bytes or entries, the first entry always comes (so a cursor moves), `more` says whether
// entries follow. Method: ten entries of known size, pulled with each limit.
#[test]
fn pulls_page_by_cursor() {
    each_store(|name, s| {
        let es: Vec<Entry> = (1..=10).map(|i| entry(5, &format!("{i:02}"), 98)).collect();
        let size = es[0].size();
        assert_eq!(size, 108);
        s.push(&A, &record("a"), &es, 0).expect("push");
        s.push(&B, &record("b"), &entries(5, 1..=3), 0)
            .expect("push B");

        let page = s.pull(&A, 0, 2 * size + 1, 100).expect("pull");
        assert_eq!((seqs(&page), page.more), (vec![1, 2], true), "{name}");
        assert_eq!(page.entries[0].1, es[0], "{name}: the entry as pushed");
        let page = s.pull(&A, 2, 2 * size, 100).expect("pull");
        assert_eq!((seqs(&page), page.more), (vec![3, 4], true), "{name}");
        let page = s.pull(&A, 4, u64::MAX, 3).expect("pull");
        assert_eq!((seqs(&page), page.more), (vec![5, 6, 7], true), "{name}");
        let page = s.pull(&A, 7, 1, 100).expect("pull");
        assert_eq!(
            (seqs(&page), page.more),
            (vec![8], true),
            "{name}: one entry over the limit still comes"
        );
        let page = s.pull(&A, 8, u64::MAX, 100).expect("pull");
        assert_eq!((seqs(&page), page.more), (vec![9, 10], false), "{name}");
        for since in [10, 11, u64::MAX - 1, u64::MAX] {
            assert_eq!(
                s.pull(&A, since, u64::MAX, 100).expect("pull"),
                Page::default(),
                "{name}: after {since}"
            );
        }
        assert_eq!(
            s.pull(&C, 0, u64::MAX, 100).expect("pull"),
            Page::default(),
            "{name}: unknown agent"
        );
        assert_eq!(
            pull_all(s, &A, 0),
            (1..=10).zip(es).collect::<Vec<_>>(),
            "{name}"
        );
    });
}

// Goal: retention drops each agent's entries received before the cutoff, from the oldest
// up to the first that is not (entries are kept in the order received), frees their usage
// and keeps the records. Method: two agents, one with a receipt time out of order.
#[test]
fn prune_drops_what_was_received_before_the_cutoff() {
    each_store(|name, s| {
        let a = vec![entry(10, "a1", 0), entry(30, "a2", 1), entry(20, "a3", 2)];
        let b = vec![entry(15, "b1", 3), entry(25, "b2", 4)];
        s.push(&A, &record("a"), &a, 0).expect("push");
        s.push(&B, &record("b"), &b, 0).expect("push");
        assert_eq!(s.prune(10).expect("prune"), 0, "{name}: nothing before 10");
        assert_eq!(s.prune(25).expect("prune"), 2, "{name}");
        // a3 (20) is older than the cutoff but follows a2 (30): it stays until a2 goes.
        assert_eq!(
            s.agent(&A).map(|x| (x.usage, x.next_seq)),
            Some((usage_of(&a[1..]), 4)),
            "{name}"
        );
        assert_eq!(
            s.agent(&B).map(|x| x.usage),
            Some(usage_of(&b[1..])),
            "{name}"
        );
        assert_eq!(seqs(&s.pull(&A, 0, u64::MAX, 9).expect("pull")), vec![2, 3]);
        assert_eq!(s.prune(u64::MAX).expect("prune"), 3, "{name}");
        assert_eq!(s.agent_count(), 2, "{name}: records stay");
        assert_eq!(s.agent(&A).map(|x| x.usage), Some(Usage::default()));
        let pushed = s
            .push(&A, &record("a"), &[entry(40, "a4", 0)], 0)
            .expect("push");
        assert_eq!(pushed.first_seq, 4, "{name}: numbers are never reused");
    });
}

// ---- sled only ----

/// Opens the sled store in `dir`.
fn open_sled(dir: &Path) -> SledKeeperStore {
    SledKeeperStore::open(dir).expect("open the keeper store")
}

/// A DID document as a keeper would hold it, from fixed keys.
fn proven_doc() -> AgentDoc {
    let chain = agent_chain(1, &[2]);
    AgentDoc {
        head_seq: 7,
        head_hash: "head".into(),
        document: chain.current().clone(),
        ever_listed: BTreeSet::from([ctx(2), ctx(3)]),
        chain: "[]".into(),
        chain_head: "head".into(),
        grants: vec![nuwa_keeper::StoredGrant {
            epoch: 3,
            bytes: vec![1, 2, 3],
        }],
    }
}

// Goal: what the keeper relies on survives a reopen: records (with their DID document),
// log heads, the usage behind its quotas (recounted from the entries), and the entries.
// Method: pushes, a compaction and a prune; then reopen and compare everything.
#[test]
fn records_usage_and_entries_survive_a_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut rec = record("did:a");
    rec.doc = Some(proven_doc());
    rec.last_push_ms.insert(ctx(2), 1_000);
    let (states, all) = {
        let mut s = open_sled(dir.path());
        s.push(&A, &rec, &entries(10, 1..=6), 0).expect("push");
        s.push(&A, &rec, &entries(20, 7..=8), 2).expect("snapshot");
        s.push(&B, &record("did:b"), &entries(5, 1..=3), 0)
            .expect("push");
        assert_eq!(s.prune(6).expect("prune"), 3);
        let states: Vec<_> = [A, B].iter().map(|h| s.agent(h)).collect();
        let all: Vec<_> = [A, B].iter().map(|h| pull_all(&s, h, 0)).collect();
        (states, all)
    };
    let mut s = open_sled(dir.path());
    assert_eq!(s.agent_count(), 2);
    assert_eq!(
        states[0].as_ref().map(|x| (x.next_seq, x.usage.envelopes)),
        Some((9, 6))
    );
    assert_eq!(states[1].as_ref().map(|x| x.usage), Some(Usage::default()));
    assert_eq!(
        [A, B].iter().map(|h| s.agent(h)).collect::<Vec<_>>(),
        states
    );
    assert_eq!(
        [A, B]
            .iter()
            .map(|h| pull_all(&s, h, 0))
            .collect::<Vec<_>>(),
        all
    );
    let pushed = s
        .push(&B, &record("did:b"), &entries(30, 1..=1), 0)
        .expect("push");
    assert_eq!(pushed.first_seq, 4, "numbering goes on after a reopen");
}

// Goal: a push refused by the store leaves nothing on disk either. Method: a refused push,
// then reopen.
#[test]
fn a_refused_push_leaves_nothing_on_disk() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let mut s = open_sled(dir.path());
        s.push(&A, &record("a"), &entries(1, 1..=2), 0)
            .expect("push");
        assert!(s.push(&A, &record("x"), &entries(1, 3..=4), 3).is_err());
        assert!(s.push(&B, &record("b"), &entries(1, 1..=1), 1).is_err());
    }
    let s = open_sled(dir.path());
    assert_eq!(s.agent_hashes(), vec![A]);
    assert_eq!(
        s.agent(&A).map(|a| (a.record.did, a.next_seq)),
        Some(("a".into(), 3))
    );
    assert_eq!(
        seqs(&s.pull(&A, 0, u64::MAX, 10).expect("pull")),
        vec![1, 2]
    );
}

// The fixture's clock and keys (see tests/fixtures/keeper-v1/README.md).
const NOW_S: i64 = 1_750_000_100;
const NOW: u64 = NOW_S as u64 * 1000;
const DAY_MS: u64 = 24 * 3600 * 1000;

fn key(n: u8) -> DeviceKey {
    DeviceKey::from_seed(&[n; 32])
}

fn ctx(n: u8) -> String {
    context_id_for(&key(n).public())
}

/// An agent (master `m`) whose document lists the devices `devs`, as the fixture made it.
fn agent_chain(m: u8, devs: &[u8]) -> DidChain {
    let master = key(m);
    let mut log = DidChain::genesis(&master, NOW_S - 100).expect("genesis");
    for (t, d) in (NOW_S - 99..).zip(devs) {
        let mut doc = log.current().clone();
        doc.add_key(
            &ctx(*d),
            &key(*d).public(),
            &[Relationship::Authentication],
            None,
        )
        .expect("add key");
        let id = log.current().capability_delegation[0].clone();
        log.append_document(&doc, &master, &id, t).expect("append");
    }
    log
}

/// A copy of the fixture directory, to open without touching the original.
fn fixture_copy() -> tempfile::TempDir {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/keeper-v1");
    let dir = tempfile::tempdir().expect("tempdir");
    for f in ["conf", "db"] {
        std::fs::copy(fixture.join(f), dir.path().join(f)).expect("copy the fixture");
    }
    dir
}

/// The plaintexts of `entries`, opened as the fixture sealed them, with the receipt times.
fn opened(entries: &[(u64, Entry)], did: &str) -> Vec<(u64, u64, String)> {
    let sk = SyncKey::from_bytes(0, [7; 32]);
    entries
        .iter()
        .map(|(seq, e)| {
            let env: Envelope = envelope_from_bytes(&e.envelope).expect("an envelope");
            let dev = [2, 3, 5]
                .into_iter()
                .find(|d| ctx(*d) == env.sender)
                .expect("a fixture device sealed it");
            let plain = nuwa_crypto::open(&env, &sk, &key(dev).public(), did).expect("opens");
            (
                *seq,
                e.received_ms,
                String::from_utf8(plain.to_vec()).expect("utf-8"),
            )
        })
        .collect()
}

// Goal: a keeper directory written before the store trait (`tests/fixtures/keeper-v1`)
// opens unchanged, with its records, log heads, usage, entries and restart floors, and the
// keeper goes on from it. Method: open a copy, compare with what the fixture's README says
// it holds, then pull, push, prune and reopen through a keeper.
#[test]
fn a_keeper_directory_from_before_the_store_trait_opens() {
    let dir = fixture_copy();
    let a = agent_chain(1, &[2, 3]);
    let b = agent_chain(4, &[5]);
    let (ha, hb) = (agent_hash(a.did()), agent_hash(b.did()));
    let s = open_sled(dir.path());
    assert_eq!(s.agent_count(), 2);

    let sa = s.agent(&ha).expect("agent A");
    assert_eq!(sa.record.did, a.did());
    assert_eq!(
        (sa.next_seq, sa.usage.bytes, sa.usage.envelopes),
        (8, 628, 4)
    );
    let doc = sa.record.doc.as_ref().expect("A's proven document");
    // The chain rebuilt here has the fixture's documents but not its entry hashes (chain
    // entries are not reproducible byte for byte), so the head hash is only checked to be
    // there.
    let proof = a.proof().verify(a.did(), NOW_S).expect("proof");
    assert_eq!(
        (doc.head_seq, &doc.document),
        (proof.head_seq(), proof.document())
    );
    assert_eq!(
        doc.head_hash.len(),
        64,
        "a SHA-256 in hex: {}",
        doc.head_hash
    );
    // Every key the document lists for devices: the master's (its fragment is the DID's
    // key) and the two devices'.
    let master = a.did().trim_start_matches("did:key:").to_owned();
    assert_eq!(doc.ever_listed, BTreeSet::from([master, ctx(2), ctx(3)]));
    assert_eq!(
        sa.record.last_push_ms,
        BTreeMap::from([(ctx(2), NOW), (ctx(3), NOW + 1000)])
    );
    assert_eq!(
        opened(&pull_all(&s, &ha, 0), a.did()),
        vec![
            (4, NOW, "A change 4".into()),
            (5, NOW, "A change 5".into()),
            (6, NOW + 1000, "A snapshot 1".into()),
            (7, NOW + 1000, "A snapshot 2".into()),
        ]
    );
    let sb = s.agent(&hb).expect("agent B");
    assert_eq!(
        (sb.next_seq, sb.usage.bytes, sb.usage.envelopes),
        (2, 156, 1)
    );
    assert_eq!(
        opened(&pull_all(&s, &hb, 0), b.did()),
        vec![(1, NOW + DAY_MS, "B change 1".into())]
    );

    // A keeper over it: device 3's last push before the "restart" is its floor; device 2
    // pulls and pushes on; retention drops A's old entries and keeps B's.
    let now = NOW + DAY_MS + 60_000;
    let mut k = Keeper::new(Box::new(s), KeeperConfig::default());
    let pull = |dev: u8, at: u64| {
        let body = KeeperBody::Pull {
            since: 0,
            max_bytes: u32::MAX,
            have_head: String::new(),
            have_epoch: 0,
        };
        sign_request(&key(dev), &ctx(dev), a.did(), 1, body, at).expect("sign")
    };
    let r = k.handle(pull(3, NOW + 1000), NOW + 1000);
    assert!(
        matches!(
            r,
            KeeperResponse::Refused {
                code: RefusalCode::Replayed,
                ..
            }
        ),
        "{r:?}"
    );
    let r = k.handle(pull(2, now), now);
    assert!(
        matches!(&r, KeeperResponse::Batch { entries, next: 7, more: false, .. } if entries.len() == 4),
        "{r:?}"
    );
    let sk = SyncKey::from_bytes(0, [7; 32]);
    let env = nuwa_crypto::seal(
        &sk,
        key(2).signing_key(),
        a.did(),
        &ctx(2),
        now,
        b"A change 8",
    )
    .expect("seal");
    let body = KeeperBody::Push {
        did_proof: Vec::new(),
        envelopes: vec![env],
        replaces_through: 0,
        membership: Default::default(),
    };
    let req = sign_request(&key(2), &ctx(2), a.did(), 2, body, now + 1).expect("sign");
    let r = k.handle(req, now + 1);
    assert!(
        matches!(
            r,
            KeeperResponse::Pushed {
                first_seq: 8,
                last_seq: 8,
                used_envelopes: 5,
                ..
            }
        ),
        "{r:?}"
    );
    let retention = KeeperConfig::default().retention.as_millis() as u64;
    assert_eq!(k.prune(NOW + 1000 + retention + 1).expect("prune"), 4);
    drop(k);

    let s = open_sled(dir.path());
    assert_eq!(
        s.agent(&ha).map(|x| (x.next_seq, x.usage.envelopes)),
        Some((9, 1))
    );
    assert_eq!(s.agent(&hb).map(|x| x.usage.envelopes), Some(1));
}

// Goal: the keeper's files hold no plaintext. Method: a keeper over sled stores envelopes
// whose plaintext carries a unique marker; reopen, scan every file.
#[test]
fn the_keeper_files_hold_no_plaintext() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = b"PLAINTEXT-MARKER-5d2c0f6e";
    {
        let mut k = Keeper::new(Box::new(open_sled(dir.path())), KeeperConfig::default());
        let log = agent_chain(1, &[2]);
        let sk = SyncKey::generate(0).expect("rng");
        let envs = (0..50)
            .map(|_| {
                nuwa_crypto::seal(&sk, key(2).signing_key(), log.did(), &ctx(2), NOW, marker)
                    .expect("seal")
            })
            .collect();
        let body = KeeperBody::Push {
            did_proof: log.proof().encode().expect("proof"),
            envelopes: envs,
            replaces_through: 0,
            membership: Default::default(),
        };
        let req = sign_request(&key(2), &ctx(2), log.did(), 1, body, NOW).expect("sign");
        let r = k.handle(req, NOW);
        assert!(matches!(r, KeeperResponse::Pushed { .. }), "{r:?}");
    }
    drop(open_sled(dir.path()));
    let mut files = vec![dir.path().to_path_buf()];
    let mut scanned = 0;
    while let Some(p) = files.pop() {
        if p.is_dir() {
            files.extend(
                std::fs::read_dir(&p)
                    .expect("read dir")
                    .map(|e| e.expect("dir entry").path()),
            );
        } else {
            let bytes = std::fs::read(&p).expect("read file");
            scanned += bytes.len();
            assert!(
                !bytes.windows(marker.len()).any(|w| w == marker),
                "marker in {p:?}"
            );
        }
    }
    assert!(
        scanned > 50 * marker.len(),
        "the store was written ({scanned} bytes)"
    );
}

// ---- against a model ----

/// The contract as plainly as it can be said: per agent, a record, a log head and a map of
/// entries; usage is always recounted, never kept.
#[derive(Default)]
struct Model {
    agents: BTreeMap<AgentHash, (AgentRecord, u64, BTreeMap<u64, Entry>)>,
}

impl Model {
    fn state(&self, h: &AgentHash) -> Option<AgentState> {
        self.agents
            .get(h)
            .map(|(record, next_seq, log)| AgentState {
                record: record.clone(),
                next_seq: *next_seq,
                usage: usage_of(&log.values().cloned().collect::<Vec<_>>()),
            })
    }

    fn push(&mut self, h: &AgentHash, rec: &AgentRecord, es: &[Entry], through: u64) -> bool {
        let next = self.agents.get(h).map_or(1, |a| a.1);
        if through >= next {
            return false;
        }
        let a = self
            .agents
            .entry(*h)
            .or_insert_with(|| (rec.clone(), next, BTreeMap::new()));
        a.2.retain(|seq, _| *seq > through);
        for (i, e) in es.iter().enumerate() {
            a.2.insert(next + i as u64, e.clone());
        }
        a.0 = rec.clone();
        a.1 = next + es.len() as u64;
        true
    }

    fn pull(&self, h: &AgentHash, since: u64, max_bytes: u64, max_entries: usize) -> Page {
        let mut page = Page::default();
        let Some(a) = self.agents.get(h) else {
            return page;
        };
        let mut size = 0;
        for (seq, e) in a.2.iter().filter(|(s, _)| **s > since) {
            if !page.entries.is_empty()
                && (size + e.size() > max_bytes || page.entries.len() >= max_entries)
            {
                page.more = true;
                break;
            }
            size += e.size();
            page.entries.push((*seq, e.clone()));
        }
        page
    }

    fn prune(&mut self, cutoff: u64) -> u64 {
        let mut n = 0;
        for a in self.agents.values_mut() {
            let old: Vec<u64> =
                a.2.iter()
                    .take_while(|(_, e)| e.received_ms < cutoff)
                    .map(|(s, _)| *s)
                    .collect();
            for s in &old {
                a.2.remove(s);
            }
            n += old.len() as u64;
        }
        n
    }
}

// Goal: both stores keep the contract under any sequence of operations, and sled across
// reopens. Method: random pushes (with and without replacement, some refused), pulls,
// partial usages, prunes and reopens, each compared with the model and every agent's
// state compared after every step.
#[test]
fn both_stores_match_the_model() {
    for seed in seeds(8) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut mem = MemKeeperStore::new();
        let mut sled = Some(open_sled(dir.path()));
        let mut model = Model::default();
        let mut rng = Rng::new(seed);
        let mut clock = 1_000u64;
        for step in 0..200 {
            let h = [A, B, C][rng.index(3)];
            let next = model.agents.get(&h).map_or(1, |a| a.1);
            let sl = sled.as_mut().expect("open");
            let what = format!("seed {seed} step {step}");
            match rng.below(100) {
                0..=39 => {
                    clock += rng.below(50);
                    let es: Vec<Entry> = (0..rng.below(4))
                        .map(|i| entry(clock, &format!("{step}.{i}"), rng.index(300)))
                        .collect();
                    let through = if rng.chance(30) {
                        rng.below(next + 2)
                    } else {
                        0
                    };
                    let mut rec = record(&format!("agent {}", h[31]));
                    rec.last_push_ms
                        .insert(format!("dev{}", rng.below(3)), clock);
                    let ok = model.push(&h, &rec, &es, through);
                    for (name, s) in [("mem", &mut mem as &mut dyn KeeperStore), ("sled", sl)] {
                        let r = s.push(&h, &rec, &es, through);
                        match (&r, ok) {
                            (Ok(p), true) => {
                                assert_eq!(p.first_seq, next, "{name} {what}");
                                assert_eq!(Some(p.usage), model.state(&h).map(|x| x.usage));
                            }
                            (Err(KeeperStoreError::ReplacesAhead { .. }), false) => {}
                            _ => panic!("{name} {what}: {r:?}, model stored: {ok}"),
                        }
                    }
                }
                40..=69 => {
                    let since = rng.below(next + 2);
                    let max_bytes = 1 + rng.below(1000);
                    let max_entries = 1 + rng.index(5);
                    let want = model.pull(&h, since, max_bytes, max_entries);
                    for (name, s) in [("mem", &mem as &dyn KeeperStore), ("sled", &*sl)] {
                        let got = s.pull(&h, since, max_bytes, max_entries).expect("pull");
                        assert_eq!(got, want, "{name} {what}");
                    }
                }
                70..=79 => {
                    let through = rng.below(next + 2);
                    let want = model.agents.get(&h).map_or(Usage::default(), |a| {
                        usage_of(
                            &a.2.range(..=through)
                                .map(|(_, e)| e.clone())
                                .collect::<Vec<_>>(),
                        )
                    });
                    assert_eq!(mem.usage_through(&h, through).expect("usage"), want);
                    assert_eq!(sl.usage_through(&h, through).expect("usage"), want);
                }
                80..=89 => {
                    let cutoff = clock.saturating_sub(rng.below(300));
                    let want = model.prune(cutoff);
                    assert_eq!(mem.prune(cutoff).expect("prune"), want, "mem {what}");
                    assert_eq!(sl.prune(cutoff).expect("prune"), want, "sled {what}");
                }
                _ => {
                    // The old store goes first: it holds the directory's lock.
                    drop(sled.take());
                    sled = Some(open_sled(dir.path()));
                }
            }
            let sl = sled.as_ref().expect("open");
            assert_eq!(mem.agent_count(), model.agents.len(), "mem {what}");
            assert_eq!(sl.agent_count(), model.agents.len(), "sled {what}");
            for h in [A, B, C] {
                assert_eq!(mem.agent(&h), model.state(&h), "mem {what}");
                assert_eq!(sl.agent(&h), model.state(&h), "sled {what}");
            }
        }
    }
}
