//! One image's accumulation: per block, the reads its guests reported, the
//! distinct guests that read it and whether it was read as a listed block.
//!
//! Everything is bounded, whatever clients send:
//!
//! * **blocks**: at most `max_blocks` (`feedback.max_blocks`).  A new block
//!   beyond that first evicts the smallest sixteenth of the table, smallest
//!   by (guests, reads): a flood of distinct blocks from one guest evicts
//!   its own kind before any block two guests read.  Evicted blocks are
//!   counted ([`Tally::evicted`]).  Counts are never inherited by the block
//!   that takes the place (unlike the classic space-saving sketch): what is
//!   published is never more than guests really reported.
//! * **guests per block**: at most 16 distinct guests, saturating (a block
//!   with 16 counts "16 or more").  Two guest indices are stored in the
//!   entry itself; a third moves them to a 16-slot chunk of a slab (at most
//!   one chunk per block, freed chunks are reused).
//! * **guests**: each distinct guest (pid and start time of its QEMU) gets a
//!   16-bit index; after 65535 of them in one accumulation, the rest share
//!   one index, so they count as one guest per block (fewer, never more).
//!
//! Memory at the default 1,048,576 blocks: the table holds 2^21 buckets of
//! 24 bytes + 1 control byte (about 52 MiB) and up to 32 bytes more per
//! block read by three or more guests; [`Tally::memory_bytes`] estimates it
//! and a test checks it with 10^6 distinct blocks.

use super::summary::{Record, Summary, FLAG_LISTED, MAX_GUESTS_PER_BLOCK};
use std::collections::HashMap;
use std::mem::size_of;

/// A guest: one QEMU process, as its pid and its start time (clock ticks
/// after boot, field 22 of /proc/PID/stat), so a reused pid is another
/// guest.
pub type GuestId = (u32, u64);

const PER_BLOCK: usize = MAX_GUESTS_PER_BLOCK as usize;
/// Guest indices kept in the entry itself.
const INLINE: usize = 2;
/// The index every guest past the first 65535 shares.
const OVERFLOW: u16 = u16::MAX;

#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    reads: u32,
    /// Up to INLINE guest indices (16 bits each), or the slab chunk index.
    ids: u32,
    /// FLAG_LISTED
    flags: u8,
    /// Guests counted before a restart (read back from Redis): their
    /// identities are not known, only how many.
    restored: u8,
    /// Guest indices held.
    n: u8,
}

impl Entry {
    fn guests(&self) -> u32 {
        (self.restored as u32 + self.n as u32).min(MAX_GUESTS_PER_BLOCK)
    }

    /// What eviction compares: guests first, then reads.
    fn weight(&self) -> u64 {
        (self.guests() as u64) << 32 | self.reads as u64
    }
}

/// How a report's blocks fared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Added {
    pub accepted: usize,
    /// Blocks past the end of the image: ignored.
    pub outside: usize,
}

pub struct Tally {
    image_blocks: u64,
    max_blocks: usize,
    entries: HashMap<u64, Entry>,
    slab: Vec<[u16; PER_BLOCK]>,
    free: Vec<u32>,
    guest_index: HashMap<GuestId, u16>,
    overflow_seen: bool,
    restored_guests: u64,
    /// Unix seconds: the start of this accumulation.
    pub since: u64,
    /// Blocks evicted to stay within `max_blocks`, over the tally's life.
    pub evicted: u64,
}

impl Tally {
    /// An empty accumulation for an image of `image_blocks` 4 KiB blocks.
    pub fn new(image_blocks: u64, max_blocks: usize, since: u64) -> Tally {
        Tally {
            image_blocks,
            max_blocks: max_blocks.max(1),
            entries: HashMap::new(),
            slab: Vec::new(),
            free: Vec::new(),
            guest_index: HashMap::new(),
            overflow_seen: false,
            restored_guests: 0,
            since,
            evicted: 0,
        }
    }

    pub fn blocks(&self) -> usize {
        self.entries.len()
    }

    /// Distinct guests that reported in this accumulation (those before a
    /// restart included, as the hash read back counted them).
    pub fn guests(&self) -> u64 {
        self.restored_guests + self.guest_index.len() as u64 + u64::from(self.overflow_seen)
    }

