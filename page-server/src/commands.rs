//! The commands that are not the daemon: `status` and `reload` (requests
//! on a running daemon's control socket), `check-config` and `check-list`.

use crate::cli::ControlSocket;
use crate::config::ConfigError;
use crate::proto::RequestError;
use crate::{config, proto, sectorlist, sys};
use std::fmt;
use std::path::{Path, PathBuf};

/// A command that could not do its work.
#[derive(Debug)]
pub enum CommandError {
    Config(ConfigError),
    Request(RequestError),
    UnexpectedReply(u32),
    /// The daemon's reply is not the JSON it should be.
    BadReply {
        what: &'static str,
        source: serde_json::Error,
    },
}

impl fmt::Display for CommandError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommandError::Config(e) => e.fmt(f),
            CommandError::Request(e) => e.fmt(f),
            CommandError::UnexpectedReply(kind) => write!(f, "unexpected reply type {kind}"),
            CommandError::BadReply { what, source } => write!(f, "bad {what} JSON: {source}"),
        }
    }
}

impl std::error::Error for CommandError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CommandError::Config(e) => Some(e),
            CommandError::Request(e) => Some(e),
            CommandError::UnexpectedReply(_) => None,
            CommandError::BadReply { source, .. } => Some(source),
        }
    }
}

impl From<ConfigError> for CommandError {
    fn from(e: ConfigError) -> Self {
        CommandError::Config(e)
    }
}

impl From<RequestError> for CommandError {
    fn from(e: RequestError) -> Self {
        CommandError::Request(e)
    }
}

fn control_path(socket: &ControlSocket) -> Result<PathBuf, ConfigError> {
    match socket {
        ControlSocket::Path(p) => Ok(p.clone()),
        ControlSocket::FromConfig(cfg) => {
            let c = config::Config::load(cfg)?;
            Ok(c.control_socket.expect("set by load"))
        }
    }
}

pub fn check_config(file: &Path) -> Result<i32, ConfigError> {
    let c = config::Config::load(file)?;
    println!("{}: ok, {} image(s)", file.display(), c.images.len());
    println!("{}", feedback_line(&c));
    // Not a configuration error: the host may install one before starting.
    match c.qemu_storage_daemon() {
        Ok(qsd) => println!("images are read with {}", qsd.display()),
        Err(e) => eprintln!("warning: {e}"),
    }
    Ok(0)
}

pub fn status(socket: &ControlSocket, as_json: bool) -> Result<i32, CommandError> {
    let path = control_path(socket)?;
    let (kind, body) = proto::request(&path, proto::MSG_STATUS_REQ, b"")?;
    if kind != proto::MSG_STATUS_REPLY {
        return Err(CommandError::UnexpectedReply(kind));
    }
    let v: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|source| CommandError::BadReply { what: "status", source })?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        print!("{}", human_status(&v));
    }
    Ok(0)
}

pub fn reload(socket: &ControlSocket, image: &str) -> Result<i32, CommandError> {
    let path = control_path(socket)?;
    let (_, body) = proto::request(&path, proto::MSG_RELOAD_REQ, image.as_bytes())?;
    let v: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|source| CommandError::BadReply { what: "reload reply", source })?;
    println!("{v}");
    Ok(if v["ok"].as_bool().unwrap_or(false) { 0 } else { 1 })
}

/// A list file parsed; else the line at fault (None: unreadable) and why.
fn read_list(file: &str) -> Result<sectorlist::SectorList, (Option<usize>, String)> {
    let data = std::fs::read(file).map_err(|e| (None, e.to_string()))?;
    sectorlist::parse_bytes(&data).map_err(|e| (Some(e.line), e.to_string()))
}

pub fn check_list(files: &[String], as_json: bool) -> i32 {
    let mut all_ok = true;
    let mut out = Vec::new();
    for f in files {
        match read_list(f) {
            Ok(l) => {
                if as_json {
                    out.push(serde_json::json!({"file": f, "ok": true, "count": l.blocks.len(), "digest": sys::hex(&l.digest), "virtual_size": l.virtual_size}));
                } else {
                    println!("OK {f}: {} blocks, sha256:{}", l.blocks.len(), sys::hex(&l.digest));
                }
            }
            Err((line, e)) => {
                all_ok = false;
                if as_json {
                    out.push(serde_json::json!({"file": f, "ok": false, "line": line, "error": e}));
                } else {
                    println!("ERR {f}: {e}");
                }
            }
        }
    }
    if as_json {
        println!("{}", serde_json::Value::Array(out));
    }
    if all_ok {
        0
    } else {
        1
    }
}

/// What `check-config` says of feedback.
fn feedback_line(c: &config::Config) -> String {
    let fb = &c.feedback;
    if c.feedback_enabled() {
        format!(
            "feedback: what guests read is published to Redis every {} s, at most {} blocks per image",
            fb.interval_secs, fb.max_blocks
        )
    } else if c.redis.is_none() {
        "feedback: off (no [redis] section)".into()
    } else {
        "feedback: off (feedback.enabled = false)".into()
    }
}

