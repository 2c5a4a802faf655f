//! Setting the server up: directories, sockets, the loader and Redis
//! threads, the metrics endpoint and the kernel probe.

use super::sockets::bind_socket;
use super::{wake, Event, ImageState, Server, ServerError};
use crate::config::Config;
use crate::identity::IdentityCache;
use crate::loader::{FailKind, Job, Loaded, Loader};
use crate::notify::Notifier;
use crate::redis_feedback::{PublishStatus, Publisher};
use crate::redis_watch::{self, RedisStatus};
use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

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

pub(super) const KSM_RUN: &str = "/sys/kernel/mm/ksm/run";

/// merge_pages() fails with EOPNOTSUPP unless ksmd is in merge mode: say so
/// at start (`run` is the content of /sys/kernel/mm/ksm/run, None if absent).
pub(super) fn ksm_run_warning(run: Option<&str>) -> Option<String> {
    match run.map(str::trim) {
        Some("1") => None,
        Some(v) => Some(format!(
            "{KSM_RUN} is {v}, not 1: merge_pages() fails (EOPNOTSUPP) until KSM runs in merge mode, and guests read from disk; `echo 1 > {KSM_RUN}` (pages_to_scan may be 0)"
        )),
        None => Some(format!("{KSM_RUN} is missing: merge_pages() needs KSM")),
    }
}

impl Server {
    pub fn new(cfg: Config) -> Result<Server, ServerError> {
        for dir in [cfg.cache_dir.clone(), cfg.cache_dir.join("lists")] {
            std::fs::create_dir_all(&dir)
                .map_err(|source| ServerError::CacheDir { dir, source })?;
        }
        let mode = cfg.socket_mode_bits().map_err(ServerError::Config)?;
        let control = bind_socket(
            cfg.control_socket.as_ref().expect("set by load"),
            0o600.min(mode) | 0o600,
        )?;
        let mut images = Vec::new();
        for img in &cfg.images {
            let listener = bind_socket(img.socket.as_ref().expect("set by load"), mode)?;
            images.push(ImageState::new(img.clone(), listener));
        }
        let pidfd = crate::sys::pidfd_self().map_err(ServerError::Pidfd)?;
        // SAFETY: plain eventfd creation.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(ServerError::Eventfd(std::io::Error::last_os_error()));
        }
        // SAFETY: fresh descriptor.
        let wake_fd = Arc::new(unsafe { OwnedFd::from_raw_fd(efd) });
        let wake_fd_redis = wake_fd.clone();
        let wake_fd_feedback = wake_fd.clone();
        let (ev_tx, ev_rx) = channel::<Event>();
        let ev_tx_feedback = ev_tx.clone();
        let (job_tx, job_rx) = channel::<Job>();
        let latest: Arc<Vec<AtomicU64>> =
            Arc::new((0..images.len()).map(|_| AtomicU64::new(0)).collect());
        let global_loaded = Arc::new(AtomicU64::new(0));
        let loader = Loader {
            cfg: cfg.clone(),
            ids: IdentityCache::new(&cfg.cache_dir),
            latest: latest.clone(),
            global_loaded: global_loaded.clone(),
        };
        spawn_loader(loader, job_rx, ev_tx.clone(), wake_fd.clone())?;
        let redis_status = Arc::new(Mutex::new(RedisStatus::default()));
        let snapshot = Arc::new(Mutex::new(String::from("{}")));
        let metrics = Arc::new(Mutex::new(String::new()));
        let redis_cmds = match &cfg.redis {
            Some(rc) => {
                let (cmd_tx, cmd_rx) = channel();
                let w = redis_watch::Watcher::new(
                    rc.clone(),
                    cfg.host(),
                    cfg.limits.max_list_bytes,
                    cmd_rx,
                    Box::new(move |list| {
                        let _ = ev_tx.send(Event::Redis(list));
                        wake(&wake_fd_redis);
                    }),
                    redis_status.clone(),
                    snapshot.clone(),
                );
                std::thread::Builder::new()
                    .name("redis".into())
                    .spawn(move || w.run())
                    .map_err(|source| ServerError::Thread { name: "redis", source })?;
                Some(cmd_tx)
            }
            None => None,
        };
        let feedback_status = Arc::new(Mutex::new(vec![PublishStatus::default(); images.len()]));
        let feedback_cmds = match &cfg.redis {
            Some(rc) if cfg.feedback_enabled() => {
                let (cmd_tx, cmd_rx) = channel();
                let events = ev_tx_feedback;
                let p = Publisher::new(
                    rc.clone(),
                    cfg.host(),
                    2 * cfg.feedback.window_secs,
                    cmd_rx,
                    Box::new(move |r| {
                        let _ = events.send(Event::ReadBack(r));
                        wake(&wake_fd_feedback);
                    }),
                    feedback_status.clone(),
                );
                std::thread::Builder::new()
                    .name("redis-feedback".into())
                    .spawn(move || p.run())
                    .map_err(|source| ServerError::Thread { name: "redis feedback", source })?;
                Some(cmd_tx)
            }
            _ => None,
        };
        if !cfg.metrics_listen.is_empty() {
            crate::metrics::spawn(&cfg.metrics_listen, metrics.clone())
                .map_err(ServerError::Metrics)?;
        }
        let degraded = probe_degraded();
        let feedback_due =
            Instant::now() + std::time::Duration::from_secs(cfg.feedback.interval_secs);
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
            feedback_due,
            feedback_cmds,
            feedback_status,
            snapshot,
            metrics,
            global_loaded,
            degraded,
            started: crate::sys::now_unix(),
            notifier: Notifier::from_env(),
            log_budget: (Instant::now(), 0),
        };
        s.setup_inotify();
        Ok(s)
    }
}

/// The loader thread: runs the jobs one at a time and hands each result to
/// the main loop.
fn spawn_loader(
    loader: Loader,
    jobs: Receiver<Job>,
    events: Sender<Event>,
    wake_fd: Arc<OwnedFd>,
) -> Result<(), ServerError> {
    std::thread::Builder::new()
        .name("loader".into())
        .spawn(move || {
            for job in jobs {
                let image = job.image;
                let seq = job.seq;
                let source = job.source.clone();
                let out =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| loader.run(job)))
                        .unwrap_or_else(|_| Loaded {
                            image,
                            seq,
                            source,
                            identity: None,
                            stamp: None,
                            result: Err(FailKind::Image.with("internal error: loader panicked")),
                        });
                if events.send(Event::Loaded(Box::new(out))).is_err() {
                    break;
                }
                wake(&wake_fd);
            }
        })
        .map(drop)
        .map_err(|source| ServerError::Thread { name: "loader", source })
}

#[cfg(test)]
mod tests {
    use super::ksm_run_warning;

    #[test]
    fn ksm_run_warning_only_unless_merging() {
        assert_eq!(ksm_run_warning(Some("1\n")), None);
        assert!(ksm_run_warning(Some("0\n")).unwrap().contains("EOPNOTSUPP"));
        assert!(ksm_run_warning(Some("2\n")).unwrap().contains("is 2, not 1"));
        assert!(ksm_run_warning(None).unwrap().contains("missing"));
    }
}
