//! The daemon's configuration file (TOML).  See page-server/README.md and
//! page-server/pageshare-server.example.toml.

use serde::Deserialize;
use std::ffi::OsStr;
use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Where the pageshare-qemu package installs the patched QEMU's binaries.
pub const PAGESHARE_QEMU_BIN: &str = "/usr/lib/pageshare-qemu/bin";

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
    /// The qemu-storage-daemon that reads images; default: the first on
    /// PATH, else pageshare-qemu's (`Config::qemu_storage_daemon`).
    #[serde(default)]
    pub qemu_storage_daemon: Option<PathBuf>,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub redis: Option<RedisConfig>,
    /// What guests read, summed per image and published to Redis.
    #[serde(default)]
    pub feedback: FeedbackConfig,
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

/// `[feedback]`: the clients' READS and LISTED_READ, summed per image and
/// published to `<prefix>:feedback:<image key>:<host>` (src/feedback/).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeedbackConfig {
    /// Default: on when a [redis] section is configured.
    #[serde(default)]
    pub enabled: Option<bool>,
    /// Seconds between publishes (a restart loses at most this much).
    #[serde(default = "d_fb_interval")]
    pub interval_secs: u64,
    /// Most blocks counted per image; the smallest are evicted beyond.
    #[serde(default = "d_fb_max_blocks")]
    pub max_blocks: usize,
    /// Seconds an accumulation lasts before it starts over (0: never).
    #[serde(default = "d_fb_window")]
    pub window_secs: u64,
}

impl Default for FeedbackConfig {
    fn default() -> Self {
        FeedbackConfig {
            enabled: None,
            interval_secs: d_fb_interval(),
            max_blocks: d_fb_max_blocks(),
            window_secs: d_fb_window(),
        }
    }
}

/// Largest `feedback.max_blocks` accepted (about 1.6 GiB of tally per image).
pub const MAX_FEEDBACK_BLOCKS: usize = 1 << 25;

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
fn d_fb_interval() -> u64 {
    60
}
fn d_fb_max_blocks() -> usize {
    1 << 20
}
fn d_fb_window() -> u64 {
    7 * 86400
}
fn d_format() -> String {
    "auto".into()
}

/// A configuration file that cannot be used.  Each message names the file,
/// says what is wrong and what to do.
#[derive(Debug)]
pub enum ConfigError {
    /// The file cannot be read.
    Read { path: PathBuf, source: std::io::Error },
    /// Not TOML, an unknown key, a missing one or a value of the wrong type
    /// (the TOML parser's message says which, and where).
    Parse { path: PathBuf, source: toml::de::Error },
    /// Parsed, but a value cannot be used.
    Invalid { path: PathBuf, problem: Problem },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Read { path, source } => write!(f, "{}: {source}", path.display()),
            ConfigError::Parse { path, source } => write!(f, "{}: {source}", path.display()),
            ConfigError::Invalid { path, problem } => write!(f, "{}: {problem}", path.display()),
        }
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConfigError::Read { source, .. } => Some(source),
            ConfigError::Parse { source, .. } => Some(source),
            ConfigError::Invalid { problem, .. } => Some(problem),
        }
    }
}

/// A value in a parsed configuration that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    SocketMode(String),
    ImageName(String),
    DuplicateImageName(String),
    /// Neither or both of list_file and list_redis.
    ListSource {
        image: String,
    },
    /// list_redis without a [redis] section.
    NoRedis {
        image: String,
    },
    Format {
        image: String,
        format: String,
    },
    NoClients,
    /// feedback.enabled = true without a [redis] section.
    FeedbackNoRedis,
    FeedbackInterval,
    FeedbackMaxBlocks(usize),
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::SocketMode(m) => write!(f, "socket_mode {m:?} is not an octal mode like \"0660\""),
            Problem::ImageName(n) => {
                write!(f, "image name {n:?}: use 1-64 characters of A-Z a-z 0-9 . _ - (not 'control', no leading '.')")
            }
            Problem::DuplicateImageName(n) => {
                write!(f, "image name {n:?} appears twice: give each [[image]] its own name (it names the image's socket)")
            }
            Problem::ListSource { image } => write!(f, "image {image:?}: give exactly one of list_file and list_redis"),
            Problem::NoRedis { image } => write!(
                f,
                "image {image:?} uses list_redis but there is no [redis] section: add one with the server's url, or use list_file"
            ),
            Problem::Format { image, format } => {
                write!(f, "image {image:?}: format must be auto, qcow2 or raw, not {format:?}")
            }
            Problem::NoClients => write!(f, "limits.max_clients must be at least 1"),
            Problem::FeedbackNoRedis => write!(
                f,
                "feedback.enabled = true needs a [redis] section (feedback is published to Redis): add one, or set enabled = false"
            ),
            Problem::FeedbackInterval => write!(f, "feedback.interval_secs must be at least 1"),
            Problem::FeedbackMaxBlocks(n) => {
                write!(f, "feedback.max_blocks is {n}: use 1 to {MAX_FEEDBACK_BLOCKS}")
            }
        }
    }
}

