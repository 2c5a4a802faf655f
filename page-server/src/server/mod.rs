//! The daemon: sockets, clients, generations, hot reload.
//!
//! One thread owns all state and polls the listening sockets, the clients,
//! an inotify descriptor and an eventfd that the loader and Redis threads
//! use to wake it.  Heavy work (hashing, reading the image) happens on the
//! loader thread, so the loop stays responsive and keeps the systemd
//! watchdog fed.
//!
//! Where to read what (each file adds methods to [`Server`]):
//!
//! * `setup.rs`: [`Server::new`]: directories, sockets, the loader and
//!   Redis threads, the kernel probe;
//! * `sockets.rs`: publishing a listening Unix socket;
//! * `event_loop.rs`: [`Server::run`]: what is polled, timers, shutdown;
//! * `generations.rs`: loads requested and finished, publishing a new
//!   generation, withdrawing a table;
//! * `file_watch.rs`: inotify on list files, image directories and image
//!   inodes;
//! * `clients.rs`: client sessions on the image sockets (TABLE, NO_TABLE,
//!   SWITCHED, STATS, BYE);
//! * `control.rs`: requests on the control socket (status, reload) and the
//!   status JSON;
//! * `feedback.rs`: the clients' READS and LISTED_READ, counted per image
//!   and handed to the Redis feedback thread.

mod clients;
mod control;
mod event_loop;
mod feedback;
mod file_watch;
mod generations;
mod setup;
mod sockets;

use crate::arena::Arena;
use crate::config::{Config, ImageConfig, Problem};
use crate::identity::{FileStamp, Identity};
use crate::loader::{Job, ListSource, Loaded};
use crate::metrics::MetricsError;
use crate::notify::Notifier;
use crate::proto::{NT_IMAGE_CHANGED, NT_LOADING, NT_NO_LIST, NT_REFUSED};
use crate::redis_feedback::{self, PublishStatus, ReadBack};
use crate::redis_watch::{self, RedisList, RedisStatus};
use clients::{Client, ClientCounters};
use feedback::{FeedbackCounters, ImageFeedback};
use generations::Generation;
use serde_json::Value;
use sockets::SocketError;
use std::collections::HashMap;
use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Why the server could not start, or its loop had to stop.
#[derive(Debug)]
pub enum ServerError {
    CacheDir { dir: PathBuf, source: io::Error },
    Config(Problem),
    Socket(SocketError),
    Pidfd(io::Error),
    Eventfd(io::Error),
    Thread { name: &'static str, source: io::Error },
    Metrics(MetricsError),
    Poll(io::Error),
}

impl fmt::Display for ServerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServerError::CacheDir { dir, source } => {
                write!(f, "cache_dir {}: {source}", dir.display())
            }
            ServerError::Config(p) => p.fmt(f),
            ServerError::Socket(e) => e.fmt(f),
            ServerError::Pidfd(e) => write!(f, "pidfd_open(getpid()): {e}"),
            ServerError::Eventfd(e) => write!(f, "eventfd: {e}"),
            ServerError::Thread { name, source } => {
                write!(f, "cannot start the {name} thread: {source}")
            }
            ServerError::Metrics(e) => e.fmt(f),
            ServerError::Poll(e) => write!(f, "poll: {e}"),
        }
    }
}

impl std::error::Error for ServerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ServerError::Config(p) => Some(p),
            ServerError::Socket(e) => Some(e),
            ServerError::Metrics(e) => Some(e),
            ServerError::CacheDir { source: e, .. }
            | ServerError::Thread { source: e, .. }
            | ServerError::Pidfd(e)
            | ServerError::Eventfd(e)
            | ServerError::Poll(e) => Some(e),
        }
    }
}

impl From<SocketError> for ServerError {
    fn from(e: SocketError) -> Self {
        ServerError::Socket(e)
    }
}

/// What the loader and Redis threads hand to the main loop.
enum Event {
    Loaded(Box<Loaded>),
    Redis(RedisList),
    /// What this host published about an image before (feedback).
    ReadBack(ReadBack),
}

/// Wake the main loop from another thread (the loader, Redis), after
/// sending it an [`Event`].
fn wake(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writing 8 bytes to an eventfd.
    unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

/// Where an image is, as `status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ImageStatus {
    Starting,
    Loading,
    Serving,
    /// No list exists yet (a Redis image before Redis has one).
    NoList,
    /// The list was refused and there is no earlier one.
    Refused,
    /// The image cannot be read; retried.
    Error,
    /// The image changed: the table was withdrawn.
    Withdrawn,
}

