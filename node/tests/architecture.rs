//! Goal: every test ARCHITECTURE.md names as holding a rule exists, so a
//! rule cannot silently lose its test to a rename or a deletion. Method:
//! read every `file.rs::…::name` reference in ARCHITECTURE.md, find the
//! file (a path, or a unique path suffix such as `layering.rs`), and look
//! for `fn name` in it or in its test module files (`tests.rs`, or the
//! `tests/` folder beside it). And the file stays under 700 lines.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if p.is_dir() {
            if !matches!(name.as_str(), "target" | ".git" | "fuzz" | "node_modules") {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// The `(file, test)` pairs named in `text`: backticked spans of the form
/// `some/path.rs::[module::]name`.
fn references(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for span in text.split('`').skip(1).step_by(2) {
        let Some((file, rest)) = span.split_once(".rs::") else {
            continue;
        };
        let name = rest.rsplit("::").next().unwrap();
        if name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            out.push((format!("{file}.rs"), name.to_owned()));
        }
    }
    out
}

/// The file a reference names: the one path that ends with it.
fn resolve<'a>(files: &'a [PathBuf], reference: &str) -> Vec<&'a PathBuf> {
    let root = root();
    files
        .iter()
        .filter(|f| {
            let rel = f.strip_prefix(&root).unwrap().to_string_lossy();
            rel == reference || rel.ends_with(&format!("/{reference}"))
        })
        .collect()
}

/// The source of `file` and of its test module files.
fn with_test_modules(file: &Path) -> String {
    let mut text = std::fs::read_to_string(file).unwrap();
    let stem = file.with_extension("");
    for extra in [stem.join("tests.rs"), file.with_file_name("tests.rs")] {
        if extra != file {
            if let Ok(t) = std::fs::read_to_string(&extra) {
                text.push_str(&t);
            }
        }
    }
    text
}

#[test]
fn every_test_the_architecture_names_exists() {
    let text = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let refs = references(&text);
    assert!(refs.len() > 40, "found the named tests: {}", refs.len());
    let mut files = Vec::new();
    rust_files(&root(), &mut files);
    let mut missing = Vec::new();
    for (file, name) in &refs {
        let found = resolve(&files, file);
        match found.as_slice() {
            [one] => {
                if !with_test_modules(one).contains(&format!("fn {name}(")) {
                    missing.push(format!("{file}: no fn {name}"));
                }
            }
            [] => missing.push(format!("{file}: no such file")),
            many => missing.push(format!("{file}: ambiguous ({} files)", many.len())),
        }
    }
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names tests that do not exist:\n{}",
        missing.join("\n")
    );
}

/// The developers' guide: ARCHITECTURE.md holds the map and the rules, and
/// stays under 700 lines. What grows without bound (why a rule is the way
/// it is, what was tried, history) belongs in docs/decisions.md.
#[test]
fn architecture_md_stays_under_700_lines() {
    let text = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let lines = text.lines().count();
    assert!(
        lines < 700,
        "ARCHITECTURE.md has {lines} lines, the limit is 699: state each rule \
         as true now with its test, and move reasons, history and alternatives \
         to docs/decisions.md (figures to docs/performance.md)"
    );
}
