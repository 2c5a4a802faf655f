//! Reads a base image's virtual disk through QEMU's own block layer:
//! qemu-storage-daemon opens the image (qcow2 including compressed clusters,
//! or raw) read-only and exports it over NBD on a private Unix socket; we
//! read it with an NBD client.  No qcow2 parsing of our own.

use nbd::client::{handshake, NbdClient};
use std::fmt;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The image cannot be read through qemu-storage-daemon.
#[derive(Debug)]
pub enum ReadError {
    Magic {
        path: PathBuf,
        source: io::Error,
    },
    PrivateDir {
        base: PathBuf,
        source: io::Error,
    },
    Log {
        path: PathBuf,
        source: io::Error,
    },
    Spawn {
        qsd: PathBuf,
        source: io::Error,
    },
    /// qemu-storage-daemon exited: what it logged, and how it ended.
    Exited {
        path: PathBuf,
        format: String,
        log: String,
        status: ExitStatus,
    },
    StartTimeout,
    Handshake(io::Error),
    PastEnd {
        len: usize,
        offset: u64,
        size: u64,
    },
    Seek {
        offset: u64,
        source: io::Error,
    },
    Read {
        len: usize,
        offset: u64,
        source: io::Error,
    },
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Magic { path, source } => {
                write!(f, "cannot read image {}: {source}", path.display())
            }
            ReadError::PrivateDir { base, source } => {
                write!(f, "mkdtemp in {}: {source}", base.display())
            }
            ReadError::Log { path, source } => write!(f, "{}: {source}", path.display()),
            ReadError::Spawn { qsd, source } => {
                write!(f, "cannot start {}: {source}", qsd.display())
            }
            ReadError::Exited { path, format, log, status } => {
                write!(
                    f,
                    "qemu-storage-daemon could not open {} ({format}): {log} ({status})",
                    path.display()
                )
            }
            ReadError::StartTimeout => {
                write!(f, "qemu-storage-daemon did not start its NBD export within 30 s")
            }
            ReadError::Handshake(e) => write!(f, "NBD handshake: {e}"),
            ReadError::PastEnd { len, offset, size } => {
                write!(f, "read of {len} bytes at {offset} is past the image end ({size})")
            }
            ReadError::Seek { offset, source } => {
                write!(f, "NBD seek to offset {offset}: {source}")
            }
            ReadError::Read { len, offset, source } => {
                write!(f, "NBD read of {len} bytes at offset {offset}: {source}")
            }
        }
    }
}

impl std::error::Error for ReadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReadError::Magic { source, .. }
            | ReadError::PrivateDir { source, .. }
            | ReadError::Log { source, .. }
            | ReadError::Spawn { source, .. }
            | ReadError::Seek { source, .. }
            | ReadError::Read { source, .. }
            | ReadError::Handshake(source) => Some(source),
            ReadError::Exited { .. } | ReadError::StartTimeout | ReadError::PastEnd { .. } => None,
        }
    }
}

pub struct BlockReader {
    child: Child,
    dir: PathBuf,
    client: NbdClient<UnixStream>,
    pub size: u64,
}

/// The format the image is read with: `configured`, or for "auto" what its
/// first bytes say (the qcow2 magic, else raw), read from the open image.
pub fn detect_format(file: &File, path: &Path, configured: &str) -> Result<String, ReadError> {
    if configured != "auto" {
        return Ok(configured.to_string());
    }
    let mut magic = [0u8; 4];
    let n = file
        .read_at(&mut magic, 0)
        .map_err(|source| ReadError::Magic { path: path.into(), source })?;
    Ok(if n == 4 && &magic == b"QFI\xfb" { "qcow2" } else { "raw" }.to_string())
}

impl BlockReader {
    /// Start qemu-storage-daemon on the open image `file` (named `path` in
    /// messages) and connect to its NBD export.  The daemon opens
    /// /proc/self/fd/N of a descriptor it inherits, so it reads exactly the
    /// file the caller opened and stamped, whatever the path names now.
    pub fn open(
        qsd: &Path,
        file: &File,
        path: &Path,
        format: &str,
    ) -> Result<BlockReader, ReadError> {
        let fd = file.as_raw_fd();
        let dir = make_private_dir()?;
        let sock = dir.join("nbd.sock");
        let log = dir.join("qsd.log");
        let file_node = serde_json::json!({
            "driver": "file", "node-name": "f0", "filename": format!("/proc/self/fd/{fd}"),
            "read-only": true, "aio": "threads",
        });
        let fmt_node = serde_json::json!({
            "driver": format, "node-name": "img0", "file": "f0", "read-only": true,
        });
        let server = serde_json::json!({"addr": {"type": "unix", "path": sock.to_string_lossy()}});
        let export = serde_json::json!({
            "type": "nbd", "id": "exp0", "node-name": "img0", "name": "img", "writable": false,
        });
        let log_error = |source| ReadError::Log { path: log.clone(), source };
        let logf = std::fs::File::create(&log).map_err(log_error)?;
        let mut cmd = Command::new(qsd);
        cmd.arg("--blockdev")
            .arg(file_node.to_string())
            .arg("--blockdev")
            .arg(fmt_node.to_string())
            .arg("--nbd-server")
            .arg(server.to_string())
            .arg("--export")
            .arg(export.to_string())
            .stdin(Stdio::null())
            .stdout(logf.try_clone().map_err(log_error)?)
            .stderr(logf);
        // SAFETY: prctl and fcntl are async-signal-safe; the child dies
        // with us and keeps the image descriptor across exec.
        unsafe {
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(ReadError::Spawn { qsd: qsd.into(), source: e });
            }
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let stream = loop {
            if let Ok(Some(status)) = child.try_wait() {
                let msg = std::fs::read_to_string(&log).unwrap_or_default();
                let _ = std::fs::remove_dir_all(&dir);
                return Err(ReadError::Exited {
                    path: path.into(),
                    format: format.into(),
                    log: msg.trim().into(),
                    status,
                });
            }
            if let Ok(s) = UnixStream::connect(&sock) {
                break s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_dir_all(&dir);
                return Err(ReadError::StartTimeout);
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
        match handshake(&stream, b"img") {
            Ok(export) => {
                let client = NbdClient::new(stream, &export);
                Ok(BlockReader { child, dir, client, size: export.size })
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_dir_all(&dir);
                Err(ReadError::Handshake(e))
            }
        }
    }

    /// Fill `buf` with the virtual disk bytes at `offset`.
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        let len = buf.len();
        if offset.checked_add(len as u64).is_none_or(|end| end > self.size) {
            return Err(ReadError::PastEnd { len, offset, size: self.size });
        }
        self.client
            .seek(SeekFrom::Start(offset))
            .map_err(|source| ReadError::Seek { offset, source })?;
        self.client.read_exact(buf).map_err(|source| ReadError::Read { len, offset, source })
    }
}

impl Drop for BlockReader {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() > deadline => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn make_private_dir() -> Result<PathBuf, ReadError> {
    let base =
        std::env::var_os("RUNTIME_DIRECTORY").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let template = base.join("pageshare-qsd-XXXXXX");
    let mut bytes = template.to_string_lossy().into_owned().into_bytes();
    bytes.push(0);
    // SAFETY: bytes is a writable NUL-terminated template.
    let p = unsafe { libc::mkdtemp(bytes.as_mut_ptr().cast()) };
    if p.is_null() {
        return Err(ReadError::PrivateDir { base, source: io::Error::last_os_error() });
    }
    bytes.pop();
    Ok(PathBuf::from(String::from_utf8_lossy(&bytes).into_owned()))
}
