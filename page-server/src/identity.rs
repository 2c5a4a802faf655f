//! Image identity and file stamps.
//!
//! The identity is the virtual size and the sha256 of the whole virtual disk
//! content (what pcsl lists name).  Computing the hash reads the whole
//! image, so it is cached, in memory and in <cache_dir>/content-hash.json,
//! keyed by the image file's path, format and [`FileStamp`].
//!
//! A [`FileStamp`] (device, inode, size, mtime, ctime to the nanosecond) is
//! what the server reports in TABLE messages as the proof of which file,
//! unchanged since when, it verified (PROTOCOL.md, "Proof of identity").  It
//! is taken from one fstat() of a descriptor the loader opens on the image
//! and must equal a stat() of the path.  ctime cannot be set from user
//! space, and every write, truncate, chmod, link or rename updates it; but
//! its granularity is coarse on kernels before 6.13 (a jiffy, up to 10 ms;
//! 1-2 s on some filesystems), so a write in the same tick right after the
//! stamp was taken could leave it unchanged.  Like git's "racily clean"
//! index entries, a stamp is therefore usable only if its ctime is at least
//! [`RACY_NS`] older than the wall-clock time at which it was taken; until
//! then [`open_stable`] waits and takes it again.
//!
//! All of that holds only where every write to the file goes through this
//! host's kernel, which updates the ctime and raises inotify events for it.
//! On a network, cluster or FUSE file system another host (or a user-space
//! daemon) can change the bytes behind the server's back, and fstat() may
//! answer from attributes cached before the change.  So a stamp is taken
//! only on the local file systems of [`LOCAL_FILE_SYSTEMS`]; an image file
//! anywhere else is refused ([`ImageError::NotLocal`]), and its VMs read
//! from their disks.

use crate::blockreader::{BlockReader, ReadError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub virtual_size: u64,
    pub content_sha256: [u8; 32],
}

impl Identity {
    /// "<virtual size>-<content sha256>": the Redis key part and the log name.
    pub fn key(&self) -> String {
        format!("{}-{}", self.virtual_size, crate::sys::hex(&self.content_sha256))
    }
}

/// Which file, and unchanged since when: st_dev, st_ino, st_size, and
/// st_mtim / st_ctim in nanoseconds since the epoch (sec * 1e9 + nsec).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FileStamp {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

/// A stamp is racy (unusable) until its ctime is this much in the past.
pub const RACY_NS: i64 = 2_000_000_000;
/// Waits for a racy stamp before open_stable() gives up (the file keeps
/// changing); the load fails and is retried later.
const MAX_RACY_WAITS: u32 = 5;
/// File systems (statfs f_type) on which every change of a file is made by
/// this host's kernel, so that it moves the ctime and inotify sees it.
pub const LOCAL_FILE_SYSTEMS: &[(i64, &str)] = &[
    (0xEF53, "ext2/3/4"),
    (0x5846_5342, "XFS"),
    (0x9123_683E, "btrfs"),
    (0x0102_1994, "tmpfs"),
    (0x8584_58F6, "ramfs"),
    (0xF2F5_2010, "f2fs"),
    (0x2FC1_2FC1, "ZFS"),
    (0xCA45_1A4E, "bcachefs"),
];

/// Names for the f_type of file systems an image is refused on.
const OTHER_FILE_SYSTEMS: &[(i64, &str)] = &[
    (0x6969, "NFS"),
    (0xFF53_4D42, "CIFS/SMB"),
    (0xFE53_4D42, "SMB2"),
    (0x6573_5546, "FUSE"),
    (0x00C3_6400, "Ceph"),
    (0x0116_1970, "GFS2"),
    (0x7461_636F, "OCFS2"),
    (0x0102_1997, "9p"),
    (0x794C_7630, "overlayfs"),
    (0x6A65_6A65, "virtiofs"),
];

