//! The block -> address table clients map (format: page-server/PROTOCOL.md).
//!
//! A 128-byte header, then `bucket_count` buckets of {u64 key; u64 addr},
//! key = block + 1 (0 = empty), open addressing with linear probing, bucket
//! index `(key * 0x9E3779B97F4A7C15) >> (64 - bucket_bits)`, load <= 0.5.
//! All integers little-endian.  page-server/client/pageshare_table.h is the
//! C reader.

use crate::identity::Identity;

pub const MAGIC: &[u8; 8] = b"PSTABLE1";
pub const VERSION: u32 = 1;
pub const HEADER_SIZE: usize = 128;
pub const HASH_MULT: u64 = 0x9E37_79B9_7F4A_7C15;
pub const MIN_BITS: u32 = 4;
pub const FLAG_DEGRADED: u32 = 1;

pub struct TableInfo {
    pub generation: u64,
    pub identity: Identity,
    pub server_pid: u32,
    pub flags: u32,
    pub arena: (u64, u64),
}

pub fn bucket_bits(entries: usize) -> u32 {
    let want = (entries.max(1) * 2).next_power_of_two();
    want.trailing_zeros().max(MIN_BITS)
}

#[inline]
pub fn slot_of(key: u64, bits: u32) -> u64 {
    key.wrapping_mul(HASH_MULT) >> (64 - bits)
}

/// Serialise a table of (block, address) pairs (blocks unique).
pub fn build(info: &TableInfo, entries: &[(u64, u64)]) -> Vec<u8> {
    let bits = bucket_bits(entries.len());
    let n = 1u64 << bits;
    let mask = n - 1;
    let mut buckets = vec![(0u64, 0u64); n as usize];
    for &(block, addr) in entries {
        let key = block + 1;
        let mut i = slot_of(key, bits);
        while buckets[i as usize].0 != 0 {
            debug_assert_ne!(buckets[i as usize].0, key, "duplicate block");
            i = (i + 1) & mask;
        }
        buckets[i as usize] = (key, addr);
    }
    let mut out = Vec::with_capacity(HEADER_SIZE + 16 * n as usize);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(HEADER_SIZE as u32).to_le_bytes());
    out.extend_from_slice(&info.generation.to_le_bytes());
    out.extend_from_slice(&info.identity.virtual_size.to_le_bytes());
    out.extend_from_slice(&info.identity.content_sha256);
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&bits.to_le_bytes());
    out.extend_from_slice(&4096u32.to_le_bytes());
    out.extend_from_slice(&(HEADER_SIZE as u64).to_le_bytes());
    out.extend_from_slice(&info.server_pid.to_le_bytes());
    out.extend_from_slice(&info.flags.to_le_bytes());
    out.extend_from_slice(&info.arena.0.to_le_bytes());
    out.extend_from_slice(&info.arena.1.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    assert_eq!(out.len(), HEADER_SIZE);
    for (k, a) in buckets {
        out.extend_from_slice(&k.to_le_bytes());
        out.extend_from_slice(&a.to_le_bytes());
    }
    out
}

/// Look a block up in a serialised table (what clients do; used in tests).
#[cfg(test)]
pub fn lookup(table: &[u8], block: u64) -> Option<u64> {
    let u64_at = |o: usize| u64::from_le_bytes(table[o..o + 8].try_into().expect("8 bytes"));
    let bits = u32::from_le_bytes(table[80..84].try_into().expect("4 bytes"));
    let n = u64_at(72);
    let key = block + 1;
    let mut i = slot_of(key, bits);
    for _ in 0..n {
        let o = HEADER_SIZE + 16 * i as usize;
        let k = u64_at(o);
        if k == key {
            return Some(u64_at(o + 8));
        }
        if k == 0 {
            return None;
        }
        i = (i + 1) & (n - 1);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_and_lookup() {
        let id = Identity { virtual_size: 1 << 30, content_sha256: [7; 32] };
        let info =
            TableInfo { generation: 3, identity: id, server_pid: 42, flags: 0, arena: (0, 0) };
        for n in [0usize, 1, 7, 8, 9, 1000, 4096] {
            let entries: Vec<(u64, u64)> =
                (0..n as u64).map(|i| (i * 3 + 5, 0x1000 * (i + 1))).collect();
            let t = build(&info, &entries);
            assert_eq!(&t[..8], MAGIC);
            for &(b, a) in &entries {
                assert_eq!(lookup(&t, b), Some(a));
            }
            assert_eq!(lookup(&t, 4), None);
            assert_eq!(lookup(&t, u64::MAX - 1), None);
            let buckets = u64::from_le_bytes(t[72..80].try_into().unwrap());
            assert!(buckets >= 2 * n as u64 && buckets.is_power_of_two());
        }
    }
}