    fn index_of(&mut self, g: GuestId) -> u16 {
        if let Some(&i) = self.guest_index.get(&g) {
            return i;
        }
        if self.guest_index.len() >= OVERFLOW as usize {
            self.overflow_seen = true;
            return OVERFLOW;
        }
        let i = self.guest_index.len() as u16;
        self.guest_index.insert(g, i);
        i
    }

    /// A READS report of `guest`: (block, reads) of unlisted blocks.
    pub fn add_reads(&mut self, guest: GuestId, entries: &[(u64, u32)]) -> Added {
        let mut out = Added::default();
        let mut gi = None;
        for &(block, reads) in entries {
            if block >= self.image_blocks {
                out.outside += 1;
            } else if reads > 0 {
                let g = *gi.get_or_insert_with(|| self.index_of(guest));
                self.bump(block, g, reads, 0);
                out.accepted += 1;
            }
        }
        out
    }

    /// A LISTED_READ report of `guest`: listed blocks it read for the first
    /// time (one read each).
    pub fn add_listed(&mut self, guest: GuestId, blocks: &[u64]) -> Added {
        let mut out = Added::default();
        let mut gi = None;
        for &block in blocks {
            if block >= self.image_blocks {
                out.outside += 1;
            } else {
                let g = *gi.get_or_insert_with(|| self.index_of(guest));
                self.bump(block, g, 1, FLAG_LISTED as u8);
                out.accepted += 1;
            }
        }
        out
    }

    /// The entry of `block`, made (evicting first if the table is full).
    fn entry(&mut self, block: u64) -> &mut Entry {
        if self.entries.len() >= self.max_blocks && !self.entries.contains_key(&block) {
            self.evict();
        }
        self.entries.entry(block).or_default()
    }

    fn bump(&mut self, block: u64, guest: u16, reads: u32, flags: u8) {
        self.entry(block);
        let e = self.entries.get_mut(&block).expect("just made");
        e.reads = e.reads.saturating_add(reads);
        e.flags |= flags;
        add_guest(e, guest, &mut self.slab, &mut self.free);
    }

    /// Drop the smallest sixteenth (at least one block), by weight.
    fn evict(&mut self) {
        let keep = self.max_blocks - (self.max_blocks / 16).max(1);
        let remove = self.entries.len().saturating_sub(keep);
        if remove == 0 {
            return;
        }
        let mut weights: Vec<u64> = self.entries.values().map(Entry::weight).collect();
        let threshold = *weights.select_nth_unstable(remove - 1).1;
        let below = weights.iter().filter(|&&w| w < threshold).count();
        drop(weights);
        let mut at_threshold = remove - below;
        let free = &mut self.free;
        self.entries.retain(|_, e| {
            let w = e.weight();
            let go = w < threshold || (w == threshold && at_threshold > 0);
            if go {
                if w == threshold {
                    at_threshold -= 1;
                }
                if e.n as usize > INLINE {
                    free.push(e.ids);
                }
            }
            !go
        });
        self.evicted += remove as u64;
    }

    /// Continue from what this host published before a restart: counts are
    /// added, guests per block too (saturating; the guests' identities were
    /// not published, so a guest seen before and after is counted twice),
    /// and the accumulation starts at the earlier `since`.  Returns how many
    /// records fell outside the image (none, for a checked summary).
    pub fn merge(&mut self, s: &Summary) -> usize {
        self.since = self.since.min(s.since);
        self.restored_guests = self.restored_guests.saturating_add(s.guests);
        let mut outside = 0;
        for r in &s.records {
            if r.block >= self.image_blocks {
                outside += 1;
                continue;
            }
            let e = self.entry(r.block);
            e.reads = e.reads.saturating_add(r.reads);
            e.flags |= (r.flags & FLAG_LISTED) as u8;
            e.restored = (e.restored as u32 + r.guests).min(MAX_GUESTS_PER_BLOCK) as u8;
        }
        outside
    }

    /// The records to publish, unsorted ([`super::summary::encode`] sorts).
    pub fn records(&self) -> Vec<Record> {
        self.entries
            .iter()
            .map(|(&block, e)| Record {
                block,
                guests: e.guests(),
                reads: e.reads,
                flags: e.flags as u32,
            })
            .collect()
    }

    /// A new accumulation from `now`; the eviction count stays.
    pub fn start_over(&mut self, now: u64) {
        let evicted = self.evicted;
        *self = Tally::new(self.image_blocks, self.max_blocks, now);
        self.evicted = evicted;
    }