/// Whether a file on a file system of statfs type `f_type` can be proved
/// unchanged by its stamp: Ok, or Err with the file system's name.
pub fn check_local_fs(f_type: i64) -> Result<(), String> {
    if LOCAL_FILE_SYSTEMS.iter().any(|(m, _)| *m == f_type) {
        return Ok(());
    }
    Err(OTHER_FILE_SYSTEMS
        .iter()
        .find(|(m, _)| *m == f_type)
        .map(|(_, name)| (*name).to_string())
        .unwrap_or_else(|| format!("a file system of type {f_type:#x}")))
}

fn fs_type(f: &File) -> io::Result<i64> {
    // SAFETY: fstatfs fills a plain struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and pointer.
    if unsafe { libc::fstatfs(f.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // f_type is i64 on x86_64, not everywhere
    Ok(st.f_type as i64)
}

/// A ctime further in the future than this is a clock problem, not a race.
const FUTURE_SLACK_NS: i64 = 1_000_000_000;

/// The image file cannot be proved to be the one verified, or read whole.
#[derive(Debug)]
pub enum ImageError {
    NulInPath(PathBuf),
    Stat {
        path: PathBuf,
        source: io::Error,
    },
    NotAnImage(PathBuf),
    Open {
        path: PathBuf,
        source: io::Error,
    },
    Fstat {
        path: PathBuf,
        source: io::Error,
    },
    /// The open descriptor's stamp moved.
    Changed {
        path: PathBuf,
        was: FileStamp,
        now: FileStamp,
    },
    /// The path names another file, or the same one changed.
    Replaced {
        path: PathBuf,
        now: FileStamp,
        verified: FileStamp,
    },
    /// Opening and stat() kept disagreeing.
    Unsettled {
        path: PathBuf,
        opened: FileStamp,
        named: FileStamp,
    },
    FutureCtime {
        path: PathBuf,
        seconds: f64,
    },
    KeepsChanging {
        path: PathBuf,
        waits: u32,
    },
    /// On a file system whose changes this host's kernel may not see.
    NotLocal {
        path: PathBuf,
        fs: String,
    },
    Cancelled,
    Read(ReadError),
    HashThread(&'static str),
    /// The file changed while its content hash was computed.
    ChangedWhileHashing(Box<ImageError>),
}

impl fmt::Display for ImageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageError::NulInPath(p) => write!(f, "image path {} contains a NUL byte", p.display()),
            ImageError::Stat { path, source } => write!(f, "cannot stat image {}: {source}", path.display()),
            ImageError::NotAnImage(p) => write!(f, "image {} is not a regular file", p.display()),
            ImageError::Open { path, source } => write!(f, "cannot open image {}: {source}", path.display()),
            ImageError::Fstat { path, source } => write!(f, "fstat of image {}: {source}", path.display()),
            ImageError::Changed { path, was, now } => write!(f, "image {} changed (was {was:?}, now {now:?})", path.display()),
            ImageError::Replaced { path, now, verified } => write!(
                f,
                "image {} was replaced or changed (path now names {now:?}, verified {verified:?})",
                path.display()
            ),
            ImageError::Unsettled { path, opened, named } => write!(
                f,
                "image {} changes or is replaced while it is opened (opened {opened:?}, path names {named:?})",
                path.display()
            ),
            ImageError::FutureCtime { path, seconds } => write!(
                f,
                "image {} has a ctime {seconds:.1} s in the future: the clock went back? cannot prove it unchanged until then",
                path.display()
            ),
            ImageError::KeepsChanging { path, waits } => write!(
                f,
                "image {} keeps changing (changed again {waits} times while waiting for it to settle)",
                path.display()
            ),
            ImageError::NotLocal { path, fs } => {
                let local: Vec<&str> = LOCAL_FILE_SYSTEMS.iter().map(|(_, n)| *n).collect();
                write!(
                    f,
                    "image {} is on {fs}, where it can change without this host's kernel moving its ctime or \
                     telling inotify, so the server cannot prove that VMs read the bytes it verified; \
                     copy it to a local file system ({}) and serve the copy",
                    path.display(),
                    local.join(", ")
                )
            }
            ImageError::Cancelled => write!(f, "cancelled"),
            ImageError::Read(e) => e.fmt(f),
            ImageError::HashThread(what) => write!(f, "hash thread {what}"),
            ImageError::ChangedWhileHashing(e) => write!(f, "{e} while its content hash was computed"),
        }
    }
}

