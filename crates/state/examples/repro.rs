use nuwa_state::{Container, SyncState};
use serde_json::json;
fn main() {
    dump(&std::fs::read(std::env::args().nth(1).unwrap()).unwrap());
    let data = std::fs::read(std::env::args().nth(1).unwrap()).unwrap();
    let mut p = Container::new(b"nuwa-fuzz-actor");
    for (k, v) in [
        ("name", json!("fuzz")),
        ("count", json!(3)),
        ("tags", json!(["a", "b"])),
        ("nested", json!({"k": {"deep": true}, "n": null})),
    ] {
        p.put(k, &v).unwrap();
    }
    let saved = p.save();
    for populated in [false, true] {
        let mk = || {
            if populated {
                Container::load(b"nuwa-fuzz-actor", Some(&saved), Vec::new()).unwrap()
            } else {
                Container::new(b"nuwa-fuzz-actor")
            }
        };
        let mut c = mk();
        let mut state = SyncState::new();
        match c.receive_sync_message(&mut state, &data) {
            Ok(changes) => {
                eprintln!("populated={populated}: receive ok {}", changes.len());
                if !changes.is_empty() {
                    eprintln!(" json {}", c.to_json());
                    let s = c.save();
                    eprintln!(
                        " reload {:?}",
                        Container::load(b"nuwa-fuzz-actor", Some(&s), Vec::new()).err()
                    );
                }
                let _ = c.generate_sync_message(&mut state);
            }
            Err(e) => eprintln!("populated={populated}: receive err {e}"),
        }
        let mut c = mk();
        match c.apply_changes(vec![data.clone()]) {
            Ok(a) => {
                eprintln!("populated={populated}: apply ok {}", a.new_changes.len());
                if !a.new_changes.is_empty() {
                    eprintln!(" json {}", c.to_json());
                    let s = c.save();
                    eprintln!(
                        " reload {:?}",
                        Container::load(b"nuwa-fuzz-actor", Some(&s), Vec::new()).err()
                    );
                }
            }
            Err(e) => eprintln!("populated={populated}: apply err {e}"),
        }
    }
}
#[allow(dead_code)]
fn dump(data: &[u8]) {
    let c = automerge::Change::from_bytes(data.to_vec()).unwrap();
    eprintln!("{:#?}", c.decode());
}
