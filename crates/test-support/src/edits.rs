//! Byte-level edits for property tests that feed near-valid input to a
//! parser: a real input with a few bytes replaced, inserted, removed, or a
//! slice repeated or cut off. Included by path (`#[path]`), so tests that
//! need no processes do not build the rest of `support`.

#![allow(dead_code)]

use proptest::prelude::*;
use proptest::sample::Index;

/// Replace the byte at the place.
pub const REPLACE: u8 = 0;
/// Insert the byte at the place.
pub const INSERT: u8 = 1;
/// Remove the byte at the place.
pub const REMOVE: u8 = 2;
/// Append a copy of everything from the place on (pipelined or duplicated messages).
pub const REPEAT_TAIL: u8 = 3;
/// Cut everything from the place on.
pub const CUT: u8 = 4;

/// Between `count.start` and `count.end - 1` edits, each one of `ops`.
pub fn edits(ops: &[u8], count: std::ops::Range<usize>) -> impl Strategy<Value = Vec<(Index, u8, u8)>> {
    prop::collection::vec((any::<Index>(), any::<u8>(), prop::sample::select(ops.to_vec())), count)
}

/// Applies `edits` in order; an empty string takes no more edits.
pub fn apply(b: &mut Vec<u8>, edits: &[(Index, u8, u8)]) {
    for (at, byte, op) in edits {
        if b.is_empty() {
            break;
        }
        let i = at.index(b.len());
        match *op {
            REPLACE => b[i] = *byte,
            INSERT => b.insert(i, *byte),
            REMOVE => {
                b.remove(i);
            }
            REPEAT_TAIL => {
                let tail = b[i..].to_vec();
                b.extend_from_slice(&tail);
            }
            _ => b.truncate(i),
        }
    }
}