impl std::error::Error for ImageError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ImageError::Stat { source, .. }
            | ImageError::Open { source, .. }
            | ImageError::Fstat { source, .. } => Some(source),
            ImageError::Read(e) => Some(e),
            ImageError::ChangedWhileHashing(e) => Some(e.as_ref()),
            _ => None,
        }
    }
}

fn is_image_type(st: &libc::stat) -> bool {
    matches!(st.st_mode & libc::S_IFMT, libc::S_IFREG | libc::S_IFBLK)
}

impl FileStamp {
    fn from_stat(st: &libc::stat) -> FileStamp {
        FileStamp {
            dev: st.st_dev,
            ino: st.st_ino,
            size: st.st_size as u64,
            mtime_ns: st.st_mtime.saturating_mul(1_000_000_000).saturating_add(st.st_mtime_nsec),
            ctime_ns: st.st_ctime.saturating_mul(1_000_000_000).saturating_add(st.st_ctime_nsec),
        }
    }

    /// fstat() of an open descriptor: exactly what a client's fstat() sees.
    pub fn of_file(f: &File) -> std::io::Result<FileStamp> {
        // SAFETY: fstat fills a plain struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid fd and pointer.
        if unsafe { libc::fstat(f.as_raw_fd(), &mut st) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(FileStamp::from_stat(&st))
    }

    /// stat() of a path (symlinks followed, like open()).
    pub fn of_path(path: &Path) -> Result<FileStamp, ImageError> {
        let c = std::ffi::CString::new(path.as_os_str().as_bytes())
            .map_err(|_| ImageError::NulInPath(path.into()))?;
        // SAFETY: plain struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid C string and pointer.
        if unsafe { libc::stat(c.as_ptr(), &mut st) } != 0 {
            return Err(ImageError::Stat { path: path.into(), source: io::Error::last_os_error() });
        }
        if !is_image_type(&st) {
            return Err(ImageError::NotAnImage(path.into()));
        }
        Ok(FileStamp::from_stat(&st))
    }
}

/// The racy rule: a stamp taken at wall-clock time `taken_ns` proves that
/// the file is unchanged since then only if its ctime is at least
/// [`RACY_NS`] older (a later change within the same ctime tick would
/// otherwise go unnoticed).
pub fn is_racy(stamp: &FileStamp, taken_ns: i64) -> bool {
    taken_ns.saturating_sub(stamp.ctime_ns) < RACY_NS
}

/// Wall-clock time in ns since the epoch (the clock ctime is taken from).
pub fn wall_ns() -> i64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: plain syscall into a local struct.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec.saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec)
}

/// The image opened read-only, with its non-racy stamp.
pub struct OpenImage {
    pub file: File,
    pub stamp: FileStamp,
    /// Wall-clock time at which `stamp` was taken (ctime <= this - RACY_NS).
    pub taken_ns: i64,
}

impl OpenImage {
    /// Err unless the descriptor and the path both still have the stamp
    /// taken at open: same file, not modified since.
    pub fn check_unchanged(&self, path: &Path) -> Result<(), ImageError> {
        let fd = FileStamp::of_file(&self.file)
            .map_err(|source| ImageError::Fstat { path: path.into(), source })?;
        if fd != self.stamp {
            return Err(ImageError::Changed { path: path.into(), was: self.stamp, now: fd });
        }
        let p = FileStamp::of_path(path)?;
        if p != self.stamp {
            return Err(ImageError::Replaced { path: path.into(), now: p, verified: self.stamp });
        }
        Ok(())
    }
}

