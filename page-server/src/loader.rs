//! Load jobs, run one at a time on the loader thread: parse the list, check
//! that it names this exact image, read every listed block through
//! qemu-storage-daemon, verify its sha256 and copy it into the image's arena.
//! A list is used whole or not at all.

use crate::arena::{Acquire, Arena};
use crate::blockreader::{detect_format, BlockReader};
use crate::config::{Config, ImageConfig};
use crate::identity::{open_stable, FileStamp, Identity, IdentityCache};
use crate::sectorlist::{self, SectorList, BLOCK_SIZE, SECTORS_PER_BLOCK, SECTOR_SIZE};
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone)]
pub enum ListSource {
    File(PathBuf),
    /// List text from Redis (key, bytes).
    Redis(String, Arc<Vec<u8>>),
    /// Redis-sourced image before Redis answered: the identity, and the last
    /// good list cached on disk if there is one.
    Cached,
}

impl ListSource {
    pub fn describe(&self) -> String {
        match self {
            ListSource::File(p) => format!("file {}", p.display()),
            ListSource::Redis(k, _) => format!("redis key {k}"),
            ListSource::Cached => "cached list".into(),
        }
    }
}

pub struct Job {
    pub image: usize,
    pub seq: u64,
    pub cfg: ImageConfig,
    pub source: ListSource,
    /// The image's current arena, reused if the identity is unchanged.
    pub arena: Option<Arc<Arena>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailKind {
    /// No list exists yet (Redis image without a cached list).
    NoList,
    /// The list is malformed, for another image, or contradicts the image.
    Refused,
    /// The base image cannot be read.
    Image,
    /// Limits.
    Limit,
    Cancelled,
}

pub struct LoadOk {
    pub arena: Arc<Arena>,
    /// The image file this load verified: its stamp at the start, checked
    /// again (descriptor and path) at the end.
    pub stamp: FileStamp,
    /// The format the image was read with ("raw" or "qcow2").
    pub format: String,
    /// Blocks of the list; the job holds one arena reference on each.
    pub blocks: Vec<u64>,
    pub list: SectorList,
    /// sha256 of the list text as received (to skip re-deliveries).
    pub text_sha: [u8; 32],
    pub read_blocks: u64,
    pub reused_blocks: u64,
    pub secs: f64,
    pub read_secs: f64,
}

pub struct Loaded {
    pub image: usize,
    pub seq: u64,
    pub source: ListSource,
    pub identity: Option<Identity>,
    /// The stamp of the image file the identity belongs to.
    pub stamp: Option<FileStamp>,
    pub result: Result<LoadOk, (FailKind, String)>,
}

pub struct Loader {
    pub cfg: Config,
    pub ids: IdentityCache,
    pub latest: Arc<Vec<AtomicU64>>,
    pub global_loaded: Arc<AtomicU64>,
}

pub fn cached_list_path(cfg: &Config, id: &Identity) -> PathBuf {
    cfg.cache_dir.join("lists").join(format!("{}.pcsl", id.key()))
}

fn fail<T>(kind: FailKind, msg: impl Into<String>) -> Result<T, (FailKind, String)> {
    Err((kind, msg.into()))
}

impl Loader {
    pub fn run(&self, job: Job) -> Loaded {
        let mut out = Loaded {
            image: job.image,
            seq: job.seq,
            source: job.source.clone(),
            identity: None,
            stamp: None,
            result: fail(FailKind::Cancelled, "not run"),
        };
        out.result = self.load(&job, &mut out.identity, &mut out.stamp);
        out
    }

    fn cancelled(&self, job: &Job) -> bool {
        self.latest[job.image].load(Ordering::SeqCst) != job.seq
    }