/// The feedback line of an image in `status`.
fn human_feedback(f: &serde_json::Value) -> String {
    let (c, p) = (&f["counters"], &f["publish"]);
    let published = match p["last_publish"].as_f64() {
        Some(t) if t > 0.0 => {
            format!("last published at {t:.0} ({} bytes)", p["last_publish_bytes"])
        }
        _ => "not published yet".into(),
    };
    let mut o = format!(
        "  feedback: {} blocks from {} guests since {}; {published}; {} evicted, rejected {} messages and {} blocks\n",
        f["blocks"], f["guests"], f["since"], f["evicted_blocks"], c["rejected_messages"], c["rejected_blocks"]
    );
    if let Some(e) = p["last_error"].as_str().filter(|e| !e.is_empty()) {
        o.push_str(&format!("  feedback publish error: {e}\n"));
    }
    o
}

fn human_status(v: &serde_json::Value) -> String {
    let mut o = String::new();
    let mib = |b: &serde_json::Value| b.as_f64().unwrap_or(0.0) / (1 << 20) as f64;
    o.push_str(&format!(
        "pageshare-server {} pid {} on {}, up {:.0} s\n",
        v["version"].as_str().unwrap_or("?"),
        v["pid"],
        v["host"].as_str().unwrap_or("?"),
        v["uptime_seconds"].as_f64().unwrap_or(0.0)
    ));
    if v["degraded"].as_bool().unwrap_or(false) {
        o.push_str(&format!("DEGRADED: {}\n", v["degraded_reason"].as_str().unwrap_or("")));
    } else {
        o.push_str("merge: kernel accepts MADV_ALLOWMERGED\n");
    }
    o.push_str(&format!(
        "memory: RSS {:.1} MiB, {:.1} MiB of verified blocks held; clients: {}\n",
        mib(&v["memory"]["rss_bytes"]),
        mib(&v["memory"]["loaded_bytes"]),
        v["clients"]
    ));
    if !v["redis"].is_null() {
        let r = &v["redis"];
        o.push_str(&format!(
            "redis: {} {}{}\n",
            r["url"].as_str().unwrap_or(""),
            if r["connected"].as_bool().unwrap_or(false) { "connected" } else { "DISCONNECTED" },
            match r["last_error"].as_str() {
                Some(e) if !e.is_empty() => format!(" (last error: {e})"),
                _ => String::new(),
            }
        ));
    }
    for i in v["images"].as_array().into_iter().flatten() {
        o.push_str(&format!(
            "image {}: {} - {}\n",
            i["name"].as_str().unwrap_or("?"),
            i["state"].as_str().unwrap_or("?"),
            i["message"].as_str().unwrap_or("")
        ));
        o.push_str(&format!(
            "  base {}  socket {}\n",
            i["path"].as_str().unwrap_or("?"),
            i["socket"].as_str().unwrap_or("?")
        ));
        o.push_str(&format!("  list from {}\n", i["list_source"].as_str().unwrap_or("?")));
        if !i["generation"].is_null() {
            o.push_str(&format!(
                "  generation {}: {} blocks, {:.1} MiB, table {} bytes, {}\n",
                i["generation"],
                i["blocks"],
                mib(&i["bytes"]),
                i["table_bytes"],
                i["list_digest"].as_str().unwrap_or("")
            ));
        }
        let cs = &i["client_stats"];
        o.push_str(&format!(
            "  clients {} (waiting to switch {}), live generations {}; lookups {} hits {} merged {} merge errors {} fallbacks {}\n",
            i["clients"], i["clients_waiting_to_switch"], i["live_generations"], cs["lookups"], cs["hits"], cs["merged"], cs["merge_errors"], cs["fallbacks"]
        ));
        // Only where a client migrated a guest by block reference: on most
        // hosts they stay 0 and would only lengthen the status.
        let refs = ["sent", "refused", "merged", "copied", "read", "failed"]
            .map(|k| (k, cs[format!("migration_refs_{k}")].as_u64().unwrap_or(0)));
        if refs.iter().any(|(_, n)| *n > 0) {
            o.push_str("  migration references:");
            for (k, n) in refs {
                o.push_str(&format!(" {k} {n}"));
            }
            o.push('\n');
        }
        if let Some(e) = i["last_error"].as_str().filter(|e| !e.is_empty()) {
            o.push_str(&format!("  last error: {e}\n"));
        }
        if v["feedback"]["enabled"].as_bool().unwrap_or(false) {
            o.push_str(&human_feedback(&i["feedback"]));
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::{human_feedback, human_status};
    use serde_json::json;

    #[test]
    fn check_config_says_whether_feedback_is_on() {
        let dir = crate::test_dir::TestDir::new("feedback-line");
        let path = dir.join("pageshare.toml");
        let line = |text: &str| {
            std::fs::write(&path, text).unwrap();
            super::feedback_line(&crate::config::Config::load(&path).unwrap())
        };
        let redis = "[redis]\nurl = \"redis://127.0.0.1/\"\n";
        assert_eq!(line(""), "feedback: off (no [redis] section)");
        assert_eq!(
            line(&format!("{redis}[feedback]\nenabled = false\n")),
            "feedback: off (feedback.enabled = false)"
        );
        assert!(line(redis).contains("every 60 s, at most 1048576 blocks per image"));
    }

    #[test]
    fn the_feedback_line_says_what_was_counted_and_published() {
        let f = json!({"blocks": 12, "guests": 2, "since": 1700000000, "evicted_blocks": 0,
                       "counters": {"rejected_messages": 1, "rejected_blocks": 3},
                       "publish": {"last_publish": 1700000060.5, "last_publish_bytes": 400, "last_error": "refused"}});
        assert_eq!(
            human_feedback(&f),
            "  feedback: 12 blocks from 2 guests since 1700000000; last published at 1700000060 (400 bytes); \
             0 evicted, rejected 1 messages and 3 blocks\n  feedback publish error: refused\n"
        );
        let f = json!({"blocks": 0, "guests": 0, "since": 5, "evicted_blocks": 0, "counters": {}, "publish": {"last_publish": 0.0}});
        assert!(human_feedback(&f).contains("not published yet"));
    }

    #[test]
    fn human_status_says_what_an_operator_looks_for() {
        let v = json!({
            "version": "0.1.0", "pid": 42, "host": "h1", "uptime_seconds": 12.4,
            "degraded": true, "degraded_reason": "no series",
            "memory": {"rss_bytes": 3 << 20, "loaded_bytes": 2 << 20}, "clients": 1,
            "redis": {"url": "redis://x:***@r/", "connected": false, "last_error": "refused"},
            "images": [{
                "name": "deb", "state": "serving", "message": "generation 2: 512 blocks (2.0 MiB)",
                "path": "/img/deb.qcow2", "socket": "/run/pageshare/deb.sock", "list_source": "file /l.pcsl",
                "generation": 2, "blocks": 512, "bytes": 2 << 20, "table_bytes": 8192, "list_digest": "sha256:ab",
                "clients": 1, "clients_waiting_to_switch": 0, "live_generations": [2],
                "client_stats": {"lookups": 5, "hits": 4, "merged": 3, "merge_errors": 0, "fallbacks": 1},
                "last_error": "",
            }],
        });
        let text = human_status(&v);
        for want in [
            "pageshare-server 0.1.0 pid 42 on h1, up 12 s\n",
            "DEGRADED: no series\n",
            "memory: RSS 3.0 MiB, 2.0 MiB of verified blocks held; clients: 1\n",
            "redis: redis://x:***@r/ DISCONNECTED (last error: refused)\n",
            "image deb: serving - generation 2: 512 blocks (2.0 MiB)\n",
            "  generation 2: 512 blocks, 2.0 MiB, table 8192 bytes, sha256:ab\n",
            "lookups 5 hits 4 merged 3 merge errors 0 fallbacks 1\n",
        ] {
            assert!(text.contains(want), "{want:?} not in:\n{text}");
        }
        assert!(!text.contains("last error: \n"), "an empty last error is not shown:\n{text}");
    }

    #[test]
    fn human_status_shows_migration_references_where_there_were_any() {
        let mut v = json!({
            "version": "0.1.0", "pid": 42, "host": "h1", "uptime_seconds": 1.0, "degraded": false,
            "memory": {"rss_bytes": 0, "loaded_bytes": 0}, "clients": 1,
            "images": [{
                "name": "deb", "state": "serving", "message": "", "path": "/img/deb.qcow2",
                "socket": "/run/pageshare/deb.sock", "list_source": "file /l.pcsl",
                "clients": 1, "clients_waiting_to_switch": 0, "live_generations": [1],
                "client_stats": {"lookups": 5, "hits": 4, "merged": 3, "merge_errors": 0, "fallbacks": 1,
                                 "migration_refs_sent": 0, "migration_refs_refused": 0,
                                 "migration_refs_merged": 0, "migration_refs_copied": 0,
                                 "migration_refs_read": 0, "migration_refs_failed": 0},
            }],
        });
        let text = human_status(&v);
        assert!(!text.contains("migration"), "{text}");
        let cs = &mut v["images"][0]["client_stats"];
        cs["migration_refs_copied"] = json!(700);
        cs["migration_refs_read"] = json!(12);
        let text = human_status(&v);
        let want = "  migration references: sent 0 refused 0 merged 0 copied 700 read 12 failed 0";
        assert!(text.contains(want), "{text}");
    }
}
