//! The daemon's main loop: sockets, clients, generations, hot reload.
//!
//! One thread owns all state and polls the listening sockets, the clients,
//! an inotify descriptor and an eventfd that the loader and Redis threads
//! use to wake it.  Heavy work (hashing, reading the image) happens on the
//! loader thread, so the loop stays responsive and keeps the systemd
//! watchdog fed.

use crate::arena::{Arena, MergeMode};
use crate::config::{Config, ImageConfig};
use crate::identity::{FileStamp, Identity, IdentityCache};
use crate::loader::{cached_list_path, FailKind, Job, ListSource, LoadOk, Loaded, Loader};
use crate::notify::Notifier;
use crate::proto::{self, *};
use crate::redis_watch::{self, RedisList, RedisStatus};
use crate::table::{self, TableInfo};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub enum Event {
    Loaded(Box<Loaded>),
    Redis(RedisList),
}

/// One published table: immutable.  Dropping the last reference (the image's
/// `current` and every client still using it) releases its blocks.
struct Generation {
    number: u64,
    /// The image file the load that produced this generation verified.
    stamp: FileStamp,
    /// "raw" or "qcow2": the format it was read with.
    format: String,
    memfd: OwnedFd,
    arena: Arc<Arena>,
    blocks: Vec<u64>,
    table_bytes: usize,
    list_digest: String,
    text_sha: [u8; 32],
    list_meta: Value,
    source: String,
    published_at: f64,
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.arena.release(&self.blocks);
    }
}

#[derive(Default, Clone, Copy)]
struct ClientCounters {
    lookups: u64,
    hits: u64,
    merged: u64,
    merge_errors: u64,
    fallbacks: u64,
}

impl ClientCounters {
    fn add(&mut self, o: &ClientCounters) {
        self.lookups += o.lookups;
        self.hits += o.hits;
        self.merged += o.merged;
        self.merge_errors += o.merge_errors;
        self.fallbacks += o.fallbacks;
    }
    fn json(&self) -> Value {
        json!({"lookups": self.lookups, "hits": self.hits, "merged": self.merged,
               "merge_errors": self.merge_errors, "fallbacks": self.fallbacks})
    }
}

struct ImageState {
    cfg: ImageConfig,
    listener: UnixListener,
    current: Option<Rc<Generation>>,
    next_generation: u64,
    state: &'static str,
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
}

enum Kind {
    Image(usize),
    Control,
}

struct Client {
    stream: UnixStream,
    kind: Kind,
    buf: Vec<u8>,
    /// Generations this client may still use (sent, not yet superseded by a
    /// SWITCHED from the client).
    held: Vec<Rc<Generation>>,
    waiting_since: Option<Instant>,
    pid: i32,
    uid: u32,
    counters: ClientCounters,
    connected_at: f64,
    bad_messages: u64,
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
    snapshot: Arc<Mutex<String>>,
    metrics: Arc<Mutex<String>>,
    global_loaded: Arc<AtomicU64>,
    degraded: Option<String>,
    started: f64,
    notifier: Notifier,
    stop: Arc<AtomicBool>,
    log_budget: (Instant, u32),
}

static STOP: AtomicBool = AtomicBool::new(false);

/// Retry interval after the base image could not be read.
const IMAGE_RETRY: Duration = Duration::from_secs(30);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn wake(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writing 8 bytes to an eventfd.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

fn bind_socket(path: &Path, mode: u32) -> Result<UnixListener, String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    // Replace a stale socket from an earlier run, but never another kind of file.
    if let Ok(md) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if md.file_type().is_socket() {
            if UnixStream::connect(path).is_ok() {
                return Err(format!("{}: another server is listening there", path.display()));
            }
            let _ = std::fs::remove_file(path);
        } else {
            return Err(format!("{}: exists and is not a socket", path.display()));
        }
    }
    // Bind and chmod under a temporary name and rename it into place: a
    // socket file that exists under its real name is already listening with
    // its final mode, so a client never sees ECONNREFUSED from the window
    // between bind() and listen(), nor a socket with the umask's mode.
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp_name);
    let _ = std::fs::remove_file(&tmp);
    let l = UnixListener::bind(&tmp).map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    let published = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("chmod {}: {e}", path.display()))
        .and_then(|_| std::fs::rename(&tmp, path).map_err(|e| format!("cannot publish {}: {e}", path.display())));
    if let Err(e) = published {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    l.set_nonblocking(true).map_err(|e| e.to_string())?;
    Ok(l)
}

/// Probe MADV_ALLOWMERGED once on a scratch page: None = supported.
fn probe_degraded() -> Option<String> {
    // SAFETY: scratch anonymous mapping, unmapped below.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return Some("mmap failed while probing MADV_ALLOWMERGED".into());
        }
        let r = libc::madvise(p, 4096, crate::sys::MADV_ALLOWMERGED);
        let e = crate::sys::errno();
        libc::munmap(p, 4096);
        if r == 0 {
            None
        } else {
            Some(format!(
                "kernel refused madvise(MADV_ALLOWMERGED={}) with {}: this kernel lacks the pageshare series; blocks are still preloaded and published, but QEMU's merge_pages() will fail and guests read from disk",
                crate::sys::MADV_ALLOWMERGED,
                std::io::Error::from_raw_os_error(e)
            ))
        }
    }
}

const KSM_RUN: &str = "/sys/kernel/mm/ksm/run";

/// merge_pages() fails with EOPNOTSUPP unless ksmd is in merge mode: say so
/// at start (`run` is the content of /sys/kernel/mm/ksm/run, None if absent).
fn ksm_run_warning(run: Option<&str>) -> Option<String> {
    match run.map(str::trim) {
        Some("1") => None,
        Some(v) => Some(format!(
            "{KSM_RUN} is {v}, not 1: merge_pages() fails (EOPNOTSUPP) until KSM runs in merge mode, and guests read from disk; `echo 1 > {KSM_RUN}` (pages_to_scan may be 0)"
        )),
        None => Some(format!("{KSM_RUN} is missing: merge_pages() needs KSM")),
    }
}

