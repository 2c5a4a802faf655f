//! Image identity: virtual size and sha256 of the whole virtual disk content
//! (what pcsl lists name).  Computing the hash reads the whole image, so it
//! is cached, in memory and in <cache_dir>/content-hash.json, keyed by the
//! image file's path, device, inode, size, mtime and ctime.

use crate::blockreader::BlockReader;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

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

pub fn file_key(path: &Path) -> Result<String, String> {
    let md = std::fs::metadata(path).map_err(|e| format!("cannot stat image {}: {e}", path.display()))?;
    if !md.is_file() && !md.file_type().is_block_device_like() {
        return Err(format!("image {} is not a regular file", path.display()));
    }
    Ok(format!(
        "{}|{}|{}|{}|{}.{}|{}.{}",
        path.display(),
        md.dev(),
        md.ino(),
        md.size(),
        md.mtime(),
        md.mtime_nsec(),
        md.ctime(),
        md.ctime_nsec()
    ))
}

trait BlockDeviceLike {
    fn is_block_device_like(&self) -> bool;
}
impl BlockDeviceLike for std::fs::FileType {
    fn is_block_device_like(&self) -> bool {
        use std::os::unix::fs::FileTypeExt;
        self.is_block_device()
    }
}

pub struct IdentityCache {
    file: PathBuf,
    map: Mutex<HashMap<String, (u64, String)>>,
}

impl IdentityCache {
    pub fn new(cache_dir: &Path) -> IdentityCache {
        let file = cache_dir.join("content-hash.json");
        let map = std::fs::read_to_string(&file)
            .ok()
            .and_then(|t| serde_json::from_str::<HashMap<String, (u64, String)>>(&t).ok())
            .unwrap_or_default();
        IdentityCache { file, map: Mutex::new(map) }
    }

    pub fn lookup(&self, key: &str) -> Option<Identity> {
        let map = self.map.lock().expect("identity cache lock");
        let (size, hex) = map.get(key)?;
        Some(Identity { virtual_size: *size, content_sha256: crate::sys::unhex32(hex)? })
    }

    fn store(&self, key: &str, id: &Identity) {
        let mut map = self.map.lock().expect("identity cache lock");
        // Forget older entries for the same path: they can never match again.
        let path_part = key.split('|').next().unwrap_or("").to_string();
        map.retain(|k, _| k.split('|').next() != Some(path_part.as_str()));
        map.insert(key.to_string(), (id.virtual_size, crate::sys::hex(&id.content_sha256)));
        if let Ok(text) = serde_json::to_string_pretty(&*map) {
            let tmp = self.file.with_extension("json.tmp");
            if std::fs::write(&tmp, text).and_then(|_| std::fs::rename(&tmp, &self.file)).is_err() {
                crate::log::warn(&format!("cannot write {}", self.file.display()));
            }
        }
    }

    /// The identity of the image, from the cache or by reading it all through
    /// `reader` (which must be open on the same file).  `cancelled` is polled
    /// between chunks.
    pub fn identity(
        &self,
        path: &Path,
        key: &str,
        reader: &mut BlockReader,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<(Identity, bool), String> {
        if let Some(id) = self.lookup(key) {
            if id.virtual_size == reader.size {
                return Ok((id, true));
            }
        }
        let t0 = Instant::now();
        let id = content_hash(reader, cancelled)?;
        // The file must not have changed while we read it.
        if file_key(path)? != key {
            return Err(format!("image {} changed while its content hash was computed", path.display()));
        }
        crate::log::info(&format!(
            "content sha256 of {} ({} bytes) computed in {:.1} s: {}",
            path.display(),
            id.virtual_size,
            t0.elapsed().as_secs_f64(),
            crate::sys::hex(&id.content_sha256)
        ));
        self.store(key, &id);
        Ok((id, false))
    }
}

/// sha256 of the whole virtual disk, read in 4 MiB chunks; the hashing runs
/// in a second thread so that reading and hashing overlap.
pub fn content_hash(reader: &mut BlockReader, cancelled: &dyn Fn() -> bool) -> Result<Identity, String> {
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
            result = Err("cancelled".to_string());
            break;
        }
        let n = CHUNK.min((size - off) as usize);
        let mut buf = back_rx.try_recv().unwrap_or_else(|_| vec![0u8; CHUNK]);
        buf.resize(n, 0);
        if let Err(e) = reader.read_at(off, &mut buf) {
            result = Err(e);
            break;
        }
        if tx.send(buf).is_err() {
            result = Err("hash thread died".into());
            break;
        }
        off += n as u64;
    }
    drop(tx);
    let digest = hasher.join().map_err(|_| "hash thread panicked".to_string())?;
    result?;
    Ok(Identity { virtual_size: size, content_sha256: digest })
}
