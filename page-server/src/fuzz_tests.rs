//! Bounded fuzzing inside `cargo test` (cargo-fuzz targets live in fuzz/).
//! A small deterministic xorshift generator mutates valid inputs; the
//! properties: the list parser never panics and accepts a mutation only if
//! it re-serialises to the same blocks; the framing parser never panics,
//! never returns a message over the limit and consumes input monotonically.

use crate::proto;
use crate::sectorlist;
use sha2::{Digest, Sha256};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn valid_list(n: usize) -> Vec<u8> {
    let mut body = String::new();
    for i in 0..n {
        let h = Sha256::digest((i as u64).to_le_bytes());
        body.push_str(&format!("{} {}\n", i * 16, crate::sys::hex(&h)));
    }
    let d = crate::sys::hex(&Sha256::digest(body.as_bytes()));
    format!(
        "# pcsl v1\nimage-virtual-size: 1048576\nimage-content-sha256: {}\nimage-name: f\nblock-size: 4096\nsector-size: 512\nhash: sha256\ncount: {n}\nlist-digest: sha256:{d}\ngenerator: g\ncreated:\ncriteria:\nruns:\nx-k: v\n---\n{body}",
        "0f".repeat(32)
    )
    .into_bytes()
}

fn mutate(r: &mut Rng, input: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    let pieces: [&[u8]; 12] = [
        b"\n",
        b"\r",
        b" ",
        b"---\n",
        b"0",
        b"8",
        b"count: ",
        b":",
        b"\xff",
        b"\xe2\x80\xa8",
        b"x-",
        b"# pcsl v1\n",
    ];
    for _ in 0..1 + r.below(4) {
        if v.is_empty() {
            v.push(b'#');
        }
        let at = r.below(v.len() + 1);
        match r.below(6) {
            0 => {
                let i = r.below(v.len());
                v[i] ^= 1 << r.below(8);
            }
            1 => {
                v.truncate(at);
            }
            2 => {
                let p = pieces[r.below(pieces.len())];
                v.splice(at..at, p.iter().copied());
            }
            3 => {
                let end = (at + r.below(80)).min(v.len());
                v.drain(at..end);
            }
            4 => {
                let i = r.below(v.len());
                v[i] = (r.next() & 0xff) as u8;
            }
            _ => {
                // duplicate a line
                let s = v[..at].iter().rposition(|&b| b == b'\n').map(|x| x + 1).unwrap_or(0);
                let e =
                    v[at..].iter().position(|&b| b == b'\n').map(|x| at + x + 1).unwrap_or(v.len());
                let line = v[s..e].to_vec();
                v.splice(e..e, line);
            }
        }
    }
    v
}

#[test]
fn fuzz_list_parser() {
    let mut r = Rng(0x9E37_79B9_7F4A_7C15);
    let seeds = [valid_list(0), valid_list(1), valid_list(5), valid_list(40)];
    let mut accepted = 0;
    for i in 0..30_000 {
        let seed = &seeds[i % seeds.len()];
        let m = mutate(&mut r, seed);
        if let Ok(l) = sectorlist::parse_bytes(&m) {
            accepted += 1;
            // Whatever is accepted is internally consistent.
            assert!(l.blocks.windows(2).all(|w| w[0].0 < w[1].0));
            assert!(l.blocks.iter().all(|(s, _)| s % 8 == 0 && s * 512 + 4096 <= l.virtual_size));
            let body: String =
                l.blocks.iter().map(|(s, h)| format!("{s} {}\n", crate::sys::hex(h))).collect();
            assert_eq!(<[u8; 32]>::from(Sha256::digest(body.as_bytes())), l.digest);
        }
    }
    // Header comments/x- keys/free text make some mutations valid; most are not.
    assert!(accepted < 30_000 / 2, "accepted {accepted}");
}

#[test]
fn fuzz_framing() {
    let mut r = Rng(12345);
    for _ in 0..20_000 {
        let mut stream = Vec::new();
        for _ in 0..r.below(5) {
            let len = r.below(64);
            stream.extend(proto::frame(r.below(40) as u32, &vec![7u8; len]));
        }
        let mut m = mutate(&mut r, &stream);
        let before = m.len();
        if let Ok(msgs) = proto::take_messages(&mut m, proto::MAX_CLIENT_PAYLOAD) {
            let used: usize = msgs.iter().map(|(_, p)| p.len() + proto::HDR).sum();
            assert_eq!(used + m.len(), before);
            assert!(msgs.iter().all(|(_, p)| p.len() <= proto::MAX_CLIENT_PAYLOAD));
        }
    }
}
