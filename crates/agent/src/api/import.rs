//! What `state import` sends and says: each line of an NDJSON file checked
//! as a batch operation before anything is sent, the operations split into
//! batches the API takes, and the replies tallied into the summary. Reading
//! the file, the HTTP calls and the progress bar are the shell's.

use serde_json::Value;

use super::{ApiError, BatchReply, ErrorCode, MAX_WRITE_VALUES, json_values};

/// Largest batch body `import` sends (the API takes up to 40 MiB).
pub const IMPORT_BATCH_BYTES: usize = 16 * 1024 * 1024;
/// Bad lines named in the refusal; the rest are only counted.
const MAX_BAD_SHOWN: usize = 20;
/// Failed operations listed after an import; the rest are only counted.
const MAX_FAILURES_SHOWN: usize = 50;

/// The lines of an import file, checked: the operations (line number,
/// the operation as sent) and the lines that are none.
#[derive(Debug, Default)]
pub struct ImportLines {
    ops: Vec<(usize, Value)>,
    /// The first [`MAX_BAD_SHOWN`] bad lines, with why.
    shown: Vec<String>,
    bad: usize,
}

impl ImportLines {
    /// Checks line `n` (from 1): a blank line is skipped; anything else
    /// must be one JSON batch operation.
    pub fn push(&mut self, n: usize, line: &str) {
        if line.trim().is_empty() {
            return;
        }
        let checked = serde_json::from_str::<Value>(line)
            .map_err(|e| e.to_string())
            .and_then(|v| {
                serde_json::from_value::<super::BatchOp>(v.clone())
                    .map(|_| v)
                    .map_err(|e| e.to_string())
            });
        match checked {
            Ok(v) => self.ops.push((n, v)),
            Err(e) => {
                if self.bad < MAX_BAD_SHOWN {
                    self.shown.push(format!("line {n}: {e}"));
                }
                self.bad += 1;
            }
        }
    }

    /// The operations, or, if any line was not one, the refusal naming
    /// `file` and the first bad lines: nothing is sent then.
    pub fn finish(self, file: &str) -> Result<Vec<(usize, Value)>, String> {
        if self.bad > 0 {
            return Err(format!(
                "{} line(s) of {file} are not operations; nothing was sent:\n  {}",
                self.bad,
                self.shown.join("\n  ")
            ));
        }
        Ok(self.ops)
    }
}

/// Where the batch that starts at `ops[start]` ends: up to `batch_size`
/// operations and about [`IMPORT_BATCH_BYTES`], and at most what one write
/// takes in JSON values ([`MAX_WRITE_VALUES`]: the daemon refuses more, to
/// keep its loop free); always at least one operation.
pub fn batch_end(ops: &[(usize, Value)], start: usize, batch_size: usize) -> usize {
    let mut end = start;
    let (mut bytes, mut values) = (0, 2);
    while end < ops.len() && end - start < batch_size {
        let text = ops[end].1.to_string();
        bytes += text.len();
        values += json_values(text.as_bytes()) + 1;
        if (bytes > IMPORT_BATCH_BYTES || values > MAX_WRITE_VALUES) && end > start {
            break;
        }
        end += 1;
    }
    end
}

/// What the batches of an import did, reply by reply.
#[derive(Debug, Default)]
pub struct ImportTally {
    pub applied: usize,
    pub failed: usize,
    /// The operations that failed on their own (line, error); those only
    /// aborted with another on their container are counted, not listed.
    pub failures: Vec<(usize, ApiError)>,
}

impl ImportTally {
    /// Adds the reply to the batch of `sent` (line, operation).
    pub fn add(&mut self, sent: &[(usize, Value)], reply: &BatchReply) {
        self.applied += reply.applied;
        self.failed += reply.failed;
        for ((line, _), r) in sent.iter().zip(&reply.results) {
            if let Some(e) = &r.error {
                if e.code != ErrorCode::BatchAborted {
                    self.failures.push((*line, e.clone()));
                }
            }
        }
    }

    /// The `--json` summary of `operations` sent in `secs`.
    pub fn to_json(&self, operations: usize, secs: f64) -> Value {
        serde_json::json!({
            "operations": operations,
            "applied": self.applied,
            "failed": self.failed,
            "durable": true,
            "seconds": secs,
            "failures": self
                .failures
                .iter()
                .map(|(line, e)| serde_json::json!({"line": line, "error": e}))
                .collect::<Vec<_>>(),
        })
    }

    /// The failures as people read them, one line each, at most
    /// [`MAX_FAILURES_SHOWN`] and a count of the rest.
    pub fn failure_lines(&self) -> Vec<String> {
        let mut out: Vec<String> = (self.failures.iter().take(MAX_FAILURES_SHOWN))
            .map(|(line, e)| format!("line {line}: {e}"))
            .collect();
        if self.failures.len() > MAX_FAILURES_SHOWN {
            out.push(format!(
                "… and {} more failed lines",
                self.failures.len() - MAX_FAILURES_SHOWN
            ));
        }
        out
    }

