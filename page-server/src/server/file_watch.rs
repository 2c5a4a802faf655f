//! inotify: the directories of the list files and images (a list written
//! or renamed into place, an image replaced), and each image's own inode (a
//! write through any path, hard links elsewhere included).

use super::Server;
use crate::identity::FileStamp;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// inotify_add_watch(2): the watch descriptor.
fn add_watch(fd: RawFd, path: &Path, mask: u32) -> io::Result<i32> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: valid C string; our inotify fd.
    let wd = unsafe { libc::inotify_add_watch(fd, c.as_ptr(), mask) };
    if wd < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(wd)
    }
}

impl Server {
    pub(super) fn setup_inotify(&mut self) {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        if fd < 0 {
            crate::log::warn(&format!(
                "inotify: {}; list files and images are re-checked only on `reload`",
                std::io::Error::last_os_error()
            ));
            return;
        }
        // SAFETY: fresh descriptor.
        self.inotify = Some(unsafe { OwnedFd::from_raw_fd(fd) });
        let mut dirs: Vec<PathBuf> = Vec::new();
        for img in &self.images {
            for p in [Some(&img.cfg.path), img.cfg.list_file.as_ref()].into_iter().flatten() {
                if let Some(d) = p.parent() {
                    let d = if d.as_os_str().is_empty() { Path::new(".") } else { d };
                    if !dirs.iter().any(|x| x == d) {
                        dirs.push(d.to_path_buf());
                    }
                }
            }
        }
        let mask = libc::IN_CLOSE_WRITE
            | libc::IN_MOVED_TO
            | libc::IN_MOVED_FROM
            | libc::IN_CREATE
            | libc::IN_DELETE
            | libc::IN_ATTRIB
            | libc::IN_MODIFY;
        for d in dirs {
            match add_watch(fd, &d, mask) {
                Ok(wd) => {
                    self.watches.insert(wd, d);
                }
                Err(e) => crate::log::warn(&format!(
                    "inotify watch on {}: {e}; changes there are noticed only on `reload`",
                    d.display()
                )),
            }
        }
    }

