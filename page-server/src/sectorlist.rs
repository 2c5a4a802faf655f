//! Reader for "pcsl v1" sector lists (format: lists/README.md).
//!
//! This is a line-for-line port of `loads()`/`read()` in
//! analyzer/pageshare/lists/sectorlist.py, the reference implementation: the same
//! checks in the same order, so both accept and refuse the same files and
//! name the same line.  tests/page_server/test_page_server_list.py checks that on
//! generated and mutated lists; keep the two in sync.

use sha2::{Digest, Sha256};
use std::fmt;

pub const BLOCK_SIZE: u64 = 4096;
pub const SECTOR_SIZE: u64 = 512;
pub const SECTORS_PER_BLOCK: u64 = BLOCK_SIZE / SECTOR_SIZE;
const MAGIC: &str = "# pcsl v1";
const SEPARATOR: &str = "---";
const MAX_DIGITS: usize = 19;

const HEADER_KEYS: [&str; 12] = [
    "image-virtual-size",
    "image-content-sha256",
    "image-name",
    "block-size",
    "sector-size",
    "hash",
    "count",
    "list-digest",
    "generator",
    "created",
    "criteria",
    "runs",
];
const REQUIRED_KEYS: [&str; 7] = [
    "image-virtual-size",
    "image-content-sha256",
    "block-size",
    "sector-size",
    "hash",
    "count",
    "list-digest",
];

/// A list that must not be used: the 1-based line and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListError {
    pub line: usize,
    pub reason: String,
}

impl fmt::Display for ListError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.reason)
    }
}

fn err<T>(line: usize, reason: impl Into<String>) -> Result<T, ListError> {
    Err(ListError { line, reason: reason.into() })
}

/// A validated list.  `blocks` is sorted by sector, without duplicates.
#[derive(Debug, Clone)]
pub struct SectorList {
    pub virtual_size: u64,
    pub content_sha256: [u8; 32],
    pub image_name: String,
    pub digest: [u8; 32],
    pub blocks: Vec<(u64, [u8; 32])>,
    pub generator: String,
    pub created: String,
    pub criteria: String,
    pub runs: String,
    pub extra: Vec<(String, String)>,
}

fn show(s: &str) -> String {
    let mut t: String = s.chars().take(60).collect();
    if s.chars().count() > 60 {
        t.push_str("...");
    }
    format!("{t:?}")
}

fn is_uint(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty() && b.iter().all(u8::is_ascii_digit) && (b[0] != b'0' || b.len() == 1)
}