impl Server {
    pub fn new(cfg: Config) -> Result<Server, String> {
        std::fs::create_dir_all(&cfg.cache_dir).map_err(|e| format!("cache_dir {}: {e}", cfg.cache_dir.display()))?;
        std::fs::create_dir_all(cfg.cache_dir.join("lists")).map_err(|e| e.to_string())?;
        let mode = cfg.socket_mode_bits()?;
        let control = bind_socket(cfg.control_socket.as_ref().expect("set by load"), 0o600.min(mode) | 0o600)?;
        let mut images = Vec::new();
        for img in &cfg.images {
            let listener = bind_socket(img.socket.as_ref().expect("set by load"), mode)?;
            images.push(ImageState {
                cfg: img.clone(),
                listener,
                current: None,
                next_generation: 1,
                state: "starting",
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
            });
        }
        let pidfd = crate::sys::pidfd_self().map_err(|e| format!("pidfd_open(getpid()): {e}"))?;
        // SAFETY: plain eventfd creation.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(format!("eventfd: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: fresh descriptor.
        let wake_fd = Arc::new(unsafe { OwnedFd::from_raw_fd(efd) });
        let (ev_tx, ev_rx) = channel::<Event>();
        let (job_tx, job_rx) = channel::<Job>();
        let latest: Arc<Vec<AtomicU64>> = Arc::new((0..images.len()).map(|_| AtomicU64::new(0)).collect());
        let global_loaded = Arc::new(AtomicU64::new(0));
        let loader = Loader {
            cfg: cfg.clone(),
            ids: IdentityCache::new(&cfg.cache_dir),
            latest: latest.clone(),
            global_loaded: global_loaded.clone(),
        };
        {
            let tx = ev_tx.clone();
            let wfd = wake_fd.clone();
            std::thread::Builder::new()
                .name("loader".into())
                .spawn(move || {
                    for job in job_rx {
                        let image = job.image;
                        let seq = job.seq;
                        let source = job.source.clone();
                        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| loader.run(job)))
                            .unwrap_or_else(|_| Loaded {
                                image,
                                seq,
                                source,
                                identity: None,
                                stamp: None,
                                result: Err((FailKind::Image, "internal error: loader panicked".into())),
                            });
                        if tx.send(Event::Loaded(Box::new(out))).is_err() {
                            break;
                        }
                        wake(wfd.as_raw_fd());
                    }
                })
                .map_err(|e| e.to_string())?;
        }
        let redis_status = Arc::new(Mutex::new(RedisStatus::default()));
        let snapshot = Arc::new(Mutex::new(String::from("{}")));
        let metrics = Arc::new(Mutex::new(String::new()));
        let redis_cmds = match &cfg.redis {
            Some(rc) => {
                let (tx, rx) = channel();
                let wfd = wake_fd.clone();
                let w = redis_watch::Watcher::new(
                    rc.clone(),
                    cfg.host(),
                    cfg.limits.max_list_bytes,
                    rx,
                    ev_tx.clone(),
                    Arc::new(move || wake(wfd.as_raw_fd())),
                    redis_status.clone(),
                    snapshot.clone(),
                );
                std::thread::Builder::new().name("redis".into()).spawn(move || w.run()).map_err(|e| e.to_string())?;
                Some(tx)
            }
            None => None,
        };
        if !cfg.metrics_listen.is_empty() {
            crate::metrics::spawn(&cfg.metrics_listen, metrics.clone())?;
        }
        let degraded = probe_degraded();
        let mut s = Server {
            cfg,
            images,
            control,
            clients: HashMap::new(),
            next_client: 1,
            pidfd,
            wake_fd,
            inotify: None,
            watches: HashMap::new(),
            events: ev_rx,
            jobs: job_tx,
            latest,
            redis_cmds,
            redis_status,
            snapshot,
            metrics,
            global_loaded,
            degraded,
            started: crate::sys::now_unix(),
            notifier: Notifier::from_env(),
            stop: Arc::new(AtomicBool::new(false)),
            log_budget: (Instant::now(), 0),
        };
        s.setup_inotify();
        Ok(s)
    }

    fn setup_inotify(&mut self) {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        if fd < 0 {
            crate::log::warn(&format!(
                "inotify: {}; list files and images are re-checked only on `reload`",
                std::io::Error::last_os_error()
            ));
            return;
        }
        // SAFETY: fresh descriptor.
        self.inotify = Some(unsafe { OwnedFd::from_raw_fd(fd) });
        let mut dirs: Vec<PathBuf> = Vec::new();
        for img in &self.images {
            for p in [Some(&img.cfg.path), img.cfg.list_file.as_ref()].into_iter().flatten() {
                if let Some(d) = p.parent() {
                    let d = if d.as_os_str().is_empty() { Path::new(".") } else { d };
                    if !dirs.iter().any(|x| x == d) {
                        dirs.push(d.to_path_buf());
                    }
                }
            }
        }
        let mask = libc::IN_CLOSE_WRITE
            | libc::IN_MOVED_TO
            | libc::IN_MOVED_FROM
            | libc::IN_CREATE
            | libc::IN_DELETE
            | libc::IN_ATTRIB
            | libc::IN_MODIFY;
        for d in dirs {
            let Ok(c) = CString::new(d.as_os_str().as_encoded_bytes()) else { continue };
            // SAFETY: valid C string; our inotify fd.
            let wd = unsafe { libc::inotify_add_watch(fd, c.as_ptr(), mask) };
            if wd < 0 {
                crate::log::warn(&format!(
                    "inotify watch on {}: {}; changes there are noticed only on `reload`",
                    d.display(),
                    std::io::Error::last_os_error()
                ));
            } else {
                self.watches.insert(wd, d);
            }
        }
    }

    fn handle_inotify(&mut self) {
        let Some(fd) = self.inotify.as_ref().map(|f| f.as_raw_fd()) else { return };
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: reading into our buffer.
            let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                break;
            }
            let mut off = 0usize;
            let n = n as usize;
            let hdr = std::mem::size_of::<libc::inotify_event>();
            while off + hdr <= n {
                // SAFETY: the kernel wrote a whole event at off.
                let ev: libc::inotify_event = unsafe { std::ptr::read_unaligned(buf[off..].as_ptr().cast()) };
                let name_bytes = &buf[off + hdr..off + hdr + ev.len as usize];
                let end = name_bytes.iter().position(|&b| b == 0).unwrap_or(name_bytes.len());
                let name: Option<&std::ffi::OsStr> = (end > 0).then(|| std::os::unix::ffi::OsStrExt::from_bytes(&name_bytes[..end]));
                if ev.mask & libc::IN_Q_OVERFLOW != 0 {
                    for img in &mut self.images {
                        img.recheck_image_at = Some(Instant::now() + Duration::from_millis(300));
                    }
                }
                if name.is_none() {
                    self.inode_event(ev.wd, ev.mask);
                }
                if let (Some(dir), Some(name)) = (self.watches.get(&ev.wd).cloned(), name) {
                    let full = dir.join(name);
                    for img in &mut self.images {
                        if img.cfg.list_file.as_ref().is_some_and(|p| *p == full) {
                            img.reload_at = Some(Instant::now() + Duration::from_millis(200));
                        }
                        if img.cfg.path == full {
                            img.recheck_image_at = Some(Instant::now() + Duration::from_millis(300));
                        }
                    }
                }
                off += hdr + ev.len as usize;
            }
        }
    }

    /// An event on an image file's own inode (written through any path,
    /// hard links in other directories included).
    fn inode_event(&mut self, wd: i32, mask: u32) {
        for idx in 0..self.images.len() {
            let Some((w, _, ino)) = self.images[idx].inode_watch else { continue };
            if w != wd {
                continue;
            }
            if mask & libc::IN_IGNORED != 0 {
                // The inode is gone (or the watch was removed): the directory
                // watch and the next load take over.
                self.images[idx].inode_watch = None;
                continue;
            }
            if mask & (libc::IN_MODIFY | libc::IN_ATTRIB | libc::IN_CLOSE_WRITE) != 0 {
                // Withdraw at once, no debounce: the bytes below the
                // published table may be changing right now.
                let img = &self.images[idx];
                let what = format!("image {} was modified (inode {ino})", img.cfg.path.display());
                if img.current.is_some() {
                    crate::log::warn(&format!("{what}: table withdrawn"));
                    self.withdraw(idx, NT_IMAGE_CHANGED, &format!("{what}: table withdrawn"));
                } else if img.image_stamp.is_some() {
                    crate::log::info(&format!("{what}; re-checking it"));
                }
                self.images[idx].image_stamp = None;
            }
            // Modified, renamed or deleted: re-check (and reload) once it is quiet.
            self.images[idx].recheck_image_at = Some(Instant::now() + Duration::from_millis(300));
        }
    }

    /// Watch the inode the image path names, if it is not the one watched
    /// already (called after each load with the stamp it verified).
    fn watch_image_inode(&mut self, idx: usize, stamp: &FileStamp) {
        let Some(fd) = self.inotify.as_ref().map(|f| f.as_raw_fd()) else { return };
        if self.images[idx].inode_watch.is_some_and(|(_, dev, ino)| dev == stamp.dev && ino == stamp.ino) {
            return;
        }
        let path = self.images[idx].cfg.path.clone();
        let old = self.images[idx].inode_watch.take();
        let Ok(c) = CString::new(path.as_os_str().as_encoded_bytes()) else { return };
        let mask = libc::IN_MODIFY | libc::IN_ATTRIB | libc::IN_CLOSE_WRITE | libc::IN_DELETE_SELF | libc::IN_MOVE_SELF;
        // SAFETY: valid C string; our inotify fd.
        let wd = unsafe { libc::inotify_add_watch(fd, c.as_ptr(), mask) };
        if wd < 0 {
            crate::log::warn(&format!(
                "inotify watch on image {}: {}; writes to it through other paths are noticed only by clients and on `reload`",
                path.display(),
                std::io::Error::last_os_error()
            ));
        } else {
            self.images[idx].inode_watch = Some((wd, stamp.dev, stamp.ino));
            // The watch is on whatever the path names now: if that is no
            // longer the verified file, re-check at once.
            if FileStamp::of_path(&path).map(|s| (s.dev, s.ino)) != Ok((stamp.dev, stamp.ino)) {
                self.images[idx].recheck_image_at = Some(Instant::now());
            }
        }
        if let Some((owd, _, _)) = old {
            if owd != wd && !self.images.iter().any(|i| i.inode_watch.is_some_and(|w| w.0 == owd)) {
                // SAFETY: removing our own watch (harmless if already gone).
                unsafe { libc::inotify_rm_watch(fd, owd) };
            }
        }
    }

    // ------------------------------------------------------------------ loads

    fn request_load(&mut self, idx: usize, source: ListSource, why: &str) {
        let img = &mut self.images[idx];
        img.seq += 1;
        self.latest[idx].store(img.seq, Ordering::SeqCst);
        img.loading = true;
        if img.current.is_none() {
            img.state = "loading";
        }
        img.message = format!("loading {} ({why})", source.describe());
        img.last_source = Some(source.clone());
        crate::log::info(&format!("image {}: loading {} ({why})", img.cfg.name, source.describe()));
        let job = Job { image: idx, seq: img.seq, cfg: img.cfg.clone(), source, arena: img.arena.clone() };
        if self.jobs.send(job).is_err() {
            crate::log::error("loader thread is gone");
        }
    }

    fn initial_source(&self, idx: usize) -> ListSource {
        let img = &self.images[idx];
        match &img.cfg.list_file {
            Some(p) => ListSource::File(p.clone()),
            None => ListSource::Cached,
        }
    }

    fn reload_source(&self, idx: usize) -> ListSource {
        let img = &self.images[idx];
        match (&img.cfg.list_file, &img.last_source) {
            (Some(p), _) => ListSource::File(p.clone()),
            (None, Some(ListSource::Redis(k, t))) => ListSource::Redis(k.clone(), t.clone()),
            _ => ListSource::Cached,
        }
    }

    fn on_loaded(&mut self, l: Loaded) {
        let idx = l.image;
        if l.seq != self.images[idx].seq {
            // Superseded by a newer request: give back what it holds.
            if let Ok(ok) = l.result {
                ok.arena.release(&ok.blocks);
            }
            return;
        }
        self.images[idx].loading = false;
        if let Some(stamp) = l.stamp {
            self.watch_image_inode(idx, &stamp);
        }
        if let (Some(id), Some(stamp)) = (l.identity, l.stamp) {
            let changed = self.images[idx].identity.is_some_and(|old| old != id);
            self.images[idx].identity = Some(id);
            self.images[idx].image_stamp = Some(stamp);
            if changed {
                self.withdraw(idx, NT_IMAGE_CHANGED, "the base image's content changed");
            }
            self.watch_redis(idx);
        }
        match l.result {
            Ok(ok) => {
                // The loader checked the stamp at its end; the image may have
                // changed since (inotify may not have told us yet): never
                // publish a table for a file that is no longer the same.
                let now = FileStamp::of_path(&self.images[idx].cfg.path).ok();
                if now != Some(ok.stamp) {
                    ok.arena.release(&ok.blocks);
                    self.images[idx].image_stamp = None;
                    self.images[idx].recheck_image_at = Some(Instant::now());
                    crate::log::warn(&format!(
                        "image {}: the base image changed after it was verified; not publishing, re-checking",
                        self.images[idx].cfg.name
                    ));
                    return;
                }
                self.publish(idx, ok, &l.source)
            }
            Err((kind, msg)) => {
                let img = &mut self.images[idx];
                if kind == FailKind::Cancelled {
                    return;
                }
                let serving = img.current.as_ref().map(|g| g.number);
                let keep = match serving {
                    Some(n) => format!("; still serving generation {n}"),
                    None => String::new(),
                };
                if kind == FailKind::NoList {
                    img.state = if img.current.is_some() { "serving" } else { "no-list" };
                    img.message = msg.clone();
                    crate::log::info(&format!("image {}: {msg}{keep}", img.cfg.name));
                    self.broadcast_no_table_if_empty(idx, NT_NO_LIST, &msg);
                    return;
                }
                img.loads_failed += 1;
                img.last_error = msg.clone();
                crate::log::error(&format!("image {}: {msg}{keep}", img.cfg.name));
                if kind == FailKind::Image {
                    // The image cannot be read or changed: what we serve may
                    // no longer be what QEMU reads.  Stop publishing it.
                    self.withdraw(idx, NT_IMAGE_CHANGED, &msg);
                    let img = &mut self.images[idx];
                    img.state = "error";
                    img.message = format!("{msg} (retrying in {} s)", IMAGE_RETRY.as_secs());
                    // The image may come back (a transient lock, a copy in
                    // progress): try again later, inotify may be quicker.
                    if img.reload_at.is_none() {
                        img.reload_at = Some(Instant::now() + IMAGE_RETRY);
                    }
                } else {
                    let img = &mut self.images[idx];
                    if img.current.is_none() {
                        img.state = "refused";
                        img.message = msg.clone();
                        self.broadcast_no_table_if_empty(idx, NT_REFUSED, &msg);
                    } else {
                        img.message = format!("new list refused, serving the previous one: {msg}");
                    }
                }
            }
        }
    }

    fn watch_redis(&mut self, idx: usize) {
        let img = &mut self.images[idx];
        let (Some(spec), Some(id), Some(rc), Some(tx)) =
            (img.cfg.list_redis.clone(), img.identity, self.cfg.redis.as_ref(), self.redis_cmds.as_ref())
        else {
            return;
        };
        let key = if spec == "auto" { format!("{}:list:{}", rc.prefix, id.key()) } else { spec };
        if img.redis_key.as_deref() != Some(key.as_str()) {
            img.redis_key = Some(key.clone());
            let _ = tx.send(redis_watch::Cmd::Watch { image: idx, key });
        }
    }

    fn publish(&mut self, idx: usize, ok: LoadOk, source: &ListSource) {
        let number = self.images[idx].next_generation;
        let entries: Vec<(u64, u64)> = ok.blocks.iter().map(|&b| (b, ok.arena.addr(b))).collect();
        let degraded = matches!(ok.arena.merge_mode, MergeMode::Degraded(_));
        let info = TableInfo {
            generation: number,
            identity: ok.arena.identity,
            server_pid: std::process::id(),
            flags: if degraded { table::FLAG_DEGRADED } else { 0 },
            arena: ok.arena.range(),
        };
        let bytes = table::build(&info, &entries);
        let name = format!("pageshare-table-{}-{number}", self.images[idx].cfg.name);
        let memfd = match crate::sys::sealed_memfd(&name, &bytes) {
            Ok(m) => m,
            Err(e) => {
                crate::log::error(&format!("image {}: cannot create the table memfd: {e}", self.images[idx].cfg.name));
                ok.arena.release(&ok.blocks);
                return;
            }
        };
        if let (ListSource::Redis(_, text), Some(id)) = (source, self.images[idx].identity) {
            // Keep the last good Redis list so a restart without Redis serves it.
            let p = cached_list_path(&self.cfg, &id);
            let tmp = p.with_extension("tmp");
            if let Err(e) = std::fs::write(&tmp, text.as_slice()).and_then(|_| std::fs::rename(&tmp, &p)) {
                crate::log::warn(&format!("cannot cache the list in {}: {e}", p.display()));
            }
        }
        let l = &ok.list;
        let list_meta = json!({
            "image_name": l.image_name, "generator": l.generator, "created": l.created,
            "criteria": l.criteria, "runs": l.runs, "count": l.blocks.len(),
            "extra": l.extra.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect::<serde_json::Map<_, _>>(),
        });
        let gen = Rc::new(Generation {
            number,
            stamp: ok.stamp,
            format: ok.format.clone(),
            memfd,
            arena: ok.arena.clone(),
            blocks: ok.blocks,
            table_bytes: bytes.len(),
            list_digest: format!("sha256:{}", crate::sys::hex(&l.digest)),
            text_sha: ok.text_sha,
            list_meta,
            source: source.describe(),
            published_at: crate::sys::now_unix(),
        });
        let mib = gen.blocks.len() as f64 * 4096.0 / (1 << 20) as f64;
        let read_mib = ok.read_blocks as f64 * 4096.0 / (1 << 20) as f64;
        let img = &mut self.images[idx];
        img.next_generation += 1;
        img.arena = Some(ok.arena.clone());
        img.current = Some(gen.clone());
        img.state = "serving";
        img.loads_ok += 1;
        img.message = format!("generation {number}: {} blocks ({mib:.1} MiB)", gen.blocks.len());
        img.last_load = json!({
            "generation": number, "seconds": ok.secs, "read_seconds": ok.read_secs,
            "read_blocks": ok.read_blocks, "reused_blocks": ok.reused_blocks,
            "read_mib_per_s": if ok.read_secs > 0.0 { read_mib / ok.read_secs } else { 0.0 },
            "finished_at": gen.published_at, "source": gen.source,
            "format": ok.format, "image_file": ok.stamp,
        });
        crate::log::info(&format!(
            "image {}: published generation {number}: {} blocks ({mib:.1} MiB; {} read and verified in {:.2} s, {} reused), table {} bytes, from {}",
            img.cfg.name,
            gen.blocks.len(),
            ok.read_blocks,
            ok.read_secs,
            ok.reused_blocks,
            gen.table_bytes,
            gen.source
        ));
        let ids: Vec<u64> = self
            .clients
            .iter()
            .filter(|(_, c)| matches!(c.kind, Kind::Image(i) if i == idx))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.send_table(id, &gen);
        }
        self.notifier.send(&format!("STATUS={}", self.short_status()));
    }

    fn withdraw(&mut self, idx: usize, reason: u32, why: &str) {
        let img = &mut self.images[idx];
        let Some(gen) = img.current.take() else { return };
        crate::log::error(&format!(
            "image {}: withdrawing generation {}: {why}",
            img.cfg.name, gen.number
        ));
        img.state = "withdrawn";
        img.message = why.to_string();
        drop(gen);
        self.broadcast_no_table_if_empty(idx, reason, why);
    }

    fn broadcast_no_table_if_empty(&mut self, idx: usize, reason: u32, why: &str) {
        if self.images[idx].current.is_some() {
            return;
        }
        let ids: Vec<u64> = self
            .clients
            .iter()
            .filter(|(_, c)| matches!(c.kind, Kind::Image(i) if i == idx))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.send_no_table(id, reason, why);
        }
    }

    // ---------------------------------------------------------------- clients

    fn send_table(&mut self, id: u64, gen: &Rc<Generation>) {
        let Some(c) = self.clients.get_mut(&id) else { return };
        let degraded = matches!(gen.arena.merge_mode, MergeMode::Degraded(_));
        let p = table_payload(&TableMsg {
            flags: if degraded { table::FLAG_DEGRADED } else { 0 },
            generation: gen.number,
            entries: gen.blocks.len() as u64,
            table_bytes: gen.table_bytes as u64,
            virtual_size: gen.arena.identity.virtual_size,
            content_sha256: &gen.arena.identity.content_sha256,
            server_pid: std::process::id(),
            format: &gen.format,
            published_at: gen.published_at,
            file_dev: gen.stamp.dev,
            file_ino: gen.stamp.ino,
            file_size: gen.stamp.size,
            file_mtime_ns: gen.stamp.mtime_ns,
            file_ctime_ns: gen.stamp.ctime_ns,
        });
        let msg = frame(MSG_TABLE, &p);
        match send_msg(c.stream.as_raw_fd(), &msg, &[gen.memfd.as_raw_fd(), self.pidfd.as_raw_fd()]) {
            Ok(()) => {
                if !c.held.is_empty() && c.waiting_since.is_none() {
                    c.waiting_since = Some(Instant::now());
                }
                c.held.push(gen.clone());
            }
            Err(e) => {
                let why = format!("cannot send the table: {e}");
                self.drop_client(id, &why);
            }
        }
    }

    fn send_no_table(&mut self, id: u64, reason: u32, why: &str) {
        let Some(c) = self.clients.get_mut(&id) else { return };
        let mut p = Vec::new();
        p.extend_from_slice(&1u32.to_le_bytes());
        p.extend_from_slice(&reason.to_le_bytes());
        let text: String = why.chars().take(1000).collect();
        p.extend_from_slice(text.as_bytes());
        let r = send_msg(c.stream.as_raw_fd(), &frame(MSG_NO_TABLE, &p), &[]);
        if let Err(e) = r {
            self.drop_client(id, &format!("cannot send: {e}"));
        }
    }

    fn accept(&mut self, kind_of: Option<usize>) {
        loop {
            let l = match kind_of {
                Some(i) => &self.images[i].listener,
                None => &self.control,
            };
            let stream = match l.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    self.client_log(&format!("accept: {e}"));
                    return;
                }
            };
            if self.clients.len() >= self.cfg.limits.max_clients {
                let _ = send_msg(
                    stream.as_raw_fd(),
                    &frame(MSG_BYE, b"too many clients (limits.max_clients)"),
                    &[],
                );
                self.client_log("refused a client: limits.max_clients reached");
                continue;
            }
            let _ = stream.set_nonblocking(true);
            let cred = crate::sys::peer_cred(stream.as_raw_fd());
            let id = self.next_client;
            self.next_client += 1;
            self.clients.insert(
                id,
                Client {
                    stream,
                    kind: match kind_of {
                        Some(i) => Kind::Image(i),
                        None => Kind::Control,
                    },
                    buf: Vec::new(),
                    held: Vec::new(),
                    waiting_since: None,
                    pid: cred.map(|c| c.pid).unwrap_or(0),
                    uid: cred.map(|c| c.uid).unwrap_or(u32::MAX),
                    counters: ClientCounters::default(),
                    connected_at: crate::sys::now_unix(),
                    bad_messages: 0,
                },
            );
            if let Some(i) = kind_of {
                self.images[i].clients_total += 1;
                match self.images[i].current.clone() {
                    Some(gen) => self.send_table(id, &gen),
                    None => {
                        let img = &self.images[i];
                        let reason = match img.state {
                            "starting" | "loading" => NT_LOADING,
                            "no-list" => NT_NO_LIST,
                            "refused" => NT_REFUSED,
                            _ => NT_IMAGE_CHANGED,
                        };
                        let why = img.message.clone();
                        self.send_no_table(id, reason, &why);
                    }
                }
            }
        }
    }

    /// Log about clients with a budget, so a hostile client cannot flood the journal.
    fn client_log(&mut self, msg: &str) {
        let (since, n) = &mut self.log_budget;
        if since.elapsed() > Duration::from_secs(10) {
            if *n > 20 {
                crate::log::warn(&format!("{} client messages suppressed", *n - 20));
            }
            *since = Instant::now();
            *n = 0;
        }
        *n += 1;
        if *n <= 20 {
            crate::log::warn(msg);
        }
    }

    fn drop_client(&mut self, id: u64, why: &str) {
        if let Some(c) = self.clients.remove(&id) {
            if let Kind::Image(i) = c.kind {
                self.images[i].closed_counters.add(&c.counters);
                if !why.is_empty() {
                    let msg = format!("image {}: client pid {} disconnected: {why}", self.images[i].cfg.name, c.pid);
                    self.client_log(&msg);
                }
            }
            // c.held dropped here: generations nobody uses are released.
        }
    }

    fn bye(&mut self, id: u64, why: &str) {
        if let Some(c) = self.clients.get(&id) {
            let _ = send_msg(c.stream.as_raw_fd(), &frame(MSG_BYE, why.as_bytes()), &[]);
        }
        self.drop_client(id, why);
    }

    fn read_client(&mut self, id: u64) {
        let mut tmp = [0u8; 8192];
        loop {
            let Some(c) = self.clients.get_mut(&id) else { return };
            match proto::recv_some(c.stream.as_raw_fd(), &mut tmp) {
                Ok((0, _, _)) => {
                    self.drop_client(id, "");
                    return;
                }
                Ok((n, fds, _)) => {
                    if !fds.is_empty() {
                        drop(fds);
                        self.bye(id, "clients must not send file descriptors");
                        return;
                    }
                    c.buf.extend_from_slice(&tmp[..n]);
                    if c.buf.len() > 4 * (MAX_CLIENT_PAYLOAD + HDR) {
                        self.bye(id, "too much unparsed input");
                        return;
                    }
                    let msgs = match take_messages(&mut c.buf, MAX_CLIENT_PAYLOAD) {
                        Ok(m) => m,
                        Err(e) => {
                            self.bye(id, &format!("protocol error: {e}"));
                            return;
                        }
                    };
                    for (kind, payload) in msgs {
                        if !self.clients.contains_key(&id) {
                            return;
                        }
                        self.handle_message(id, kind, &payload);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    self.drop_client(id, &format!("read: {e}"));
                    return;
                }
            }
        }
    }

    fn handle_message(&mut self, id: u64, kind: u32, p: &[u8]) {
        let is_control = matches!(self.clients.get(&id).map(|c| &c.kind), Some(Kind::Control));
        match (is_control, kind) {
            (false, MSG_SWITCHED) => {
                let Some(gen) = u64_at(p, 0) else {
                    self.bye(id, "protocol error: SWITCHED needs 8 bytes");
                    return;
                };
                let c = self.clients.get_mut(&id).expect("present");
                if gen != NO_GENERATION && !c.held.iter().any(|g| g.number == gen) {
                    self.bye(id, &format!("protocol error: SWITCHED to generation {gen}, which this client was never sent"));
                    return;
                }
                c.held.retain(|g| g.number == gen);
                c.waiting_since = None;
            }
            (false, MSG_STATS) => {
                let vals: Vec<u64> = (0..6).filter_map(|i| u64_at(p, 8 * i)).collect();
                if vals.len() != 6 {
                    self.bye(id, "protocol error: STATS needs 48 bytes");
                    return;
                }
                let c = self.clients.get_mut(&id).expect("present");
                // Cumulative per connection; keep the latest.
                c.counters = ClientCounters {
                    lookups: vals[1],
                    hits: vals[2],
                    merged: vals[3],
                    merge_errors: vals[4],
                    fallbacks: vals[5],
                };
            }
            (true, MSG_STATUS_REQ) => {
                let s = self.status_json().to_string();
                self.reply(id, MSG_STATUS_REPLY, s.as_bytes());
            }
            (true, MSG_RELOAD_REQ) => {
                let name = String::from_utf8_lossy(p).to_string();
                let mut which = Vec::new();
                for i in 0..self.images.len() {
                    if name.is_empty() || self.images[i].cfg.name == name {
                        which.push(i);
                    }
                }
                let ok = !which.is_empty();
                for i in &which {
                    let src = self.reload_source(*i);
                    self.request_load(*i, src, "reload requested");
                }
                let names: Vec<String> = which.iter().map(|i| self.images[*i].cfg.name.clone()).collect();
                let r = json!({"ok": ok, "reloading": names, "error": if ok { "" } else { "no such image" }});
                self.reply(id, MSG_RELOAD_REPLY, r.to_string().as_bytes());
            }
            _ => {
                let c = self.clients.get_mut(&id).expect("present");
                c.bad_messages += 1;
                if c.bad_messages > 100 {
                    self.bye(id, "too many unknown messages");
                } else {
                    let msg = format!("client pid {}: ignored unknown message type {kind}", c.pid);
                    self.client_log(&msg);
                }
            }
        }
    }

    fn reply(&mut self, id: u64, kind: u32, payload: &[u8]) {
        let Some(c) = self.clients.get(&id) else { return };
        // Control replies can be large: send blocking with a timeout.
        let fd = c.stream.as_raw_fd();
        let _ = crate::sys::set_nonblocking(fd, false);
        let _ = c.stream.set_write_timeout(Some(Duration::from_secs(2)));
        use std::io::Write;
        let r = (&c.stream).write_all(&frame(kind, payload));
        let _ = crate::sys::set_nonblocking(fd, true);
        if let Err(e) = r {
            self.drop_client(id, &format!("control reply: {e}"));
        }
    }

    fn expire_waiting(&mut self) {
        let limit = Duration::from_secs(self.cfg.limits.client_switch_timeout_secs);
        let late: Vec<u64> = self
            .clients
            .iter()
            .filter(|(_, c)| c.waiting_since.is_some_and(|t| t.elapsed() > limit))
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            self.bye(
                id,
                "did not acknowledge the new generation in time (limits.client_switch_timeout_secs); reconnect",
            );
        }
    }

    // ----------------------------------------------------------------- status

    fn short_status(&self) -> String {
        let parts: Vec<String> = self
            .images
            .iter()
            .map(|i| match &i.current {
                Some(g) => format!("{}: gen {} {} blocks", i.cfg.name, g.number, g.blocks.len()),
                None => format!("{}: {}", i.cfg.name, i.state),
            })
            .collect();
        parts.join("; ")
    }

    fn status_json(&self) -> Value {
        let (rss, anon) = crate::sys::self_memory_kb();
        let images: Vec<Value> = self
            .images
            .iter()
            .enumerate()
            .map(|(i, img)| {
                let mut counters = img.closed_counters;
                let mut nclients = 0;
                let mut waiting = 0;
                let mut held_gens: Vec<u64> = Vec::new();
                let mut client_list: Vec<Value> = Vec::new();
                for c in self.clients.values() {
                    if matches!(c.kind, Kind::Image(k) if k == i) {
                        client_list.push(json!({
                            "pid": c.pid, "uid": c.uid, "connected_at": c.connected_at,
                            "generations": c.held.iter().map(|g| g.number).collect::<Vec<_>>(),
                            "stats": c.counters.json(),
                        }));
                        counters.add(&c.counters);
                        nclients += 1;
                        if c.waiting_since.is_some() {
                            waiting += 1;
                        }
                        for g in &c.held {
                            if !held_gens.contains(&g.number) {
                                held_gens.push(g.number);
                            }
                        }
                    }
                }
                if let Some(g) = &img.current {
                    if !held_gens.contains(&g.number) {
                        held_gens.push(g.number);
                    }
                }
                held_gens.sort_unstable();
                let cur = img.current.as_ref();
                json!({
                    "name": img.cfg.name,
                    "path": img.cfg.path,
                    "socket": img.cfg.socket,
                    "list_source": match (&img.cfg.list_file, &img.redis_key) {
                        (Some(p), _) => format!("file {}", p.display()),
                        (None, Some(k)) => format!("redis key {k}"),
                        (None, None) => "redis (key known once the image identity is)".into(),
                    },
                    "state": img.state,
                    "message": img.message,
                    "loading": img.loading,
                    "identity": img.identity.map(|id| json!({
                        "virtual_size": id.virtual_size,
                        "content_sha256": crate::sys::hex(&id.content_sha256),
                    })),
                    "generation": cur.map(|g| g.number),
                    "blocks": cur.map(|g| g.blocks.len()).unwrap_or(0),
                    "bytes": cur.map(|g| g.blocks.len() * 4096).unwrap_or(0),
                    "table_bytes": cur.map(|g| g.table_bytes).unwrap_or(0),
                    "list_digest": cur.map(|g| g.list_digest.clone()),
                    "list": cur.map(|g| g.list_meta.clone()),
                    "list_from": cur.map(|g| g.source.clone()),
                    "published_at": cur.map(|g| g.published_at),
                    "format": cur.map(|g| g.format.clone()),
                    "image_file": cur.map(|g| g.stamp),
                    "arena_loaded_blocks": img.arena.as_ref().map(|a| a.loaded_blocks()).unwrap_or(0),
                    "live_generations": held_gens,
                    "clients": nclients,
                    "client_list": client_list,
                    "clients_waiting_to_switch": waiting,
                    "clients_total": img.clients_total,
                    "client_stats": counters.json(),
                    "last_load": img.last_load,
                    "last_error": img.last_error,
                    "loads_ok": img.loads_ok,
                    "loads_failed": img.loads_failed,
                })
            })
            .collect();
        let redis = self.cfg.redis.as_ref().map(|_| {
            serde_json::to_value(self.redis_status.lock().expect("redis status").clone()).unwrap_or(Value::Null)
        });
        json!({
            "server": "pageshare-server",
            "version": env!("CARGO_PKG_VERSION"),
            "pid": std::process::id(),
            "host": self.cfg.host(),
            "started_at": self.started,
            "uptime_seconds": crate::sys::now_unix() - self.started,
            "degraded": self.degraded.is_some(),
            "degraded_reason": self.degraded.clone().unwrap_or_default(),
            "kernel_abi": {"MADV_ALLOWMERGED": crate::sys::MADV_ALLOWMERGED,
                           "__NR_merge_page": crate::sys::NR_MERGE_PAGE,
                           "__NR_merge_pages": crate::sys::NR_MERGE_PAGES},
            "memory": {"rss_bytes": rss * 1024, "rss_anon_bytes": anon * 1024,
                       "loaded_blocks": self.global_loaded.load(Ordering::Relaxed),
                       "loaded_bytes": self.global_loaded.load(Ordering::Relaxed) * 4096},
            "clients": self.clients.values().filter(|c| matches!(c.kind, Kind::Image(_))).count(),
            "redis": redis,
            "images": images,
        })
    }

    fn refresh_snapshot(&self) {
        let st = self.status_json();
        *self.metrics.lock().expect("metrics") = crate::metrics::render(&st);
        *self.snapshot.lock().expect("snapshot") = st.to_string();
    }

    // -------------------------------------------------------------- main loop

    pub fn run(mut self) -> Result<(), String> {
        // SAFETY: installing a simple async-signal-safe handler.
        unsafe {
            libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
            libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
        if let Some(d) = &self.degraded {
            crate::log::warn(&format!("DEGRADED MODE: {d}"));
        } else {
            crate::log::info("kernel supports MADV_ALLOWMERGED: clients can merge_pages() from this server");
            if let Some(w) = ksm_run_warning(std::fs::read_to_string(KSM_RUN).ok().as_deref()) {
                crate::log::warn(&w);
            }
        }
        for i in 0..self.images.len() {
            let src = self.initial_source(i);
            self.request_load(i, src, "start-up");
        }
        self.refresh_snapshot();
        self.notifier.send(&format!(
            "READY=1\nSTATUS={}\nMAINPID={}",
            if self.degraded.is_some() { "degraded mode; loading" } else { "loading" },
            std::process::id()
        ));
        crate::log::info(&format!(
            "listening: control {}, {} image socket(s)",
            self.cfg.control_socket.as_ref().expect("set").display(),
            self.images.len()
        ));
        let mut last_watchdog = Instant::now();
        let mut last_snapshot = Instant::now();
        while !STOP.load(Ordering::SeqCst) && !self.stop.load(Ordering::SeqCst) {
            let mut pfds: Vec<libc::pollfd> = Vec::new();
            let mut what: Vec<(u8, u64)> = Vec::new(); // 0 wake, 1 inotify, 2 control, 3 image listener, 4 client
            let mut add = |fd: RawFd, tag: (u8, u64)| {
                pfds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
                what.push(tag);
            };
            add(self.wake_fd.as_raw_fd(), (0, 0));
            if let Some(f) = &self.inotify {
                add(f.as_raw_fd(), (1, 0));
            }
            add(self.control.as_raw_fd(), (2, 0));
            for (i, img) in self.images.iter().enumerate() {
                add(img.listener.as_raw_fd(), (3, i as u64));
            }
            for (id, c) in &self.clients {
                add(c.stream.as_raw_fd(), (4, *id));
            }
            let mut timeout_ms: i32 = 500;
            if let Some(w) = self.notifier.watchdog_every {
                timeout_ms = timeout_ms.min((w.as_millis() as i32 / 2).max(10));
            }
            // SAFETY: pfds is a valid array.
            let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
            if n < 0 && crate::sys::errno() != libc::EINTR {
                return Err(format!("poll: {}", std::io::Error::last_os_error()));
            }
            if n > 0 {
                for (k, p) in pfds.iter().enumerate() {
                    if p.revents == 0 {
                        continue;
                    }
                    match what[k] {
                        (0, _) => {
                            let mut v = 0u64;
                            // SAFETY: draining the eventfd.
                            unsafe { libc::read(p.fd, (&mut v as *mut u64).cast(), 8) };
                        }
                        (1, _) => self.handle_inotify(),
                        (2, _) => self.accept(None),
                        (3, i) => self.accept(Some(i as usize)),
                        (4, id) => self.read_client(id),
                        _ => {}
                    }
                }
            }
            while let Ok(ev) = self.events.try_recv() {
                match ev {
                    Event::Loaded(l) => self.on_loaded(*l),
                    Event::Redis(r) => {
                        let sha: [u8; 32] = sha2::Digest::finalize(sha2::Digest::chain_update(
                            <sha2::Sha256 as sha2::Digest>::new(),
                            r.text.as_slice(),
                        ))
                        .into();
                        let img = &self.images[r.image];
                        if img.current.as_ref().is_some_and(|g| g.text_sha == sha) && !img.loading {
                            crate::log::info(&format!(
                                "image {}: the list in Redis is the one already served",
                                img.cfg.name
                            ));
                        } else if img.redis_key.as_deref() == Some(r.key.as_str()) {
                            self.request_load(r.image, ListSource::Redis(r.key, r.text), "new list in Redis");
                        }
                    }
                }
            }
            let now = Instant::now();
            for i in 0..self.images.len() {
                if self.images[i].reload_at.is_some_and(|t| now >= t) {
                    self.images[i].reload_at = None;
                    let src = self.reload_source(i);
                    self.request_load(i, src, "list file changed or retry");
                }
                if self.images[i].recheck_image_at.is_some_and(|t| now >= t) {
                    self.images[i].recheck_image_at = None;
                    self.recheck_image(i);
                }
            }
            self.expire_waiting();
            if let Some(w) = self.notifier.watchdog_every {
                if last_watchdog.elapsed() >= w / 2 {
                    self.notifier.send("WATCHDOG=1");
                    last_watchdog = Instant::now();
                }
            }
            if last_snapshot.elapsed() >= Duration::from_millis(500) {
                self.refresh_snapshot();
                last_snapshot = Instant::now();
            }
        }
        crate::log::info("stopping: telling clients, removing sockets");
        self.notifier.send("STOPPING=1");
        let ids: Vec<u64> = self.clients.keys().copied().collect();
        for id in ids {
            if matches!(self.clients.get(&id).map(|c| &c.kind), Some(Kind::Image(_))) {
                self.send_no_table(id, NT_SHUTDOWN, "server shutting down");
            }
            self.drop_client(id, "");
        }
        if let Some(tx) = &self.redis_cmds {
            let _ = tx.send(redis_watch::Cmd::Shutdown);
        }
        for img in &self.images {
            let _ = std::fs::remove_file(img.cfg.socket.as_ref().expect("set"));
        }
        let _ = std::fs::remove_file(self.cfg.control_socket.as_ref().expect("set"));
        Ok(())
    }

    fn recheck_image(&mut self, i: usize) {
        let now_stamp = FileStamp::of_path(&self.images[i].cfg.path).ok();
        let img = &self.images[i];
        if img.image_stamp.is_some() && now_stamp == img.image_stamp {
            return;
        }
        let why = match &now_stamp {
            None => format!("base image {} is gone or unreadable", img.cfg.path.display()),
            Some(_) => format!("base image {} changed on disk", img.cfg.path.display()),
        };
        self.withdraw(i, NT_IMAGE_CHANGED, &why);
        self.images[i].image_stamp = None;
        let src = self.reload_source(i);
        self.request_load(i, src, "base image changed");
    }
}

