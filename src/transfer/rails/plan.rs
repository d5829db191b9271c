//! How a rails transfer is cut and spread: pieces into slices, and which rail takes the next
//! slice. Plain arithmetic over counters, no verbs: the one place the striping policy lives.

use std::collections::VecDeque;

/// A slice of one piece: bytes `start..start + len` of piece `piece`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cut {
    pub(crate) piece: usize,
    pub(crate) start: u64,
    pub(crate) len: u64,
}

/// The pieces of `lens` bytes cut, in order, into slices of at most `slice` bytes (a piece of
/// no bytes has none). `slice` is at least 1.
pub(crate) fn cut(lens: &[u64], slice: u64) -> VecDeque<Cut> {
    let slice = slice.max(1);
    let mut cuts = VecDeque::new();
    for (piece, &len) in lens.iter().enumerate() {
        let mut start = 0;
        while start < len {
            let n = slice.min(len - start);
            cuts.push_back(Cut { piece, start, len: n });
            start += n;
        }
    }
    cuts
}

/// Where the next slice goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Choice {
    /// Post it on this rail.
    Rail(usize),
    /// Every rail that may take it is at its window: wait for a completion first.
    Full,
    /// No rail may take it (none lives, or none reaches the piece).
    Unreachable,
}

/// One rail as the policy sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Load {
    /// Whether the rail may take the slice (alive, reaches the piece's memory on both sides).
    pub(crate) usable: bool,
    /// Whether the rail's device is on the piece's NUMA node.
    pub(crate) local: bool,
    /// Bytes posted on the rail and not yet completed (by every transfer sharing it).
    pub(crate) outstanding: u64,
}

/// The rail for a slice of `len` bytes: among the usable rails — only the local ones if any
/// local rail is usable — the one with the fewest outstanding bytes whose window (`window`
/// bytes outstanding at most) has room; the lowest index on a tie. A transfer with nothing of
/// its own in flight (`idle`) always gets a rail if one is usable, so it never waits on other
/// transfers' slices alone. Spreading by outstanding bytes, not in turn, gives a slow rail
/// fewer slices: its bytes stay outstanding longer.
pub(crate) fn choose(rails: &[Load], len: u64, window: u64, idle: bool) -> Choice {
    let any_local = rails.iter().any(|l| l.usable && l.local);
    let candidates = || rails.iter().enumerate().filter(move |(_, l)| l.usable && (l.local || !any_local));
    let Some((best, load)) = candidates().min_by_key(|(i, l)| (l.outstanding, *i)) else {
        return Choice::Unreachable;
    };
    if idle || load.outstanding == 0 || load.outstanding.saturating_add(len) <= window {
        Choice::Rail(best)
    } else {
        Choice::Full
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn load(usable: bool, local: bool, outstanding: u64) -> Load {
        Load { usable, local, outstanding }
    }

    #[test]
    fn the_least_loaded_rail_with_room_takes_the_slice() {
        let rails = [load(true, false, 300), load(true, false, 100), load(true, false, 200)];
        assert_eq!(choose(&rails, 100, 1000, false), Choice::Rail(1));
        // Full windows: wait, unless the transfer has nothing in flight.
        let full = [load(true, false, 1000), load(true, false, 950)];
        assert_eq!(choose(&full, 100, 1000, false), Choice::Full);
        assert_eq!(choose(&full, 100, 1000, true), Choice::Rail(1));
        // An empty rail takes a slice larger than the window.
        assert_eq!(choose(&[load(true, false, 0)], 5000, 1000, false), Choice::Rail(0));
        // Ties go to the lowest index.
        assert_eq!(choose(&[load(true, false, 7), load(true, false, 7)], 1, 100, false), Choice::Rail(0));
    }

    #[test]
    fn dead_rails_and_remote_nodes_are_passed_over() {
        let rails = [load(false, true, 0), load(true, false, 500), load(true, true, 900)];
        // The usable local rail wins over a less loaded remote one.
        assert_eq!(choose(&rails, 100, 1000, false), Choice::Rail(2));
        assert_eq!(choose(&rails, 200, 1000, false), Choice::Full);
        // No local rail usable: any usable rail.
        let rails = [load(false, true, 0), load(true, false, 500)];
        assert_eq!(choose(&rails, 100, 1000, false), Choice::Rail(1));
        assert_eq!(choose(&[load(false, false, 0)], 1, 10, true), Choice::Unreachable);
        assert_eq!(choose(&[], 1, 10, true), Choice::Unreachable);
    }

    #[test]
    fn a_slow_rail_gets_fewer_slices() {
        // Rail 1 completes a slice every 3 rounds, rail 0 every round: spread by outstanding
        // bytes, rail 0 carries most.
        let mut out = [0u64; 2];
        let mut posted = [0u64; 2];
        let mut queue: [VecDeque<u64>; 2] = Default::default();
        for round in 0..300u64 {
            while let Choice::Rail(r) =
                choose(&[load(true, false, out[0]), load(true, false, out[1])], 10, 40, out == [0, 0])
            {
                out[r] += 10;
                posted[r] += 1;
                queue[r].push_back(10);
            }
            for (r, every) in [(0, 1), (1, 3)] {
                if round % every == 0 {
                    if let Some(n) = queue[r].pop_front() {
                        out[r] -= n;
                    }
                }
            }
        }
        assert!(posted[0] > 2 * posted[1], "slices per rail: {posted:?}");
    }

    proptest! {
        #[test]
        fn cuts_cover_every_byte_once(lens in proptest::collection::vec(0u64..10_000, 0..20), slice in 1u64..5000) {
            let cuts = cut(&lens, slice);
            let mut next = vec![0u64; lens.len()];
            let mut last = 0;
            for c in &cuts {
                prop_assert!(c.len >= 1 && c.len <= slice);
                prop_assert!(c.piece >= last, "pieces in order");
                last = c.piece;
                prop_assert_eq!(c.start, next[c.piece], "slices of a piece in order, no gap");
                next[c.piece] += c.len;
            }
            prop_assert_eq!(next, lens);
        }
    }
}
