//! pageshare-server: per-host daemon that preloads the verified blocks of
//! golden images into mergeable memory and publishes block -> address tables
//! to QEMU.  See page-server/README.md and page-server/PROTOCOL.md.

mod arena;
mod blockreader;
mod config;
mod identity;
mod loader;
mod log;
mod metrics;
mod notify;
mod proto;
mod redis_watch;
mod sectorlist;
mod server;
mod sys;
mod table;

#[cfg(test)]
mod fuzz_tests;

use std::path::PathBuf;

const USAGE: &str = "\
usage: pageshare-server COMMAND [ARGS]

commands:
  run --config FILE            run the daemon (systemd: Type=notify)
  status [--config FILE | --socket PATH] [--json]
                               ask a running daemon for its state and stats
  reload [IMAGE] [--config FILE | --socket PATH]
                               re-read the lists (all images, or one)
  check-config FILE            parse and validate a configuration file
  check-list [--json] FILE...  validate pcsl v1 lists exactly as the daemon does
  --version

The default config is /etc/pageshare/server.toml.
";

fn arg_value(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn control_path(args: &[String]) -> Result<PathBuf, String> {
    if let Some(s) = arg_value(args, "--socket") {
        return Ok(s.into());
    }
    let cfg = arg_value(args, "--config").unwrap_or_else(|| "/etc/pageshare/server.toml".into());
    let c = config::Config::load(std::path::Path::new(&cfg))?;
    Ok(c.control_socket.expect("set by load"))
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
        o.push_str(&format!("image {}: {} - {}\n", i["name"].as_str().unwrap_or("?"), i["state"].as_str().unwrap_or("?"), i["message"].as_str().unwrap_or("")));
        o.push_str(&format!("  base {}  socket {}\n", i["path"].as_str().unwrap_or("?"), i["socket"].as_str().unwrap_or("?")));
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
        if let Some(e) = i["last_error"].as_str().filter(|e| !e.is_empty()) {
            o.push_str(&format!("  last error: {e}\n"));
        }
    }
    o
}

fn real_main() -> Result<i32, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first().map(String::as_str) else {
        eprint!("{USAGE}");
        return Ok(2);
    };
    let rest = &args[1..];
    match cmd {
        "-h" | "--help" | "help" => {
            print!("{USAGE}");
            Ok(0)
        }
        "--version" => {
            println!("pageshare-server {}", env!("CARGO_PKG_VERSION"));
            Ok(0)
        }
        "run" => {
            let cfg = arg_value(rest, "--config").unwrap_or_else(|| "/etc/pageshare/server.toml".into());
            let c = config::Config::load(std::path::Path::new(&cfg))?;
            let s = server::Server::new(c)?;
            s.run()?;
            Ok(0)
        }
        "check-config" => {
            let f = rest.first().ok_or("check-config needs a FILE")?;
            let c = config::Config::load(std::path::Path::new(f))?;
            println!("{f}: ok, {} image(s)", c.images.len());
            Ok(0)
        }
        "status" => {
            let path = control_path(rest)?;
            let (kind, body) = proto::request(&path, proto::MSG_STATUS_REQ, b"")?;
            if kind != proto::MSG_STATUS_REPLY {
                return Err(format!("unexpected reply type {kind}"));
            }
            let v: serde_json::Value = serde_json::from_slice(&body).map_err(|e| format!("bad status JSON: {e}"))?;
            if rest.iter().any(|a| a == "--json") {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                print!("{}", human_status(&v));
            }
            Ok(0)
        }
        "reload" => {
            let path = control_path(rest)?;
            let image = rest
                .iter()
                .enumerate()
                .find(|(i, a)| !a.starts_with("--") && (*i == 0 || !["--socket", "--config"].contains(&rest[i - 1].as_str())))
                .map(|(_, a)| a.clone())
                .unwrap_or_default();
            let (_, body) = proto::request(&path, proto::MSG_RELOAD_REQ, image.as_bytes())?;
            let v: serde_json::Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
            println!("{v}");
            Ok(if v["ok"].as_bool().unwrap_or(false) { 0 } else { 1 })
        }
        "check-list" => {
            let as_json = rest.iter().any(|a| a == "--json");
            let mut all_ok = true;
            let mut out = Vec::new();
            for f in rest.iter().filter(|a| *a != "--json") {
                let r = std::fs::read(f).map_err(|e| e.to_string()).and_then(|d| sectorlist::parse_bytes(&d).map_err(|e| e.to_string()).map(|l| (l, d)));
                match r {
                    Ok((l, _)) => {
                        if as_json {
                            out.push(serde_json::json!({"file": f, "ok": true, "count": l.blocks.len(), "digest": sys::hex(&l.digest), "virtual_size": l.virtual_size}));
                        } else {
                            println!("OK {f}: {} blocks, sha256:{}", l.blocks.len(), sys::hex(&l.digest));
                        }
                    }
                    Err(e) => {
                        all_ok = false;
                        let line = e.strip_prefix("line ").and_then(|s| s.split(':').next()).and_then(|n| n.parse::<u64>().ok());
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
            Ok(if all_ok { 0 } else { 1 })
        }
        other => Err(format!("unknown command {other:?}\n{USAGE}")),
    }
}

fn main() {
    match real_main() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("pageshare-server: error: {e}");
            std::process::exit(2);
        }
    }
}