#[cfg(test)]
mod tests {
    use super::{bind_socket, ksm_run_warning};
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    use std::os::unix::net::UnixStream;

    #[test]
    fn bind_socket_publishes_a_listening_socket_with_its_mode() {
        let dir = std::env::temp_dir().join(format!("ps-bind-{}", std::process::id()));
        let path = dir.join("img.sock");
        let l = bind_socket(&path, 0o660).unwrap();
        let md = std::fs::symlink_metadata(&path).unwrap();
        assert!(md.file_type().is_socket());
        assert_eq!(md.permissions().mode() & 0o777, 0o660);
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("img.sock")], "no temporary name left behind");
        UnixStream::connect(&path).expect("the published name accepts connections");
        // A second server on the same path is refused while the first listens.
        assert!(bind_socket(&path, 0o660).unwrap_err().contains("another server"));
        drop(l);
        // The first one gone, its stale socket file is replaced.
        let _l2 = bind_socket(&path, 0o600).unwrap();
        UnixStream::connect(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn ksm_run_warning_only_unless_merging() {
        assert_eq!(ksm_run_warning(Some("1\n")), None);
        assert!(ksm_run_warning(Some("0\n")).unwrap().contains("EOPNOTSUPP"));
        assert!(ksm_run_warning(Some("2\n")).unwrap().contains("is 2, not 1"));
        assert!(ksm_run_warning(None).unwrap().contains("missing"));
    }
}