fn is_hex64(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

fn is_key(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_lowercase()
        && b[1..].iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

fn is_ext_key(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() >= 3
        && b.starts_with(b"x-")
        && (b[2].is_ascii_lowercase() || b[2].is_ascii_digit())
        && b[3..].iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

/// The first character a header value must not contain (see _BAD_TEXT).
fn bad_text(s: &str) -> Option<char> {
    s.chars().find(|&c| {
        let u = c as u32;
        (u <= 0x08)
            || (0x0a..=0x1f).contains(&u)
            || (0x7f..=0x9f).contains(&u)
            || u == 0x2028
            || u == 0x2029
    })
}

fn parse_uint(line: usize, key: &str, value: &str) -> Result<u64, ListError> {
    if !is_uint(value) {
        return err(
            line,
            format!(
                "{key}: expected a decimal integer (digits only, no sign or leading zeros), got {}",
                show(value)
            ),
        );
    }
    if value.len() > MAX_DIGITS {
        return err(line, format!("{key}: value {} is too large", show(value)));
    }
    // 19 digits always fit in u64.
    Ok(value.parse::<u64>().expect("19 digits fit in u64"))
}

fn check_magic(first: &str) -> Result<(), ListError> {
    if first == MAGIC {
        return Ok(());
    }
    if first.trim_end_matches('\r') == MAGIC {
        return err(1, "line ends with CR: CRLF line endings are not allowed, use LF");
    }
    if first.starts_with('\u{feff}') {
        return err(1, "file starts with a byte-order mark; save it as UTF-8 without BOM");
    }
    if let Some(v) = first.strip_prefix("# pcsl v") {
        if !v.is_empty() && v.bytes().all(|c| c.is_ascii_digit()) {
            return err(
                1,
                format!("unsupported format version pcsl v{v} (this reader understands only v1); update pageshare"),
            );
        }
    }
    err(1, format!("not a pcsl sector list: first line must be {MAGIC:?}, got {}", show(first)))
}

fn diagnose_body_line(line: &str) -> String {
    let expected = "expected '<sector> <sha256hex>'";
    if line.is_empty() {
        return format!("empty line in the body ({expected})");
    }
    if line.ends_with('\r') {
        return "line ends with CR: CRLF line endings are not allowed, use LF".into();
    }
    let parts: Vec<&str> = line.split(' ').collect();
    if parts.len() != 2 {
        return format!("{expected} separated by a single space, got {}", show(line));
    }
    if !is_uint(parts[0]) {
        return format!(
            "sector {} is not a decimal integer (no sign or leading zeros)",
            show(parts[0])
        );
    }
    if parts[0].len() > MAX_DIGITS {
        return format!("sector {} is too large", show(parts[0]));
    }
    format!("malformed hash {}: must be 64 lowercase hex digits (sha256)", show(parts[1]))
}

/// Parse raw bytes (what `read()` in Python does: strict UTF-8 first).
pub fn parse_bytes(data: &[u8]) -> Result<SectorList, ListError> {
    match std::str::from_utf8(data) {
        Ok(text) => parse(text),
        Err(e) => {
            let start = e.valid_up_to();
            let line = data[..start].iter().filter(|&&b| b == b'\n').count() + 1;
            err(line, format!("not valid UTF-8 (byte offset {start})"))
        }
    }
}

/// Parse and fully validate pcsl v1 text.
///
/// In steps, as `loads()` in Python: the lines (magic, final newline),
/// the header's lines (`read_header`), their values (`check_header`), the
/// body's lines (`read_body`) and last the body's digest.
pub fn parse(text: &str) -> Result<SectorList, ListError> {
    if text.is_empty() {
        return err(1, format!("empty file: expected {MAGIC:?}"));
    }
    let mut lines: Vec<&str> = text.split('\n').collect();
    check_magic(lines[0])?;
    if !lines.last().expect("split yields one item").is_empty() {
        return err(lines.len(), "last line has no terminating newline: truncated file?");
    }
    lines.pop();

    let header = read_header(&lines)?;
    let checked = check_header(&header)?;
    let blocks = read_body(&lines, header.sep_index, &checked)?;
    let body_start: usize = lines[..=header.sep_index].iter().map(|l| l.len() + 1).sum();
    let actual: [u8; 32] = Sha256::digest(&text.as_bytes()[body_start..]).into();
    if actual != checked.digest {
        return err(
            checked.digest_line,
            "list body does not match list-digest: file corrupted or edited",
        );
    }
    let text_of = |k: &str| header.get(k).map(|(_, v)| v.to_string()).unwrap_or_default();
    Ok(SectorList {
        virtual_size: checked.virtual_size,
        content_sha256: checked.content,
        image_name: text_of("image-name"),
        digest: checked.digest,
        blocks,
        generator: text_of("generator"),
        created: text_of("created"),
        criteria: text_of("criteria"),
        runs: text_of("runs"),
        extra: header.extra,
    })
}

/// The header's lines, up to '---'.
struct Header<'a> {
    values: Vec<(&'a str, usize, &'a str)>, // key, line, value
    extra: Vec<(String, String)>,
    sep_index: usize,
}

impl<'a> Header<'a> {
    /// A known key's (line, value).
    fn get(&self, k: &str) -> Option<(usize, &'a str)> {
        self.values.iter().find(|(key, _, _)| *key == k).map(|&(_, l, v)| (l, v))
    }
}

fn read_header<'a>(lines: &[&'a str]) -> Result<Header<'a>, ListError> {
    let mut values: Vec<(&str, usize, &str)> = Vec::new();
    let mut first_seen: Vec<(&str, usize)> = Vec::new();
    let mut extra: Vec<(String, String)> = Vec::new();
    for (index, &line) in lines.iter().enumerate().skip(1) {
        let line_no = index + 1;
        if line == SEPARATOR {
            return Ok(Header { values, extra, sep_index: index });
        }
        if line.ends_with('\r') {
            return err(line_no, "line ends with CR: CRLF line endings are not allowed, use LF");
        }
        if line.starts_with('#') {
            continue;
        }
        let (key, rest) = match line.find(':') {
            Some(i) => (&line[..i], Some(&line[i + 1..])),
            None => (line, None),
        };
        let rest = match rest {
            Some(r) if is_key(key) => r,
            _ => {
                return err(
                    line_no,
                    format!("expected a 'key: value' header line or '---', got {}", show(line)),
                )
            }
        };
        if !rest.is_empty() && !rest.starts_with(' ') {
            return err(line_no, format!("expected a space after '{key}:'"));
        }
        let value = if rest.is_empty() { "" } else { &rest[1..] };
        if let Some(c) = bad_text(value) {
            return err(line_no, format!("value of '{key}' contains control character {c:?}"));
        }
        if let Some((_, first)) = first_seen.iter().find(|(k, _)| *k == key) {
            return err(line_no, format!("duplicate header key '{key}' (first on line {first})"));
        }
        first_seen.push((key, line_no));
        if key.starts_with("x-") {
            if !is_ext_key(key) {
                return err(line_no, format!("extension key {key:?} needs a name after 'x-'"));
            }
            extra.push((key.to_string(), value.to_string()));
        } else if HEADER_KEYS.contains(&key) {
            values.push((key, line_no, value));
        } else {
            return err(
                line_no,
                format!(
                    "unknown header key '{key}' (extensions must start with 'x-'; is this list from a newer pageshare?)"
                ),
            );
        }
    }
    err(lines.len(), "file ends before the '---' line that ends the header: truncated file?")
}

