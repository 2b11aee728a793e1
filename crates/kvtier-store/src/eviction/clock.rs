//! CLOCK (second chance) over a fixed array of slots.
//!
//! A hit sets a slot's reference bit; the hand walks the slots in a circle,
//! clears set bits as it passes and stops at the first unreferenced slot it
//! may take. Slots it may not take (empty, pinned by a reader, being
//! written) are passed over. Two turns of the hand visit every slot with its
//! bit cleared once, so a victim is found whenever one exists.
//!
//! The policy holds no state of its own beyond the hand: the caller keeps
//! the reference bits where its slots are, and tells the sweep what it sees.

/// What the hand finds at one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visit {
    /// Not a candidate (free, pinned, being written): pass over it.
    Skip,
    /// Referenced since the last pass: the visitor cleared its bit; pass
    /// over it this time.
    SecondChance,
    /// Unreferenced and unpinned: take it.
    Take,
}

/// Moves `hand` round `n` slots, at most two turns, calling `visit` at each,
/// and returns the first slot `visit` takes (the hand is left just past
/// it). `None` when no slot can be taken.
pub fn sweep(hand: &mut usize, n: usize, mut visit: impl FnMut(usize) -> Visit) -> Option<usize> {
    if n == 0 {
        return None;
    }
    for _ in 0..2 * n {
        let i = *hand % n;
        *hand = (i + 1) % n;
        if visit(i) == Visit::Take {
            return Some(i);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A referenced / pinned slot array driven the way G3 drives it.
    fn pick(referenced: &mut [bool], pinned: &[bool], hand: &mut usize) -> Option<usize> {
        sweep(hand, referenced.len(), |i| {
            if pinned[i] {
                Visit::Skip
            } else if referenced[i] {
                referenced[i] = false;
                Visit::SecondChance
            } else {
                Visit::Take
            }
        })
    }

    #[test]
    fn second_chance_then_take_and_pinned_never() {
        let mut referenced = [true, false, true, false];
        let pinned = [false, true, false, false];
        let mut hand = 0;
        // 0 referenced (cleared), 1 pinned, 2 referenced (cleared), 3 taken.
        assert_eq!(pick(&mut referenced, &pinned, &mut hand), Some(3));
        assert_eq!(hand, 0);
        // Next: 0 has lost its bit.
        assert_eq!(pick(&mut referenced, &pinned, &mut hand), Some(0));
        assert_eq!(pick(&mut referenced, &pinned, &mut hand), Some(2));
        assert_eq!(referenced, [false; 4]);
    }

    #[test]
    fn all_referenced_takes_after_one_turn_and_all_pinned_takes_none() {
        let mut referenced = [true; 3];
        let mut hand = 1;
        assert_eq!(pick(&mut referenced, &[false; 3], &mut hand), Some(1));
        assert_eq!(pick(&mut [false; 3], &[true; 3], &mut hand), None);
        assert_eq!(sweep(&mut hand, 0, |_| Visit::Take), None);
    }
}
