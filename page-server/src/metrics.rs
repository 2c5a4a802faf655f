//! Prometheus text endpoint: a tiny HTTP/1.0 server on its own thread that
//! answers GET /metrics with the text the main loop renders every 0.5 s.

use serde_json::Value;
use std::fmt;
use std::io::{self, Read, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The metrics endpoint could not be started.
#[derive(Debug)]
pub enum MetricsError {
    /// `what` names the socket or the `metrics_listen` address.
    Bind {
        what: String,
        source: io::Error,
    },
    Thread(io::Error),
}

impl fmt::Display for MetricsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetricsError::Bind { what, source } => write!(f, "{what}: {source}"),
            MetricsError::Thread(e) => write!(f, "cannot start the metrics thread: {e}"),
        }
    }
}

impl std::error::Error for MetricsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            MetricsError::Bind { source, .. } | MetricsError::Thread(source) => Some(source),
        }
    }
}

/// A connection the endpoint can answer: both stream kinds, with timeouts.
trait Connection: Read + Write {
    fn set_timeouts(&self, t: Duration);
}

impl Connection for std::os::unix::net::UnixStream {
    fn set_timeouts(&self, t: Duration) {
        let _ = self.set_read_timeout(Some(t));
        let _ = self.set_write_timeout(Some(t));
    }
}

impl Connection for std::net::TcpStream {
    fn set_timeouts(&self, t: Duration) {
        let _ = self.set_read_timeout(Some(t));
        let _ = self.set_write_timeout(Some(t));
    }
}

pub fn spawn(listen: &str, text: Arc<Mutex<String>>) -> Result<(), MetricsError> {
    if let Some(path) = listen.strip_prefix("unix:") {
        let _ = std::fs::remove_file(path);
        let l = std::os::unix::net::UnixListener::bind(path).map_err(|source| {
            MetricsError::Bind { what: format!("metrics socket {path}"), source }
        })?;
        serve_on(move || l.accept().map(|(s, _)| s), text)
    } else {
        let l = std::net::TcpListener::bind(listen).map_err(|source| MetricsError::Bind {
            what: format!("metrics_listen {listen}"),
            source,
        })?;
        crate::log::info(&format!(
            "metrics on http://{}/metrics",
            l.local_addr().map(|a| a.to_string()).unwrap_or_default()
        ));
        serve_on(move || l.accept().map(|(s, _)| s), text)
    }
}

/// Answer the connections `accept` returns, one at a time, on a thread.
fn serve_on<S: Connection>(
    accept: impl Fn() -> io::Result<S> + Send + 'static,
    text: Arc<Mutex<String>>,
) -> Result<(), MetricsError> {
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || loop {
            if let Ok(s) = accept() {
                s.set_timeouts(Duration::from_secs(2));
                serve(s, &text);
            }
        })
        .map(drop)
        .map_err(MetricsError::Thread)
}

