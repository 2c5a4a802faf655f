//! Feedback from the clients of an image socket (READS, LISTED_READ):
//! checked, counted per image in a [`Tally`] and handed to the Redis
//! feedback thread (src/redis_feedback.rs) every `feedback.interval_secs`.
//!
//! What is never trusted: a message of the wrong shape, a generation this
//! server never published, a LISTED_READ of a block its generation does not
//! list, blocks past the end of the image.  Each is counted (status,
//! metrics), logged within the client log budget and ignored; the client
//! stays connected (its reads are served as before).

use super::{ImageState, Server};
use crate::feedback::messages::{self, BadReport};
use crate::feedback::summary::Summary;
use crate::feedback::tally::{Added, Tally};
use crate::proto::{MSG_READS, NO_GENERATION};
use crate::redis_feedback::{Cmd, ReadBack, Snapshot};
use serde_json::{json, Value};
use std::sync::mpsc::channel;
use std::time::Duration;

/// One image's feedback: the accumulation for its current identity.
pub(super) struct ImageFeedback {
    /// `<virtual size>-<content sha256>`
    key: String,
    image_blocks: u64,
    tally: Tally,
    /// What Redis held for this host and image was merged (or there was
    /// nothing, or it was refused): snapshots may be published.
    continued: bool,
    /// What the read-back found, for `status`.
    read_back: String,
}

/// Counters of the feedback messages of an image, over the server's life.
#[derive(Default, Clone, Copy, serde::Serialize)]
pub(super) struct FeedbackCounters {
    reads_messages: u64,
    listed_messages: u64,
    /// Blocks counted (entries of accepted messages).
    accepted_blocks: u64,
    /// Messages ignored whole: bad shape or generation.
    rejected_messages: u64,
    /// Entries ignored: outside the image, or not listed where listed.
    rejected_blocks: u64,
    /// READS that said the client's table evicted entries.
    truncated_reports: u64,
    /// Messages that came before the image's identity was known, or with
    /// feedback disabled.
    ignored_messages: u64,
}

/// What an accepted message reports.
struct Report {
    /// READS: (block, reads)
    reads: Vec<(u64, u32)>,
    /// LISTED_READ: blocks
    listed: Vec<u64>,
    truncated: bool,
}

/// Why a message was ignored whole.
enum Rejected {
    Shape(BadReport),
    Generation { what: &'static str, generation: u64, next: u64 },
    ListedWithoutTable,
}

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejected::Shape(e) => e.fmt(f),
            Rejected::Generation { what, generation, next } => {
                write!(f, "{what} for generation {generation}, which was never published (next is {next})")
            }
            Rejected::ListedWithoutTable => write!(f, "LISTED_READ without a generation"),
        }
    }
}

impl ImageState {
    /// The image's feedback as `status` shows it.
    pub(super) fn feedback_json(
        &self,
        publish: Option<&crate::redis_feedback::PublishStatus>,
    ) -> Value {
        let mut v = json!({ "counters": self.feedback_counters });
        match &self.feedback {
            Some(f) => {
                v["image_key"] = json!(f.key);
                v["blocks"] = json!(f.tally.blocks());
                v["guests"] = json!(f.tally.guests());
                v["since"] = json!(f.tally.since);
                v["evicted_blocks"] = json!(f.tally.evicted);
                v["memory_bytes"] = json!(f.tally.memory_bytes());
                v["continued"] = json!(f.continued);
                v["read_back"] = json!(f.read_back);
            }
            None => {
                v["blocks"] = json!(0);
                v["guests"] = json!(0);
            }
        }
        v["publish"] =
            serde_json::to_value(publish.cloned().unwrap_or_default()).unwrap_or(Value::Null);
        v
    }
}

fn now_secs() -> u64 {
    crate::sys::now_unix() as u64
}

