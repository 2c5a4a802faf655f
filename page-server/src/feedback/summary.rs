//! What a host publishes about one image: the hash
//! `<prefix>:feedback:<image key>:<host>` (README.md, "Redis"):
//!
//! ```text
//! host     the host name          image    <virtual size>-<content sha256>
//! since    unix seconds, start of the accumulation
//! updated  unix seconds, this publish
//! guests   distinct guests that reported in the accumulation
//! version  1
//! blocks   little-endian records sorted by block, 20 bytes each:
//!          { u64 block; u32 guests; u32 reads; u32 flags (bit 0 listed) }
//! ```
//!
//! The server reads its own hash back at start and continues from it, so
//! [`Summary::from_fields`] checks everything it reads: another host's or
//! another image's hash, a version it does not know, records out of order,
//! out of the image or with more guests than a block can count are refused.

use std::collections::HashMap;
use std::fmt;

pub const VERSION: u32 = 1;
pub const RECORD_BYTES: usize = 20;
/// Record flags bit 0: the reads came from LISTED_READ (a listed block).
pub const FLAG_LISTED: u32 = 1;
/// Distinct guests counted per block at most (saturating).
pub const MAX_GUESTS_PER_BLOCK: u32 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Record {
    pub block: u64,
    pub guests: u32,
    pub reads: u32,
    pub flags: u32,
}

/// One host's accumulation for one image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub host: String,
    pub image: String,
    pub since: u64,
    pub updated: u64,
    pub guests: u64,
    /// Sorted by block, no duplicates.
    pub records: Vec<Record>,
}

/// A hash that is not a summary this server can continue from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadSummary {
    /// The key holds something else than a hash.
    NotAHash,
    Missing(&'static str),
    /// A field that should be a decimal number.
    NotANumber {
        field: &'static str,
        value: String,
    },
    Version(String),
    /// The hash names another image or host than its key.
    Names {
        field: &'static str,
        found: String,
        want: String,
    },
    /// `blocks` is not a whole number of records.
    Length(usize),
    Unsorted {
        index: usize,
        block: u64,
    },
    OutsideImage {
        block: u64,
        blocks: u64,
    },
    TooManyGuests {
        block: u64,
        guests: u32,
    },
    SinceAfterUpdated {
        since: u64,
        updated: u64,
    },
}

impl fmt::Display for BadSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BadSummary::NotAHash => write!(f, "the key is not a hash"),
            BadSummary::Missing(field) => write!(f, "field {field} is missing"),
            BadSummary::NotANumber { field, value } => {
                write!(f, "field {field} is {value:?}, not a number")
            }
            BadSummary::Version(v) => write!(f, "version {v:?}, not {VERSION}"),
            BadSummary::Names { field, found, want } => {
                write!(f, "{field} is {found:?}, not {want:?}")
            }
            BadSummary::Length(n) => {
                write!(f, "blocks is {n} bytes, not a multiple of {RECORD_BYTES}")
            }
            BadSummary::Unsorted { index, block } => {
                write!(f, "record {index} (block {block}) does not follow its predecessor in order")
            }
            BadSummary::OutsideImage { block, blocks } => {
                write!(f, "block {block} is outside the image ({blocks} blocks)")
            }
            BadSummary::TooManyGuests { block, guests } => {
                write!(f, "block {block} has {guests} guests (at most {MAX_GUESTS_PER_BLOCK})")
            }
            BadSummary::SinceAfterUpdated { since, updated } => {
                write!(f, "since {since} is after updated {updated}")
            }
        }
    }
}

impl std::error::Error for BadSummary {}

/// The `blocks` field: `records` sorted by block.
pub fn encode(records: &mut [Record]) -> Vec<u8> {
    records.sort_unstable_by_key(|r| r.block);
    let mut out = Vec::with_capacity(records.len() * RECORD_BYTES);
    for r in records.iter() {
        out.extend_from_slice(&r.block.to_le_bytes());
        out.extend_from_slice(&r.guests.to_le_bytes());
        out.extend_from_slice(&r.reads.to_le_bytes());
        out.extend_from_slice(&r.flags.to_le_bytes());
    }
    out
}

/// The records of a `blocks` field of an image of `image_blocks` blocks.
pub fn decode(bytes: &[u8], image_blocks: u64) -> Result<Vec<Record>, BadSummary> {
    let chunks = bytes.chunks_exact(RECORD_BYTES);
    if !chunks.remainder().is_empty() {
        return Err(BadSummary::Length(bytes.len()));
    }
    let mut out: Vec<Record> = Vec::with_capacity(bytes.len() / RECORD_BYTES);
    for (index, c) in chunks.enumerate() {
        let u32_at = |o: usize| u32::from_le_bytes(c[o..o + 4].try_into().expect("4 bytes"));
        let r = Record {
            block: u64::from_le_bytes(c[..8].try_into().expect("8 bytes")),
            guests: u32_at(8),
            reads: u32_at(12),
            flags: u32_at(16),
        };
        if out.last().is_some_and(|p| p.block >= r.block) {
            return Err(BadSummary::Unsorted { index, block: r.block });
        }
        if r.block >= image_blocks {
            return Err(BadSummary::OutsideImage { block: r.block, blocks: image_blocks });
        }
        if r.guests > MAX_GUESTS_PER_BLOCK {
            return Err(BadSummary::TooManyGuests { block: r.block, guests: r.guests });
        }
        out.push(r);
    }
    Ok(out)
}