fn serve<S: Read + Write>(mut s: S, text: &Arc<Mutex<String>>) {
    let mut req = Vec::new();
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") && !req.windows(2).any(|w| w == b"\n\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => req.extend_from_slice(&buf[..n]),
        }
        if req.len() > 8192 {
            break;
        }
    }
    let line = String::from_utf8_lossy(&req);
    let first = line.lines().next().unwrap_or("");
    let mut parts = first.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, body) = if method == "GET" && (path == "/metrics" || path == "/") {
        ("200 OK", text.lock().expect("metrics").clone())
    } else {
        ("404 Not Found", "try GET /metrics\n".to_string())
    };
    let _ = write!(
        s,
        "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Prometheus exposition text from the status JSON.
pub fn render(st: &Value) -> String {
    let mut o = String::new();
    let num = |v: &Value| v.as_f64().unwrap_or(0.0);
    let mut metric = |name: &str, help: &str, kind: &str, rows: Vec<(String, f64)>| {
        o.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (labels, v) in rows {
            o.push_str(&format!("{name}{labels} {v}\n"));
        }
    };
    metric(
        "pageshare_server_info",
        "Server version and host.",
        "gauge",
        vec![(
            format!(
                "{{version=\"{}\",host=\"{}\"}}",
                esc(st["version"].as_str().unwrap_or("")),
                esc(st["host"].as_str().unwrap_or(""))
            ),
            1.0,
        )],
    );
    metric(
        "pageshare_degraded",
        "1 if the kernel lacks MADV_ALLOWMERGED (clients cannot merge, guests read from disk).",
        "gauge",
        vec![(String::new(), if st["degraded"].as_bool().unwrap_or(false) { 1.0 } else { 0.0 })],
    );
    metric(
        "pageshare_rss_bytes",
        "Resident memory of the server.",
        "gauge",
        vec![(String::new(), num(&st["memory"]["rss_bytes"]))],
    );
    metric(
        "pageshare_loaded_bytes",
        "Bytes of verified blocks held, all images and generations.",
        "gauge",
        vec![(String::new(), num(&st["memory"]["loaded_bytes"]))],
    );
    metric(
        "pageshare_clients",
        "Connected clients on image sockets.",
        "gauge",
        vec![(String::new(), num(&st["clients"]))],
    );
    if !st["redis"].is_null() {
        metric(
            "pageshare_redis_connected",
            "1 while the Redis connection is up.",
            "gauge",
            vec![(
                String::new(),
                if st["redis"]["connected"].as_bool().unwrap_or(false) { 1.0 } else { 0.0 },
            )],
        );
        metric(
            "pageshare_redis_failures_total",
            "Redis connection failures.",
            "counter",
            vec![(String::new(), num(&st["redis"]["failures"]))],
        );
    }
    let images = st["images"].as_array().cloned().unwrap_or_default();
    let per = |f: &dyn Fn(&Value) -> f64| -> Vec<(String, f64)> {
        images
            .iter()
            .map(|i| (format!("{{image=\"{}\"}}", esc(i["name"].as_str().unwrap_or(""))), f(i)))
            .collect()
    };
    metric(
        "pageshare_image_serving",
        "1 if a table is published for the image.",
        "gauge",
        per(&|i| if i["generation"].is_null() { 0.0 } else { 1.0 }),
    );
    metric(
        "pageshare_image_generation",
        "Published table generation.",
        "gauge",
        per(&|i| num(&i["generation"])),
    );
    metric(
        "pageshare_image_blocks",
        "Blocks in the published table.",
        "gauge",
        per(&|i| num(&i["blocks"])),
    );
    metric(
        "pageshare_image_bytes",
        "Bytes of the published blocks.",
        "gauge",
        per(&|i| num(&i["bytes"])),
    );
    metric("pageshare_image_clients", "Connected clients.", "gauge", per(&|i| num(&i["clients"])));
    let mut by_proof = Vec::new();
    for i in &images {
        if let Some(m) = i["clients_proof"].as_object() {
            for (proof, n) in m {
                by_proof.push((
                    format!(
                        "{{image=\"{}\",proof=\"{}\"}}",
                        esc(i["name"].as_str().unwrap_or("")),
                        esc(proof)
                    ),
                    num(n),
                ));
            }
        }
    }
    metric(
        "pageshare_image_clients_by_proof",
        "Connected clients by what their last STATS says of their table: sharing, no-table, unchecked, unproven (not the file the server verified), base-changed (their base changed after it was verified), unknown (older clients).",
        "gauge",
        by_proof,
    );
    metric(
        "pageshare_image_reverifying",
        "1 while the image's table is withdrawn because its file changed and the server verifies it again.",
        "gauge",
        per(&|i| if i["reverifying"].is_null() { 0.0 } else { 1.0 }),
    );
    metric(
        "pageshare_image_live_generations",
        "Generations still held by clients or current.",
        "gauge",
        per(&|i| i["live_generations"].as_array().map(|a| a.len() as f64).unwrap_or(0.0)),
    );
    metric(
        "pageshare_image_loads_total",
        "Successful list loads.",
        "counter",
        per(&|i| num(&i["loads_ok"])),
    );
    metric(
        "pageshare_image_load_failures_total",
        "Refused or failed list loads.",
        "counter",
        per(&|i| num(&i["loads_failed"])),
    );
    metric(
        "pageshare_image_last_load_seconds",
        "Duration of the last successful load.",
        "gauge",
        per(&|i| num(&i["last_load"]["seconds"])),
    );
    for (k, help) in [
        ("lookups", "Table lookups reported by clients."),
        ("hits", "Lookups that found the block."),
        ("merged", "Pages merged into guests (merge_pages successes)."),
        ("merge_errors", "merge_pages failures."),
        ("fallbacks", "Reads that went to disk instead."),
        ("migration_refs_sent", "Guest pages an outgoing migration sent as block references."),
        ("migration_refs_refused", "Guest pages an outgoing migration sent in full instead."),
        ("migration_refs_merged", "Block references an incoming migration merged."),
        ("migration_refs_copied", "Block references an incoming migration copied."),
        ("migration_refs_read", "Block references an incoming migration read from the base image."),
        ("migration_refs_failed", "Block references an incoming migration could not fill."),
        (
            "fallback_unproven",
            "Blocks clients read from disk because no table was proven for their base file.",
        ),
    ] {
        metric(
            &format!("pageshare_client_{k}_total"),
            help,
            "counter",
            per(&|i| num(&i["client_stats"][k])),
        );
    }
    if st["feedback"]["enabled"].as_bool().unwrap_or(false) {
        metric(
            "pageshare_feedback_blocks",
            "Blocks in the feedback accumulation.",
            "gauge",
            per(&|i| num(&i["feedback"]["blocks"])),
        );
        metric(
            "pageshare_feedback_guests",
            "Distinct guests in the feedback accumulation.",
            "gauge",
            per(&|i| num(&i["feedback"]["guests"])),
        );
        metric(
            "pageshare_feedback_memory_bytes",
            "Estimated memory of the feedback accumulation.",
            "gauge",
            per(&|i| num(&i["feedback"]["memory_bytes"])),
        );
        metric(
            "pageshare_feedback_evicted_blocks_total",
            "Blocks evicted beyond feedback.max_blocks.",
            "counter",
            per(&|i| num(&i["feedback"]["evicted_blocks"])),
        );
        for (k, help) in [
            ("reads_messages", "READS messages received."),
            ("listed_messages", "LISTED_READ messages received."),
            ("accepted_blocks", "Reported blocks counted."),
            ("rejected_messages", "Feedback messages ignored: bad length, count or generation."),
            ("rejected_blocks", "Reported blocks ignored: outside the image, or not listed."),
            ("truncated_reports", "READS whose client table had evicted entries."),
            ("ignored_messages", "Feedback messages before the image identity was known."),
        ] {
            metric(
                &format!("pageshare_feedback_{k}_total"),
                help,
                "counter",
                per(&|i| num(&i["feedback"]["counters"][k])),
            );
        }
        metric(
            "pageshare_feedback_publishes_total",
            "Feedback summaries published to Redis.",
            "counter",
            per(&|i| num(&i["feedback"]["publish"]["publishes"])),
        );
        metric(
            "pageshare_feedback_publish_failures_total",
            "Feedback publishes or read-backs that failed.",
            "counter",
            per(&|i| num(&i["feedback"]["publish"]["failures"])),
        );
        metric(
            "pageshare_feedback_last_publish_time_seconds",
            "Unix time of the last feedback publish.",
            "gauge",
            per(&|i| num(&i["feedback"]["publish"]["last_publish"])),
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn client_counters_are_per_image_counters_with_help() {
        let st = json!({
            "version": "0.1.0", "host": "h1", "images": [{
                "name": "deb", "generation": 3,
                "client_stats": {"lookups": 5, "hits": 4, "merged": 3, "merge_errors": 0, "fallbacks": 1,
                                 "migration_refs_sent": 900, "migration_refs_refused": 7,
                                 "migration_refs_merged": 0, "migration_refs_copied": 850,
                                 "migration_refs_read": 50, "migration_refs_failed": 0,
                                 "fallback_unproven": 12},
                "clients_proof": {"sharing": 2, "base-changed": 1},
                "reverifying": {"generation": 3},
            }],
        });
        let text = super::render(&st);
        for want in [
            "pageshare_client_lookups_total{image=\"deb\"} 5\n",
            "# TYPE pageshare_client_migration_refs_sent_total counter\n",
            "pageshare_client_migration_refs_sent_total{image=\"deb\"} 900\n",
            "pageshare_client_migration_refs_refused_total{image=\"deb\"} 7\n",
            "pageshare_client_migration_refs_merged_total{image=\"deb\"} 0\n",
            "pageshare_client_migration_refs_copied_total{image=\"deb\"} 850\n",
            "pageshare_client_migration_refs_read_total{image=\"deb\"} 50\n",
            "pageshare_client_migration_refs_failed_total{image=\"deb\"} 0\n",
            "pageshare_client_fallback_unproven_total{image=\"deb\"} 12\n",
            "pageshare_image_clients_by_proof{image=\"deb\",proof=\"sharing\"} 2\n",
            "pageshare_image_clients_by_proof{image=\"deb\",proof=\"base-changed\"} 1\n",
            "pageshare_image_reverifying{image=\"deb\"} 1\n",
        ] {
            assert!(text.contains(want), "{want:?} not in:\n{text}");
        }
        // Every metric has its HELP and TYPE, once.
        let types = text.lines().filter_map(|l| l.strip_prefix("# TYPE "));
        for name in types.map(|l| l.split(' ').next().unwrap()) {
            for what in ["HELP", "TYPE"] {
                let line = format!("# {what} {name} ");
                assert_eq!(text.matches(&line).count(), 1, "{line}");
            }
        }
    }
}
