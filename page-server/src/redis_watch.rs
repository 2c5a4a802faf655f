//! The Redis side: watch for new lists of the images we serve, push our
//! status to the fleet view.  Runs on its own thread; Redis being down never
//! blocks serving.  Keys (shared with analyzer/pageshare/lists/distribute.py):
//!
//! * `<prefix>:list:<size>-<sha256>`  the pcsl text of an image's current list
//! * `<prefix>:meta:<size>-<sha256>`  hash: who published it, when, stats
//! * `<prefix>:images`                set of the image keys above
//! * `<prefix>:events`                pub/sub channel; message = image key
//! * `<prefix>:host:<host>`           hash: `status` (JSON), `updated`, `pid`
//! * `<prefix>:hosts`                 set of host names
//! * `<prefix>:feedback:<size>-<sha256>:<host>`  hash: what this host's
//!   guests read of the image (`host`, `image`, `since`, `updated`,
//!   `guests`, `version`, binary `blocks`; src/feedback/summary.rs)
//! * `<prefix>:feedback:<size>-<sha256>:hosts`   set of the hosts that
//!   published feedback for the image
//!
//! The two feedback keys are written by src/redis_feedback.rs, on a thread
//! of its own with its own connection ([`connect`]), so that a slow publish
//! never delays a list.

use crate::config::RedisConfig;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub enum Cmd {
    /// Watch `key` for image number `image`.
    Watch {
        image: usize,
        key: String,
    },
    Shutdown,
}

pub struct RedisList {
    pub image: usize,
    pub key: String,
    pub text: Arc<Vec<u8>>,
}

#[derive(Default, Clone, serde::Serialize)]
pub struct RedisStatus {
    pub connected: bool,
    pub url: String,
    pub last_error: String,
    pub connects: u64,
    pub failures: u64,
    pub lists_received: u64,
    pub stats_pushed: u64,
    pub last_contact: f64,
}

pub struct Watcher {
    pub cfg: RedisConfig,
    pub host: String,
    pub max_list_bytes: u64,
    pub cmds: Receiver<Cmd>,
    /// Hands a new list to the main loop (and wakes it).
    pub deliver: Box<dyn Fn(RedisList) + Send>,
    pub status: Arc<Mutex<RedisStatus>>,
    /// The server's status JSON, pushed to the host hash.
    pub snapshot: Arc<Mutex<String>>,
    watched: Vec<(usize, String)>,
    /// sha256 of the last text delivered per key, so a list is delivered once.
    delivered: HashMap<String, [u8; 32]>,
    shutdown: bool,
}

/// Waiting for a connection to Redis.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Waiting for Redis to take a command or answer it.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a Redis session (or a feedback publish) ended.
#[derive(Debug)]
pub(crate) enum RedisError {
    BadUrl(redis::RedisError),
    /// Connecting or subscribing.
    Connect(redis::RedisError),
    Subscription(redis::RedisError),
    /// A command on a key: what it was, and Redis's answer.
    Command {
        what: String,
        source: redis::RedisError,
    },
    PushStats(redis::RedisError),
}

impl RedisError {
    /// Whether the session had got as far as a connection (a session that
    /// did resets the backoff).
    fn was_connected(&self) -> bool {
        !matches!(self, RedisError::BadUrl(_) | RedisError::Connect(_))
    }
}

impl fmt::Display for RedisError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RedisError::BadUrl(e) => write!(f, "bad url: {e}"),
            RedisError::Connect(e) => e.fmt(f),
            RedisError::Subscription(e) => write!(f, "subscription: {e}"),
            RedisError::Command { what, source } => write!(f, "{what}: {source}"),
            RedisError::PushStats(e) => write!(f, "pushing stats: {e}"),
        }
    }
}

impl std::error::Error for RedisError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RedisError::BadUrl(e)
            | RedisError::Connect(e)
            | RedisError::Subscription(e)
            | RedisError::Command { source: e, .. }
            | RedisError::PushStats(e) => Some(e),
        }
    }
}

/// A command connection to `client`'s Redis, with the timeouts every
/// command of the server runs under.
pub(crate) fn connect(client: &redis::Client) -> Result<redis::Connection, RedisError> {
    let con = client.get_connection_with_timeout(CONNECT_TIMEOUT).map_err(RedisError::Connect)?;
    con.set_read_timeout(Some(COMMAND_TIMEOUT)).map_err(RedisError::Connect)?;
    con.set_write_timeout(Some(COMMAND_TIMEOUT)).map_err(RedisError::Connect)?;
    Ok(con)
}