    /// About how many bytes the tally holds (hash tables at 7/8 load, one
    /// control byte per bucket).
    pub fn memory_bytes(&self) -> usize {
        let table =
            |cap: usize, slot: usize| (cap * 8).div_ceil(7).next_power_of_two() * (slot + 1);
        table(self.entries.capacity(), size_of::<(u64, Entry)>())
            + self.slab.capacity() * size_of::<[u16; PER_BLOCK]>()
            + self.free.capacity() * size_of::<u32>()
            + table(self.guest_index.capacity(), size_of::<(GuestId, u16)>())
    }
}

/// Count guest index `g` in `e`, unless it is there or the entry is full.
fn add_guest(e: &mut Entry, g: u16, slab: &mut Vec<[u16; PER_BLOCK]>, free: &mut Vec<u32>) {
    if e.guests() >= MAX_GUESTS_PER_BLOCK {
        return;
    }
    let n = e.n as usize;
    if n <= INLINE {
        let inline = [e.ids as u16, (e.ids >> 16) as u16];
        if inline[..n].contains(&g) {
            return;
        }
        if n < INLINE {
            e.ids |= (g as u32) << (16 * n);
            e.n += 1;
            return;
        }
        let mut chunk = [0u16; PER_BLOCK];
        chunk[..INLINE].copy_from_slice(&inline);
        chunk[INLINE] = g;
        e.ids = match free.pop() {
            Some(slot) => {
                slab[slot as usize] = chunk;
                slot
            }
            None => {
                slab.push(chunk);
                (slab.len() - 1) as u32
            }
        };
        e.n += 1;
        return;
    }
    let chunk = &mut slab[e.ids as usize];
    if !chunk[..n].contains(&g) {
        chunk[n] = g;
        e.n += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feedback::summary::{encode, RECORD_BYTES};

    fn by_block(t: &Tally) -> HashMap<u64, Record> {
        t.records().into_iter().map(|r| (r.block, r)).collect()
    }

    #[test]
    fn reads_add_up_and_guests_are_distinct() {
        let mut t = Tally::new(100, 1000, 5);
        let (a, b) = ((10, 1000), (11, 1000));
        assert_eq!(t.add_reads(a, &[(1, 3), (2, 1)]), Added { accepted: 2, outside: 0 });
        t.add_reads(a, &[(1, 2)]);
        t.add_reads(b, &[(1, 1), (3, 0)]); // a zero count is no read
                                           // The same pid started again later is another guest.
        t.add_reads((10, 2000), &[(1, 1)]);
        t.add_listed(b, &[2, 50]);
        let r = by_block(&t);
        assert_eq!(r[&1], Record { block: 1, guests: 3, reads: 7, flags: 0 });
        assert_eq!(r[&2], Record { block: 2, guests: 2, reads: 2, flags: FLAG_LISTED });
        assert_eq!(r[&50], Record { block: 50, guests: 1, reads: 1, flags: FLAG_LISTED });
        assert!(!r.contains_key(&3));
        assert_eq!((t.blocks(), t.guests(), t.since), (3, 3, 5));
    }

    #[test]
    fn blocks_outside_the_image_are_ignored() {
        let mut t = Tally::new(8, 1000, 0);
        assert_eq!(
            t.add_reads((1, 1), &[(7, 1), (8, 1), (u64::MAX, 9)]),
            Added { accepted: 1, outside: 2 }
        );
        assert_eq!(t.add_listed((1, 1), &[8, 0]), Added { accepted: 1, outside: 1 });
        assert_eq!(t.blocks(), 2);
        // A guest whose every block was refused is not counted.
        t.add_reads((2, 2), &[(9, 1)]);
        assert_eq!(t.guests(), 1);
    }

    #[test]
    fn guests_per_block_saturate_at_16_and_reads_at_u32_max() {
        let mut t = Tally::new(10, 10, 0);
        for pid in 0..40 {
            t.add_reads((pid, 7), &[(4, u32::MAX / 8)]);
            t.add_reads((pid, 7), &[(4, 1)]);
        }
        let r = by_block(&t)[&4];
        assert_eq!((r.guests, r.reads), (16, u32::MAX));
        assert_eq!(t.guests(), 40);
        // Chunks are freed with their blocks and reused.
        for pid in 0..3 {
            t.add_reads((pid, 7), &[(5, 1)]);
        }
        assert_eq!(by_block(&t)[&5].guests, 3);
        assert_eq!(t.slab.len(), 2);
    }

    #[test]
    fn eviction_takes_the_smallest_first() {
        let mut t = Tally::new(1 << 20, 32, 0);
        // Real blocks: read by two guests.
        for g in [(1, 1), (2, 2)] {
            t.add_reads(g, &[(1000, 5), (1001, 1)]);
        }
        // A flood from one guest, with huge counts.
        for b in 0..500 {
            t.add_reads((3, 3), &[(b, u32::MAX)]);
        }
        assert!(t.blocks() <= 32);
        assert!(t.evicted >= 500 + 2 - 32, "{}", t.evicted);
        let r = by_block(&t);
        assert_eq!(r[&1000], Record { block: 1000, guests: 2, reads: 10, flags: 0 });
        assert_eq!(r[&1001], Record { block: 1001, guests: 2, reads: 2, flags: 0 });
        // The last flood block is there: a new block is never its own victim.
        assert!(r.contains_key(&499));
        // A table of one block.
        let mut t = Tally::new(10, 1, 0);
        t.add_reads((1, 1), &[(1, 1), (2, 1)]);
        assert_eq!((t.blocks(), t.evicted), (1, 1));
    }

    #[test]
    fn a_restart_continues_from_the_summary() {
        let mut t = Tally::new(100, 1000, 500);
        t.add_reads((1, 1), &[(1, 2)]);
        let s = Summary {
            host: "h".into(),
            image: "i".into(),
            since: 100,
            updated: 400,
            guests: 5,
            records: vec![
                Record { block: 1, guests: 15, reads: 10, flags: 0 },
                Record { block: 2, guests: 2, reads: 3, flags: FLAG_LISTED },
                Record { block: 200, guests: 1, reads: 1, flags: 0 },
            ],
        };
        assert_eq!(t.merge(&s), 1);
        t.add_reads((2, 2), &[(1, 1), (2, 1)]);
        let r = by_block(&t);
        assert_eq!(r[&1], Record { block: 1, guests: 16, reads: 13, flags: 0 });
        assert_eq!(r[&2], Record { block: 2, guests: 3, reads: 4, flags: FLAG_LISTED });
        assert_eq!((t.since, t.guests()), (100, 7));
        t.start_over(900);
        assert_eq!((t.blocks(), t.guests(), t.since), (0, 0, 900));
    }

    /// Issue 22: the server's memory and the summary stay bounded with 10^6
    /// distinct hot blocks (and more), and the blocks many guests read
    /// survive the flood with their exact counts.
    #[test]
    fn a_million_distinct_blocks_stay_bounded() {
        const MAX: usize = 1 << 20;
        let mut t = Tally::new(1 << 32, MAX, 0);
        let real: Vec<(u64, u32)> = (0..1000).map(|i| ((1 << 31) + i * 7, 3)).collect();
        for g in 0..4 {
            t.add_reads((g, 1), &real);
        }
        // Three guests read some blocks: chunks are used.
        for g in 0..3 {
            t.add_reads((100 + g, 1), &[(5, 1), (6, 1)]);
        }
        let flood: Vec<u64> = (0..1_500_000u64).map(|i| i * 13 + 1000).collect();
        for batch in flood.chunks(254) {
            let e: Vec<(u64, u32)> = batch.iter().map(|&b| (b, 1)).collect();
            t.add_reads((9, 9), &e);
        }
        assert!(t.blocks() <= MAX && t.blocks() > MAX - MAX / 16 - 1, "{}", t.blocks());
        assert!(t.evicted >= 1_500_000 + 1002 - MAX as u64, "{}", t.evicted);
        let mem = t.memory_bytes();
        assert!(mem < 64 << 20, "{} MiB", mem >> 20);
        let r = by_block(&t);
        for (b, _) in &real {
            assert_eq!(r[b], Record { block: *b, guests: 4, reads: 12, flags: 0 });
        }
        assert_eq!(r[&5].guests, 3);
        let mut records = t.records();
        let bytes = encode(&mut records);
        assert!(bytes.len() <= MAX * RECORD_BYTES);
    }
}
