//! cargo fuzz run list: the pcsl v1 parser never panics, and anything it
//! accepts is sorted, aligned, inside the image and matches its digest.
#![no_main]
#![allow(dead_code)]

#[path = "../../src/sectorlist.rs"]
mod sectorlist;
#[path = "../../src/sys.rs"]
mod sys;

use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

fuzz_target!(|data: &[u8]| {
    if let Ok(l) = sectorlist::parse_bytes(data) {
        assert!(l.blocks.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(l
            .blocks
            .iter()
            .all(|(s, _)| s % 8 == 0 && (*s as u128) * 512 + 4096 <= l.virtual_size as u128));
        let body: String = l.blocks.iter().map(|(s, h)| format!("{s} {}\n", sys::hex(h))).collect();
        assert_eq!(<[u8; 32]>::from(Sha256::digest(body.as_bytes())), l.digest);
    }
});
