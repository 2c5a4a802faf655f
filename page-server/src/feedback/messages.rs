//! The two feedback messages a client sends on its image socket, parsed and
//! checked for their shape (lengths and counts).  What they say about the
//! image (block numbers, generations) is checked by the tally and the
//! server, which know the image.
//!
//! ```text
//! READS (18):       u64 generation; u32 count (<= 254); u32 flags (bit 0 TRUNCATED);
//!                   count x { u64 block; u32 reads; u32 reserved }
//! LISTED_READ (19): u64 generation; u32 count (<= 509); u32 reserved;
//!                   count x u64 block
//! ```
//! Reserved fields and unknown flag bits are ignored.

use std::fmt;

/// Most entries in one READS message (16 + 254 * 16 = 4080 bytes).
pub const MAX_READS_ENTRIES: usize = 254;
/// Most blocks in one LISTED_READ message (16 + 509 * 8 = 4088 bytes).
pub const MAX_LISTED_ENTRIES: usize = 509;
/// READS flags bit 0: the client's table evicted entries since its last
/// READS, so the counts are lower bounds.
pub const READS_TRUNCATED: u32 = 1;

const HEADER: usize = 16;
const READS_ENTRY: usize = 16;
const LISTED_ENTRY: usize = 8;

/// A READS message: reads of unlisted blocks since the client's last one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reads {
    pub generation: u64,
    pub truncated: bool,
    /// (block, reads)
    pub entries: Vec<(u64, u32)>,
}

/// A LISTED_READ message: listed blocks read for the first time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedRead {
    pub generation: u64,
    pub blocks: Vec<u64>,
}

/// Why a feedback message was ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadReport {
    /// Shorter than its 16-byte header.
    Short { what: &'static str, len: usize },
    /// More entries than one message may carry.
    TooMany { what: &'static str, count: u32, max: usize },
    /// The payload is not exactly the header and `count` entries.
    Length { what: &'static str, count: u32, len: usize, want: usize },
}

impl fmt::Display for BadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BadReport::Short { what, len } => {
                write!(f, "{what} of {len} bytes is shorter than its 16-byte header")
            }
            BadReport::TooMany { what, count, max } => {
                write!(f, "{what} announces {count} entries (at most {max})")
            }
            BadReport::Length { what, count, len, want } => {
                write!(f, "{what} of {len} bytes for {count} entries (must be {want})")
            }
        }
    }
}

impl std::error::Error for BadReport {}

fn u64_at(p: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(p[off..off + 8].try_into().expect("8 bytes"))
}

fn u32_at(p: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(p[off..off + 4].try_into().expect("4 bytes"))
}

/// The header (generation, count, flags) of a message whose entries are
/// `entry` bytes each, after checking the payload's length against it.
fn header(
    what: &'static str,
    p: &[u8],
    entry: usize,
    max: usize,
) -> Result<(u64, u32, u32), BadReport> {
    if p.len() < HEADER {
        return Err(BadReport::Short { what, len: p.len() });
    }
    let (generation, count, flags) = (u64_at(p, 0), u32_at(p, 8), u32_at(p, 12));
    if count as usize > max {
        return Err(BadReport::TooMany { what, count, max });
    }
    let want = HEADER + entry * count as usize;
    if p.len() != want {
        return Err(BadReport::Length { what, count, len: p.len(), want });
    }
    Ok((generation, count, flags))
}

pub fn parse_reads(p: &[u8]) -> Result<Reads, BadReport> {
    let (generation, count, flags) = header("READS", p, READS_ENTRY, MAX_READS_ENTRIES)?;
    let entries = (0..count as usize)
        .map(|i| {
            let off = HEADER + i * READS_ENTRY;
            (u64_at(p, off), u32_at(p, off + 8))
        })
        .collect();
    Ok(Reads { generation, truncated: flags & READS_TRUNCATED != 0, entries })
}

