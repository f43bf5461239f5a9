//! The `state.events` stream as the CLI reads it: a decoder of
//! server-sent events (bytes in, `(event, data)` out, whatever the chunks
//! the HTTP body arrives in), and the line `state events` prints for a
//! [`ChangeEvent`](super::ChangeEvent). The HTTP client and stdout are the
//! shell's.

/// A server-sent-events decoder: bytes in, (event, data) out.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Longest event kept while waiting for its end; the daemon's are
    /// far smaller.
    pub const MAX_EVENT_BYTES: usize = 1024 * 1024;

    /// Takes the next bytes of the stream and returns the events they
    /// complete: `event` is `message` when the block names none, `data` the
    /// block's `data:` lines joined by newlines; a block without data is
    /// dropped. An unfinished event longer than [`Self::MAX_EVENT_BYTES`]
    /// is dropped too.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<(String, String)> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            let text_end = self
                .buf
                .windows(2)
                .position(|w| w == b"\n\n")
                .map(|i| (i, i + 2));
            let Some((end, next)) = text_end else { break };
            let block = String::from_utf8_lossy(&self.buf[..end]).replace('\r', "");
            self.buf.drain(..next);
            let (mut event, mut data) = ("message".to_owned(), Vec::new());
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    event = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push(v.strip_prefix(' ').unwrap_or(v).to_owned());
                }
            }
            if !data.is_empty() {
                out.push((event, data.join("\n")));
            }
        }
        if self.buf.len() > Self::MAX_EVENT_BYTES {
            self.buf.clear();
        }
        out
    }
}

/// The line `state events` prints for the data of a `change` event (a
/// [`ChangeEvent`](super::ChangeEvent) as JSON): when, which container, how
/// many changes, from where, and the heads cut to 12 hex digits. A field
/// the event lacks prints as `?` (or 0); data that is no JSON is an error.
pub fn change_line(data: &str) -> Result<String, serde_json::Error> {
    let ev: serde_json::Value = serde_json::from_str(data)?;
    let n = ev["changes"].as_u64().unwrap_or(0);
    let heads: Vec<String> = ev["heads"]
        .as_array()
        .map(|hs| {
            hs.iter()
                .filter_map(|h| h.as_str())
                .map(|h| h.chars().take(12).collect())
                .collect()
        })
        .unwrap_or_default();
    Ok(format!(
        "{}  {}  {n} change{}  from {}  heads {}",
        crate::devices::format_unix_ms(ev["at_unix_ms"].as_u64().unwrap_or(0)),
        ev["container"].as_str().unwrap_or("?"),
        if n == 1 { "" } else { "s" },
        match ev["origin"].as_str() {
            Some("local") => "this device",
            Some("peer") => "a peer",
            Some(other) => other,
            None => "?",
        },
        heads.join(",")
    ))
}

#[cfg(test)]
mod tests {
    //! The decoder over any split of the stream, and the printed line.
    use super::*;

    // Goal: the same events come out however the bytes are chunked, CRs
    // in a block and a missing event name included, and a data-less block
    // is dropped (a block ends at "\n\n"). Method: one stream pushed
    // whole, byte by byte, and in two halves.
    #[test]
    fn events_survive_any_chunking() {
        let stream = b"event: ready\ndata: {}\n\n: keep-alive\n\nevent:change\r\ndata: a\r\ndata:b\n\ndata: plain\n\nevent: lagged\n\n";
        let want = vec![
            ("ready".to_owned(), "{}".to_owned()),
            ("change".to_owned(), "a\nb".to_owned()),
            ("message".to_owned(), "plain".to_owned()),
        ];
        assert_eq!(SseParser::default().push(stream), want);
        let mut p = SseParser::default();
        let bytewise: Vec<_> = stream.iter().flat_map(|b| p.push(&[*b])).collect();
        assert_eq!(bytewise, want);
        let mut p = SseParser::default();
        let (a, b) = stream.split_at(20);
        let halves: Vec<_> = p.push(a).into_iter().chain(p.push(b)).collect();
        assert_eq!(halves, want);
    }

    // Goal: an event that never ends is not kept past the cap. Method: an
    // endless data line, then a whole event.
    #[test]
    fn an_endless_event_is_dropped() {
        let mut p = SseParser::default();
        let long = vec![b'x'; SseParser::MAX_EVENT_BYTES + 1];
        assert!(p.push(b"data: ").is_empty());
        assert!(p.push(&long).is_empty());
        assert_eq!(
            p.push(b"data: ok\n\n"),
            vec![("message".into(), "ok".into())]
        );
    }

    // Goal: a change event prints as one line, and what it lacks prints
    // as `?`. Method: a full event, a bare one, and no JSON.
    #[test]
    fn change_lines() {
        let full = r#"{"container":"notes","changes":1,"heads":["0123456789abcdef"],
                      "origin":"peer","at_unix_ms":0}"#;
        assert_eq!(
            change_line(full).unwrap(),
            "1970-01-01T00:00:00Z  notes  1 change  from a peer  heads 0123456789ab"
        );
        let bare = change_line(r#"{"changes":2,"origin":"local","heads":["a","b"]}"#).unwrap();
        assert!(
            bare.ends_with("  ?  2 changes  from this device  heads a,b"),
            "{bare}"
        );
        assert!(change_line("{").is_err());
    }
}
