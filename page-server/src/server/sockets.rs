//! Publishing a listening Unix socket (the control socket and one per image).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

/// Listen on `path` with permissions `mode`, replacing a stale socket left
/// by an earlier run.
pub(super) fn bind_socket(path: &Path, mode: u32) -> Result<UnixListener, String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    // Replace a stale socket from an earlier run, but never another kind of file.
    if let Ok(md) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if md.file_type().is_socket() {
            if UnixStream::connect(path).is_ok() {
                return Err(format!("{}: another server is listening there", path.display()));
            }
            let _ = std::fs::remove_file(path);
        } else {
            return Err(format!("{}: exists and is not a socket", path.display()));
        }
    }
    // Bind and chmod under a temporary name and rename it into place: a
    // socket file that exists under its real name is already listening with
    // its final mode, so a client never sees ECONNREFUSED from the window
    // between bind() and listen(), nor a socket with the umask's mode.
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp_name);
    let _ = std::fs::remove_file(&tmp);
    let l = UnixListener::bind(&tmp).map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    let published = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("chmod {}: {e}", path.display()))
        .and_then(|_| std::fs::rename(&tmp, path).map_err(|e| format!("cannot publish {}: {e}", path.display())));
    if let Err(e) = published {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    l.set_nonblocking(true).map_err(|e| e.to_string())?;
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::bind_socket;
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    use std::os::unix::net::UnixStream;

    #[test]
    fn bind_socket_publishes_a_listening_socket_with_its_mode() {
        let dir = std::env::temp_dir().join(format!("ps-bind-{}", std::process::id()));
        let path = dir.join("img.sock");
        let l = bind_socket(&path, 0o660).unwrap();
        let md = std::fs::symlink_metadata(&path).unwrap();
        assert!(md.file_type().is_socket());
        assert_eq!(md.permissions().mode() & 0o777, 0o660);
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("img.sock")], "no temporary name left behind");
        UnixStream::connect(&path).expect("the published name accepts connections");
        // A second server on the same path is refused while the first listens.
        assert!(bind_socket(&path, 0o660).unwrap_err().contains("another server"));
        drop(l);
        // The first one gone, its stale socket file is replaced.
        let _l2 = bind_socket(&path, 0o600).unwrap();
        UnixStream::connect(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
