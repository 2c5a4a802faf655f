//! The control socket: `status` (the status JSON, also rendered for the
//! metrics endpoint and pushed to Redis) and `reload`.

use super::clients::Proof;
use super::Server;
use crate::proto::{frame, MSG_RELOAD_REPLY, MSG_RELOAD_REQ, MSG_STATUS_REPLY, MSG_STATUS_REQ};
use serde_json::{json, Value};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::time::Duration;

impl Server {
    /// A request on the control socket; false if its type is not one.
    pub(super) fn control_message(&mut self, id: u64, kind: u32, p: &[u8]) -> bool {
        match kind {
            MSG_STATUS_REQ => {
                let s = self.status_json().to_string();
                self.reply(id, MSG_STATUS_REPLY, s.as_bytes());
            }
            MSG_RELOAD_REQ => {
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
                let names: Vec<String> =
                    which.iter().map(|i| self.images[*i].cfg.name.clone()).collect();
                let r = json!({"ok": ok, "reloading": names, "error": if ok { "" } else { "no such image" }});
                self.reply(id, MSG_RELOAD_REPLY, r.to_string().as_bytes());
            }
            _ => return false,
        }
        true
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

    pub(super) fn short_status(&self) -> String {
        let parts: Vec<String> = self
            .images
            .iter()
            .map(|i| match &i.current {
                Some(g) => format!("{}: gen {} {} blocks", i.cfg.name, g.number, g.blocks.len()),
                None => format!("{}: {}", i.cfg.name, i.state.as_str()),
            })
            .collect();
        parts.join("; ")
    }

    fn status_json(&self) -> Value {
        let (rss, anon) = crate::sys::self_memory_kb();
        let feedback_status = self.feedback_status.lock().expect("feedback status").clone();
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
                let mut by_proof = [0u64; Proof::ALL.len()];
                for c in self.clients.values() {
                    if c.image() == Some(i) {
                        client_list.push(json!({
                            "pid": c.pid, "uid": c.uid, "connected_at": c.connected_at,
                            "generations": c.held.iter().map(|g| g.number).collect::<Vec<_>>(),
                            "proof": c.proof.as_str(),
                            "stats": c.counters.json(),
                        }));
                        if let Some(k) = Proof::ALL.iter().position(|p| *p == c.proof) {
                            by_proof[k] += 1;
                        }
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
                let clients_proof: serde_json::Map<String, Value> = Proof::ALL
                    .iter()
                    .zip(by_proof)
                    .map(|(p, n)| (p.as_str().to_string(), json!(n)))
                    .collect();
                json!({
                    "name": img.cfg.name,
                    "path": img.cfg.path,
                    "socket": img.cfg.socket,
                    "list_source": match (&img.cfg.list_file, &img.redis_key) {
                        (Some(p), _) => format!("file {}", p.display()),
                        (None, Some(k)) => format!("redis key {k}"),
                        (None, None) => "redis (key known once the image identity is)".into(),
                    },
                    "state": img.state.as_str(),
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
                    "clients_proof": clients_proof,
                    "reverifying": img.suspended.as_ref().map(|g| json!({
                        "generation": g.number, "image_file": g.stamp,
                    })),
                    "clients_total": img.clients_total,
                    "client_stats": counters.json(),
                    "last_load": img.last_load,
                    "last_error": img.last_error,
                    "loads_ok": img.loads_ok,
                    "loads_failed": img.loads_failed,
                    "feedback": img.feedback_json(feedback_status.get(i)),
                })
            })
            .collect();
        let redis = self.cfg.redis.as_ref().map(|_| {
            serde_json::to_value(self.redis_status.lock().expect("redis status").clone())
                .unwrap_or(Value::Null)
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
            "clients": self.clients.values().filter(|c| c.image().is_some()).count(),
            "redis": redis,
            "feedback": {
                "enabled": self.feedback_cmds.is_some(),
                "interval_secs": self.cfg.feedback.interval_secs,
                "max_blocks": self.cfg.feedback.max_blocks,
                "window_secs": self.cfg.feedback.window_secs,
            },
            "images": images,
        })
    }

    pub(super) fn refresh_snapshot(&self) {
        let st = self.status_json();
        *self.metrics.lock().expect("metrics") = crate::metrics::render(&st);
        *self.snapshot.lock().expect("snapshot") = st.to_string();
    }
}