    /// The summary line of `operations` sent in `secs`.
    pub fn summary(&self, operations: usize, secs: f64) -> String {
        format!(
            "imported {} of {operations} operations in {secs:.1} s ({:.0}/s); {} failed; durable=true",
            self.applied,
            self.applied as f64 / secs.max(1e-9),
            self.failed
        )
    }

    /// The error the command ends with when an operation failed.
    pub fn error(&self) -> Option<String> {
        (self.failed > 0).then(|| {
            format!(
                "{} operation(s) failed (a failed one aborts the others on its container in its batch)",
                self.failed
            )
        })
    }
}

#[cfg(test)]
mod tests {
    //! The line check, the batch split and the tally.
    use super::*;

    fn put(i: usize) -> Value {
        serde_json::json!({"op": "put", "container": "c", "key": format!("k{i}"), "value": i})
    }

    // Goal: a file with one bad line sends nothing and names the first
    // bad lines; blank lines are skipped. Method: good, blank and bad
    // lines, then more bad lines than are shown.
    #[test]
    fn bad_lines_refuse_the_whole_file() {
        let mut ok = ImportLines::default();
        ok.push(1, &put(1).to_string());
        ok.push(2, "   ");
        ok.push(3, &put(3).to_string());
        let ops = ok.finish("f.ndjson").expect("every line is an operation");
        assert_eq!(ops.iter().map(|(n, _)| *n).collect::<Vec<_>>(), [1, 3]);

        let mut bad = ImportLines::default();
        bad.push(1, &put(1).to_string());
        for n in 2..30 {
            bad.push(n, r#"{"op": "fly"}"#);
        }
        bad.push(30, "{");
        let e = bad.finish("f.ndjson").unwrap_err();
        assert!(
            e.starts_with(
                "29 line(s) of f.ndjson are not operations; nothing was sent:\n  line 2: "
            ),
            "{e}"
        );
        assert_eq!(e.matches("\n  line ").count(), MAX_BAD_SHOWN, "{e}");
        assert!(!e.contains("line 30"), "{e}");
    }

    // Goal: batches hold at most `batch_size` operations and stay under
    // the write's value limit, yet always move on. Method: small
    // operations, then operations of many values.
    #[test]
    fn batches_respect_size_and_values() {
        let ops: Vec<(usize, Value)> = (0..10).map(|i| (i + 1, put(i))).collect();
        assert_eq!(batch_end(&ops, 0, 4), 4);
        assert_eq!(batch_end(&ops, 8, 4), 10);
        let wide = |i| {
            let value: Vec<usize> = (0..MAX_WRITE_VALUES / 3).collect();
            (
                i,
                serde_json::json!({"op": "put", "container": "c", "key": "k", "value": value}),
            )
        };
        let big: Vec<(usize, Value)> = (1..=4).map(wide).collect();
        assert_eq!(batch_end(&big, 0, 100), 2);
        assert_eq!(batch_end(&big, 3, 100), 4);
        let one = vec![(
            1,
            serde_json::json!({"value": (0..MAX_WRITE_VALUES * 2).collect::<Vec<_>>()}),
        )];
        assert_eq!(batch_end(&one, 0, 100), 1, "one operation goes alone");
    }

    // Goal: the tally lists failures of their own, not the aborted, and
    // says how the import went. Method: a reply with one failure and one
    // abort.
    #[test]
    fn the_tally_lists_failures_of_their_own() {
        let reply: BatchReply = serde_json::from_value(serde_json::json!({
            "ok": false, "applied": 1, "failed": 2, "durable": true, "containers": [],
            "results": [
                {"ok": true},
                {"ok": false, "error": {"code": "bad_request", "message": "no"}},
                {"ok": false, "error": {"code": "batch_aborted", "message": "aborted"}},
            ],
        }))
        .expect("a reply");
        let sent: Vec<(usize, Value)> = (1..=3).map(|i| (i * 10, put(i))).collect();
        let mut t = ImportTally::default();
        t.add(&sent, &reply);
        assert_eq!((t.applied, t.failed), (1, 2));
        assert_eq!(t.failure_lines(), ["line 20: bad_request: no"]);
        assert_eq!(
            t.summary(3, 2.0),
            "imported 1 of 3 operations in 2.0 s (0/s); 2 failed; durable=true"
        );
        assert_eq!(t.to_json(3, 2.0)["failures"][0]["line"], 20);
        assert!(
            t.error()
                .is_some_and(|e| e.starts_with("2 operation(s) failed"))
        );
        assert!(ImportTally::default().error().is_none());
    }
}
