//! A stream of server-sent events (`text/event-stream`) read as it passes,
//! in pieces cut anywhere: each event's data is handed over once the event
//! is whole, and nothing else is kept. LLM APIs stream their answers so, and
//! report the tokens used in one of the last events.
//!
//! ```text
//! event: message_delta\r\n
//! data: {"type":"message_delta",\r\n
//! data: "usage":{"output_tokens":15}}\r\n
//! \r\n
//! ```
//!
//! The format is the WHATWG one: lines end in `\r\n`, `\n` or `\r`; a blank
//! line ends an event; its `data:` lines (one leading space dropped) are its
//! data, joined by `\n`; other fields and `:` comments are passed over, and
//! a byte order mark at the start is too. Memory is one event's: an event
//! whose data passes [`MAX_EVENT`] is passed over and counted
//! ([`Scanner::skipped`]).
//!
//! A [`Scanner`] also edits a stream ([`Scanner::edit`]): it then holds each
//! event's bytes back until the event is whole, and writes it out as it
//! came, without some bytes of its data, or not at all ([`Verdict`]). An app
//! acts on an event only once it is whole, so holding its start back delays
//! nothing it sees. An event too large to hold is written out as it comes,
//! unedited.

use std::ops::Range;

/// The largest event read: its data, and in an edited stream its bytes (1 MiB).
pub const MAX_EVENT: usize = 1024 * 1024;
/// The most room a buffer keeps between events: a larger one is given back.
const KEEP: usize = 64 * 1024;
/// UTF-8's byte order mark, which a stream may start with.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// What becomes of an event of an edited stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// It goes out as it came.
    Keep,
    /// It goes out without these bytes of its data (unedited, if they
    /// span two of its `data:` lines).
    Cut(Range<usize>),
    /// It does not go out.
    Drop,
}

/// Reads the events of one stream; see the module docs.
#[derive(Debug)]
pub(crate) struct Scanner {
    /// The current line, when it began in an earlier piece.
    line: Vec<u8>,
    /// Bytes of the current line so far, kept or not.
    line_len: usize,
    /// The current event's data: each `data:` value followed by `\n`.
    data: Vec<u8>,
    /// The last piece ended with `\r`: a `\n` first in the next one ends the same line.
    cr: bool,
    /// The current event passed [`MAX_EVENT`]: the rest of it is passed over.
    over: bool,
    /// No line has ended yet: the stream's first may start with a byte order mark.
    fresh: bool,
    /// Events passed over for their size, so far.
    pub(crate) skipped: u64,
    /// Set for an edited stream: the current event's bytes.
    raw: Option<Raw>,
}

/// The bytes of the current event of an edited stream, held back until it is whole.
#[derive(Debug, Default)]
struct Raw {
    bytes: Vec<u8>,
    /// Where the current line starts in `bytes`.
    line_start: usize,
    /// Each `data:` value: where it starts in the data, and in `bytes`.
    values: Vec<(usize, usize)>,
    /// The last piece ended with the `\r` that ended an event, which went out
    /// (true) or not: a `\n` first in the next piece goes with it.
    after_event: Option<bool>,
}

impl Scanner {
    /// A scanner of a stream that is read (`edited`: and edited) from its first byte.
    pub(crate) fn new(edited: bool) -> Self {
        Scanner {
            line: Vec::new(),
            line_len: 0,
            data: Vec::new(),
            cr: false,
            over: false,
            fresh: true,
            skipped: 0,
            raw: edited.then(Raw::default),
        }
    }

    /// Whether the stream is edited.
    pub(crate) fn edits(&self) -> bool {
        self.raw.is_some()
    }

    /// Stops editing: what is held back of the current event is forgotten
    /// (nobody will read it), and the rest is only read.
    pub(crate) fn stop_editing(&mut self) {
        self.raw = None;
    }

    /// Reads the next piece of the stream, handing each whole event's data
    /// to `event` (whose verdict matters only when editing).
    pub(crate) fn scan(&mut self, piece: &[u8], event: &mut impl FnMut(&[u8]) -> Verdict) {
        self.feed(piece, &mut Vec::new(), event);
    }

