//! Loads and generations: asking the loader for a list, taking its result,
//! publishing a new generation to the clients, withdrawing a table.

use super::{ImageStatus, Server};
use crate::arena::{Arena, MergeMode};
use crate::identity::FileStamp;
use crate::loader::{cached_list_path, FailKind, Job, ListSource, LoadError, LoadOk, Loaded};
use crate::proto::{NT_IMAGE_CHANGED, NT_NO_LIST, NT_REFUSED};
use crate::redis_watch;
use crate::table::{self, TableInfo};
use serde_json::{json, Value};
use std::os::fd::OwnedFd;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Retry interval after the base image could not be read.
const IMAGE_RETRY: Duration = Duration::from_secs(30);

/// One published table: immutable.  Dropping the last reference (the image's
/// `current` and every client still using it) releases its blocks.
pub(super) struct Generation {
    pub(super) number: u64,
    /// The image file the load that produced this generation verified.
    pub(super) stamp: FileStamp,
    /// "raw" or "qcow2": the format it was read with.
    pub(super) format: String,
    pub(super) memfd: OwnedFd,
    pub(super) arena: Arc<Arena>,
    pub(super) blocks: Vec<u64>,
    pub(super) table_bytes: usize,
    pub(super) list_digest: String,
    pub(super) text_sha: [u8; 32],
    pub(super) list_meta: Value,
    pub(super) source: String,
    pub(super) published_at: f64,
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.arena.release(&self.blocks);
    }
}

impl Server {
    pub(super) fn request_load(&mut self, idx: usize, source: ListSource, why: &str) {
        let img = &mut self.images[idx];
        img.seq += 1;
        self.latest[idx].store(img.seq, Ordering::SeqCst);
        img.loading = true;
        if img.current.is_none() {
            img.state = ImageStatus::Loading;
        }
        img.message = format!("loading {} ({why})", source.describe());
        img.last_source = Some(source.clone());
        crate::log::info(&format!("image {}: loading {} ({why})", img.cfg.name, source.describe()));
        let job = Job {
            image: idx,
            seq: img.seq,
            cfg: img.cfg.clone(),
            source,
            arena: img.arena.clone(),
        };
        if self.jobs.send(job).is_err() {
            crate::log::error("loader thread is gone");
        }
    }

    pub(super) fn initial_source(&self, idx: usize) -> ListSource {
        let img = &self.images[idx];
        match &img.cfg.list_file {
            Some(p) => ListSource::File(p.clone()),
            None => ListSource::Cached,
        }
    }

    pub(super) fn reload_source(&self, idx: usize) -> ListSource {
        let img = &self.images[idx];
        match (&img.cfg.list_file, &img.last_source) {
            (Some(p), _) => ListSource::File(p.clone()),
            (None, Some(ListSource::Redis(k, t))) => ListSource::Redis(k.clone(), t.clone()),
            _ => ListSource::Cached,
        }
    }