impl std::error::Error for Problem {}

/// No qemu-storage-daemon was configured and none was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoQemuStorageDaemon {
    /// The PATH that was searched.
    pub path_var: String,
}

impl fmt::Display for NoQemuStorageDaemon {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no qemu-storage-daemon on PATH ({}) or in {PAGESHARE_QEMU_BIN}: install qemu-utils \
             (Debian 13), qemu-system-common (Debian 12) or pageshare-qemu, or set \
             qemu_storage_daemon in the configuration",
            self.path_var
        )
    }
}

impl std::error::Error for NoQemuStorageDaemon {}

/// A regular file with an execute bit.
fn executable(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The first executable `qemu-storage-daemon` in the directories of
/// `path_var` (a PATH value), else in `fallback_dirs`.  Debian's (in
/// qemu-utils on Debian 13, qemu-system-common on Debian 12; any version
/// from 7.2 reads what the server needs) comes first: the patched QEMU of
/// the pageshare-qemu package is used when it is the only one.
pub fn find_qemu_storage_daemon(
    path_var: Option<&OsStr>,
    fallback_dirs: &[&Path],
) -> Option<PathBuf> {
    let on_path =
        path_var.map(|v| std::env::split_paths(v).collect::<Vec<_>>()).unwrap_or_default();
    on_path
        .iter()
        .filter(|d| d.is_absolute())
        .map(PathBuf::as_path)
        .chain(fallback_dirs.iter().copied())
        .map(|d| d.join("qemu-storage-daemon"))
        .find(|p| executable(p))
}

impl Config {
    /// The qemu-storage-daemon to read images with: the configured one
    /// (used as given, even if it does not exist, so that the error names
    /// it), else the first on PATH, else pageshare-qemu's.
    pub fn qemu_storage_daemon(&self) -> Result<PathBuf, NoQemuStorageDaemon> {
        if let Some(p) = &self.qemu_storage_daemon {
            return Ok(p.clone());
        }
        let path_var = std::env::var_os("PATH");
        find_qemu_storage_daemon(path_var.as_deref(), &[Path::new(PAGESHARE_QEMU_BIN)]).ok_or_else(
            || NoQemuStorageDaemon {
                path_var: path_var.unwrap_or_default().to_string_lossy().into_owned(),
            },
        )
    }

    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.into(), source })?;
        Config::parse(path, &text)
    }

    /// The configuration `text` of file `path`, validated, with the default
    /// socket paths filled in.
    fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let mut c: Config = toml::from_str(text)
            .map_err(|source| ConfigError::Parse { path: path.into(), source })?;
        c.validate().map_err(|problem| ConfigError::Invalid { path: path.into(), problem })?;
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

    fn validate(&self) -> Result<(), Problem> {
        self.socket_mode_bits()?;
        let mut names = std::collections::HashSet::new();
        for img in &self.images {
            let ok = !img.name.is_empty()
                && img.name.len() <= 64
                && img.name.bytes().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
                && !img.name.starts_with('.')
                && img.name != "control";
            if !ok {
                return Err(Problem::ImageName(img.name.clone()));
            }
            if !names.insert(img.name.clone()) {
                return Err(Problem::DuplicateImageName(img.name.clone()));
            }
            if img.list_file.is_some() == img.list_redis.is_some() {
                return Err(Problem::ListSource { image: img.name.clone() });
            }
            if img.list_redis.is_some() && self.redis.is_none() {
                return Err(Problem::NoRedis { image: img.name.clone() });
            }
            if !["auto", "qcow2", "raw"].contains(&img.format.as_str()) {
                return Err(Problem::Format {
                    image: img.name.clone(),
                    format: img.format.clone(),
                });
            }
        }
        if self.limits.max_clients == 0 {
            return Err(Problem::NoClients);
        }
        let fb = &self.feedback;
        if fb.enabled == Some(true) && self.redis.is_none() {
            return Err(Problem::FeedbackNoRedis);
        }
        if fb.interval_secs == 0 {
            return Err(Problem::FeedbackInterval);
        }
        if fb.max_blocks == 0 || fb.max_blocks > MAX_FEEDBACK_BLOCKS {
            return Err(Problem::FeedbackMaxBlocks(fb.max_blocks));
        }
        Ok(())
    }

    pub fn socket_mode_bits(&self) -> Result<u32, Problem> {
        u32::from_str_radix(self.socket_mode.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o777)
            .ok_or_else(|| Problem::SocketMode(self.socket_mode.clone()))
    }

    /// Whether READS and LISTED_READ are counted and published: by default
    /// wherever Redis is configured.
    pub fn feedback_enabled(&self) -> bool {
        self.redis.is_some() && self.feedback.enabled.unwrap_or(true)
    }

    pub fn host(&self) -> String {
        self.host_name.clone().unwrap_or_else(crate::sys::hostname)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_dir::TestDir;

    const IMAGE: &str =
        "[[image]]\nname = \"deb\"\npath = \"/img/deb.qcow2\"\nlist_file = \"/lists/deb.pcsl\"\n";

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("/etc/ps.toml"), text)
    }

    /// The message for `text`, which must be refused.
    fn refused(text: &str) -> String {
        let e = parse(text).expect_err("refused");
        let msg = e.to_string();
        assert!(msg.starts_with("/etc/ps.toml: "), "names the file: {msg}");
        msg
    }

    /// A scratch directory with fake binaries: `(name, mode)`.
    fn bin_dir(name: &str, files: &[(&str, u32)]) -> TestDir {
        let d = TestDir::new(&format!("config-{name}"));
        for (f, mode) in files {
            let p = d.join(f);
            std::fs::write(&p, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(*mode)).unwrap();
        }
        d
    }

    #[test]
    fn qemu_storage_daemon_from_path_then_pageshare_qemu() {
        const QSD: &str = "qemu-storage-daemon";
        let debian = bin_dir("debian", &[(QSD, 0o755)]);
        let ours = bin_dir("ours", &[(QSD, 0o755)]);
        let other = bin_dir("other", &[("qemu-img", 0o755)]);
        let not_exec = bin_dir("not-exec", &[(QSD, 0o644)]);
        let find = |path: Option<&std::ffi::OsString>| {
            find_qemu_storage_daemon(path.map(|p| p.as_os_str()), &[&*ours])
        };
        let path = |dirs: &[&Path]| Some(std::env::join_paths(dirs).unwrap());
        // Debian's on PATH is used even when pageshare-qemu is installed.
        assert_eq!(find(path(&[&other, &debian]).as_ref()), Some(debian.join(QSD)));
        // Not on PATH (or PATH unset): pageshare-qemu's.
        assert_eq!(find(path(&[&other]).as_ref()), Some(ours.join(QSD)));
        assert_eq!(find(None), Some(ours.join(QSD)));
        // A file without an execute bit, a directory, a relative PATH entry: skipped.
        std::fs::create_dir_all(other.join("sub").join(QSD)).unwrap();
        assert_eq!(
            find(path(&[&not_exec, &other.join("sub"), Path::new("rel")]).as_ref()),
            Some(ours.join(QSD))
        );
        // Neither: None, and the message says what to install.
        assert_eq!(find_qemu_storage_daemon(path(&[&other]).as_deref(), &[&*not_exec]), None);
        let msg = NoQemuStorageDaemon { path_var: "/usr/bin:/bin".into() }.to_string();
        assert!(
            msg.contains("(/usr/bin:/bin)")
                && msg.contains(PAGESHARE_QEMU_BIN)
                && msg.contains("pageshare-qemu"),
            "{msg}"
        );
    }

    #[test]
    fn a_configured_qemu_storage_daemon_is_used_as_given() {
        let c = parse(&format!("qemu_storage_daemon = \"/opt/q/qsd\"\n{IMAGE}")).unwrap();
        assert_eq!(c.qemu_storage_daemon(), Ok(PathBuf::from("/opt/q/qsd")));
        // Unset: looked up (PATH here is the test's; the result must be executable).
        let c = parse(IMAGE).unwrap();
        assert!(c.qemu_storage_daemon.is_none());
        if let Ok(p) = c.qemu_storage_daemon() {
            assert!(p.ends_with("qemu-storage-daemon") && executable(&p), "{}", p.display());
        }
    }

    #[test]
    fn defaults_and_derived_socket_paths() {
        let c = parse(&format!("socket_dir = \"/run/x\"\n{IMAGE}")).unwrap();
        assert_eq!(c.control_socket, Some(PathBuf::from("/run/x/control.sock")));
        assert_eq!(c.images[0].socket, Some(PathBuf::from("/run/x/deb.sock")));
        assert_eq!(c.images[0].format, "auto");
        assert_eq!(c.socket_mode_bits(), Ok(0o660));
        assert_eq!(c.cache_dir, PathBuf::from("/var/cache/pageshare-server"));
        assert_eq!(c.limits.max_clients, 1024);
        assert!(c.redis.is_none() && c.metrics_listen.is_empty());
        // An empty file is a server with no images.
        assert!(parse("").unwrap().images.is_empty());
    }

    #[test]
    fn explicit_sockets_are_kept() {
        let c =
            parse(&format!("control_socket = \"/c.sock\"\n{IMAGE}socket = \"/i.sock\"\n")).unwrap();
        assert_eq!(c.control_socket, Some(PathBuf::from("/c.sock")));
        assert_eq!(c.images[0].socket, Some(PathBuf::from("/i.sock")));
    }

    #[test]
    fn the_example_config_is_valid() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("server.example.toml");
        let c = Config::load(&p).unwrap();
        assert_eq!(c.images.len(), 2);
        assert!(c.redis.is_some());
    }

    #[test]
    fn socket_modes() {
        for (m, bits) in [("0660", 0o660), ("0o600", 0o600), ("777", 0o777), ("0", 0)] {
            let c = parse(&format!("socket_mode = \"{m}\"")).unwrap();
            assert_eq!(c.socket_mode_bits(), Ok(bits), "{m}");
        }
        for m in ["0999", "rw-rw----", "01777", ""] {
            let msg = refused(&format!("socket_mode = \"{m}\""));
            assert!(
                msg.contains(&format!("socket_mode {m:?} is not an octal mode like \"0660\"")),
                "{msg}"
            );
        }
    }

    #[test]
    fn bad_image_names_say_which_characters_to_use() {
        for name in ["", ".hidden", "control", "a/b", "sp ace", &"x".repeat(65)] {
            let msg = refused(&IMAGE.replace("\"deb\"", &format!("{name:?}")));
            assert!(
                msg.contains(&format!(
                    "image name {name:?}: use 1-64 characters of A-Z a-z 0-9 . _ -"
                )),
                "{msg}"
            );
        }
        parse(&IMAGE.replace("\"deb\"", "\"Deb_12.1-x\"")).unwrap();
    }

    #[test]
    fn each_image_needs_its_own_name() {
        let msg = refused(&format!("{IMAGE}{IMAGE}"));
        assert!(
            msg.contains("image name \"deb\" appears twice: give each [[image]] its own name"),
            "{msg}"
        );
    }

    #[test]
    fn exactly_one_list_source() {
        let neither = IMAGE.replace("list_file = \"/lists/deb.pcsl\"\n", "");
        let both = format!("{IMAGE}list_redis = \"auto\"\n[redis]\nurl = \"redis://127.0.0.1/\"\n");
        for text in [neither, both] {
            let msg = refused(&text);
            assert!(
                msg.contains("image \"deb\": give exactly one of list_file and list_redis"),
                "{msg}"
            );
        }
    }

    #[test]
    fn list_redis_needs_a_redis_section() {
        let text = IMAGE.replace("list_file = \"/lists/deb.pcsl\"", "list_redis = \"auto\"");
        let msg = refused(&text);
        assert!(
            msg.contains("image \"deb\" uses list_redis but there is no [redis] section: add one"),
            "{msg}"
        );
        let c = parse(&format!("{text}[redis]\nurl = \"redis://127.0.0.1/\"\n")).unwrap();
        let r = c.redis.unwrap();
        assert_eq!((r.prefix.as_str(), r.poll_interval_secs), ("pageshare", 30));
    }

    #[test]
    fn unknown_formats_are_refused() {
        let msg = refused(&format!("{IMAGE}format = \"vmdk\"\n"));
        assert!(
            msg.contains("image \"deb\": format must be auto, qcow2 or raw, not \"vmdk\""),
            "{msg}"
        );
        for f in ["auto", "qcow2", "raw"] {
            parse(&format!("{IMAGE}format = \"{f}\"\n")).unwrap();
        }
    }

    #[test]
    fn max_clients_must_allow_one() {
        let msg = refused("[limits]\nmax_clients = 0\n");
        assert!(msg.ends_with("limits.max_clients must be at least 1"), "{msg}");
    }

    #[test]
    fn feedback_is_on_with_redis_and_its_limits_are_checked() {
        let redis = "[redis]\nurl = \"redis://127.0.0.1/\"\n";
        let c = parse(&format!("{IMAGE}{redis}")).unwrap();
        assert!(c.feedback_enabled());
        let fb = &c.feedback;
        assert_eq!((fb.interval_secs, fb.max_blocks, fb.window_secs), (60, 1_048_576, 604_800));
        assert!(!parse(IMAGE).unwrap().feedback_enabled());
        let off = parse(&format!("{IMAGE}{redis}[feedback]\nenabled = false\n")).unwrap();
        assert!(!off.feedback_enabled());
        let msg = refused(&format!("{IMAGE}[feedback]\nenabled = true\n"));
        assert!(msg.contains("feedback.enabled = true needs a [redis] section"), "{msg}");
        let msg = refused("[feedback]\ninterval_secs = 0\n");
        assert!(msg.ends_with("feedback.interval_secs must be at least 1"), "{msg}");
        for n in [0, MAX_FEEDBACK_BLOCKS + 1] {
            let msg = refused(&format!("[feedback]\nmax_blocks = {n}\n"));
            assert!(msg.contains(&format!("feedback.max_blocks is {n}: use 1 to")), "{msg}");
        }
        let msg = refused("[feedback]\nintervall_secs = 5\n");
        assert!(msg.contains("unknown field `intervall_secs`"), "{msg}");
    }

    #[test]
    fn toml_mistakes_name_the_key_and_the_line() {
        // A misspelt key: unknown fields are refused, not ignored.
        let msg = refused("sockets_dir = \"/run/x\"\n");
        assert!(msg.contains("unknown field `sockets_dir`") && msg.contains("socket_dir"), "{msg}");
        assert!(msg.contains("line 1"), "{msg}");
        let msg = refused(&format!("{IMAGE}list_fiel = \"/x\"\n"));
        assert!(msg.contains("unknown field `list_fiel`"), "{msg}");
        // A value of the wrong type says what it expected.
        let msg = refused("socket_mode = 660\n");
        assert!(msg.contains("expected a string"), "{msg}");
        // A required key that is missing.
        let msg = refused("[[image]]\nname = \"deb\"\nlist_file = \"/l\"\n");
        assert!(msg.contains("missing field `path`"), "{msg}");
        // Not TOML at all.
        let msg = refused("this is not toml");
        assert!(msg.contains("line 1"), "{msg}");
        assert!(matches!(parse("[limits\n"), Err(ConfigError::Parse { .. })));
    }

    #[test]
    fn an_unreadable_file_is_named() {
        let e = Config::load(Path::new("/nonexistent/ps.toml")).unwrap_err();
        assert!(matches!(e, ConfigError::Read { .. }));
        assert!(e.to_string().starts_with("/nonexistent/ps.toml: No such file"), "{e}");
    }
}