/// The header's values the body is checked against.
struct Checked {
    virtual_size: u64,
    content: [u8; 32],
    count: u64,
    count_line: usize,
    digest: [u8; 32],
    digest_line: usize,
}

/// The required keys there, each value as pcsl v1 allows it.
fn check_header(header: &Header<'_>) -> Result<Checked, ListError> {
    for key in REQUIRED_KEYS {
        if header.get(key).is_none() {
            return err(header.sep_index + 1, format!("header lacks required key '{key}'"));
        }
    }
    let get = |k: &str| header.get(k).expect("required");
    let uint_of = |k: &str| {
        let (l, v) = get(k);
        parse_uint(l, k, v)
    };

    let virtual_size = uint_of("image-virtual-size")?;
    let (content_line, content) = get("image-content-sha256");
    if !is_hex64(content) {
        return err(
            content_line,
            format!("image-content-sha256 must be 64 lowercase hex digits, got {}", show(content)),
        );
    }
    for (key, supported) in [("block-size", BLOCK_SIZE), ("sector-size", SECTOR_SIZE)] {
        if uint_of(key)? != supported {
            let (l, v) = get(key);
            return err(l, format!("unsupported {key} {v} (pcsl v1 supports only {supported})"));
        }
    }
    let (hash_line, hash_name) = get("hash");
    if hash_name != "sha256" {
        return err(
            hash_line,
            format!("unsupported hash {} (pcsl v1 supports only sha256)", show(hash_name)),
        );
    }
    let count_line = get("count").0;
    let count = uint_of("count")?;
    let (digest_line, digest) = get("list-digest");
    let digest_hex = match digest.strip_prefix("sha256:") {
        Some(h) if is_hex64(h) => h,
        _ => {
            return err(
                digest_line,
                format!(
                    "list-digest must be 'sha256:' and 64 lowercase hex digits, got {}",
                    show(digest)
                ),
            )
        }
    };
    Ok(Checked {
        virtual_size,
        content: crate::sys::unhex32(content).expect("checked"),
        count,
        count_line,
        digest: crate::sys::unhex32(digest_hex).expect("checked"),
        digest_line,
    })
}

