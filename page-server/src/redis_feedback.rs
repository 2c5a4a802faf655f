//! Publishing what guests read (src/feedback/) to Redis, on a thread of its
//! own with its own connection: the main loop hands over a snapshot every
//! `feedback.interval_secs` and never waits for Redis.
//!
//! Per image, this host writes the hash `<prefix>:feedback:<image
//! key>:<host>` (replaced whole, in one MULTI) and adds itself to the set
//! `<prefix>:feedback:<image key>:hosts`; both expire after two windows
//! without a publish.  Before the first publish of an image key it reads
//! that hash back and hands it to the main loop, which continues the
//! accumulation from it: until then nothing is written, so a restart loses
//! at most the last interval.
//!
//! Redis down: the publish is dropped (the next interval has everything,
//! the accumulation is cumulative), the failure is logged once per outage
//! and counted in the status, and the next interval tries again.

use crate::config::RedisConfig;
use crate::feedback::summary::{BadSummary, Summary};
use crate::redis_watch::{connect, redact, RedisError};
use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};

pub enum Cmd {
    /// Read this host's hash of image key `key` back (once per key).
    ReadBack {
        image: usize,
        name: String,
        key: String,
        image_blocks: u64,
    },
    Publish(Box<Snapshot>),
    /// Finish what is queued, then tell `done` and stop.
    Shutdown {
        done: Sender<()>,
    },
}

/// One image's accumulation, to publish.
pub struct Snapshot {
    pub image: usize,
    /// The image's name in the configuration (for the log).
    pub name: String,
    pub image_blocks: u64,
    /// False while what was read back has not been merged yet: publishing
    /// would overwrite it, so the snapshot asks for the read-back instead.
    pub continued: bool,
    pub summary: Summary,
}

/// This host's hash of an image key as read back: None if there is none.
pub struct ReadBack {
    pub image: usize,
    pub key: String,
    pub result: Result<Option<Summary>, BadSummary>,
}

/// What `status` shows of the publishing, per image.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct PublishStatus {
    pub publishes: u64,
    pub failures: u64,
    /// Unix seconds of the last successful publish (0: none yet).
    pub last_publish: f64,
    pub last_publish_bytes: u64,
    pub last_error: String,
}

pub struct Publisher {
    cfg: RedisConfig,
    host: String,
    /// Seconds the keys live without a publish (0: forever).
    expire_secs: u64,
    cmds: Receiver<Cmd>,
    /// Hands a read-back to the main loop (and wakes it).
    deliver: Box<dyn Fn(ReadBack) + Send>,
    status: Arc<Mutex<Vec<PublishStatus>>>,
    con: Option<redis::Connection>,
    /// Image keys whose hash was read back and delivered.
    read_back: HashSet<String>,
    /// The outage already logged (cleared by a success).
    outage: Option<String>,
}

/// The hash of `host`'s feedback on image `key`.
pub fn hash_key(prefix: &str, key: &str, host: &str) -> String {
    format!("{prefix}:feedback:{key}:{host}")
}

/// The set of hosts that published feedback on image `key`.
pub fn hosts_key(prefix: &str, key: &str) -> String {
    format!("{prefix}:feedback:{key}:hosts")
}

impl Publisher {
    pub fn new(
        cfg: RedisConfig,
        host: String,
        expire_secs: u64,
        cmds: Receiver<Cmd>,
        deliver: Box<dyn Fn(ReadBack) + Send>,
        status: Arc<Mutex<Vec<PublishStatus>>>,
    ) -> Publisher {
        Publisher {
            cfg,
            host,
            expire_secs,
            cmds,
            deliver,
            status,
            con: None,
            read_back: HashSet::new(),
            outage: None,
        }
    }

    pub fn run(mut self) {
        while let Ok(first) = self.cmds.recv() {
            // Everything queued at once: only the latest snapshot of each
            // image is worth publishing (each holds the whole accumulation).
            let mut queue = vec![first];
            queue.extend(self.cmds.try_iter());
            let mut latest: HashMap<usize, usize> = HashMap::new();
            for (i, c) in queue.iter().enumerate() {
                if let Cmd::Publish(s) = c {
                    latest.insert(s.image, i);
                }
            }
            let mut done = None;
            for (i, c) in queue.into_iter().enumerate() {
                match c {
                    Cmd::ReadBack { image, name, key, image_blocks } => {
                        self.read_back(image, &name, &key, image_blocks)
                    }
                    Cmd::Publish(s) if latest.get(&s.image) == Some(&i) => self.publish(*s),
                    Cmd::Publish(_) => {}
                    Cmd::Shutdown { done: d } => done = Some(d),
                }
            }
            if let Some(d) = done {
                let _ = d.send(());
                return;
            }
        }
    }

