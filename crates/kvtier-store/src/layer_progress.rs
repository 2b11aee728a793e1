//! [`LayerProgress`]: which layers of which blocks of a layer-wise read are
//! in, and which blocks will bring nothing more, so that a caller can wait
//! for one layer of every block while the later layers are still being
//! read. Shared by the store's layer-wise loads (`transfer/layers.rs`:
//! blocks settle when their chunk is done) and the engine's layer-wise
//! restore into G1 pages (blocks settle when a layer could not be
//! decoded).

use std::ops::Range;

/// Which layers of which blocks of a layer-wise load are in.
#[derive(Debug, Clone)]
pub struct LayerProgress {
    layers: usize,
    /// Per block, per layer: decoded into the caller's memory.
    landed: Vec<bool>,
    /// Per block: nothing more will land (its chunk is done).
    settled: Vec<bool>,
    /// Per layer: blocks that have neither landed it nor settled.
    waiting: Vec<usize>,
}

impl LayerProgress {
    /// Nothing in yet, for `blocks` blocks of `layers` layers.
    pub fn new(blocks: usize, layers: u32) -> Self {
        let layers = layers as usize;
        Self {
            layers,
            landed: vec![false; blocks * layers],
            settled: vec![false; blocks],
            waiting: vec![blocks; layers],
        }
    }

    /// Layers `layers` of `block` are in the caller's memory.
    pub fn land(&mut self, block: usize, layers: Range<u32>) {
        let settled = self.settled.get(block).copied().unwrap_or(true);
        for l in layers.map(|l| l as usize).filter(|&l| l < self.layers) {
            if let Some(done) = self.landed.get_mut(block * self.layers + l)
                && !*done
            {
                *done = true;
                if !settled {
                    self.waiting[l] -= 1;
                }
            }
        }
    }

    /// Nothing more lands for `blocks`.
    pub fn settle(&mut self, blocks: Range<usize>) {
        for b in blocks {
            let Some(s) = self.settled.get_mut(b) else {
                continue;
            };
            if std::mem::replace(s, true) {
                continue;
            }
            for l in 0..self.layers {
                if !self.landed[b * self.layers + l] {
                    self.waiting[l] -= 1;
                }
            }
        }
    }

    /// True once layer `layer` of every block is in (or will not come);
    /// true for a layer past the last.
    pub fn ready(&self, layer: u32) -> bool {
        self.waiting
            .get(layer as usize)
            .is_none_or(|&waiting| waiting == 0)
    }

    /// True once layer `layer` of each of the first `blocks` blocks is in
    /// (or will not come); true for a layer past the last.
    pub fn ready_within(&self, layer: u32, blocks: usize) -> bool {
        let l = layer as usize;
        l >= self.layers
            || (0..blocks.min(self.settled.len()))
                .all(|b| self.settled[b] || self.landed[b * self.layers + l])
    }

    /// The first of the leading `blocks` blocks that settled: in a restore
    /// that settles only blocks it could not take, the first that failed.
    pub fn first_settled(&self, blocks: usize) -> Option<usize> {
        self.settled.iter().take(blocks).position(|&s| s)
    }

    /// The layers of `block` not in the caller's memory yet.
    pub fn missing(&self, block: usize) -> Vec<u32> {
        (0..self.layers)
            .filter(|&l| {
                !self
                    .landed
                    .get(block * self.layers + l)
                    .copied()
                    .unwrap_or(false)
            })
            .map(|l| l as u32)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_blocks_are_ready_on_their_own_and_the_first_settled_is_found() {
        let mut p = LayerProgress::new(3, 2);
        p.land(0, 0..2);
        p.land(1, 0..1);
        assert!(p.ready_within(0, 2) && !p.ready_within(0, 3));
        assert!(!p.ready_within(1, 2), "block 1 lacks layer 1");
        assert!(p.ready_within(2, 3), "no layer 2");
        assert_eq!(p.first_settled(3), None);
        p.settle(1..2);
        assert!(p.ready_within(1, 2), "block 1 settled");
        assert_eq!(p.first_settled(3), Some(1));
        assert_eq!(p.first_settled(1), None);
    }

    #[test]
    fn a_layer_is_ready_once_every_block_landed_it_or_settled() {
        let mut p = LayerProgress::new(3, 2);
        assert!(!p.ready(0) && !p.ready(1));
        assert!(p.ready(2), "no layer 2: nothing to wait for");
        p.land(0, 0..1);
        p.land(1, 0..2);
        assert!(!p.ready(0), "block 2 has not landed layer 0");
        p.land(2, 0..1);
        assert!(p.ready(0) && !p.ready(1));
        // Landing twice counts once.
        p.land(2, 0..1);
        assert_eq!(p.waiting, vec![0, 2]);
        assert_eq!(p.missing(0), vec![1]);
        // Block 0 will not land layer 1 (its chunk is done): only block 2
        // is waited for now; settling again changes nothing.
        p.settle(0..1);
        p.settle(0..1);
        assert!(!p.ready(1));
        p.settle(1..3);
        assert!(p.ready(1));
        assert_eq!(p.waiting, vec![0, 0]);
        // A late hand-over of a settled block changes no count.
        p.land(0, 1..2);
        assert_eq!(p.waiting, vec![0, 0]);
    }
}