pub(crate) fn redact(url: &str) -> String {
    // redis://user:password@host -> redis://user:***@host
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let cred = &url[s + 3..at];
            match cred.find(':') {
                Some(c) => format!("{}{}:***{}", &url[..s + 3], &cred[..c], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

impl Watcher {
    pub fn new(
        cfg: RedisConfig,
        host: String,
        max_list_bytes: u64,
        cmds: Receiver<Cmd>,
        deliver: Box<dyn Fn(RedisList) + Send>,
        status: Arc<Mutex<RedisStatus>>,
        snapshot: Arc<Mutex<String>>,
    ) -> Watcher {
        status.lock().expect("status").url = redact(&cfg.url);
        Watcher {
            cfg,
            host,
            max_list_bytes,
            cmds,
            deliver,
            status,
            snapshot,
            watched: Vec::new(),
            delivered: HashMap::new(),
            shutdown: false,
        }
    }

    fn drain_cmds(&mut self) -> Vec<usize> {
        let mut new = Vec::new();
        while let Ok(c) = self.cmds.try_recv() {
            match c {
                Cmd::Watch { image, key } => {
                    self.watched.retain(|(i, _)| *i != image);
                    self.watched.push((image, key));
                    new.push(image);
                }
                Cmd::Shutdown => self.shutdown = true,
            }
        }
        new
    }

    pub fn run(mut self) {
        let mut backoff = Duration::from_secs(1);
        let max_backoff = Duration::from_secs(self.cfg.max_backoff_secs.max(1));
        let mut last_logged: Option<(String, Instant)> = None;
        while !self.shutdown {
            self.drain_cmds();
            let err = match self.session() {
                Ok(()) => break,
                Err(e) => {
                    if e.was_connected() {
                        backoff = Duration::from_secs(1);
                    }
                    e.to_string()
                }
            };
            if self.shutdown {
                break;
            }
            {
                let mut s = self.status.lock().expect("status");
                s.connected = false;
                s.failures += 1;
                s.last_error = err.clone();
            }
            // Say it once per distinct error, and again every minute while it lasts.
            let say = match &last_logged {
                Some((m, t)) => *m != err || t.elapsed() > Duration::from_secs(60),
                None => true,
            };
            if say {
                crate::log::warn(&format!(
                    "redis {}: {err}; still serving the current lists, retrying (backoff up to {} s)",
                    redact(&self.cfg.url),
                    max_backoff.as_secs()
                ));
                last_logged = Some((err, Instant::now()));
            }
            let until = Instant::now() + backoff;
            while Instant::now() < until && !self.shutdown {
                std::thread::sleep(Duration::from_millis(100));
                self.drain_cmds();
            }
            backoff = (backoff * 2).min(max_backoff);
        }
    }

    /// One connected session, until Redis fails or the server shuts down.
    fn session(&mut self) -> Result<(), RedisError> {
        let client = redis::Client::open(self.cfg.url.as_str()).map_err(RedisError::BadUrl)?;
        let mut con = connect(&client)?;
        let mut sub =
            client.get_connection_with_timeout(CONNECT_TIMEOUT).map_err(RedisError::Connect)?;
        let channel = format!("{}:events", self.cfg.prefix);
        let mut ps = sub.as_pubsub();
        ps.subscribe(&channel).map_err(RedisError::Connect)?;
        ps.set_read_timeout(Some(Duration::from_millis(500))).map_err(RedisError::Connect)?;
        {
            let mut s = self.status.lock().expect("status");
            s.connected = true;
            s.connects += 1;
            s.last_error.clear();
            s.last_contact = crate::sys::now_unix();
        }
        crate::log::info(&format!(
            "redis {}: connected, watching channel {channel}",
            redact(&self.cfg.url)
        ));
        // Anything we missed while disconnected.
        self.check(&mut con, None)?;
        self.push_stats(&mut con)?;
        let poll = Duration::from_secs(self.cfg.poll_interval_secs.max(1));
        let stats_every = Duration::from_secs(self.cfg.stats_interval_secs.max(1));
        let mut next_poll = Instant::now() + poll;
        let mut next_stats = Instant::now() + stats_every;
        loop {
            let new = self.drain_cmds();
            if self.shutdown {
                return Ok(());
            }
            for image in new {
                self.check(&mut con, Some(image))?;
            }
            match ps.get_message() {
                Ok(msg) => {
                    let payload: String = msg.get_payload().unwrap_or_default();
                    let hit: Vec<usize> = self
                        .watched
                        .iter()
                        .filter(|(_, k)| k.ends_with(&format!(":{payload}")) || *k == payload)
                        .map(|(i, _)| *i)
                        .collect();
                    for image in hit {
                        self.check(&mut con, Some(image))?;
                    }
                }
                Err(e) if e.is_timeout() => {}
                Err(e) => return Err(RedisError::Subscription(e)),
            }
            if Instant::now() >= next_poll {
                self.check(&mut con, None)?;
                next_poll = Instant::now() + poll;
            }
            if Instant::now() >= next_stats {
                self.push_stats(&mut con)?;
                next_stats = Instant::now() + stats_every;
            }
            self.status.lock().expect("status").last_contact = crate::sys::now_unix();
        }
    }

    /// Fetch the watched keys (or one image's) and deliver new texts.
    fn check(
        &mut self,
        con: &mut redis::Connection,
        only: Option<usize>,
    ) -> Result<(), RedisError> {
        let watched = self.watched.clone();
        for (image, key) in watched {
            if only.is_some_and(|o| o != image) {
                continue;
            }
            let len: i64 = match redis::cmd("STRLEN").arg(&key).query(con) {
                Ok(n) => n,
                Err(e) if e.code() == Some("WRONGTYPE") => {
                    let marker = [0xfeu8; 32];
                    if self.delivered.get(&key) != Some(&marker) {
                        crate::log::error(&format!("redis key {key} is not a string; ignored"));
                        self.delivered.insert(key.clone(), marker);
                    }
                    continue;
                }
                Err(source) => {
                    return Err(RedisError::Command { what: format!("STRLEN {key}"), source })
                }
            };
            if len == 0 {
                continue; // no list published (or not a string: reported by GET below)
            }
            if len as u64 > self.max_list_bytes {
                let digest = [0xffu8; 32];
                if self.delivered.get(&key) != Some(&digest) {
                    crate::log::error(&format!(
                        "redis key {key} holds {len} bytes, over limits.max_list_bytes; ignored"
                    ));
                    self.delivered.insert(key.clone(), digest);
                }
                continue;
            }
            let text: Option<Vec<u8>> = match redis::cmd("GET").arg(&key).query(con) {
                Ok(t) => t,
                Err(e)
                    if e.kind() == redis::ErrorKind::TypeError || e.code() == Some("WRONGTYPE") =>
                {
                    crate::log::error(&format!("redis key {key} is not a string; ignored"));
                    continue;
                }
                Err(source) => {
                    return Err(RedisError::Command { what: format!("GET {key}"), source })
                }
            };
            let Some(text) = text else { continue };
            let digest: [u8; 32] = Sha256::digest(&text).into();
            if self.delivered.get(&key) == Some(&digest) {
                continue;
            }
            self.delivered.insert(key.clone(), digest);
            self.status.lock().expect("status").lists_received += 1;
            (self.deliver)(RedisList { image, key, text: Arc::new(text) });
        }
        Ok(())
    }

    fn push_stats(&mut self, con: &mut redis::Connection) -> Result<(), RedisError> {
        let snap = self.snapshot.lock().expect("snapshot").clone();
        let key = format!("{}:host:{}", self.cfg.prefix, self.host);
        redis::pipe()
            .atomic()
            .cmd("HSET")
            .arg(&key)
            .arg("status")
            .arg(&snap)
            .arg("updated")
            .arg(format!("{:.3}", crate::sys::now_unix()))
            .arg("pid")
            .arg(std::process::id())
            .ignore()
            .cmd("EXPIRE")
            .arg(&key)
            .arg(86400)
            .ignore()
            .cmd("SADD")
            .arg(format!("{}:hosts", self.cfg.prefix))
            .arg(&self.host)
            .ignore()
            .query::<()>(con)
            .map_err(RedisError::PushStats)?;
        self.status.lock().expect("status").stats_pushed += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn redact_hides_only_the_password() {
        assert_eq!(redact("redis://user:secret@host:6379/0"), "redis://user:***@host:6379/0");
        assert_eq!(redact("redis://:secret@host/"), "redis://:***@host/");
        assert_eq!(redact("redis://user@host/"), "redis://user@host/");
        assert_eq!(redact("redis://127.0.0.1:6379/0"), "redis://127.0.0.1:6379/0");
        assert_eq!(redact("unix:///run/redis.sock"), "unix:///run/redis.sock");
    }
}