/// Open `path` O_RDONLY and take its stamp: fstat() of the descriptor,
/// which a stat() of the path must equal (else the path was renamed or
/// replaced in between: retried, then refused).  If the stamp is racy,
/// wait until it is not and take it again (see [`is_racy`]).  `cancelled`
/// is polled while waiting.
pub fn open_stable(path: &Path, cancelled: &dyn Fn() -> bool) -> Result<OpenImage, ImageError> {
    let mut logged = false;
    let mut waits = 0;
    loop {
        let (file, stamp) = open_matching(path)?;
        let now = wall_ns();
        if !is_racy(&stamp, now) {
            return Ok(OpenImage { file, stamp, taken_ns: now });
        }
        let wait = stamp.ctime_ns.saturating_add(RACY_NS).saturating_sub(now);
        if wait > RACY_NS + FUTURE_SLACK_NS {
            return Err(ImageError::FutureCtime {
                path: path.into(),
                seconds: (stamp.ctime_ns - now) as f64 / 1e9,
            });
        }
        waits += 1;
        if waits > MAX_RACY_WAITS {
            return Err(ImageError::KeepsChanging { path: path.into(), waits: MAX_RACY_WAITS });
        }
        if !logged {
            crate::log::info(&format!(
                "image {} changed less than {} s ago; waiting before verifying it",
                path.display(),
                RACY_NS / 1_000_000_000
            ));
            logged = true;
        }
        drop(file);
        let until = Instant::now() + Duration::from_nanos(wait as u64 + 1_000_000);
        while Instant::now() < until {
            if cancelled() {
                return Err(ImageError::Cancelled);
            }
            std::thread::sleep((until - Instant::now()).min(Duration::from_millis(100)));
        }
    }
}

