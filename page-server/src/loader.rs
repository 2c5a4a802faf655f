//! Load jobs, run one at a time on the loader thread: parse the list, check
//! that it names this exact image, read every listed block through
//! qemu-storage-daemon, verify its sha256 and copy it into the image's arena.
//! A list is used whole or not at all.

use crate::arena::{Acquire, Arena};
use crate::blockreader::{detect_format, BlockReader};
use crate::config::{Config, ImageConfig};
use crate::identity::{open_stable, FileStamp, Identity, IdentityCache, ImageError};
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

/// What kind of failure a load is: the server keeps serving, withdraws the
/// table or retries by it.
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

impl FailKind {
    pub fn with(self, message: impl Into<String>) -> LoadError {
        LoadError { kind: self, message: message.into() }
    }
}

/// A load that produced no generation: its kind and what to tell the
/// operator and the clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError {
    pub kind: FailKind,
    pub message: String,
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for LoadError {}

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
    pub result: Result<LoadOk, LoadError>,
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

fn fail<T>(kind: FailKind, msg: impl Into<String>) -> Result<T, LoadError> {
    Err(kind.with(msg))
}

/// A list's bytes, shared with the job that carried them (None: not read).
type ListText = Option<Arc<Vec<u8>>>;

/// Step 4's slots: all the list's blocks held, those to read and verify.
struct Reserved {
    arena: Arc<Arena>,
    held: Vec<u64>,
    to_load: Vec<(u64, [u8; 32])>,
}

