//! The daemon's configuration file (TOML).  See page-server/README.md and
//! page-server/pageshare-server.example.toml.

use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Directory of the per-image sockets and of control.sock.
    #[serde(default = "default_socket_dir")]
    pub socket_dir: PathBuf,
    /// Status/stats socket; default <socket_dir>/control.sock.
    #[serde(default)]
    pub control_socket: Option<PathBuf>,
    /// Mode of the sockets (octal string, e.g. "0660").
    #[serde(default = "default_socket_mode")]
    pub socket_mode: String,
    /// Content-hash cache and the last good list of each image.
    #[serde(default = "default_cache_dir")]
    pub cache_dir: PathBuf,
    /// Prometheus text endpoint: "127.0.0.1:9477", "unix:/path", or "" (off).
    #[serde(default)]
    pub metrics_listen: String,
    /// Name under which this host reports to Redis (default: hostname).
    #[serde(default)]
    pub host_name: Option<String>,
    #[serde(default = "default_qsd")]
    pub qemu_storage_daemon: PathBuf,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub redis: Option<RedisConfig>,
    #[serde(default, rename = "image")]
    pub images: Vec<ImageConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Largest list text accepted (file or Redis), bytes.
    #[serde(default = "d_max_list_bytes")]
    pub max_list_bytes: u64,
    /// Most blocks one image's list may have.
    #[serde(default = "d_max_blocks")]
    pub max_blocks_per_image: u64,
    /// Most preloaded bytes over all images (a list that would exceed it is refused).
    #[serde(default = "d_max_total_bytes")]
    pub max_total_bytes: u64,
    /// Most connected clients over all sockets.
    #[serde(default = "d_max_clients")]
    pub max_clients: usize,
    /// Seconds a client has to acknowledge a new generation before it is
    /// disconnected and the old generation's blocks are freed.
    #[serde(default = "d_switch_timeout")]
    pub client_switch_timeout_secs: u64,
    /// Largest image (virtual size) served.
    #[serde(default = "d_max_image")]
    pub max_image_virtual_size: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_list_bytes: d_max_list_bytes(),
            max_blocks_per_image: d_max_blocks(),
            max_total_bytes: d_max_total_bytes(),
            max_clients: d_max_clients(),
            client_switch_timeout_secs: d_switch_timeout(),
            max_image_virtual_size: d_max_image(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// redis://host:port/db or unix:///path
    pub url: String,
    /// Key prefix shared with `pageshare list publish` (default "pageshare").
    #[serde(default = "d_prefix")]
    pub prefix: String,
    /// Seconds between polls for new lists (pub/sub is the fast path).
    #[serde(default = "d_poll")]
    pub poll_interval_secs: u64,
    /// Seconds between stats pushes to the host hash.
    #[serde(default = "d_stats")]
    pub stats_interval_secs: u64,
    /// Longest wait between reconnection attempts.
    #[serde(default = "d_backoff")]
    pub max_backoff_secs: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageConfig {
    /// Short name: socket file name, metrics label.
    pub name: String,
    /// The base image file (qcow2 or raw).
    pub path: PathBuf,
    /// "qcow2", "raw" or "auto" (by magic).
    #[serde(default = "d_format")]
    pub format: String,
    /// Read the list from this file (watched with inotify).
    #[serde(default)]
    pub list_file: Option<PathBuf>,
    /// Read the list from Redis: "auto" (key from the image identity) or a key.
    #[serde(default)]
    pub list_redis: Option<String>,
    /// Socket path; default <socket_dir>/<name>.sock.
    #[serde(default)]
    pub socket: Option<PathBuf>,
}

fn default_socket_dir() -> PathBuf {
    "/run/pageshare".into()
}
fn default_socket_mode() -> String {
    "0660".into()
}
fn default_cache_dir() -> PathBuf {
    "/var/cache/pageshare-server".into()
}
fn default_qsd() -> PathBuf {
    "/usr/bin/qemu-storage-daemon".into()
}
fn d_max_list_bytes() -> u64 {
    256 << 20
}
fn d_max_blocks() -> u64 {
    4 << 20
}
fn d_max_total_bytes() -> u64 {
    16 << 30
}
fn d_max_clients() -> usize {
    1024
}
fn d_switch_timeout() -> u64 {
    30
}
fn d_max_image() -> u64 {
    16 << 40
}
fn d_prefix() -> String {
    "pageshare".into()
}
fn d_poll() -> u64 {
    30
}
fn d_stats() -> u64 {
    10
}
fn d_backoff() -> u64 {
    30
}
fn d_format() -> String {
    "auto".into()
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut c: Config = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        c.validate().map_err(|e| format!("{}: {e}", path.display()))?;
        if c.control_socket.is_none() {
            c.control_socket = Some(c.socket_dir.join("control.sock"));
        }
        for img in &mut c.images {
            if img.socket.is_none() {
                img.socket = Some(c.socket_dir.join(format!("{}.sock", img.name)));
            }
        }
        Ok(c)
    }

    fn validate(&self) -> Result<(), String> {
        self.socket_mode_bits()?;
        let mut names = std::collections::HashSet::new();
        for img in &self.images {
            let ok = !img.name.is_empty()
                && img.name.len() <= 64
                && img.name.bytes().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
                && !img.name.starts_with('.')
                && img.name != "control";
            if !ok {
                return Err(format!(
                    "image name {:?}: use 1-64 characters of A-Z a-z 0-9 . _ - (not 'control', no leading '.')",
                    img.name
                ));
            }
            if !names.insert(img.name.clone()) {
                return Err(format!("image name {:?} appears twice", img.name));
            }
            match (&img.list_file, &img.list_redis) {
                (Some(_), None) | (None, Some(_)) => {}
                _ => {
                    return Err(format!(
                        "image {:?}: give exactly one of list_file and list_redis",
                        img.name
                    ))
                }
            }
            if img.list_redis.is_some() && self.redis.is_none() {
                return Err(format!("image {:?} uses list_redis but there is no [redis] section", img.name));
            }
            if !["auto", "qcow2", "raw"].contains(&img.format.as_str()) {
                return Err(format!("image {:?}: format must be auto, qcow2 or raw", img.name));
            }
        }
        if self.limits.max_clients == 0 {
            return Err("limits.max_clients must be at least 1".into());
        }
        Ok(())
    }

    pub fn socket_mode_bits(&self) -> Result<u32, String> {
        u32::from_str_radix(self.socket_mode.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o777)
            .ok_or_else(|| format!("socket_mode {:?} is not an octal mode like \"0660\"", self.socket_mode))
    }

    pub fn host(&self) -> String {
        self.host_name.clone().unwrap_or_else(crate::sys::hostname)
    }
}