    pub(super) fn on_loaded(&mut self, l: Loaded) {
        let idx = l.image;
        if l.seq != self.images[idx].seq {
            // Superseded by a newer request: give back what it holds.
            if let Ok(ok) = l.result {
                ok.arena.release(&ok.blocks);
            }
            return;
        }
        // The generation withdrawn because the file changed is kept only
        // for this load (its blocks are held by `ok` if the content is the
        // same); it goes when this function returns, unless the file
        // changed again and is re-checked.
        let suspended = self.images[idx].suspended.take();
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
            self.ensure_feedback(idx);
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
                    self.images[idx].suspended = suspended;
                    return;
                }
                if let Some(old) = &suspended {
                    if Arc::ptr_eq(&old.arena, &ok.arena) && old.stamp != ok.stamp {
                        crate::log::info(&format!(
                            "image {}: verified again after its file changed: same content (sha256 of the whole disk) as generation {}, only the file's metadata changed; the next generation proves the new stamp (clients use it again)",
                            self.images[idx].cfg.name, old.number
                        ));
                    }
                }
                self.publish(idx, ok, &l.source)
            }
            Err(e) => self.on_load_failed(idx, e),
        }
    }

    /// A load failed: keep serving what was verified, or withdraw it if the
    /// image itself is in doubt, and say why.
    fn on_load_failed(&mut self, idx: usize, e: LoadError) {
        let LoadError { kind, message: msg } = e;
        if kind == FailKind::Cancelled {
            return;
        }
        let img = &mut self.images[idx];
        let serving = img.current.as_ref().map(|g| g.number);
        let keep = match serving {
            Some(n) => format!("; still serving generation {n}"),
            None => String::new(),
        };
        if kind == FailKind::NoList {
            img.state =
                if img.current.is_some() { ImageStatus::Serving } else { ImageStatus::NoList };
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
            img.state = ImageStatus::Error;
            img.message = format!("{msg} (retrying in {} s)", IMAGE_RETRY.as_secs());
            // The image may come back (a transient lock, a copy in
            // progress): try again later, inotify may be quicker.
            if img.reload_at.is_none() {
                img.reload_at = Some(Instant::now() + IMAGE_RETRY);
            }
        } else {
            let img = &mut self.images[idx];
            if img.current.is_none() {
                img.state = ImageStatus::Refused;
                img.message = msg.clone();
                self.broadcast_no_table_if_empty(idx, NT_REFUSED, &msg);
            } else {
                img.message = format!("new list refused, serving the previous one: {msg}");
            }
        }
    }

    fn watch_redis(&mut self, idx: usize) {
        let img = &mut self.images[idx];
        let (Some(spec), Some(id), Some(rc), Some(tx)) = (
            img.cfg.list_redis.clone(),
            img.identity,
            self.cfg.redis.as_ref(),
            self.redis_cmds.as_ref(),
        ) else {
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
                crate::log::error(&format!(
                    "image {}: cannot create the table memfd: {e}",
                    self.images[idx].cfg.name
                ));
                ok.arena.release(&ok.blocks);
                return;
            }
        };
        if let (ListSource::Redis(_, text), Some(id)) = (source, self.images[idx].identity) {
            // Keep the last good Redis list so a restart without Redis serves it.
            let p = cached_list_path(&self.cfg, &id);
            let tmp = p.with_extension("tmp");
            if let Err(e) =
                std::fs::write(&tmp, text.as_slice()).and_then(|_| std::fs::rename(&tmp, &p))
            {
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
        img.state = ImageStatus::Serving;
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
        for id in self.image_clients(idx) {
            self.send_table(id, &gen);
        }
        self.notifier.send(&format!("STATUS={}", self.short_status()));
    }

    /// The image file changed (its stamp moved: a write, or only a chmod,
    /// chown, link or touch): withdraw the table at once, as
    /// [`Server::withdraw`], but keep the generation's blocks until the
    /// load that verifies the file again ends.
    pub(super) fn suspend(&mut self, idx: usize, why: &str) {
        let img = &mut self.images[idx];
        if let Some(gen) = img.current.clone() {
            img.suspended = Some(gen);
        }
        self.withdraw(idx, NT_IMAGE_CHANGED, why);
    }

    pub(super) fn withdraw(&mut self, idx: usize, reason: u32, why: &str) {
        let img = &mut self.images[idx];
        let Some(gen) = img.current.take() else { return };
        crate::log::error(&format!(
            "image {}: withdrawing generation {}: {why}",
            img.cfg.name, gen.number
        ));
        img.state = ImageStatus::Withdrawn;
        img.message = why.to_string();
        drop(gen);
        self.broadcast_no_table_if_empty(idx, reason, why);
    }

    fn broadcast_no_table_if_empty(&mut self, idx: usize, reason: u32, why: &str) {
        if self.images[idx].current.is_some() {
            return;
        }
        for id in self.image_clients(idx) {
            self.send_no_table(id, reason, why);
        }
    }
}