impl Summary {
    /// The hash's fields, in the order they are written (the records are
    /// sorted in place: no copy of a million of them).
    pub fn fields(&mut self) -> Vec<(&'static str, Vec<u8>)> {
        let blocks = encode(&mut self.records);
        vec![
            ("host", self.host.clone().into_bytes()),
            ("image", self.image.clone().into_bytes()),
            ("since", self.since.to_string().into_bytes()),
            ("updated", self.updated.to_string().into_bytes()),
            ("guests", self.guests.to_string().into_bytes()),
            ("version", VERSION.to_string().into_bytes()),
            ("blocks", blocks),
        ]
    }

    /// The summary a hash holds, checked: it must be `host`'s for `image`
    /// (an image of `image_blocks` blocks).  None for an empty hash (none
    /// published yet).
    pub fn from_fields(
        fields: &HashMap<String, Vec<u8>>,
        image: &str,
        host: &str,
        image_blocks: u64,
    ) -> Result<Option<Summary>, BadSummary> {
        if fields.is_empty() {
            return Ok(None);
        }
        let text = |field: &'static str| -> Result<String, BadSummary> {
            let v = fields.get(field).ok_or(BadSummary::Missing(field))?;
            Ok(String::from_utf8_lossy(v).into_owned())
        };
        let number = |field: &'static str| -> Result<u64, BadSummary> {
            let v = text(field)?;
            v.parse().map_err(|_| BadSummary::NotANumber { field, value: v })
        };
        let version = text("version")?;
        if version != VERSION.to_string() {
            return Err(BadSummary::Version(version));
        }
        for (field, want) in [("image", image), ("host", host)] {
            let found = text(field)?;
            if found != want {
                return Err(BadSummary::Names { field, found, want: want.to_string() });
            }
        }
        let (since, updated) = (number("since")?, number("updated")?);
        if since > updated {
            return Err(BadSummary::SinceAfterUpdated { since, updated });
        }
        let records =
            decode(fields.get("blocks").ok_or(BadSummary::Missing("blocks"))?, image_blocks)?;
        Ok(Some(Summary {
            host: host.to_string(),
            image: image.to_string(),
            since,
            updated,
            guests: number("guests")?,
            records,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(block: u64, guests: u32, reads: u32, flags: u32) -> Record {
        Record { block, guests, reads, flags }
    }

    fn sample() -> Summary {
        Summary {
            host: "h1".into(),
            image: "8192-ab".into(),
            since: 100,
            updated: 160,
            guests: 3,
            records: vec![rec(1, 2, 5, 0), rec(0, 1, 1, FLAG_LISTED)],
        }
    }

    fn as_map(s: &Summary) -> HashMap<String, Vec<u8>> {
        s.clone().fields().into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    #[test]
    fn records_are_sorted_little_endian() {
        let b = encode(&mut [rec(0x0102, 3, 4, 1), rec(1, 0xa, 0xb, 0)]);
        assert_eq!(b.len(), 2 * RECORD_BYTES);
        assert_eq!(&b[..20], &[1, 0, 0, 0, 0, 0, 0, 0, 0xa, 0, 0, 0, 0xb, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&b[20..30], &[2, 1, 0, 0, 0, 0, 0, 0, 3, 0]);
        assert_eq!(decode(&b, 0x0103).unwrap(), vec![rec(1, 10, 11, 0), rec(0x102, 3, 4, 1)]);
        assert_eq!(decode(&[], 0).unwrap(), vec![]);
    }

    #[test]
    fn a_summary_round_trips_through_its_fields() {
        let s = sample();
        let back = Summary::from_fields(&as_map(&s), "8192-ab", "h1", 2).unwrap().unwrap();
        let mut want = s.clone();
        want.records.sort_by_key(|r| r.block);
        assert_eq!(back, want);
        assert_eq!(Summary::from_fields(&HashMap::new(), "8192-ab", "h1", 2), Ok(None));
    }

    #[test]
    fn what_cannot_be_continued_from_is_refused() {
        let good = as_map(&sample());
        let with = |k: &str, v: &[u8]| {
            let mut m = good.clone();
            m.insert(k.into(), v.to_vec());
            Summary::from_fields(&m, "8192-ab", "h1", 2).unwrap_err()
        };
        assert_eq!(with("version", b"2"), BadSummary::Version("2".into()));
        assert!(matches!(with("host", b"h2"), BadSummary::Names { field: "host", .. }));
        assert!(matches!(with("image", b"1-cd"), BadSummary::Names { field: "image", .. }));
        assert!(matches!(with("since", b"x"), BadSummary::NotANumber { field: "since", .. }));
        assert_eq!(
            with("since", b"200"),
            BadSummary::SinceAfterUpdated { since: 200, updated: 160 }
        );
        assert_eq!(with("blocks", &[0; 21]), BadSummary::Length(21));
        let mut b = encode(&mut [rec(0, 1, 1, 0), rec(1, 1, 1, 0)]);
        b[20] = 0; // second record's block = 0: a duplicate
        assert_eq!(with("blocks", &b), BadSummary::Unsorted { index: 1, block: 0 });
        let b = encode(&mut [rec(2, 1, 1, 0)]);
        assert_eq!(with("blocks", &b), BadSummary::OutsideImage { block: 2, blocks: 2 });
        let b = encode(&mut [rec(1, 17, 1, 0)]);
        assert_eq!(with("blocks", &b), BadSummary::TooManyGuests { block: 1, guests: 17 });
        let mut m = good.clone();
        m.remove("guests");
        assert_eq!(
            Summary::from_fields(&m, "8192-ab", "h1", 2),
            Err(BadSummary::Missing("guests"))
        );
    }
}