/// The body's block lines after the '---' at `sep_index`: as many as
/// 'count' says, each a 4 KiB-aligned sector inside the image, ascending,
/// with its hash.  Structure only: the digest is checked after.
fn read_body(
    lines: &[&str],
    sep_index: usize,
    h: &Checked,
) -> Result<Vec<(u64, [u8; 32])>, ListError> {
    let body = &lines[sep_index + 1..];
    let first_body_line = sep_index + 2;
    let (count, count_line, virtual_size) = (h.count, h.count_line, h.virtual_size);
    if (body.len() as u64) < count {
        return err(
            lines.len(),
            format!(
                "file ends after {} of the {count} block lines announced by 'count' (line {count_line}): truncated file?",
                body.len()
            ),
        );
    }
    if (body.len() as u64) > count {
        return err(
            first_body_line + count as usize,
            format!(
                "unexpected line after the {count} block lines announced by 'count' (line {count_line}): trailing garbage or a wrong count"
            ),
        );
    }
    let mut blocks: Vec<(u64, [u8; 32])> = Vec::with_capacity(body.len());
    let mut previous: i128 = -1;
    for (offset, line) in body.iter().enumerate() {
        let line_no = first_body_line + offset;
        let parsed = line.split_once(' ').and_then(|(s, h)| {
            let ok = is_uint(s) && s.len() <= MAX_DIGITS && is_hex64(h);
            ok.then(|| {
                (s.parse::<u64>().expect("checked"), crate::sys::unhex32(h).expect("checked"))
            })
        });
        let Some((sector, hash)) = parsed else {
            return err(line_no, diagnose_body_line(line));
        };
        let s = sector as i128;
        if s == previous {
            return err(line_no, format!("duplicate sector {sector}"));
        }
        if s < previous {
            return err(
                line_no,
                format!(
                    "sector {sector} follows sector {previous}: the body must be sorted ascending"
                ),
            );
        }
        if sector % SECTORS_PER_BLOCK != 0 {
            return err(
                line_no,
                format!("sector {sector} is not 4 KiB aligned (must be a multiple of {SECTORS_PER_BLOCK})"),
            );
        }
        let start = sector as u128 * SECTOR_SIZE as u128;
        let end = start + BLOCK_SIZE as u128;
        if end > virtual_size as u128 {
            return err(
                line_no,
                format!(
                    "block at sector {sector} (bytes {start}..{}) extends past the image end (image-virtual-size {virtual_size})",
                    end - 1
                ),
            );
        }
        blocks.push((sector, hash));
        previous = s;
    }
    Ok(blocks)
}

/// The text of a valid list (for tests): `blocks` are (sector, sha256 of
/// the block's 4096 bytes), in order.
#[cfg(test)]
pub(crate) fn test_list_text(
    virtual_size: u64,
    content_sha256: &[u8; 32],
    blocks: &[(u64, [u8; 32])],
) -> String {
    let mut body = String::new();
    for (s, hash) in blocks {
        body.push_str(&format!("{s} {}\n", crate::sys::hex(hash)));
    }
    let digest = crate::sys::hex(&Sha256::digest(body.as_bytes()));
    format!(
        "# pcsl v1\nimage-virtual-size: {virtual_size}\nimage-content-sha256: {}\nimage-name: t\nblock-size: 4096\nsector-size: 512\nhash: sha256\ncount: {}\nlist-digest: sha256:{digest}\ngenerator:\ncreated:\ncriteria:\nruns:\n---\n{body}",
        crate::sys::hex(content_sha256),
        blocks.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn make(blocks: &[(u64, &[u8])], size: u64) -> String {
        let hashed: Vec<(u64, [u8; 32])> = blocks
            .iter()
            .map(|(s, data)| {
                let mut block = vec![0u8; 4096];
                block[..data.len()].copy_from_slice(data);
                (*s, Sha256::digest(&block).into())
            })
            .collect();
        test_list_text(size, &[0xab; 32], &hashed)
    }

    #[test]
    fn accepts_valid() {
        let t = make(&[(0, b"a"), (8, b"b"), (2048, b"c")], 2 << 20);
        let l = parse(&t).unwrap();
        assert_eq!(l.blocks.len(), 3);
        assert_eq!(l.blocks[2].0, 2048);
        assert_eq!(l.virtual_size, 2 << 20);
    }

    #[test]
    fn rejects_edits() {
        let t = make(&[(0, b"a"), (8, b"b")], 1 << 20);
        assert!(parse(&t.replace("# pcsl v1", "# pcsl v2"))
            .unwrap_err()
            .reason
            .contains("unsupported format"));
        assert!(parse(&t[..t.len() - 1]).is_err());
        assert!(parse(&t.replace("count: 2", "count: 3")).is_err());
        assert!(parse(&t.replace("\n8 ", "\n9 ")).is_err());
        assert!(parse(&t.replace('\n', "\r\n")).is_err());
        // A changed hex digit in a block hash: only the digest catches it.
        let body_start = t.find("---\n").unwrap() + 4;
        let mut b = t.clone().into_bytes();
        let i = body_start + 2;
        b[i] = if b[i] == b'0' { b'1' } else { b'0' };
        let e = parse_bytes(&b).unwrap_err();
        assert!(e.reason.contains("list-digest"), "{e}");
        assert_eq!(parse_bytes(b"# pcsl v1\n\xff\n").unwrap_err().line, 2);
    }

    #[test]
    fn rejects_out_of_range() {
        let t = make(&[(256, b"a")], 256 * 512 + 4095);
        assert!(parse(&t).unwrap_err().reason.contains("past the image end"));
    }
}
