//! The feedback loop's server side (issue 22): what guests really read.
//!
//! Clients of an image socket (QEMU's filter) report the base blocks their
//! guest read: `READS` (unlisted blocks, with read counts) and
//! `LISTED_READ` (listed blocks read for the first time), PROTOCOL.md.
//!
//! * [`messages`]: parsing and checking those two payloads;
//! * [`tally`]: the per-image accumulation (reads, distinct guests, listed
//!   flag per block), bounded in blocks, guests per block and guests;
//! * [`summary`]: the binary records and hash fields published to Redis
//!   (`<prefix>:feedback:<image key>:<host>`) and read back at start.
//!
//! `src/redis_feedback.rs` publishes the summaries; `src/server/feedback.rs`
//! connects the clients' messages to the tally.

pub mod messages;
pub mod summary;
pub mod tally;
