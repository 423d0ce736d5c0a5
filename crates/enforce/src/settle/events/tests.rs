use proptest::prelude::*;

use super::*;

/// The events of `stream` read whole, line by line, as the format says:
/// what the scanner must find however the stream is cut.
fn reference(stream: &[u8]) -> Vec<Vec<u8>> {
    let mut lines = Vec::new();
    let (mut i, mut start) = (0, 0);
    while i < stream.len() {
        match stream[i] {
            b'\n' => {
                lines.push(&stream[start..i]);
                start = i + 1;
            }
            b'\r' => {
                lines.push(&stream[start..i]);
                if stream.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    if start < stream.len() {
        lines.push(&stream[start..]);
    }
    let (mut events, mut data) = (Vec::new(), Vec::<u8>::new());
    for (n, line) in lines.into_iter().enumerate() {
        let line = if n == 0 { line.strip_prefix(BOM).unwrap_or(line) } else { line };
        if line.is_empty() {
            if !data.is_empty() {
                data.pop();
                events.push(std::mem::take(&mut data));
            }
            continue;
        }
        let value = match line.strip_prefix(b"data") {
            Some([]) => &b""[..],
            Some([b':', b' ', v @ ..] | [b':', v @ ..]) => v,
            _ => continue,
        };
        data.extend_from_slice(value);
        data.push(b'\n');
    }
    if !data.is_empty() {
        data.pop();
        events.push(data);
    }
    events
}

/// The events a scanner finds in `pieces`, and what it writes out when it
/// edits with `judge`.
fn scanned(pieces: &[&[u8]], edited: bool, judge: impl Fn(&[u8]) -> Verdict) -> (Vec<Vec<u8>>, Vec<u8>, u64) {
    let mut s = Scanner::new(edited);
    let (mut events, mut out) = (Vec::new(), Vec::new());
    let mut on = |d: &[u8]| {
        events.push(d.to_vec());
        judge(d)
    };
    for p in pieces {
        match edited {
            true => s.edit(p, &mut out, &mut on),
            false => s.scan(p, &mut on),
        }
    }
    s.end(&mut out, &mut on);
    (events, out, s.skipped)
}

const SAMPLE: &[u8] =
    b"\xEF\xBB\xBFevent: start\r\ndata: {\"a\":1}\r\n\r\n: keep-alive\n\ndata:{\"b\":2,\"usage\":null}\n\
    data\ndata:  two spaces\r\rid: 7\rdata: {\"choices\":[],\"usage\":{\"total_tokens\":9}}\n\ndatabase: no\n\n\
    data: [DONE]\n\n";

#[test]
fn a_stream_cut_at_every_byte_gives_the_same_events() {
    let whole = reference(SAMPLE);
    assert_eq!(whole.len(), 4, "{whole:?}");
    assert_eq!(whole[1], b"{\"b\":2,\"usage\":null}\n\n two spaces");
    for cut in 0..=SAMPLE.len() {
        let (a, b) = SAMPLE.split_at(cut);
        assert_eq!(scanned(&[a, b], false, |_| Verdict::Keep).0, whole, "cut at {cut}");
        let (events, out, _) = scanned(&[a, b], true, |_| Verdict::Keep);
        assert_eq!(events, whole, "cut at {cut}, edited");
        assert_eq!(out, SAMPLE, "cut at {cut}: kept, the bytes go out as they came");
    }
    let bytes: Vec<&[u8]> = SAMPLE.chunks(1).collect();
    assert_eq!(scanned(&bytes, false, |_| Verdict::Keep).0, whole, "a byte at a time");
}

#[test]
fn an_edited_stream_loses_only_what_is_judged_away() {
    let judge = |d: &[u8]| {
        if d.starts_with(b"{\"choices\":[]") {
            return Verdict::Drop;
        }
        match memchr::memmem::find(d, b",\"usage\":null") {
            Some(at) => Verdict::Cut(at..at + 13),
            None => Verdict::Keep,
        }
    };
    let want: &[u8] = b"\xEF\xBB\xBFevent: start\r\ndata: {\"a\":1}\r\n\r\n: keep-alive\n\ndata:{\"b\":2}\n\
        data\ndata:  two spaces\r\rdatabase: no\n\ndata: [DONE]\n\n";
    for cut in 0..=SAMPLE.len() {
        for second in [cut, (cut + 7).min(SAMPLE.len())] {
            let pieces = [&SAMPLE[..cut], &SAMPLE[cut..second], &SAMPLE[second..]];
            let (_, out, _) = scanned(&pieces, true, judge);
            assert_eq!(String::from_utf8_lossy(&out), String::from_utf8_lossy(want), "cut at {cut} and {second}");
        }
    }
}

#[test]
fn a_cut_across_two_data_lines_leaves_the_event_as_it_came() {
    let stream = b"data: {\"a\":\ndata: 1}\n\n";
    let (events, out, _) = scanned(&[stream], true, |_| Verdict::Cut(3..8));
    assert_eq!(events, [b"{\"a\":\n1}".to_vec()]);
    assert_eq!(out, stream);
    let (_, out, _) = scanned(&[stream], true, |_| Verdict::Cut(1..4));
    assert_eq!(out, b"data: {:\ndata: 1}\n\n", "within one line, the bytes go");
}

#[test]
fn an_event_over_the_bound_is_passed_over_counted_and_sent_unedited() {
    let big = format!("data: {}\n\n", "x".repeat(MAX_EVENT + 10));
    let stream = format!("data: 1\n\n{big}data: 2\n\n");
    for size in [1000, 65536, stream.len()] {
        let pieces: Vec<&[u8]> = stream.as_bytes().chunks(size).collect();
        let (events, _, skipped) = scanned(&pieces, false, |_| Verdict::Keep);
        assert_eq!(events, [b"1".to_vec(), b"2".to_vec()], "pieces of {size}");
        assert_eq!(skipped, 1);
        let (events, out, skipped) = scanned(&pieces, true, |_| Verdict::Drop);
        assert_eq!(events.len(), 2);
        assert_eq!(skipped, 1);
        assert_eq!(out, big.as_bytes(), "pieces of {size}: the big event went out as it came; the others were dropped");
    }
}

#[test]
fn memory_stays_within_one_event() {
    let mut s = Scanner::new(true);
    let mut out = Vec::new();
    let event = format!("data: {}\n\n", "y".repeat(200 * 1024));
    for _ in 0..20 {
        s.edit(event.as_bytes(), &mut out, &mut |_| Verdict::Keep);
        assert!(s.data.capacity() <= KEEP && s.raw.as_ref().unwrap().bytes.capacity() <= KEEP);
        out.clear();
    }
    let endless = vec![b'z'; 64 * 1024];
    s.edit(b"data: ", &mut out, &mut |_| Verdict::Keep);
    for _ in 0..40 {
        s.edit(&endless, &mut out, &mut |_| Verdict::Keep);
    }
    assert!(s.line.capacity() + s.data.capacity() <= 2 * MAX_EVENT, "an endless line is not kept whole");
    assert_eq!(out.len(), 40 * endless.len() + 6, "and goes out as it comes, once it is too large to hold");
}

/// A line of a stream: a field, a comment or a blank line, and its end.
fn line() -> impl Strategy<Value = Vec<u8>> {
    let text = proptest::collection::vec(prop_oneof![Just(b'a'), Just(b':'), Just(b' '), Just(b'{'), Just(b'"')], 0..6);
    let field = prop_oneof![
        Just(&b"data: "[..]),
        Just(&b"data:"[..]),
        Just(&b"data"[..]),
        Just(&b"event: "[..]),
        Just(&b": "[..]),
        Just(&b""[..])
    ];
    let end = prop_oneof![Just(&b"\n"[..]), Just(&b"\r\n"[..]), Just(&b"\r"[..])];
    (field, text, end).prop_map(|(f, t, e)| [f, &t[..], e].concat())
}

proptest! {
    #[test]
    fn any_stream_cut_anywhere_reads_as_the_reference(
        lines in proptest::collection::vec(line(), 0..30),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let stream = lines.concat();
        let mut at: Vec<usize> = cuts.iter().map(|c| c.index(stream.len() + 1)).collect();
        at.sort_unstable();
        let mut pieces = Vec::new();
        let mut from = 0;
        for a in at {
            pieces.push(&stream[from..a]);
            from = a;
        }
        pieces.push(&stream[from..]);
        prop_assert_eq!(scanned(&pieces, false, |_| Verdict::Keep).0, reference(&stream));
        let (events, out, _) = scanned(&pieces, true, |_| Verdict::Keep);
        prop_assert_eq!(events, reference(&stream));
        prop_assert_eq!(out, stream);
    }
}
