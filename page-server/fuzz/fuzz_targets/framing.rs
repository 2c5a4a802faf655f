//! cargo fuzz run framing: splitting client input into messages never
//! panics, never yields a payload over the limit, and accounts for every byte.
#![no_main]
#![allow(dead_code)]

#[path = "../../src/proto.rs"]
mod proto;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut buf = data.to_vec();
    let before = buf.len();
    if let Ok(msgs) = proto::take_messages(&mut buf, proto::MAX_CLIENT_PAYLOAD) {
        let used: usize = msgs.iter().map(|(_, p)| p.len() + proto::HDR).sum();
        assert_eq!(used + buf.len(), before);
        assert!(msgs.iter().all(|(_, p)| p.len() <= proto::MAX_CLIENT_PAYLOAD));
    }
});