pub fn parse_listed_read(p: &[u8]) -> Result<ListedRead, BadReport> {
    let (generation, count, _reserved) =
        header("LISTED_READ", p, LISTED_ENTRY, MAX_LISTED_ENTRIES)?;
    let blocks = (0..count as usize).map(|i| u64_at(p, HEADER + i * LISTED_ENTRY)).collect();
    Ok(ListedRead { generation, blocks })
}

#[cfg(test)]
pub(crate) fn reads_payload(generation: u64, flags: u32, entries: &[(u64, u32)]) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&generation.to_le_bytes());
    p.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    p.extend_from_slice(&flags.to_le_bytes());
    for (b, r) in entries {
        p.extend_from_slice(&b.to_le_bytes());
        p.extend_from_slice(&r.to_le_bytes());
        p.extend_from_slice(&0u32.to_le_bytes());
    }
    p
}

#[cfg(test)]
pub(crate) fn listed_payload(generation: u64, blocks: &[u64]) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&generation.to_le_bytes());
    p.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    for b in blocks {
        p.extend_from_slice(&b.to_le_bytes());
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_round_trip() {
        let e = vec![(7, 3), (u64::MAX, u32::MAX), (0, 0)];
        let r = parse_reads(&reads_payload(5, READS_TRUNCATED | 0x80, &e)).unwrap();
        assert_eq!(r, Reads { generation: 5, truncated: true, entries: e });
        let r = parse_reads(&reads_payload(u64::MAX, 0, &[])).unwrap();
        assert!(!r.truncated && r.entries.is_empty() && r.generation == u64::MAX);
        // The largest message fits the framing's 4096 bytes.
        let full: Vec<(u64, u32)> = (0..MAX_READS_ENTRIES as u64).map(|b| (b, 1)).collect();
        let p = reads_payload(1, 0, &full);
        assert!(p.len() <= crate::proto::MAX_CLIENT_PAYLOAD);
        assert_eq!(parse_reads(&p).unwrap().entries.len(), MAX_READS_ENTRIES);
    }

    #[test]
    fn listed_round_trip() {
        let r = parse_listed_read(&listed_payload(2, &[1, 9, 4])).unwrap();
        assert_eq!(r, ListedRead { generation: 2, blocks: vec![1, 9, 4] });
        let full: Vec<u64> = (0..MAX_LISTED_ENTRIES as u64).collect();
        let p = listed_payload(1, &full);
        assert!(p.len() <= crate::proto::MAX_CLIENT_PAYLOAD);
        assert_eq!(parse_listed_read(&p).unwrap().blocks, full);
    }

    #[test]
    fn bad_shapes_are_refused_with_why() {
        assert_eq!(parse_reads(&[0; 15]), Err(BadReport::Short { what: "READS", len: 15 }));
        assert_eq!(parse_listed_read(&[]), Err(BadReport::Short { what: "LISTED_READ", len: 0 }));
        // A count over the limit, whatever the length.
        let mut p = reads_payload(1, 0, &[]);
        p[8..12].copy_from_slice(&255u32.to_le_bytes());
        assert_eq!(
            parse_reads(&p),
            Err(BadReport::TooMany { what: "READS", count: 255, max: 254 })
        );
        let mut p = listed_payload(1, &[]);
        p[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(parse_listed_read(&p), Err(BadReport::TooMany { count: u32::MAX, .. })));
        // Entries missing, or trailing bytes.
        let mut p = reads_payload(1, 0, &[(1, 1), (2, 2)]);
        p.pop();
        assert_eq!(
            parse_reads(&p),
            Err(BadReport::Length { what: "READS", count: 2, len: 47, want: 48 })
        );
        let mut p = listed_payload(1, &[1]);
        p.push(0);
        let e = parse_listed_read(&p).unwrap_err();
        assert_eq!(e.to_string(), "LISTED_READ of 25 bytes for 1 entries (must be 24)");
        // A READS payload is not a LISTED_READ one (16-byte vs 8-byte entries).
        assert!(parse_listed_read(&reads_payload(1, 0, &[(1, 1)])).is_err());
    }
}