    pub(super) fn handle_inotify(&mut self) {
        let Some(fd) = self.inotify.as_ref().map(|f| f.as_raw_fd()) else { return };
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: reading into our buffer.
            let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                break;
            }
            let mut off = 0usize;
            let n = n as usize;
            let hdr = std::mem::size_of::<libc::inotify_event>();
            while off + hdr <= n {
                // SAFETY: the kernel wrote a whole event at off.
                let ev: libc::inotify_event =
                    unsafe { std::ptr::read_unaligned(buf[off..].as_ptr().cast()) };
                let name_bytes = &buf[off + hdr..off + hdr + ev.len as usize];
                let end = name_bytes.iter().position(|&b| b == 0).unwrap_or(name_bytes.len());
                let name: Option<&std::ffi::OsStr> =
                    (end > 0).then(|| std::os::unix::ffi::OsStrExt::from_bytes(&name_bytes[..end]));
                if ev.mask & libc::IN_Q_OVERFLOW != 0 {
                    for img in &mut self.images {
                        img.recheck_image_at = Some(Instant::now() + Duration::from_millis(300));
                    }
                }
                if name.is_none() {
                    self.inode_event(ev.wd, ev.mask);
                }
                if let (Some(dir), Some(name)) = (self.watches.get(&ev.wd).cloned(), name) {
                    let full = dir.join(name);
                    for img in &mut self.images {
                        if img.cfg.list_file.as_ref().is_some_and(|p| *p == full) {
                            img.reload_at = Some(Instant::now() + Duration::from_millis(200));
                        }
                        if img.cfg.path == full {
                            img.recheck_image_at =
                                Some(Instant::now() + Duration::from_millis(300));
                        }
                    }
                }
                off += hdr + ev.len as usize;
            }
        }
    }

    /// An event on an image file's own inode (written through any path,
    /// hard links in other directories included).
    fn inode_event(&mut self, wd: i32, mask: u32) {
        for idx in 0..self.images.len() {
            let Some((w, _, ino)) = self.images[idx].inode_watch else { continue };
            if w != wd {
                continue;
            }
            if mask & libc::IN_IGNORED != 0 {
                // The inode is gone (or the watch was removed): the directory
                // watch and the next load take over.
                self.images[idx].inode_watch = None;
                continue;
            }
            if mask & (libc::IN_MODIFY | libc::IN_ATTRIB | libc::IN_CLOSE_WRITE) != 0 {
                // Withdraw at once, no debounce: the bytes below the
                // published table may be changing right now.
                let img = &self.images[idx];
                let what =
                    format!("image {} {} (inode {ino})", img.cfg.path.display(), change_of(mask));
                if img.current.is_some() {
                    crate::log::warn(&format!(
                        "{what}: table withdrawn until it is verified again"
                    ));
                    self.suspend(
                        idx,
                        &format!("{what}: table withdrawn until it is verified again"),
                    );
                } else if img.image_stamp.is_some() {
                    crate::log::info(&format!("{what}; re-checking it"));
                }
                self.images[idx].image_stamp = None;
            }
            // Modified, renamed or deleted: re-check (and reload) once it is quiet.
            self.images[idx].recheck_image_at = Some(Instant::now() + Duration::from_millis(300));
        }
    }

    /// Watch the inode the image path names, if it is not the one watched
    /// already (called after each load with the stamp it verified).
    pub(super) fn watch_image_inode(&mut self, idx: usize, stamp: &FileStamp) {
        let Some(fd) = self.inotify.as_ref().map(|f| f.as_raw_fd()) else { return };
        if self.images[idx]
            .inode_watch
            .is_some_and(|(_, dev, ino)| dev == stamp.dev && ino == stamp.ino)
        {
            return;
        }
        let path = self.images[idx].cfg.path.clone();
        let old = self.images[idx].inode_watch.take();
        let mask = libc::IN_MODIFY
            | libc::IN_ATTRIB
            | libc::IN_CLOSE_WRITE
            | libc::IN_DELETE_SELF
            | libc::IN_MOVE_SELF;
        let wd = match add_watch(fd, &path, mask) {
            Ok(wd) => wd,
            Err(e) => {
                crate::log::warn(&format!(
                    "inotify watch on image {}: {e}; writes to it through other paths are noticed only by clients and on `reload`",
                    path.display()
                ));
                -1
            }
        };
        if wd >= 0 {
            self.images[idx].inode_watch = Some((wd, stamp.dev, stamp.ino));
            // The watch is on whatever the path names now: if that is no
            // longer the verified file, re-check at once.
            if FileStamp::of_path(&path).ok().map(|s| (s.dev, s.ino))
                != Some((stamp.dev, stamp.ino))
            {
                self.images[idx].recheck_image_at = Some(Instant::now());
            }
        }
        if let Some((owd, _, _)) = old {
            if owd != wd && !self.images.iter().any(|i| i.inode_watch.is_some_and(|w| w.0 == owd)) {
                // SAFETY: removing our own watch (harmless if already gone).
                unsafe { libc::inotify_rm_watch(fd, owd) };
            }
        }
    }

    /// The image file may have changed: unless it still has the stamp the
    /// last load verified, withdraw its table and load it again.
    pub(super) fn recheck_image(&mut self, i: usize) {
        let now_stamp = FileStamp::of_path(&self.images[i].cfg.path).ok();
        let img = &self.images[i];
        if img.image_stamp.is_some() && now_stamp == img.image_stamp {
            return;
        }
        let why = match &now_stamp {
            None => format!("base image {} is gone or unreadable", img.cfg.path.display()),
            Some(_) => format!("base image {} changed on disk", img.cfg.path.display()),
        };
        self.suspend(i, &why);
        self.images[i].image_stamp = None;
        let src = self.reload_source(i);
        self.request_load(i, src, "base image changed");
    }
}

/// What an inotify event on an image's inode says happened to it.  A chown
/// or chmod (libvirt's, at a VM's start) moves the ctime as a write does,
/// so it also ends the proof; but the operator should read which it was.
fn change_of(mask: u32) -> &'static str {
    if mask & libc::IN_MODIFY != 0 {
        "was modified"
    } else if mask & libc::IN_CLOSE_WRITE != 0 {
        "was opened for writing"
    } else {
        "had its owner, mode, times or extended attributes changed"
    }
}

#[cfg(test)]
mod tests {
    use super::change_of;

    #[test]
    fn a_write_is_a_modification_and_a_chown_is_not() {
        assert_eq!(change_of(libc::IN_MODIFY), "was modified");
        assert_eq!(change_of(libc::IN_MODIFY | libc::IN_ATTRIB), "was modified");
        assert_eq!(change_of(libc::IN_CLOSE_WRITE), "was opened for writing");
        assert_eq!(
            change_of(libc::IN_ATTRIB),
            "had its owner, mode, times or extended attributes changed"
        );
    }
}
