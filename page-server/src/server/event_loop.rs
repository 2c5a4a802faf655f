//! The main loop: poll every descriptor, run what is due, feed the
//! watchdog; on SIGTERM/SIGINT tell the clients and remove the sockets.

use super::setup::{ksm_run_warning, KSM_RUN};
use super::{Event, Server, ServerError};
use crate::loader::ListSource;
use crate::proto::NT_SHUTDOWN;
use crate::redis_watch::{self, RedisList};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// What a polled descriptor is: the one place that says what to do when it
/// is readable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PollTag {
    /// The eventfd the other threads write to: drain it, then the events.
    Wake,
    Inotify,
    ControlListener,
    /// The listening socket of image number .0.
    ImageListener(usize),
    /// Client id .0 (image or control).
    Client(u64),
}

impl Server {
    /// The descriptors to poll, each with what it is.
    fn poll_set(&self) -> (Vec<libc::pollfd>, Vec<PollTag>) {
        let mut pfds: Vec<libc::pollfd> = Vec::new();
        let mut tags: Vec<PollTag> = Vec::new();
        let mut add = |fd: RawFd, tag: PollTag| {
            pfds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
            tags.push(tag);
        };
        add(self.wake_fd.as_raw_fd(), PollTag::Wake);
        if let Some(f) = &self.inotify {
            add(f.as_raw_fd(), PollTag::Inotify);
        }
        add(self.control.as_raw_fd(), PollTag::ControlListener);
        for (i, img) in self.images.iter().enumerate() {
            add(img.listener.as_raw_fd(), PollTag::ImageListener(i));
        }
        for (id, c) in &self.clients {
            add(c.stream.as_raw_fd(), PollTag::Client(*id));
        }
        (pfds, tags)
    }

    fn on_readable(&mut self, tag: PollTag) {
        match tag {
            PollTag::Wake => {
                let mut v = 0u64;
                // SAFETY: draining the eventfd.
                unsafe { libc::read(self.wake_fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
            }
            PollTag::Inotify => self.handle_inotify(),
            PollTag::ControlListener => self.accept(None),
            PollTag::ImageListener(i) => self.accept(Some(i)),
            PollTag::Client(id) => self.read_client(id),
        }
    }

    /// A list from Redis: load it unless it is the one already served.
    fn on_redis_list(&mut self, r: RedisList) {
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

    /// Debounced reloads and image re-checks that are due.
    fn run_timers(&mut self) {
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
    }

    pub fn run(mut self) -> Result<(), ServerError> {
        // SAFETY: installing a simple async-signal-safe handler.
        unsafe {
            libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
            libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
        if let Some(d) = &self.degraded {
            crate::log::warn(&format!("DEGRADED MODE: {d}"));
        } else {
            crate::log::info(
                "kernel supports MADV_ALLOWMERGED: clients can merge_pages() from this server",
            );
            if let Some(w) = ksm_run_warning(std::fs::read_to_string(KSM_RUN).ok().as_deref()) {
                crate::log::warn(&w);
            }
        }
        match self.cfg.qemu_storage_daemon() {
            Ok(qsd) => crate::log::info(&format!("images are read with {}", qsd.display())),
            Err(e) => crate::log::warn(&e.to_string()),
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
        while !STOP.load(Ordering::SeqCst) {
            let (mut pfds, tags) = self.poll_set();
            let mut timeout_ms: i32 = 500;
            if let Some(w) = self.notifier.watchdog_every {
                timeout_ms = timeout_ms.min((w.as_millis() as i32 / 2).max(10));
            }
            // SAFETY: pfds is a valid array.
            let n =
                unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
            if n < 0 && crate::sys::errno() != libc::EINTR {
                return Err(ServerError::Poll(std::io::Error::last_os_error()));
            }
            if n > 0 {
                for (p, tag) in pfds.iter().zip(tags) {
                    if p.revents != 0 {
                        self.on_readable(tag);
                    }
                }
            }
            while let Ok(ev) = self.events.try_recv() {
                match ev {
                    Event::Loaded(l) => self.on_loaded(*l),
                    Event::Redis(r) => self.on_redis_list(r),
                    Event::ReadBack(r) => self.on_read_back(r),
                }
            }
            self.run_timers();
            if Instant::now() >= self.feedback_due {
                self.publish_feedback();
                self.feedback_due =
                    Instant::now() + Duration::from_secs(self.cfg.feedback.interval_secs);
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
        self.shut_down();
        Ok(())
    }

    fn shut_down(&mut self) {
        crate::log::info("stopping: telling clients, removing sockets");
        self.notifier.send("STOPPING=1");
        let ids: Vec<u64> = self.clients.keys().copied().collect();
        for id in ids {
            if self.clients.get(&id).is_some_and(|c| c.image().is_some()) {
                self.send_no_table(id, NT_SHUTDOWN, "server shutting down");
            }
            self.drop_client(id, "");
        }
        if let Some(tx) = &self.redis_cmds {
            let _ = tx.send(redis_watch::Cmd::Shutdown);
        }
        self.flush_feedback();
        for img in &self.images {
            let _ = std::fs::remove_file(img.cfg.socket.as_ref().expect("set"));
        }
        let _ = std::fs::remove_file(self.cfg.control_socket.as_ref().expect("set"));
    }
}