/// open() + fstat(), equal to stat() of the path.
fn open_matching(path: &Path) -> Result<(File, FileStamp), ImageError> {
    let mut attempt = 0;
    loop {
        let file =
            File::open(path).map_err(|source| ImageError::Open { path: path.into(), source })?;
        let fd = FileStamp::of_file(&file)
            .map_err(|source| ImageError::Fstat { path: path.into(), source })?;
        let p = FileStamp::of_path(path)?;
        if fd == p {
            if file.metadata().map(|m| m.file_type().is_file()).unwrap_or(false) {
                let t = fs_type(&file)
                    .map_err(|source| ImageError::Fstat { path: path.into(), source })?;
                check_local_fs(t).map_err(|fs| ImageError::NotLocal { path: path.into(), fs })?;
            }
            return Ok((file, fd));
        }
        attempt += 1;
        if attempt == 3 {
            return Err(ImageError::Unsettled { path: path.into(), opened: fd, named: p });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A content-hash cache entry's key: the path, the format the image was
/// opened with, and the file's stamp (never a racy one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct CacheEntry {
    path: PathBuf,
    format: String,
    #[serde(flatten)]
    stamp: FileStamp,
    virtual_size: u64,
    content_sha256: String,
}

#[derive(Default, Serialize, Deserialize)]
struct CacheFile {
    version: u32,
    entries: Vec<CacheEntry>,
}

const CACHE_VERSION: u32 = 2;

pub struct IdentityCache {
    file: PathBuf,
    entries: Mutex<Vec<CacheEntry>>,
}

impl IdentityCache {
    pub fn new(cache_dir: &Path) -> IdentityCache {
        let file = cache_dir.join("content-hash.json");
        // Older formats (version 1: string keys) are dropped: hashed again once.
        let entries = std::fs::read_to_string(&file)
            .ok()
            .and_then(|t| serde_json::from_str::<CacheFile>(&t).ok())
            .filter(|c| c.version == CACHE_VERSION)
            .map(|c| c.entries)
            .unwrap_or_default();
        IdentityCache { file, entries: Mutex::new(entries) }
    }

    pub fn lookup(&self, path: &Path, format: &str, stamp: &FileStamp) -> Option<Identity> {
        let entries = self.entries.lock().expect("identity cache lock");
        let e =
            entries.iter().find(|e| e.path == path && e.format == format && e.stamp == *stamp)?;
        Some(Identity {
            virtual_size: e.virtual_size,
            content_sha256: crate::sys::unhex32(&e.content_sha256)?,
        })
    }

    /// Remember `id` for the file with `stamp`, taken at `taken_ns`; a racy
    /// stamp is never stored (it could match a later, different content).
    fn store(
        &self,
        path: &Path,
        format: &str,
        stamp: &FileStamp,
        taken_ns: i64,
        id: &Identity,
    ) -> bool {
        if is_racy(stamp, taken_ns) {
            return false;
        }
        let mut entries = self.entries.lock().expect("identity cache lock");
        // Forget older entries for the same path: they can never match again.
        entries.retain(|e| e.path != path);
        entries.push(CacheEntry {
            path: path.to_path_buf(),
            format: format.to_string(),
            stamp: *stamp,
            virtual_size: id.virtual_size,
            content_sha256: crate::sys::hex(&id.content_sha256),
        });
        let c = CacheFile { version: CACHE_VERSION, entries: entries.clone() };
        if let Ok(text) = serde_json::to_string_pretty(&c) {
            let tmp = self.file.with_extension("json.tmp");
            if std::fs::write(&tmp, text).and_then(|_| std::fs::rename(&tmp, &self.file)).is_err() {
                crate::log::warn(&format!("cannot write {}", self.file.display()));
            }
        }
        true
    }

    /// The identity of the image, from the cache or by reading it all through
    /// `reader` (which must read `img`, opened as `format`).  `cancelled`
    /// is polled between chunks.
    pub fn identity(
        &self,
        path: &Path,
        format: &str,
        img: &OpenImage,
        reader: &mut BlockReader,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<(Identity, bool), ImageError> {
        if let Some(id) = self.lookup(path, format, &img.stamp) {
            if id.virtual_size == reader.size {
                return Ok((id, true));
            }
        }
        let t0 = Instant::now();
        let id = content_hash(reader, cancelled)?;
        // The file must not have changed while we read it.
        img.check_unchanged(path).map_err(|e| ImageError::ChangedWhileHashing(Box::new(e)))?;
        crate::log::info(&format!(
            "content sha256 of {} ({} bytes) computed in {:.1} s: {}",
            path.display(),
            id.virtual_size,
            t0.elapsed().as_secs_f64(),
            crate::sys::hex(&id.content_sha256)
        ));
        self.store(path, format, &img.stamp, img.taken_ns, &id);
        Ok((id, false))
    }
}

/// sha256 of the whole virtual disk, read in 4 MiB chunks; the hashing runs
/// in a second thread so that reading and hashing overlap.
pub fn content_hash(
    reader: &mut BlockReader,
    cancelled: &dyn Fn() -> bool,
) -> Result<Identity, ImageError> {
    const CHUNK: usize = 4 << 20;
    let size = reader.size;
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(2);
    let (back_tx, back_rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let hasher = std::thread::spawn(move || {
        let mut h = Sha256::new();
        for buf in rx {
            h.update(&buf);
            let _ = back_tx.send(buf);
        }
        let d: [u8; 32] = h.finalize().into();
        d
    });
    let mut off = 0u64;
    let mut result = Ok(());
    while off < size {
        if cancelled() {
            result = Err(ImageError::Cancelled);
            break;
        }
        let n = CHUNK.min((size - off) as usize);
        let mut buf = back_rx.try_recv().unwrap_or_else(|_| vec![0u8; CHUNK]);
        buf.resize(n, 0);
        if let Err(e) = reader.read_at(off, &mut buf) {
            result = Err(ImageError::Read(e));
            break;
        }
        if tx.send(buf).is_err() {
            result = Err(ImageError::HashThread("died"));
            break;
        }
        off += n as u64;
    }
    drop(tx);
    let digest = hasher.join().map_err(|_| ImageError::HashThread("panicked"))?;
    result?;
    Ok(Identity { virtual_size: size, content_sha256: digest })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_dir::TestDir;
    use std::io::Write;

    fn tmpdir(name: &str) -> TestDir {
        TestDir::new(&format!("identity-{name}"))
    }

    fn stamp(ctime_ns: i64) -> FileStamp {
        FileStamp { dev: 1, ino: 2, size: 3, mtime_ns: ctime_ns, ctime_ns }
    }

    const S: i64 = 1_000_000_000;

    #[test]
    fn only_local_file_systems_are_proven() {
        assert!(check_local_fs(0xEF53).is_ok());
        assert!(check_local_fs(0x0102_1994).is_ok());
        assert_eq!(check_local_fs(0x6969).unwrap_err(), "NFS");
        assert_eq!(check_local_fs(0x6573_5546).unwrap_err(), "FUSE");
        assert_eq!(check_local_fs(0x1234).unwrap_err(), "a file system of type 0x1234");
        // the test's own temporary directory is local, and open_stable() takes it
        let d = tmpdir("local-fs");
        let p = d.join("img");
        std::fs::write(&p, b"x").unwrap();
        let f = File::open(&p).unwrap();
        assert!(check_local_fs(fs_type(&f).unwrap()).is_ok(), "{:#x}", fs_type(&f).unwrap());
    }

    #[test]
    fn racy_rule_with_explicit_times() {
        let t = 1_800_000_000 * S;
        // Changed now, or less than 2 s before the stamp was taken: racy.
        assert!(is_racy(&stamp(t), t));
        assert!(is_racy(&stamp(t - RACY_NS + 1), t));
        assert!(is_racy(&stamp(t - S), t));
        // 2 s or more: usable.
        assert!(!is_racy(&stamp(t - RACY_NS), t));
        assert!(!is_racy(&stamp(t - 3 * S), t));
        // A ctime in the future (clock went back) is never usable.
        assert!(is_racy(&stamp(t + 5 * S), t));
        // No overflow at the extremes.
        assert!(is_racy(&stamp(i64::MAX), i64::MIN));
        assert!(!is_racy(&stamp(i64::MIN), i64::MAX));
    }

    #[test]
    fn a_file_written_now_is_racy() {
        let d = tmpdir("now");
        let f = d.join("img");
        std::fs::write(&f, b"x").unwrap();
        let st = FileStamp::of_path(&f).unwrap();
        assert!(is_racy(&st, wall_ns()), "{st:?}");
        let md = std::fs::metadata(&f).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!((st.dev, st.ino, st.size), (md.dev(), md.ino(), 1));
        assert_eq!(st.ctime_ns, md.ctime() * S + md.ctime_nsec());
        assert_eq!(st.mtime_ns, md.mtime() * S + md.mtime_nsec());
        assert_eq!(FileStamp::of_file(&File::open(&f).unwrap()).unwrap(), st);
        assert!(FileStamp::of_path(&d).is_err(), "a directory is not an image");
    }

    #[test]
    fn open_stable_waits_until_the_stamp_is_not_racy() {
        let d = tmpdir("wait");
        let f = d.join("img");
        std::fs::write(&f, b"first").unwrap();
        let t0 = Instant::now();
        // A second write 1 s later, while the loader waits: it must wait
        // for that one too and return its stamp.
        let f2 = f.clone();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1000));
            let mut w = std::fs::OpenOptions::new().append(true).open(&f2).unwrap();
            w.write_all(b" second").unwrap();
        });
        let img = open_stable(&f, &|| false).unwrap();
        writer.join().unwrap();
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_millis(2900), "waited only {waited:?}");
        assert_eq!(img.stamp.size, 12, "the stamp is the one after the second write");
        assert!(!is_racy(&img.stamp, img.taken_ns));
        assert_eq!(img.stamp, FileStamp::of_path(&f).unwrap());
        img.check_unchanged(&f).unwrap();
        // Any later change is caught, through the descriptor or the path.
        std::fs::OpenOptions::new().append(true).open(&f).unwrap().write_all(b"!").unwrap();
        let e = img.check_unchanged(&f).unwrap_err();
        assert!(
            matches!(e, ImageError::Changed { .. }) && e.to_string().contains("changed"),
            "{e}"
        );
        let img2 = open_stable(&f, &|| false).unwrap();
        let other = d.join("other");
        std::fs::write(&other, b"first second!").unwrap();
        std::fs::rename(&other, &f).unwrap();
        assert!(img2.check_unchanged(&f).is_err(), "a file renamed over the path is another file");
    }

    #[test]
    fn open_stable_can_be_cancelled_while_waiting() {
        let d = tmpdir("cancel");
        let f = d.join("img");
        std::fs::write(&f, b"x").unwrap();
        let t0 = Instant::now();
        let e = open_stable(&f, &|| t0.elapsed() > Duration::from_millis(200)).err().unwrap();
        assert!(matches!(e, ImageError::Cancelled), "{e}");
        assert!(t0.elapsed() < Duration::from_millis(1500));
        assert!(open_stable(&d.join("missing"), &|| false).is_err());
    }

    #[test]
    fn cache_is_keyed_by_the_typed_stamp_and_never_stores_racy_ones() {
        let d = tmpdir("cache");
        let p = Path::new("/images/base.qcow2");
        let id = Identity { virtual_size: 4096, content_sha256: [9; 32] };
        let t = 1_800_000_000 * S;
        let c = IdentityCache::new(&d);
        assert!(!c.store(p, "qcow2", &stamp(t - S), t, &id), "racy: not stored");
        assert_eq!(c.lookup(p, "qcow2", &stamp(t - S)), None);
        assert!(!d.join("content-hash.json").exists());
        assert!(c.store(p, "qcow2", &stamp(t - 3 * S), t, &id));
        assert_eq!(c.lookup(p, "qcow2", &stamp(t - 3 * S)), Some(id));
        assert_eq!(c.lookup(p, "raw", &stamp(t - 3 * S)), None, "format is part of the key");
        assert_eq!(c.lookup(Path::new("/images/other"), "qcow2", &stamp(t - 3 * S)), None);
        for f in [
            |s: &mut FileStamp| s.dev += 1,
            |s: &mut FileStamp| s.ino += 1,
            |s: &mut FileStamp| s.size += 1,
            |s: &mut FileStamp| s.mtime_ns += 1,
            |s: &mut FileStamp| s.ctime_ns += 1,
        ] {
            let mut s = stamp(t - 3 * S);
            f(&mut s);
            assert_eq!(c.lookup(p, "qcow2", &s), None, "{s:?}");
        }
        // Persisted, typed; a newer stamp replaces the path's entry.
        let c2 = IdentityCache::new(&d);
        assert_eq!(c2.lookup(p, "qcow2", &stamp(t - 3 * S)), Some(id));
        assert!(c2.store(p, "qcow2", &stamp(t - 2 * S), t, &id));
        assert_eq!(c2.lookup(p, "qcow2", &stamp(t - 3 * S)), None);
        let text = std::fs::read_to_string(d.join("content-hash.json")).unwrap();
        assert!(text.contains("\"ctime_ns\"") && text.contains("\"version\": 2"), "{text}");
        // The old string-keyed format is ignored (hashed again once).
        std::fs::write(d.join("content-hash.json"), r#"{"/a|1|2|3|4.5|6.7": [4096, "00"]}"#)
            .unwrap();
        assert_eq!(IdentityCache::new(&d).entries.lock().unwrap().len(), 0);
    }
}