/// Step 3: the list must name exactly this image.
fn check_names_image(
    list: &SectorList,
    identity: &Identity,
    origin: &str,
    img: &ImageConfig,
) -> Result<(), LoadError> {
    if list.virtual_size != identity.virtual_size || list.content_sha256 != identity.content_sha256
    {
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
    Ok(())
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

    fn read_list(&self, path: &std::path::Path) -> Result<Vec<u8>, LoadError> {
        let md = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return fail(
                    FailKind::NoList,
                    format!("list file {} does not exist", path.display()),
                )
            }
            Err(e) => {
                return fail(FailKind::Refused, format!("cannot read list {}: {e}", path.display()))
            }
        };
        if md.len() > self.cfg.limits.max_list_bytes {
            return fail(
                FailKind::Limit,
                format!(
                    "list {} is {} bytes, over limits.max_list_bytes",
                    path.display(),
                    md.len()
                ),
            );
        }
        std::fs::read(path).map_err(|e| {
            FailKind::Refused.with(format!("cannot read list {}: {e}", path.display()))
        })
    }

    fn load(
        &self,
        job: &Job,
        identity_out: &mut Option<Identity>,
        stamp_out: &mut Option<FileStamp>,
    ) -> Result<LoadOk, LoadError> {
        let t0 = Instant::now();
        let img = &job.cfg;
        // 1. The list, parsed and validated before the image is touched.
        let (text, origin) = self.list_text(&job.source)?;
        let mut cached_text: Option<Arc<Vec<u8>>> = None;
        let mut list = match &text {
            Some(t) => Some(self.parse_list(t, &origin)?),
            None => None,
        };

        // 2. The image, opened once: its stamp (not racy), its format, and
        // its identity (cached by path, format and stamp, else hashed).
        let cancel = || self.cancelled(job);
        let cancel_or = |kind: FailKind| {
            move |e: ImageError| {
                if cancel() { FailKind::Cancelled } else { kind }.with(e.to_string())
            }
        };
        let image = open_stable(&img.path, &cancel).map_err(cancel_or(FailKind::Image))?;
        let format = detect_format(&image.file, &img.path, &img.format)
            .map_err(|e| FailKind::Image.with(e.to_string()))?;
        let mut reader: Option<BlockReader> = None;
        let open = |r: &mut Option<BlockReader>| -> Result<(), LoadError> {
            if r.is_none() {
                let qsd = self
                    .cfg
                    .qemu_storage_daemon()
                    .map_err(|e| FailKind::Image.with(e.to_string()))?;
                *r = Some(
                    BlockReader::open(&qsd, &image.file, &img.path, &format)
                        .map_err(|e| FailKind::Image.with(e.to_string()))?,
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
                    return fail(
                        FailKind::Limit,
                        format!(
                            "image {} is larger than limits.max_image_virtual_size",
                            img.path.display()
                        ),
                    );
                }
                self.ids
                    .identity(&img.path, &format, &image, r, &cancel)
                    .map_err(cancel_or(FailKind::Image))?
                    .0
            }
        };
        *identity_out = Some(identity);
        *stamp_out = Some(image.stamp);

        if list.is_none() {
            let (l, t) = self.cached_list(&identity)?;
            list = Some(l);
            cached_text = Some(t);
        }
        let list = list.expect("set above");
        let text_sha: [u8; 32] = match (&text, &cached_text) {
            (Some(t), _) | (None, Some(t)) => Sha256::digest(t.as_slice()).into(),
            _ => [0; 32],
        };
        let origin = if origin.is_empty() { "cached list".to_string() } else { origin };

        // 3. The list must name exactly this image.
        check_names_image(&list, &identity, &origin, img)?;

        // 4. Reserve slots; reuse blocks already loaded and verified.
        let Reserved { arena, held, to_load } = self.reserve(job, identity, &list, &origin)?;
        let release = |held: &Vec<u64>| arena.release(held);

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
            return fail(
                FailKind::Image,
                format!("image {} changed while the list was loaded: {e}", img.path.display()),
            );
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

    /// Step 1: the list's bytes and where they come from (empty for a
    /// Redis image before Redis answered: the cached list is read later).
    fn list_text(&self, source: &ListSource) -> Result<(ListText, String), LoadError> {
        Ok(match source {
            ListSource::File(p) => (Some(Arc::new(self.read_list(p)?)), p.display().to_string()),
            ListSource::Redis(k, t) => {
                if t.len() as u64 > self.cfg.limits.max_list_bytes {
                    return fail(
                        FailKind::Limit,
                        format!(
                            "list in redis key {k} is {} bytes, over limits.max_list_bytes",
                            t.len()
                        ),
                    );
                }
                (Some(t.clone()), format!("redis key {k}"))
            }
            ListSource::Cached => (None, String::new()),
        })
    }

    /// Step 1: the list parsed and within limits.max_blocks_per_image.
    fn parse_list(&self, text: &[u8], origin: &str) -> Result<SectorList, LoadError> {
        let l = sectorlist::parse_bytes(text)
            .map_err(|e| FailKind::Refused.with(format!("list refused: {origin}: {e}")))?;
        if l.blocks.len() as u64 > self.cfg.limits.max_blocks_per_image {
            return fail(
                FailKind::Limit,
                format!(
                    "list {origin} has {} blocks, over limits.max_blocks_per_image",
                    l.blocks.len()
                ),
            );
        }
        Ok(l)
    }

    /// A Redis image, Redis not heard from yet: the last good list of this
    /// identity cached on disk, if any (it passed the limits when loaded).
    fn cached_list(&self, identity: &Identity) -> Result<(SectorList, Arc<Vec<u8>>), LoadError> {
        let p = cached_list_path(&self.cfg, identity);
        let t = match std::fs::read(&p) {
            Ok(t) => t,
            Err(_) => return fail(FailKind::NoList, "no list yet (waiting for Redis)"),
        };
        let l = sectorlist::parse_bytes(&t).map_err(|e| {
            FailKind::Refused.with(format!("cached list {} refused: {e}", p.display()))
        })?;
        Ok((l, Arc::new(t)))
    }

    /// Step 4: a slot for each listed block in the arena (the job's, if it
    /// holds this identity), blocks already loaded and verified reused,
    /// within limits.max_total_bytes.  On an error nothing stays held.
    fn reserve(
        &self,
        job: &Job,
        identity: Identity,
        list: &SectorList,
        origin: &str,
    ) -> Result<Reserved, LoadError> {
        let arena = match &job.arena {
            Some(a) if a.identity == identity => a.clone(),
            _ => Arc::new(
                Arena::new(identity, self.global_loaded.clone())
                    .map_err(|e| FailKind::Limit.with(e.to_string()))?,
            ),
        };
        let mut held: Vec<u64> = Vec::with_capacity(list.blocks.len());
        let mut to_load: Vec<(u64, [u8; 32])> = Vec::new();
        for (sector, hash) in &list.blocks {
            let block = sector / SECTORS_PER_BLOCK;
            match arena.acquire(block, hash) {
                Ok(Acquire::Reused) => held.push(block),
                Ok(Acquire::MustLoad) => {
                    held.push(block);
                    to_load.push((block, *hash));
                }
                Err(e) => {
                    arena.release(&held);
                    return fail(FailKind::Refused, format!("list refused: {origin}: {e}"));
                }
            }
        }
        let limit_blocks = self.cfg.limits.max_total_bytes / BLOCK_SIZE;
        let loaded_now = self.global_loaded.load(Ordering::Relaxed);
        if loaded_now + to_load.len() as u64 > limit_blocks {
            arena.release(&held);
            return fail(
                FailKind::Limit,
                format!(
                    "loading {} more blocks would exceed limits.max_total_bytes ({} blocks loaded)",
                    to_load.len(),
                    loaded_now
                ),
            );
        }
        Ok(Reserved { arena, held, to_load })
    }

    fn read_blocks(
        &self,
        job: &Job,
        r: &mut BlockReader,
        arena: &Arena,
        to_load: &[(u64, [u8; 32])],
        origin: &str,
    ) -> Result<(), LoadError> {
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
            r.read_at(start * BLOCK_SIZE, bytes)
                .map_err(|e| FailKind::Image.with(format!("reading the image: {e}")))?;
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
            arena.fill_run(start, bytes).map_err(|e| FailKind::Limit.with(e.to_string()))?;
            i = j;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::tests::vm_read;
    use crate::sectorlist::test_list_text;
    use crate::test_dir::TestDir;

    const BLOCKS: u64 = 16;

    struct Setup {
        dir: TestDir,
        image: PathBuf,
        /// The image's bytes.
        data: Vec<u8>,
    }

    /// A raw image of BLOCKS distinct blocks in a directory of its own.
    fn setup(name: &str) -> Setup {
        let dir = TestDir::new(&format!("loader-{name}"));
        let data: Vec<u8> = (0..BLOCKS * BLOCK_SIZE)
            .map(|i| ((i / BLOCK_SIZE) as u8).wrapping_mul(37) ^ (i as u8))
            .collect();
        let image = dir.join("base.raw");
        std::fs::write(&image, &data).unwrap();
        Setup { dir, image, data }
    }

    impl Setup {
        fn block(&self, b: u64) -> &[u8] {
            &self.data[(b * BLOCK_SIZE) as usize..((b + 1) * BLOCK_SIZE) as usize]
        }

        /// A list of `blocks` of this image, or of an image with content
        /// hash `content` instead.
        fn list(&self, blocks: &[u64], content: Option<[u8; 32]>) -> String {
            let hashed: Vec<(u64, [u8; 32])> = blocks
                .iter()
                .map(|&b| (b * SECTORS_PER_BLOCK, Sha256::digest(self.block(b)).into()))
                .collect();
            let content = content.unwrap_or_else(|| Sha256::digest(&self.data).into());
            test_list_text(self.data.len() as u64, &content, &hashed)
        }

        fn write_list(&self, text: &str) -> PathBuf {
            let p = self.dir.join("list.pcsl");
            std::fs::write(&p, text).unwrap();
            p
        }

        fn loader(&self, limits: &str) -> Loader {
            let cfg: Config =
                toml::from_str(&format!("cache_dir = {:?}\n[limits]\n{limits}", &*self.dir))
                    .unwrap();
            std::fs::create_dir_all(cfg.cache_dir.join("lists")).unwrap();
            Loader {
                ids: IdentityCache::new(&cfg.cache_dir),
                cfg,
                latest: Arc::new(vec![AtomicU64::new(1)]),
                global_loaded: Arc::new(AtomicU64::new(0)),
            }
        }

        fn job(&self, source: ListSource, arena: Option<Arc<Arena>>) -> Job {
            let cfg = ImageConfig {
                name: "img".into(),
                path: self.image.clone(),
                format: "auto".into(),
                list_file: None,
                list_redis: None,
                socket: None,
            };
            Job { image: 0, seq: 1, cfg, source, arena }
        }
    }

    fn failure(l: Loaded) -> LoadError {
        match l.result {
            Ok(ok) => panic!("loaded {} blocks", ok.blocks.len()),
            Err(e) => e,
        }
    }

    #[test]
    fn a_list_for_this_image_is_loaded_whole_and_reloads_reuse_blocks() {
        let s = setup("ok");
        let loader = s.loader("");
        let list = s.write_list(&s.list(&[1, 2, 9], None));
        let l = loader.run(s.job(ListSource::File(list.clone()), None));
        assert_eq!(l.identity.map(|id| id.virtual_size), Some(BLOCKS * BLOCK_SIZE));
        assert_eq!(l.stamp, Some(FileStamp::of_path(&s.image).unwrap()));
        let ok = l.result.unwrap();
        assert_eq!((ok.blocks.clone(), ok.read_blocks, ok.reused_blocks), (vec![1, 2, 9], 3, 0));
        assert_eq!(ok.format, "raw");
        assert_eq!(ok.list.blocks.len(), 3);
        assert_eq!(ok.text_sha, <[u8; 32]>::from(Sha256::digest(std::fs::read(&list).unwrap())));
        for b in [1, 2, 9] {
            assert_eq!(
                vm_read(ok.arena.addr(b), BLOCK_SIZE as usize).unwrap(),
                s.block(b),
                "block {b}"
            );
        }
        assert_eq!(
            vm_read(ok.arena.addr(3), BLOCK_SIZE as usize),
            Err(libc::EFAULT),
            "not listed, not readable"
        );
        assert_eq!(loader.global_loaded.load(Ordering::Relaxed), 3);

        // The next list, on the same arena: only the new block is read.
        let text = s.list(&[2, 9, 10], None);
        let job = s.job(
            ListSource::Redis("k".into(), Arc::new(text.into_bytes())),
            Some(ok.arena.clone()),
        );
        let ok2 = loader.run(job).result.unwrap();
        assert!(Arc::ptr_eq(&ok.arena, &ok2.arena));
        assert_eq!((ok2.read_blocks, ok2.reused_blocks), (1, 2));
        assert_eq!(vm_read(ok2.arena.addr(10), BLOCK_SIZE as usize).unwrap(), s.block(10));
        ok.arena.release(&ok.blocks);
        ok2.arena.release(&ok2.blocks);
        assert_eq!(ok2.arena.loaded_blocks(), 0);
    }

    #[test]
    fn a_missing_list_file_is_no_list_yet() {
        let s = setup("nolist");
        let e = failure(s.loader("").run(s.job(ListSource::File(s.dir.join("absent.pcsl")), None)));
        assert_eq!(e.kind, FailKind::NoList);
        assert!(
            e.message.starts_with("list file ")
                && e.message.ends_with("absent.pcsl does not exist"),
            "{e}"
        );
    }

    #[test]
    fn a_malformed_list_is_refused_before_the_image_is_opened() {
        let s = setup("malformed");
        let text = s.list(&[1, 2], None).replace("count: 2", "count: 3");
        let list = s.write_list(&text);
        std::fs::remove_file(&s.image).unwrap();
        let l = s.loader("").run(s.job(ListSource::File(list.clone()), None));
        assert_eq!(l.identity, None, "the image was not looked at");
        let e = failure(l);
        assert_eq!(e.kind, FailKind::Refused);
        assert!(e.message.starts_with(&format!("list refused: {}: line ", list.display())), "{e}");
    }

    #[test]
    fn lists_over_the_limits_are_refused_as_limits() {
        let s = setup("limits");
        let text = s.list(&[1, 2, 3], None);
        let list = s.write_list(&text);
        let small = s.loader("max_list_bytes = 100");
        let e = failure(small.run(s.job(ListSource::File(list.clone()), None)));
        assert_eq!(e.kind, FailKind::Limit);
        assert!(e.message.contains("over limits.max_list_bytes"), "{e}");
        let e = failure(small.run(
            s.job(ListSource::Redis("pageshare:list:x".into(), Arc::new(text.into_bytes())), None),
        ));
        assert_eq!(e.kind, FailKind::Limit);
        assert!(e.message.starts_with("list in redis key pageshare:list:x is "), "{e}");
        let e = failure(
            s.loader("max_blocks_per_image = 2").run(s.job(ListSource::File(list.clone()), None)),
        );
        assert_eq!(e.kind, FailKind::Limit);
        assert!(e.message.contains("has 3 blocks, over limits.max_blocks_per_image"), "{e}");
        let e =
            failure(s.loader("max_total_bytes = 8192").run(s.job(ListSource::File(list), None)));
        assert_eq!(e.kind, FailKind::Limit);
        assert!(
            e.message.contains("loading 3 more blocks would exceed limits.max_total_bytes"),
            "{e}"
        );
    }

    #[test]
    fn a_list_for_another_image_is_refused() {
        let s = setup("other");
        let list = s.write_list(&s.list(&[1], Some([7; 32])));
        let l = s.loader("").run(s.job(ListSource::File(list), None));
        assert!(l.identity.is_some(), "the image's identity is known even so");
        let e = failure(l);
        assert_eq!(e.kind, FailKind::Refused);
        assert!(e.message.contains("is for another image"), "{e}");
    }

    #[test]
    fn a_block_that_does_not_hash_to_the_list_refuses_the_whole_list() {
        let s = setup("hash");
        // Block 3 listed with block 2's hash.
        let hash = |b: u64| -> [u8; 32] { Sha256::digest(s.block(b)).into() };
        let blocks = [(8, hash(1)), (16, hash(2)), (24, hash(2))];
        let text = test_list_text(s.data.len() as u64, &Sha256::digest(&s.data).into(), &blocks);
        let loader = s.loader("");
        let e = failure(
            loader.run(s.job(ListSource::Redis("k".into(), Arc::new(text.into_bytes())), None)),
        );
        assert_eq!(e.kind, FailKind::Refused);
        assert!(
            e.message.starts_with("list refused: redis key k: block at sector 24 hashes to "),
            "{e}"
        );
        assert!(
            e.message.ends_with(
                "the image was modified since its content hash was taken, or the list is wrong"
            ),
            "{e}"
        );
        assert_eq!(loader.global_loaded.load(Ordering::Relaxed), 0, "nothing of it stays loaded");
    }

    #[test]
    fn an_unreadable_image_is_an_image_failure() {
        let s = setup("noimage");
        let list = s.write_list(&s.list(&[1], None));
        std::fs::remove_file(&s.image).unwrap();
        let e = failure(s.loader("").run(s.job(ListSource::File(list), None)));
        assert_eq!(e.kind, FailKind::Image);
    }

    #[test]
    fn a_redis_image_serves_its_cached_list_until_redis_answers() {
        let s = setup("cached");
        let loader = s.loader("");
        let e = failure(loader.run(s.job(ListSource::Cached, None)));
        assert_eq!(e, FailKind::NoList.with("no list yet (waiting for Redis)"));
        let id = Identity {
            virtual_size: s.data.len() as u64,
            content_sha256: Sha256::digest(&s.data).into(),
        };
        std::fs::write(cached_list_path(&loader.cfg, &id), s.list(&[4], None)).unwrap();
        let ok = loader.run(s.job(ListSource::Cached, None)).result.unwrap();
        assert_eq!(ok.blocks, vec![4]);
        ok.arena.release(&ok.blocks);
        assert_eq!(ListSource::Cached.describe(), "cached list");
    }

    #[test]
    fn a_superseded_job_is_cancelled() {
        let s = setup("cancel");
        let list = s.write_list(&s.list(&[1], None));
        let loader = s.loader("");
        loader.latest[0].store(2, Ordering::SeqCst);
        let e = failure(loader.run(s.job(ListSource::File(list), None)));
        assert_eq!(e.kind, FailKind::Cancelled);
    }
}
