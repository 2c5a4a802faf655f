//! Publishing a listening Unix socket (the control socket and one per image).

use std::fmt;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// Why a socket could not be published.
#[derive(Debug)]
pub enum SocketError {
    CreateDir { dir: PathBuf, source: io::Error },
    InUse(PathBuf),
    NotASocket(PathBuf),
    Listen { path: PathBuf, source: io::Error },
    Chmod { path: PathBuf, source: io::Error },
    Publish { path: PathBuf, source: io::Error },
    NonBlocking { path: PathBuf, source: io::Error },
}

impl fmt::Display for SocketError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SocketError::CreateDir { dir, source } => write!(f, "{}: {source}", dir.display()),
            SocketError::InUse(p) => write!(
                f,
                "{}: another server is listening there; stop it, or give this one another socket_dir or socket",
                p.display()
            ),
            SocketError::NotASocket(p) => {
                write!(f, "{}: exists and is not a socket; move it away or choose another socket path", p.display())
            }
            SocketError::Listen { path, source } => write!(f, "cannot listen on {}: {source}", path.display()),
            SocketError::Chmod { path, source } => write!(f, "chmod {}: {source}", path.display()),
            SocketError::Publish { path, source } => write!(f, "cannot publish {}: {source}", path.display()),
            SocketError::NonBlocking { path, source } => write!(f, "{}: non-blocking mode: {source}", path.display()),
        }
    }
}

impl std::error::Error for SocketError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SocketError::InUse(_) | SocketError::NotASocket(_) => None,
            SocketError::CreateDir { source, .. }
            | SocketError::Listen { source, .. }
            | SocketError::Chmod { source, .. }
            | SocketError::Publish { source, .. }
            | SocketError::NonBlocking { source, .. } => Some(source),
        }
    }
}

/// Listen on `path` with permissions `mode`, replacing a stale socket left
/// by an earlier run.
pub(super) fn bind_socket(path: &Path, mode: u32) -> Result<UnixListener, SocketError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|source| SocketError::CreateDir { dir: dir.into(), source })?;
    }
    // Replace a stale socket from an earlier run, but never another kind of file.
    if let Ok(md) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if md.file_type().is_socket() {
            if UnixStream::connect(path).is_ok() {
                return Err(SocketError::InUse(path.into()));
            }
            let _ = std::fs::remove_file(path);
        } else {
            return Err(SocketError::NotASocket(path.into()));
        }
    }
    // Bind and chmod under a temporary name and rename it into place: a
    // socket file that exists under its real name is already listening with
    // its final mode, so a client never sees ECONNREFUSED from the window
    // between bind() and listen(), nor a socket with the umask's mode.
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp_name);
    let _ = std::fs::remove_file(&tmp);
    let l = UnixListener::bind(&tmp)
        .map_err(|source| SocketError::Listen { path: path.into(), source })?;
    let published = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .map_err(|source| SocketError::Chmod { path: path.into(), source })
        .and_then(|_| {
            std::fs::rename(&tmp, path)
                .map_err(|source| SocketError::Publish { path: path.into(), source })
        });
    if let Err(e) = published {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    l.set_nonblocking(true)
        .map_err(|source| SocketError::NonBlocking { path: path.into(), source })?;
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::bind_socket;
    use crate::test_dir::TestDir;
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    use std::os::unix::net::UnixStream;

    #[test]
    fn bind_socket_publishes_a_listening_socket_with_its_mode() {
        let tmp = TestDir::new("bind");
        let dir = tmp.join("run"); // made by bind_socket
        let path = dir.join("img.sock");
        let l = bind_socket(&path, 0o660).unwrap();
        let md = std::fs::symlink_metadata(&path).unwrap();
        assert!(md.file_type().is_socket());
        assert_eq!(md.permissions().mode() & 0o777, 0o660);
        let names: Vec<_> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from("img.sock")],
            "no temporary name left behind"
        );
        UnixStream::connect(&path).expect("the published name accepts connections");
        // A second server on the same path is refused while the first listens.
        let e = bind_socket(&path, 0o660).unwrap_err();
        assert!(matches!(e, super::SocketError::InUse(_)));
        assert!(e.to_string().contains("another server is listening there"), "{e}");
        drop(l);
        // The first one gone, its stale socket file is replaced.
        let _l2 = bind_socket(&path, 0o600).unwrap();
        UnixStream::connect(&path).unwrap();
    }

    #[test]
    fn bind_socket_never_replaces_another_kind_of_file() {
        let dir = TestDir::new("bind-file");
        let path = dir.join("img.sock");
        std::fs::write(&path, b"data").unwrap();
        let e = bind_socket(&path, 0o660).unwrap_err();
        assert!(
            e.to_string().ends_with(
                "img.sock: exists and is not a socket; move it away or choose another socket path"
            ),
            "{e}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), b"data");
    }
}