impl ImageStatus {
    fn as_str(self) -> &'static str {
        match self {
            ImageStatus::Starting => "starting",
            ImageStatus::Loading => "loading",
            ImageStatus::Serving => "serving",
            ImageStatus::NoList => "no-list",
            ImageStatus::Refused => "refused",
            ImageStatus::Error => "error",
            ImageStatus::Withdrawn => "withdrawn",
        }
    }

    /// What NO_TABLE tells a client that connects while there is no table.
    fn no_table_reason(self) -> u32 {
        match self {
            ImageStatus::Starting | ImageStatus::Loading => NT_LOADING,
            ImageStatus::NoList => NT_NO_LIST,
            ImageStatus::Refused => NT_REFUSED,
            ImageStatus::Serving | ImageStatus::Error | ImageStatus::Withdrawn => NT_IMAGE_CHANGED,
        }
    }
}

/// One image the server serves: its socket, the generation it publishes and
/// what the loads so far said.
struct ImageState {
    cfg: ImageConfig,
    listener: UnixListener,
    current: Option<Rc<Generation>>,
    /// The generation withdrawn because the image file changed, kept (its
    /// blocks stay loaded, at the same addresses) until the load that
    /// verifies the file again ends: if the content is the same, the next
    /// generation reuses every block instead of reading it again.
    suspended: Option<Rc<Generation>>,
    next_generation: u64,
    state: ImageStatus,
    message: String,
    identity: Option<Identity>,
    /// Stamp of the image file the last load verified (None: re-check).
    image_stamp: Option<FileStamp>,
    /// inotify watch on the image file's inode: (wd, st_dev, st_ino).
    inode_watch: Option<(i32, u64, u64)>,
    arena: Option<Arc<Arena>>,
    seq: u64,
    loading: bool,
    /// Debounced reload (inotify) at this time.
    reload_at: Option<Instant>,
    recheck_image_at: Option<Instant>,
    last_source: Option<ListSource>,
    redis_key: Option<String>,
    last_load: Value,
    last_error: String,
    loads_ok: u64,
    loads_failed: u64,
    closed_counters: ClientCounters,
    clients_total: u64,
    /// What guests read, for the current identity (None: feedback is off
    /// or the identity is not known yet).
    feedback: Option<ImageFeedback>,
    feedback_counters: FeedbackCounters,
}

impl ImageState {
    fn new(cfg: ImageConfig, listener: UnixListener) -> ImageState {
        ImageState {
            cfg,
            listener,
            current: None,
            suspended: None,
            next_generation: 1,
            state: ImageStatus::Starting,
            message: String::new(),
            identity: None,
            image_stamp: None,
            inode_watch: None,
            arena: None,
            seq: 0,
            loading: false,
            reload_at: None,
            recheck_image_at: None,
            last_source: None,
            redis_key: None,
            last_load: Value::Null,
            last_error: String::new(),
            loads_ok: 0,
            loads_failed: 0,
            closed_counters: ClientCounters::default(),
            clients_total: 0,
            feedback: None,
            feedback_counters: FeedbackCounters::default(),
        }
    }
}

pub struct Server {
    cfg: Config,
    images: Vec<ImageState>,
    control: UnixListener,
    clients: HashMap<u64, Client>,
    next_client: u64,
    pidfd: OwnedFd,
    wake_fd: Arc<OwnedFd>,
    inotify: Option<OwnedFd>,
    /// inotify watch descriptor -> directory it watches (the images'
    /// inodes are watched too: ImageState::inode_watch)
    watches: HashMap<i32, PathBuf>,
    events: Receiver<Event>,
    jobs: Sender<Job>,
    latest: Arc<Vec<AtomicU64>>,
    redis_cmds: Option<Sender<redis_watch::Cmd>>,
    redis_status: Arc<Mutex<RedisStatus>>,
    /// The Redis feedback thread (None: feedback is off).
    feedback_cmds: Option<Sender<redis_feedback::Cmd>>,
    feedback_status: Arc<Mutex<Vec<PublishStatus>>>,
    feedback_due: Instant,
    snapshot: Arc<Mutex<String>>,
    metrics: Arc<Mutex<String>>,
    global_loaded: Arc<AtomicU64>,
    degraded: Option<String>,
    started: f64,
    notifier: Notifier,
    log_budget: (Instant, u32),
}