    fn read_list(&self, path: &std::path::Path) -> Result<Vec<u8>, (FailKind, String)> {
        let md = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return fail(FailKind::NoList, format!("list file {} does not exist", path.display()))
            }
            Err(e) => return fail(FailKind::Refused, format!("cannot read list {}: {e}", path.display())),
        };
        if md.len() > self.cfg.limits.max_list_bytes {
            return fail(
                FailKind::Limit,
                format!("list {} is {} bytes, over limits.max_list_bytes", path.display(), md.len()),
            );
        }
        std::fs::read(path).map_err(|e| (FailKind::Refused, format!("cannot read list {}: {e}", path.display())))
    }

    fn load(
        &self,
        job: &Job,
        identity_out: &mut Option<Identity>,
        stamp_out: &mut Option<FileStamp>,
    ) -> Result<LoadOk, (FailKind, String)> {
        let t0 = Instant::now();
        let img = &job.cfg;
        // 1. The list, parsed and validated before the image is touched.
        let (text, origin): (Option<Arc<Vec<u8>>>, String) = match &job.source {
            ListSource::File(p) => (Some(Arc::new(self.read_list(p)?)), p.display().to_string()),
            ListSource::Redis(k, t) => {
                if t.len() as u64 > self.cfg.limits.max_list_bytes {
                    return fail(FailKind::Limit, format!("list in redis key {k} is {} bytes, over limits.max_list_bytes", t.len()));
                }
                (Some(t.clone()), format!("redis key {k}"))
            }
            ListSource::Cached => (None, String::new()),
        };
        let mut cached_text: Option<Arc<Vec<u8>>> = None;
        let mut list = match &text {
            Some(t) => Some(
                sectorlist::parse_bytes(t).map_err(|e| (FailKind::Refused, format!("list refused: {origin}: {e}")))?,
            ),
            None => None,
        };
        if let Some(l) = &list {
            if l.blocks.len() as u64 > self.cfg.limits.max_blocks_per_image {
                return fail(
                    FailKind::Limit,
                    format!("list {origin} has {} blocks, over limits.max_blocks_per_image", l.blocks.len()),
                );
            }
        }

        // 2. The image, opened once: its stamp (not racy), its format, and
        // its identity (cached by path, format and stamp, else hashed).
        let cancel = || self.cancelled(job);
        let cancel_or = |kind: FailKind| move |e: String| if cancel() { (FailKind::Cancelled, e) } else { (kind, e) };
        let image = open_stable(&img.path, &cancel).map_err(cancel_or(FailKind::Image))?;
        let format = detect_format(&image.file, &img.path, &img.format).map_err(|e| (FailKind::Image, e))?;
        let mut reader: Option<BlockReader> = None;
        let open = |r: &mut Option<BlockReader>| -> Result<(), (FailKind, String)> {
            if r.is_none() {
                *r = Some(
                    BlockReader::open(&self.cfg.qemu_storage_daemon, &image.file, &img.path, &format)
                        .map_err(|e| (FailKind::Image, e))?,
                );
            }
            Ok(())
        };
        let identity = match self.ids.lookup(&img.path, &format, &image.stamp) {
            Some(id) => id,
            None => {
                open(&mut reader)?;
                let r = reader.as_mut().expect("opened");
                if r.size > self.cfg.limits.max_image_virtual_size {
                    return fail(FailKind::Limit, format!("image {} is larger than limits.max_image_virtual_size", img.path.display()));
                }
                self.ids.identity(&img.path, &format, &image, r, &cancel).map_err(cancel_or(FailKind::Image))?.0
            }
        };
        *identity_out = Some(identity);
        *stamp_out = Some(image.stamp);

        if list.is_none() {
            // Redis image, Redis not heard from yet: the last good list, if any.
            let p = cached_list_path(&self.cfg, &identity);
            let t = match std::fs::read(&p) {
                Ok(t) => t,
                Err(_) => return fail(FailKind::NoList, "no list yet (waiting for Redis)"),
            };
            let l = sectorlist::parse_bytes(&t)
                .map_err(|e| (FailKind::Refused, format!("cached list {} refused: {e}", p.display())))?;
            list = Some(l);
            cached_text = Some(Arc::new(t));
        }
        let list = list.expect("set above");
        let text_sha: [u8; 32] = match (&text, &cached_text) {
            (Some(t), _) | (None, Some(t)) => Sha256::digest(t.as_slice()).into(),
            _ => [0; 32],
        };
        let origin = if origin.is_empty() { "cached list".to_string() } else { origin };

        // 3. The list must name exactly this image.
        if list.virtual_size != identity.virtual_size || list.content_sha256 != identity.content_sha256 {
            return fail(
                FailKind::Refused,
                format!(
                    "list refused: {origin} is for another image (list: size {} content {}; image {}: size {} content {})",
                    list.virtual_size,
                    crate::sys::hex(&list.content_sha256),
                    img.path.display(),
                    identity.virtual_size,
                    crate::sys::hex(&identity.content_sha256)
                ),
            );
        }

        // 4. Reserve slots; reuse blocks already loaded and verified.
        let arena = match &job.arena {
            Some(a) if a.identity == identity => a.clone(),
            _ => Arc::new(Arena::new(identity, self.global_loaded.clone()).map_err(|e| (FailKind::Limit, e))?),
        };
        let mut held: Vec<u64> = Vec::with_capacity(list.blocks.len());
        let mut to_load: Vec<(u64, [u8; 32])> = Vec::new();
        let release = |held: &Vec<u64>| arena.release(held);
        for (sector, hash) in &list.blocks {
            let block = sector / SECTORS_PER_BLOCK;
            match arena.acquire(block, hash) {
                Ok(Acquire::Reused) => held.push(block),
                Ok(Acquire::MustLoad) => {
                    held.push(block);
                    to_load.push((block, *hash));
                }
                Err(e) => {
                    release(&held);
                    return fail(FailKind::Refused, format!("list refused: {origin}: {e}"));
                }
            }
        }
        let limit_blocks = self.cfg.limits.max_total_bytes / BLOCK_SIZE;
        let loaded_now = self.global_loaded.load(Ordering::Relaxed);
        if loaded_now + to_load.len() as u64 > limit_blocks {
            release(&held);
            return fail(
                FailKind::Limit,
                format!(
                    "loading {} more blocks would exceed limits.max_total_bytes ({} blocks loaded)",
                    to_load.len(),
                    loaded_now
                ),
            );
        }

        // 5. Read, verify and copy the new blocks, in runs of up to 1 MiB.
        let t_read = Instant::now();
        if !to_load.is_empty() {
            if let Err(e) = open(&mut reader) {
                release(&held);
                return Err(e);
            }
            let r = reader.as_mut().expect("opened");
            if r.size != identity.virtual_size {
                release(&held);
                return fail(FailKind::Image, "image size changed");
            }
            if let Err(e) = self.read_blocks(job, r, &arena, &to_load, &origin) {
                release(&held);
                return Err(e);
            }
        }
        let read_secs = t_read.elapsed().as_secs_f64();
        drop(reader);

        // 6. The image must not have changed under us: the descriptor and
        // the path still have the stamp taken before anything was read.
        if let Err(e) = image.check_unchanged(&img.path) {
            release(&held);
            return fail(FailKind::Image, format!("image {} changed while the list was loaded: {e}", img.path.display()));
        }
        Ok(LoadOk {
            arena,
            stamp: image.stamp,
            format,
            blocks: held,
            list,
            text_sha,
            read_blocks: to_load.len() as u64,
            reused_blocks: 0,
            secs: t0.elapsed().as_secs_f64(),
            read_secs,
        })
        .map(|mut ok| {
            ok.reused_blocks = ok.blocks.len() as u64 - ok.read_blocks;
            ok
        })
    }

    fn read_blocks(
        &self,
        job: &Job,
        r: &mut BlockReader,
        arena: &Arena,
        to_load: &[(u64, [u8; 32])],
        origin: &str,
    ) -> Result<(), (FailKind, String)> {
        const MAX_RUN: usize = 256;
        let mut buf = vec![0u8; MAX_RUN * BLOCK_SIZE as usize];
        let mut i = 0;
        while i < to_load.len() {
            if self.cancelled(job) {
                return fail(FailKind::Cancelled, "superseded by a newer list");
            }
            let mut j = i + 1;
            while j < to_load.len() && j - i < MAX_RUN && to_load[j].0 == to_load[j - 1].0 + 1 {
                j += 1;
            }
            let n = j - i;
            let start = to_load[i].0;
            let bytes = &mut buf[..n * BLOCK_SIZE as usize];
            r.read_at(start * BLOCK_SIZE, bytes).map_err(|e| (FailKind::Image, format!("reading the image: {e}")))?;
            for k in 0..n {
                let (block, want) = &to_load[i + k];
                let data = &bytes[k * BLOCK_SIZE as usize..(k + 1) * BLOCK_SIZE as usize];
                let got: [u8; 32] = Sha256::digest(data).into();
                if got != *want {
                    return fail(
                        FailKind::Refused,
                        format!(
                            "list refused: {origin}: block at sector {} hashes to {} in the image, the list says {}: the image was modified since its content hash was taken, or the list is wrong",
                            block * BLOCK_SIZE / SECTOR_SIZE,
                            crate::sys::hex(&got),
                            crate::sys::hex(want)
                        ),
                    );
                }
            }
            // The whole run is verified: move it into place in one step
            // (ENOMEM there is vm.max_map_count, a limit).
            arena.fill_run(start, bytes).map_err(|e| (FailKind::Limit, e))?;
            i = j;
        }
        Ok(())
    }
}
