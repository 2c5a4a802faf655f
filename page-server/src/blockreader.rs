//! Reads a base image's virtual disk through QEMU's own block layer:
//! qemu-storage-daemon opens the image (qcow2 including compressed clusters,
//! or raw) read-only and exports it over NBD on a private Unix socket; we
//! read it with an NBD client.  No qcow2 parsing of our own.

use nbd::client::{handshake, NbdClient};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct BlockReader {
    child: Child,
    dir: PathBuf,
    client: NbdClient<UnixStream>,
    pub size: u64,
}

/// The format the image is read with: `configured`, or for "auto" what its
/// first bytes say (the qcow2 magic, else raw), read from the open image.
pub fn detect_format(file: &File, path: &Path, configured: &str) -> Result<String, String> {
    if configured != "auto" {
        return Ok(configured.to_string());
    }
    let mut magic = [0u8; 4];
    let n = file.read_at(&mut magic, 0).map_err(|e| format!("cannot read image {}: {e}", path.display()))?;
    Ok(if n == 4 && &magic == b"QFI\xfb" { "qcow2" } else { "raw" }.to_string())
}

impl BlockReader {
    /// Start qemu-storage-daemon on the open image `file` (named `path` in
    /// messages) and connect to its NBD export.  The daemon opens
    /// /proc/self/fd/N of a descriptor it inherits, so it reads exactly the
    /// file the caller opened and stamped, whatever the path names now.
    pub fn open(qsd: &Path, file: &File, path: &Path, format: &str) -> Result<BlockReader, String> {
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
        let logf = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
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
            .stdout(logf.try_clone().map_err(|e| e.to_string())?)
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
                return Err(format!("cannot start {}: {e}", qsd.display()));
            }
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let stream = loop {
            if let Ok(Some(status)) = child.try_wait() {
                let msg = std::fs::read_to_string(&log).unwrap_or_default();
                let _ = std::fs::remove_dir_all(&dir);
                return Err(format!(
                    "qemu-storage-daemon could not open {} ({format}): {} ({status})",
                    path.display(),
                    msg.trim()
                ));
            }
            if let Ok(s) = UnixStream::connect(&sock) {
                break s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_dir_all(&dir);
                return Err("qemu-storage-daemon did not start its NBD export within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
        let result = (|| {
            let export = handshake(&stream, b"img").map_err(|e| format!("NBD handshake: {e}"))?;
            let client = NbdClient::new(stream, &export);
            Ok::<_, String>((client, export.size))
        })();
        match result {
            Ok((client, size)) => Ok(BlockReader { child, dir, client, size }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    /// Fill `buf` with the virtual disk bytes at `offset`.
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), String> {
        if offset.checked_add(buf.len() as u64).is_none_or(|end| end > self.size) {
            return Err(format!("read of {} bytes at {offset} is past the image end ({})", buf.len(), self.size));
        }
        self.client.seek(SeekFrom::Start(offset)).map_err(|e| e.to_string())?;
        self.client
            .read_exact(buf)
            .map_err(|e| format!("NBD read of {} bytes at offset {offset}: {e}", buf.len()))
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

fn make_private_dir() -> Result<PathBuf, String> {
    let base = std::env::var_os("RUNTIME_DIRECTORY")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let template = base.join("pageshare-qsd-XXXXXX");
    let mut bytes = template.to_string_lossy().into_owned().into_bytes();
    bytes.push(0);
    // SAFETY: bytes is a writable NUL-terminated template.
    let p = unsafe { libc::mkdtemp(bytes.as_mut_ptr().cast()) };
    if p.is_null() {
        return Err(format!("mkdtemp in {}: {}", base.display(), std::io::Error::last_os_error()));
    }
    bytes.pop();
    Ok(PathBuf::from(String::from_utf8_lossy(&bytes).into_owned()))
}