    fn connection(&mut self) -> Result<&mut redis::Connection, RedisError> {
        if self.con.is_none() {
            let client = redis::Client::open(self.cfg.url.as_str()).map_err(RedisError::BadUrl)?;
            self.con = Some(connect(&client)?);
        }
        Ok(self.con.as_mut().expect("just made"))
    }

    /// A failure: drop the connection, count it, say it once per outage.
    fn failed(&mut self, image: usize, name: &str, e: RedisError) {
        self.con = None;
        let msg = e.to_string();
        if let Some(s) = self.status.lock().expect("feedback status").get_mut(image) {
            s.failures += 1;
            s.last_error = msg.clone();
        }
        if self.outage.is_none() {
            crate::log::warn(&format!(
                "redis {}: feedback of image {name} not published: {msg}; still counting, retrying every interval",
                redact(&self.cfg.url)
            ));
            self.outage = Some(msg);
        }
    }

    fn read_back(&mut self, image: usize, name: &str, key: &str, image_blocks: u64) {
        if self.read_back.contains(key) {
            return;
        }
        let hash = hash_key(&self.cfg.prefix, key, &self.host);
        let got: Result<HashMap<String, Vec<u8>>, RedisError> = self.connection().and_then(|con| {
            redis::cmd("HGETALL")
                .arg(&hash)
                .query(con)
                .map_err(|source| RedisError::Command { what: format!("HGETALL {hash}"), source })
        });
        let result = match got {
            Ok(fields) => Summary::from_fields(&fields, key, &self.host, image_blocks),
            Err(RedisError::Command { source, .. }) if source.code() == Some("WRONGTYPE") => {
                Err(BadSummary::NotAHash)
            }
            Err(e) => {
                self.failed(image, name, e);
                return;
            }
        };
        self.read_back.insert(key.to_string());
        (self.deliver)(ReadBack { image, key: key.to_string(), result });
    }

    fn publish(&mut self, mut s: Snapshot) {
        let key = s.summary.image.clone();
        if !s.continued {
            // Not merged yet: read back first (again, if Redis was down).
            self.read_back(s.image, &s.name, &key, s.image_blocks);
            return;
        }
        let hash = hash_key(&self.cfg.prefix, &key, &self.host);
        let hosts = hosts_key(&self.cfg.prefix, &key);
        let fields = s.summary.fields();
        let bytes: usize = fields.iter().map(|(_, v)| v.len()).sum();
        let mut pipe = redis::pipe();
        pipe.atomic().cmd("DEL").arg(&hash).ignore();
        let hset = pipe.cmd("HSET").arg(&hash);
        for (field, value) in &fields {
            hset.arg(*field).arg(value.as_slice());
        }
        hset.ignore();
        pipe.cmd("SADD").arg(&hosts).arg(&self.host).ignore();
        if self.expire_secs > 0 {
            pipe.cmd("EXPIRE").arg(&hash).arg(self.expire_secs).ignore();
            pipe.cmd("EXPIRE").arg(&hosts).arg(self.expire_secs).ignore();
        }
        let sent = self.connection().and_then(|con| {
            pipe.query::<()>(con).map_err(|source| RedisError::Command {
                what: format!("publishing {hash}"),
                source,
            })
        });
        match sent {
            Ok(()) => {
                if let Some(st) = self.status.lock().expect("feedback status").get_mut(s.image) {
                    st.publishes += 1;
                    st.last_publish = crate::sys::now_unix();
                    st.last_publish_bytes = bytes as u64;
                    st.last_error.clear();
                }
                if self.outage.take().is_some() {
                    crate::log::info(&format!(
                        "redis {}: feedback published again ({hash}, {} blocks)",
                        redact(&self.cfg.url),
                        s.summary.records.len()
                    ));
                }
            }
            Err(e) => self.failed(s.image, &s.name, e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_list_keys() {
        assert_eq!(hash_key("ps", "8192-ab", "h1"), "ps:feedback:8192-ab:h1");
        assert_eq!(hosts_key("ps", "8192-ab"), "ps:feedback:8192-ab:hosts");
    }
}