    /// Reads the next piece of an edited stream, appending to `out` what
    /// goes out of it: the events it ends, as `event` judges them, and the
    /// bytes of an event too large to hold.
    pub(crate) fn edit(&mut self, piece: &[u8], out: &mut Vec<u8>, event: &mut impl FnMut(&[u8]) -> Verdict) {
        self.feed(piece, out, event);
    }

    /// The stream has ended: an event it did not end with a blank line is
    /// read all the same (its cost was spent), and what was held back of it
    /// goes out as it came.
    pub(crate) fn end(&mut self, out: &mut Vec<u8>, event: &mut impl FnMut(&[u8]) -> Verdict) {
        if self.line_len > 0 && !self.over {
            let line = std::mem::take(&mut self.line);
            self.field(&line, out);
            self.line = line;
        }
        if !self.over && !self.data.is_empty() {
            self.data.pop();
            event(&self.data);
        }
        if let Some(raw) = &mut self.raw {
            out.extend_from_slice(&raw.bytes);
            raw.bytes.clear();
        }
        self.line.clear();
        self.line_len = 0;
        self.data.clear();
    }

    fn feed(&mut self, mut piece: &[u8], out: &mut Vec<u8>, event: &mut impl FnMut(&[u8]) -> Verdict) {
        if piece.is_empty() {
            // An empty piece (hyper may yield one) leaves a pending `\r` pending.
            return;
        }
        if std::mem::take(&mut self.cr) && piece.first() == Some(&b'\n') {
            // The `\n` of a `\r\n` cut in two goes where its `\r` went.
            match self.raw.as_mut().map(|r| r.after_event.take()) {
                Some(Some(true)) => out.push(b'\n'),
                Some(Some(false)) | None => {}
                Some(None) => {
                    self.keep_raw(b"\n", out);
                    if let Some(raw) = &mut self.raw {
                        raw.line_start = raw.bytes.len();
                    }
                }
            }
            piece = &piece[1..];
        }
        if let Some(raw) = &mut self.raw {
            raw.after_event = None;
        }
        while !piece.is_empty() {
            let Some(k) = memchr::memchr2(b'\r', b'\n', piece) else {
                self.partial(piece, out);
                return;
            };
            let crlf = piece[k] == b'\r' && piece.get(k + 1) == Some(&b'\n');
            let used = k + 1 + usize::from(crlf);
            self.keep_raw(&piece[..used], out);
            let ended = self.line_end(&piece[..k], out, event);
            if piece[k] == b'\r' && !crlf && used == piece.len() {
                self.cr = true;
                if let Some(raw) = &mut self.raw {
                    raw.after_event = ended;
                }
            }
            piece = &piece[used..];
        }
    }

    /// A line's bytes that do not end it.
    fn partial(&mut self, bytes: &[u8], out: &mut Vec<u8>) {
        self.keep_raw(bytes, out);
        self.line_len += bytes.len();
        if self.over {
            return;
        }
        if self.line.len() + self.data.len() + bytes.len() > MAX_EVENT {
            self.overflow(out);
            return;
        }
        self.line.extend_from_slice(bytes);
    }

    /// Holds back an edited stream's bytes, or, for an event too large to
    /// hold, writes them out.
    fn keep_raw(&mut self, bytes: &[u8], out: &mut Vec<u8>) {
        let Some(raw) = &mut self.raw else { return };
        if self.over {
            out.extend_from_slice(bytes);
        } else if raw.bytes.len() + bytes.len() > MAX_EVENT {
            out.extend_from_slice(&raw.bytes);
            out.extend_from_slice(bytes);
            raw.bytes.clear();
            self.overflow(out);
        } else {
            raw.bytes.extend_from_slice(bytes);
        }
    }