impl Server {
    /// A READS or LISTED_READ from client `id` (always handled: old and new
    /// clients are never sent BYE for them).
    pub(super) fn feedback_message(&mut self, id: u64, kind: u32, p: &[u8]) {
        let Some(c) = self.clients.get(&id) else {
            return;
        };
        let Some(idx) = c.image() else { return };
        let (pid, guest) = (c.pid, c.guest);
        let img = &mut self.images[idx];
        let counters = &mut img.feedback_counters;
        if kind == MSG_READS {
            counters.reads_messages += 1;
        } else {
            counters.listed_messages += 1;
        }
        if img.feedback.is_none() {
            counters.ignored_messages += 1;
            return;
        }
        let next = img.next_generation;
        let known = |what, generation: u64| {
            if generation != NO_GENERATION && generation >= next {
                Err(Rejected::Generation { what, generation, next })
            } else {
                Ok(())
            }
        };
        let mut unlisted = 0usize;
        let parsed: Result<Report, Rejected> = if kind == MSG_READS {
            messages::parse_reads(p).map_err(Rejected::Shape).and_then(|r| {
                known("READS", r.generation)?;
                Ok(Report { reads: r.entries, listed: Vec::new(), truncated: r.truncated })
            })
        } else {
            messages::parse_listed_read(p).map_err(Rejected::Shape).and_then(|mut r| {
                if r.generation == NO_GENERATION {
                    return Err(Rejected::ListedWithoutTable);
                }
                known("LISTED_READ", r.generation)?;
                // A generation the client still holds (or the current one):
                // its blocks must be listed there.
                let gen =
                    c.held.iter().chain(img.current.iter()).find(|g| g.number == r.generation);
                if let Some(g) = gen {
                    let before = r.blocks.len();
                    r.blocks.retain(|b| g.blocks.binary_search(b).is_ok());
                    unlisted = before - r.blocks.len();
                }
                Ok(Report { reads: Vec::new(), listed: r.blocks, truncated: false })
            })
        };
        let Report { reads, listed, truncated } = match parsed {
            Ok(x) => x,
            Err(why) => {
                img.feedback_counters.rejected_messages += 1;
                let msg = format!("image {}: client pid {pid}: {why}; ignored", img.cfg.name);
                self.client_log(&msg);
                return;
            }
        };
        let fb = img.feedback.as_mut().expect("checked");
        let added: Added = if kind == MSG_READS {
            fb.tally.add_reads(guest, &reads)
        } else {
            fb.tally.add_listed(guest, &listed)
        };
        let image_blocks = fb.image_blocks;
        let counters = &mut img.feedback_counters;
        counters.accepted_blocks += added.accepted as u64;
        counters.rejected_blocks += (added.outside + unlisted) as u64;
        counters.truncated_reports += u64::from(truncated);
        if added.outside + unlisted > 0 {
            let msg = format!(
                "image {}: client pid {pid} reported {} block(s) outside the image ({image_blocks} blocks) and {unlisted} not listed in its generation; ignored",
                img.cfg.name, added.outside
            );
            self.client_log(&msg);
        }
    }

    /// The image's identity is known (or changed): count for it, and ask
    /// for what this host published about it before.
    pub(super) fn ensure_feedback(&mut self, idx: usize) {
        let (Some(tx), Some(id)) = (self.feedback_cmds.as_ref(), self.images[idx].identity) else {
            return;
        };
        let key = id.key();
        let img = &mut self.images[idx];
        if img.feedback.as_ref().is_some_and(|f| f.key == key) {
            return;
        }
        let image_blocks = id.virtual_size.div_ceil(4096);
        img.feedback = Some(ImageFeedback {
            key: key.clone(),
            image_blocks,
            tally: Tally::new(image_blocks, self.cfg.feedback.max_blocks, now_secs()),
            continued: false,
            read_back: "pending".into(),
        });
        let _ =
            tx.send(Cmd::ReadBack { image: idx, name: img.cfg.name.clone(), key, image_blocks });
    }

    /// What Redis held: continue from it.
    pub(super) fn on_read_back(&mut self, r: ReadBack) {
        let img = &mut self.images[r.image];
        let name = img.cfg.name.clone();
        let Some(fb) = img.feedback.as_mut().filter(|f| f.key == r.key && !f.continued) else {
            return;
        };
        fb.continued = true;
        fb.read_back = match r.result {
            Ok(None) => "nothing published before".into(),
            Ok(Some(s)) => {
                fb.tally.merge(&s);
                let what = format!(
                    "continued from {} blocks, {} guests since {}",
                    s.records.len(),
                    s.guests,
                    s.since
                );
                crate::log::info(&format!("image {name}: feedback {what}"));
                what
            }
            Err(e) => {
                crate::log::error(&format!(
                    "image {name}: this host's feedback in Redis cannot be continued from ({e}); starting over, it will be replaced"
                ));
                format!("refused: {e}")
            }
        };
    }

    /// Hand every image's accumulation to the Redis thread; an accumulation
    /// older than `feedback.window_secs` starts over after it.
    pub(super) fn publish_feedback(&mut self) {
        let Some(tx) = self.feedback_cmds.as_ref() else {
            return;
        };
        let now = now_secs();
        let host = self.cfg.host();
        let window = self.cfg.feedback.window_secs;
        for (i, img) in self.images.iter_mut().enumerate() {
            let Some(fb) = img.feedback.as_mut() else {
                continue;
            };
            let summary = Summary {
                host: host.clone(),
                image: fb.key.clone(),
                since: fb.tally.since.min(now),
                updated: now,
                guests: fb.tally.guests(),
                records: if fb.continued { fb.tally.records() } else { Vec::new() },
            };
            let s = Snapshot {
                image: i,
                name: img.cfg.name.clone(),
                image_blocks: fb.image_blocks,
                continued: fb.continued,
                summary,
            };
            let _ = tx.send(Cmd::Publish(Box::new(s)));
            if fb.continued && window > 0 && now.saturating_sub(fb.tally.since) >= window {
                crate::log::info(&format!(
                    "image {}: feedback accumulated since {} published; starting a new one (feedback.window_secs)",
                    img.cfg.name, fb.tally.since
                ));
                fb.tally.start_over(now);
            }
        }
    }

    /// At shutdown: publish what was counted since the last interval, and
    /// wait a little for it.
    pub(super) fn flush_feedback(&mut self) {
        self.publish_feedback();
        let Some(tx) = self.feedback_cmds.take() else {
            return;
        };
        let (done, wait) = channel();
        if tx.send(Cmd::Shutdown { done }).is_ok()
            && wait.recv_timeout(Duration::from_secs(3)).is_err()
        {
            crate::log::warn("feedback: Redis did not take the last publish within 3 s");
        }
    }
}