    /// The current event is too large: what is kept of it is dropped, and the rest passed over.
    fn overflow(&mut self, out: &mut Vec<u8>) {
        if let Some(raw) = &mut self.raw {
            out.extend_from_slice(&raw.bytes);
            raw.bytes.clear();
            raw.values.clear();
        }
        self.over = true;
        self.line.clear();
        self.data.clear();
    }

    /// A line ended (`tail`: its bytes in this piece). Returns, when it
    /// ended an event of an edited stream, whether the event went out.
    fn line_end(&mut self, tail: &[u8], out: &mut Vec<u8>, event: &mut impl FnMut(&[u8]) -> Verdict) -> Option<bool> {
        let len = std::mem::take(&mut self.line_len) + tail.len();
        if len == 0 {
            self.fresh = false;
            return self.dispatch(out, event);
        }
        if !self.over {
            if self.line.is_empty() {
                self.field(tail, out);
            } else if self.line.len() + self.data.len() + tail.len() > MAX_EVENT {
                self.overflow(out);
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(tail);
                self.field(&line, out);
                line.clear();
                self.line = line;
            }
        }
        self.fresh = false;
        if let Some(raw) = &mut self.raw {
            raw.line_start = raw.bytes.len();
        }
        None
    }

    /// Reads one whole line of an event: a `data` field adds its value to the data.
    fn field(&mut self, line: &[u8], out: &mut Vec<u8>) {
        let text = match self.fresh {
            true => line.strip_prefix(BOM).unwrap_or(line),
            false => line,
        };
        let Some(rest) = text.strip_prefix(b"data") else { return };
        let value = match rest {
            [] => rest,
            [b':', b' ', v @ ..] | [b':', v @ ..] => v,
            // Another field whose name starts with `data`.
            _ => return,
        };
        if self.data.len() + value.len() + 1 > MAX_EVENT {
            self.overflow(out);
            return;
        }
        if let Some(raw) = &mut self.raw {
            raw.values.push((self.data.len(), raw.line_start + line.len() - value.len()));
        }
        self.data.extend_from_slice(value);
        self.data.push(b'\n');
    }

    /// A blank line: the event is whole. Returns, for an edited stream, whether it went out.
    fn dispatch(&mut self, out: &mut Vec<u8>, event: &mut impl FnMut(&[u8]) -> Verdict) -> Option<bool> {
        let verdict = match std::mem::take(&mut self.over) {
            true => {
                self.skipped += 1;
                None
            }
            false if self.data.is_empty() => None,
            false => {
                self.data.pop();
                Some(event(&self.data))
            }
        };
        self.data.clear();
        shrink(&mut self.data);
        shrink(&mut self.line);
        let raw = self.raw.as_mut()?;
        let went = match verdict.unwrap_or(Verdict::Keep) {
            Verdict::Keep => {
                out.extend_from_slice(&raw.bytes);
                true
            }
            Verdict::Drop => false,
            Verdict::Cut(cut) => {
                match raw.locate(&cut) {
                    Some(at) => {
                        out.extend_from_slice(&raw.bytes[..at.start]);
                        out.extend_from_slice(&raw.bytes[at.end..]);
                    }
                    None => out.extend_from_slice(&raw.bytes),
                }
                true
            }
        };
        raw.bytes.clear();
        raw.values.clear();
        raw.line_start = 0;
        shrink(&mut raw.bytes);
        Some(went)
    }
}

impl Raw {
    /// Where the data bytes `cut` are in `bytes`, if in one `data:` value.
    fn locate(&self, cut: &Range<usize>) -> Option<Range<usize>> {
        let i = self.values.iter().rposition(|(d, _)| *d <= cut.start)?;
        let (d, b) = self.values[i];
        // A value ends where the next begins, less its `\n`.
        let end = self.values.get(i + 1).map_or(usize::MAX, |(next, _)| next - 1);
        (cut.end <= end).then(|| b + (cut.start - d)..b + (cut.end - d))
    }
}

/// Gives back the room of a buffer a large event grew.
fn shrink(buf: &mut Vec<u8>) {
    if buf.capacity() > KEEP {
        *buf = Vec::new();
    }
}

#[cfg(test)]
mod tests;
