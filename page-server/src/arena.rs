//! Where preloaded blocks live.
//!
//! One arena per image identity: an anonymous private mapping as large as
//! the image's virtual disk (MAP_NORESERVE; only loaded blocks use memory),
//! marked MADV_NOHUGEPAGE and MADV_ALLOWMERGED.  Block `b` (sector `8b`)
//! lives at `base + b * 4096`, always, and nowhere else.
//!
//! **Invariant: an arena address is readable if and only if it currently
//! holds its block's complete verified bytes, and there is no instant at
//! which it is readable and incomplete.**  The mapping is created PROT_NONE
//! and no part of it is ever made writable.  fill_run() assembles a run in a
//! fresh private staging mapping elsewhere (MADV_NOHUGEPAGE, written, made
//! PROT_READ) and moves it onto the PROT_NONE arena range with
//! mremap(MREMAP_MAYMOVE | MREMAP_FIXED); then, if the kernel has the
//! series, marks it MADV_ALLOWMERGED.  mremap() replaces the target under
//! the mmap write lock; merge_pages() and process_vm_readv() look pages up
//! under the read lock, so they find either PROT_NONE (EFAULT: the client
//! reads its disk) or the finished read-only page, never a page being
//! written.  (Writing in place would not do: a block released and listed
//! again is filled at the same address, and a stale client's merge_pages()
//! would snapshot, or its process_vm_readv() copy, a half-written page.)
//! ALLOWMERGED is set after the move, not on the staging area: mremap() of
//! a VM_MERGEABLE area first unmerges its KSM pages, which fails if a signal
//! is pending, and by then the target range has already been unmapped.
//!
//! release() first makes a run PROT_NONE and only then discards it with
//! MADV_DONTNEED, so a concurrent reader faults or sees the verified bytes,
//! never zeros.  If the PROT_NONE step fails the bytes are kept (they are
//! still the verified ones) and freeing them is retried on the next release.
//! A client with a stale table can therefore never map or copy wrong data.
//! When an arena is no longer used its range is replaced by a PROT_NONE
//! reservation that is never unmapped, so the addresses are never reused.
//!
//! VMAs: each moved run is a VMA of its own (with its own anon_vma, so it
//! does not merge with its neighbours, not even with an adjacent run filled
//! separately), and each gap between runs is one: about 2 * runs + 1,
//! counted against `vm.max_map_count`.  A released run would stay a
//! PROT_NONE VMA of its own for the same reason (and the count would grow
//! with every reload), so release() replaces the whole inaccessible stretch
//! around it, up to the nearest loaded blocks, by one fresh PROT_NONE
//! reservation: one VMA per gap again.  When the kernel refuses a mapping
//! (ENOMEM) the load fails with a message that names that sysctl.  If the
//! move fails, the target is left (or made again) a PROT_NONE reservation
//! and the load fails.
//!
//! Slots are reference counted by the generations (and the load in progress)
//! that list them; a slot whose count drops to zero is freed as above.

use crate::identity::Identity;
use crate::sys::{MADV_ALLOWMERGED, PAGE_SIZE};
use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MergeMode {
    /// MADV_ALLOWMERGED accepted: clients can merge_pages() from us.
    Allowed,
    /// The kernel refused MADV_ALLOWMERGED (stock kernel: EINVAL).
    Degraded(i32),
}

struct Slot {
    hash: [u8; 32],
    refs: u32,
    loaded: bool,
}

#[derive(Default)]
struct Slots {
    map: HashMap<u64, Slot>,
    /// The loaded blocks, ordered: release() finds the loaded neighbours of
    /// a freed run here.
    loaded: BTreeSet<u64>,
    /// Loaded slots nobody references whose pages could not be made
    /// PROT_NONE: still readable, still verified; freed on a later release.
    stuck: BTreeSet<u64>,
}

pub struct Arena {
    base: usize,
    len: usize,
    pub identity: Identity,
    pub merge_mode: MergeMode,
    slots: Mutex<Slots>,
    /// Loaded blocks over all arenas (for limits.max_total_bytes and stats).
    global_loaded: Arc<AtomicU64>,
    /// Address ranges (start, len) of the arena that a failed move left
    /// unmapped and that another mapping of this process took before they
    /// could be reserved again (see rereserve()).  Never mapped over again,
    /// by a fill, a release or at drop: whoever took them keeps them.
    lost: Mutex<Vec<(usize, usize)>>,
}

// SAFETY: the raw mapping is only touched through methods that serialise on
// `slots`.
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

pub enum Acquire {
    /// Already loaded with the same hash: reference taken, nothing to read.
    Reused,
    /// New slot reserved for the caller, who must fill() it or release it.
    MustLoad,
}

/// Why the arena cannot do what a list asks.
#[derive(Debug)]
pub enum ArenaError {
    Map {
        len: usize,
        source: std::io::Error,
    },
    /// A loaded block whose verified bytes hash to something else.
    Contradicts {
        sector: u64,
        listed: [u8; 32],
        verified: [u8; 32],
    },
    BeingLoaded {
        sector: u64,
    },
    Unreserved {
        sector: u64,
    },
    AlreadyLoaded {
        sector: u64,
    },
    /// A fill of blocks whose addresses the arena lost (Arena::lost).
    Lost {
        sector: u64,
    },
    Vm(VmError),
}

impl fmt::Display for ArenaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArenaError::Map { len, source } => write!(f, "mmap of {len} bytes for the block arena: {source}"),
            ArenaError::Contradicts { sector, listed, verified } => write!(
                f,
                "the list gives sector {sector} hash {}, but this image's block hashes to {} (verified earlier)",
                crate::sys::hex(listed),
                crate::sys::hex(verified)
            ),
            ArenaError::BeingLoaded { sector } => write!(f, "block at sector {sector} is being loaded by another list"),
            ArenaError::Unreserved { sector } => write!(f, "fill of an unreserved slot (sector {sector})"),
            ArenaError::AlreadyLoaded { sector } => write!(f, "fill of a loaded slot (sector {sector})"),
            ArenaError::Lost { sector } => write!(
                f,
                "the arena lost the addresses of the block at sector {sector} to another mapping after a failed mremap(); restart the server to load it"
            ),
            ArenaError::Vm(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ArenaError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ArenaError::Map { source, .. } => Some(source),
            ArenaError::Vm(e) => Some(e),
            _ => None,
        }
    }
}

impl From<VmError> for ArenaError {
    fn from(e: VmError) -> Self {
        ArenaError::Vm(e)
    }
}

/// A system call on arena memory failed: "<what>: <error>", with the
/// vm.max_map_count hint for ENOMEM (the kernel's answer when a new mapping
/// or a split would exceed the limit).
#[derive(Debug)]
pub struct VmError {
    what: String,
    source: std::io::Error,
    /// For ENOMEM: the process's mappings and vm.max_map_count then.
    map_count: Option<(usize, String)>,
    /// What else failed while repairing after this.
    then: Option<Box<VmError>>,
}

impl VmError {
    fn new(what: impl Into<String>, source: std::io::Error) -> VmError {
        let map_count = (source.raw_os_error() == Some(libc::ENOMEM)).then(|| {
            let max = std::fs::read_to_string("/proc/sys/vm/max_map_count").unwrap_or_default();
            let have =
                std::fs::read_to_string("/proc/self/maps").map(|m| m.lines().count()).unwrap_or(0);
            (have, max.trim().to_string())
        });
        VmError { what: what.into(), source, map_count, then: None }
    }

    /// Without the vm.max_map_count hint.
    fn plain(what: impl Into<String>, source: std::io::Error) -> VmError {
        VmError { what: what.into(), source, map_count: None, then: None }
    }

    fn then(mut self, more: Option<VmError>) -> VmError {
        self.then = more.map(Box::new);
        self
    }
}

impl fmt::Display for VmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.what, self.source)?;
        if let Some((have, max)) = &self.map_count {
            write!(
                f,
                ": the process has {have} memory mappings and vm.max_map_count is {max} (each run of loaded blocks is its own mapping); raise vm.max_map_count"
            )?;
        }
        if let Some(more) = &self.then {
            write!(f, "; {more}")?;
        }
        Ok(())
    }
}

impl std::error::Error for VmError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// mprotect() of part of our own mapping.
fn protect(addr: usize, len: usize, prot: libc::c_int) -> std::io::Result<()> {
    // SAFETY: callers pass page-aligned ranges of mappings they own.
    if unsafe { libc::mprotect(addr as *mut libc::c_void, len, prot) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// madvise() of part of our own mapping.
fn advise(addr: usize, len: usize, advice: libc::c_int) -> std::io::Result<()> {
    // SAFETY: advice on page-aligned ranges of mappings the caller owns.
    if unsafe { libc::madvise(addr as *mut libc::c_void, len, advice) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A fresh private anonymous mapping outside the arena in which one run is
/// put together: 4 KiB pages (MADV_NOHUGEPAGE), written, made PROT_READ,
/// then moved into the arena whole.  Unmapped on drop unless it was moved.
struct Staging {
    addr: usize,
    len: usize,
}

impl Staging {
    fn new(data: &[u8]) -> std::io::Result<Staging> {
        let len = data.len();
        // SAFETY: a fresh anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let staging = Staging { addr: p as usize, len };
        // A VMA flag, so the arena range keeps it after the move.  Arena::new
        // already warned if the kernel has no THP to refuse.
        let _ = advise(staging.addr, len, libc::MADV_NOHUGEPAGE);
        // SAFETY: our fresh mapping, writable, len bytes; nobody else knows
        // its address.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p as *mut u8, len) };
        protect(staging.addr, len, libc::PROT_READ)?;
        Ok(staging)
    }

    /// mremap() the whole staging area onto `dst`, replacing what is there
    /// in one step.  On error the staging area is unmapped; the kernel may
    /// already have unmapped `dst` (the caller re-reserves it).
    fn move_to(self, dst: usize) -> std::io::Result<()> {
        #[cfg(test)]
        if let Some(taken) = tests::BREAK_NEXT_MOVE.with(|b| b.take()) {
            // What a kernel failure after mremap_to()'s do_munmap() of the
            // target leaves behind: the target unmapped, the source intact;
            // and, with `taken`, another thread's mmap() in the hole.
            // SAFETY: test only; the target is an arena range of the caller.
            unsafe { libc::munmap(dst as *mut libc::c_void, self.len) };
            if taken {
                tests::take_page(dst + PAGE_SIZE);
            }
            return Err(std::io::Error::from_raw_os_error(libc::ENOMEM));
        }
        // SAFETY: moves our staging mapping onto a page-aligned range of the
        // caller's arena (MREMAP_FIXED replaces only that range).
        let p = unsafe {
            libc::mremap(
                self.addr as *mut libc::c_void,
                self.len,
                self.len,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                dst as *mut libc::c_void,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        assert_eq!(p as usize, dst, "mremap(MREMAP_FIXED) moved elsewhere");
        std::mem::forget(self);
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: our own staging mapping, never published.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

impl Arena {
    pub fn new(identity: Identity, global_loaded: Arc<AtomicU64>) -> Result<Arena, ArenaError> {
        let len = (identity.virtual_size as usize).div_ceil(PAGE_SIZE).max(1) * PAGE_SIZE;
        // SAFETY: a fresh anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(ArenaError::Map { len, source: std::io::Error::last_os_error() });
        }
        let base = p as usize;
        if let Err(e) = advise(base, len, libc::MADV_NOHUGEPAGE) {
            crate::log::warn(&format!("madvise(MADV_NOHUGEPAGE): {e}"));
        }
        let merge_mode = match advise(base, len, MADV_ALLOWMERGED) {
            Ok(()) => MergeMode::Allowed,
            Err(e) => MergeMode::Degraded(e.raw_os_error().unwrap_or(0)),
        };
        // The arena itself is never written, so its PROT_NONE parts have no
        // anon_vma and a fresh reservation (reserve()) merges with them.
        Ok(Arena {
            base,
            len,
            identity,
            merge_mode,
            slots: Mutex::new(Slots::default()),
            global_loaded,
            lost: Mutex::new(Vec::new()),
        })
    }

    pub fn addr(&self, block: u64) -> u64 {
        self.base as u64 + block * PAGE_SIZE as u64
    }

    pub fn range(&self) -> (u64, u64) {
        (self.base as u64, self.len as u64)
    }

    fn blocks(&self) -> u64 {
        (self.len / PAGE_SIZE) as u64
    }

    /// Take a reference on `block` for a list that says its content hashes to
    /// `hash`.  Err if a loaded slot holds content with another hash (the
    /// list contradicts what we verified from this image).
    pub fn acquire(&self, block: u64, hash: &[u8; 32]) -> Result<Acquire, ArenaError> {
        let mut slots = self.slots.lock().expect("arena lock");
        let slots = &mut *slots;
        match slots.map.get_mut(&block) {
            Some(s) if s.loaded && s.hash == *hash => {
                if s.refs == 0 {
                    slots.stuck.remove(&block);
                }
                s.refs += 1;
                Ok(Acquire::Reused)
            }
            Some(s) if s.loaded => {
                Err(ArenaError::Contradicts { sector: block * 8, listed: *hash, verified: s.hash })
            }
            Some(_) => Err(ArenaError::BeingLoaded { sector: block * 8 }),
            None => {
                slots.map.insert(block, Slot { hash: *hash, refs: 1, loaded: false });
                Ok(Acquire::MustLoad)
            }
        }
    }

    /// Put verified bytes into the run of slots `start..start + n` (n =
    /// data.len() / 4096), all reserved by acquire() -> MustLoad: assembled
    /// read-only in a staging mapping and moved onto the PROT_NONE run in
    /// one mremap(), so the run goes from inaccessible to complete at once.
    pub fn fill_run(&self, start: u64, data: &[u8]) -> Result<(), ArenaError> {
        assert!(!data.is_empty() && data.len() & (PAGE_SIZE - 1) == 0);
        let n = (data.len() / PAGE_SIZE) as u64;
        assert!(
            start.checked_add(n).is_some_and(|end| end <= self.blocks()),
            "fill outside the arena"
        );
        let dst = self.addr(start) as usize;
        let what = |op: &str| format!("{op} for {n} blocks at sector {} of the arena", start * 8);
        // Nobody can see the staging area: put it together without the lock.
        let staging = Staging::new(data).map_err(|e| VmError::new(what("staging mapping"), e))?;
        let mut slots = self.slots.lock().expect("arena lock");
        if self.unlost(dst, data.len()) != [(dst, data.len())] {
            return Err(ArenaError::Lost { sector: start * 8 });
        }
        for b in start..start + n {
            match slots.map.get(&b) {
                None => return Err(ArenaError::Unreserved { sector: b * 8 }),
                Some(s) if s.loaded => return Err(ArenaError::AlreadyLoaded { sector: b * 8 }),
                Some(_) => {}
            }
        }
        if let Err(e) = staging.move_to(dst) {
            return Err(VmError::new(what("mremap(MREMAP_FIXED)"), e)
                .then(self.rereserve(dst, data.len()))
                .into());
        }
        for b in start..start + n {
            slots.map.get_mut(&b).expect("checked above").loaded = true;
            slots.loaded.insert(b);
        }
        self.global_loaded.fetch_add(n, Ordering::Relaxed);
        if self.merge_mode == MergeMode::Allowed {
            // The bytes are verified and in place: readable is right even
            // if this fails (the load fails and releases them).
            advise(dst, data.len(), MADV_ALLOWMERGED)
                .map_err(|e| VmError::new(what("madvise(MADV_ALLOWMERGED)"), e))?;
        }
        Ok(())
    }

    /// After a failed move: mremap() unmaps the target before it moves, and
    /// a few late failures (out of memory) leave it unmapped.  Map a
    /// PROT_NONE reservation there again without replacing anything
    /// (MAP_FIXED_NOREPLACE).  EEXIST means the target was still mapped,
    /// the usual case, or that another thread's mmap() (a staging area, the
    /// allocator) took part of the hole meanwhile: then the range is lost
    /// (Arena::lost) and never mapped over.  Some(error) if the target is
    /// not reserved now.
    fn rereserve(&self, addr: usize, len: usize) -> Option<VmError> {
        // SAFETY: maps only where nothing is mapped (MAP_FIXED_NOREPLACE).
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE
                    | libc::MAP_ANONYMOUS
                    | libc::MAP_NORESERVE
                    | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Some(VmError::plain(
                    format!("re-reserving the unmapped arena range at {addr:#x}"),
                    e,
                ));
            }
            if still_reserved(addr, len) {
                return None;
            }
            self.lost.lock().expect("arena lost ranges").push((addr, len));
            return Some(VmError::plain(
                format!(
                    "re-reserving the arena range at {addr:#x} ({len} bytes): another mapping took part of it; its blocks cannot be loaded until the server restarts"
                ),
                e,
            ));
        }
        if p as usize != addr {
            // A kernel before 4.17 takes MAP_FIXED_NOREPLACE as a hint.
            // SAFETY: the mapping we just made elsewhere.
            unsafe { libc::munmap(p, len) };
            return None;
        }
        self.advise_reservation(addr, len);
        crate::log::error(&format!(
            "the kernel unmapped the arena range at {addr:#x} ({len} bytes) in a failed mremap(); reserved it again"
        ));
        None
    }

    /// The pieces of `addr..addr + len` outside the lost ranges, in order.
    fn unlost(&self, addr: usize, len: usize) -> Vec<(usize, usize)> {
        let mut lost = self.lost.lock().expect("arena lost ranges").clone();
        lost.sort_unstable();
        let (mut at, end, mut out) = (addr, addr + len, Vec::new());
        for (a, n) in lost {
            let (a, b) = (a.max(at), (a + n).min(end));
            if a >= b {
                continue;
            }
            if a > at {
                out.push((at, a - at));
            }
            at = b;
        }
        if at < end {
            out.push((at, end - at));
        }
        out
    }

    /// The arena's flags on a fresh PROT_NONE reservation, so that it
    /// merges with its PROT_NONE neighbours (errors only cost a VMA).
    fn advise_reservation(&self, addr: usize, len: usize) {
        let _ = advise(addr, len, libc::MADV_NOHUGEPAGE);
        if self.merge_mode == MergeMode::Allowed {
            let _ = advise(addr, len, MADV_ALLOWMERGED);
        }
    }

    /// Replace blocks `lo..hi`, all inaccessible and empty, by one fresh
    /// PROT_NONE reservation (one VMA instead of the pieces moved runs
    /// leave behind).  Safe at any time: the range faults before and after.
    fn reserve(&self, lo: u64, hi: u64) -> Result<(), VmError> {
        let (addr, len) = (self.addr(lo) as usize, ((hi - lo) as usize) * PAGE_SIZE);
        // Never over a lost range; the rest is a PROT_NONE part of our own
        // mapping that holds nothing (the caller holds the lock: no fill
        // can run).
        for (addr, len) in self.unlost(addr, len) {
            if let Err(e) = map_reservation(addr, len) {
                let what =
                    format!("mmap(MAP_FIXED, PROT_NONE) of {len} bytes at {addr:#x} of the arena");
                let e = VmError::new(what, e);
                // Before Linux 6.12 a failed MAP_FIXED mapping can leave a hole.
                return Err(e.then(self.rereserve(addr, len)));
            }
            self.advise_reservation(addr, len);
        }
        Ok(())
    }

    /// Drop one reference on each block; free slots nobody lists any more:
    /// mprotect(PROT_NONE) first, then MADV_DONTNEED, per contiguous run;
    /// then tidy the VMAs (reserve()).
    pub fn release(&self, blocks: &[u64]) {
        let mut slots = self.slots.lock().expect("arena lock");
        let slots = &mut *slots;
        let mut free: Vec<u64> = std::mem::take(&mut slots.stuck).into_iter().collect();
        for b in blocks {
            if let Some(s) = slots.map.get_mut(b) {
                s.refs -= 1;
                if s.refs == 0 {
                    if s.loaded {
                        free.push(*b);
                    } else {
                        slots.map.remove(b);
                    }
                }
            }
        }
        free.sort_unstable();
        free.dedup();
        // The lock is held throughout: a freed slot can be reserved and
        // filled again only after we are done with its page.
        let mut failed: Vec<String> = Vec::new();
        let mut freed: Vec<(u64, u64)> = Vec::new();
        let mut i = 0;
        while i < free.len() {
            let mut j = i + 1;
            while j < free.len() && free[j] == free[j - 1] + 1 {
                j += 1;
            }
            let addr = self.addr(free[i]) as usize;
            let len = (j - i) * PAGE_SIZE;
            match protect(addr, len, libc::PROT_NONE) {
                Ok(()) => {
                    // SAFETY: pages inside our mapping that no generation
                    // lists, already inaccessible.
                    unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_DONTNEED) };
                    for b in &free[i..j] {
                        slots.map.remove(b);
                        slots.loaded.remove(b);
                    }
                    self.global_loaded.fetch_sub((j - i) as u64, Ordering::Relaxed);
                    freed.push((free[i], free[j - 1] + 1));
                }
                Err(e) => {
                    // Never discard a readable page (it would read as
                    // zeros): keep the verified bytes, retry later.
                    failed.push(
                        VmError::new(format!("{} blocks at sector {}", j - i, free[i] * 8), e)
                            .to_string(),
                    );
                    slots.stuck.extend(free[i..j].iter().copied());
                }
            }
            i = j;
        }
        if !failed.is_empty() {
            crate::log::error(&format!(
                "cannot make released blocks inaccessible, keeping their verified bytes in memory (retried on the next release): mprotect(PROT_NONE) of {}",
                failed.join("; ")
            ));
        }
        // Each freed run is now a PROT_NONE VMA with the anon_vma of the
        // staging area it came from, which keeps it from merging with its
        // neighbours.  Replace every inaccessible stretch that contains one,
        // from loaded block to loaded block, by one fresh reservation.
        let mut untidy: Vec<VmError> = Vec::new();
        let mut done_to = 0;
        for (a, b) in freed {
            if a < done_to {
                continue;
            }
            let lo = slots.loaded.range(..a).next_back().map_or(0, |x| x + 1);
            let hi = slots.loaded.range(b..).next().copied().unwrap_or(self.blocks());
            if let Err(e) = self.reserve(lo, hi) {
                untidy.push(e);
            }
            done_to = hi;
        }
        if let Some(first) = untidy.first() {
            crate::log::warn(&format!(
                "released blocks stay separate mappings in {} places (they still fault): {first}",
                untidy.len()
            ));
        }
    }

    pub fn loaded_blocks(&self) -> usize {
        self.slots.lock().expect("arena lock").loaded.len()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let n = self.loaded_blocks() as u64;
        self.global_loaded.fetch_sub(n, Ordering::Relaxed);
        // Replace the pages by a PROT_NONE reservation: memory is freed, the
        // addresses stay taken for the life of the process (never reused).
        // Lost ranges are someone else's now: left alone.
        for (addr, len) in self.unlost(self.base, self.len) {
            if map_reservation(addr, len).is_ok() {
                continue;
            }
            // Could not re-reserve: make it inaccessible, then drop the
            // contents; never leave readable zeros.
            match protect(addr, len, libc::PROT_NONE) {
                // SAFETY: our own mapping, now inaccessible.
                Ok(()) => unsafe {
                    libc::madvise(addr as *mut libc::c_void, len, libc::MADV_DONTNEED);
                },
                Err(e) => crate::log::error(&format!(
                    "retiring an arena: {}; its verified bytes stay in memory",
                    VmError::new("mprotect(PROT_NONE)", e)
                )),
            }
        }
    }
}

/// Replace `addr..addr + len`, a range of an arena's own mapping outside
/// its lost ranges, by a fresh PROT_NONE reservation (MAP_FIXED).
fn map_reservation(addr: usize, len: usize) -> std::io::Result<()> {
    // SAFETY: MAP_FIXED over the caller's own mapping only (see above).
    let p = unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Is `addr..addr + len` wholly covered by PROT_NONE private mappings that
/// carry the arena's MADV_NOHUGEPAGE (smaps "nh"), as the arena's
/// reservations do?  A staging area (readable), an allocator's mapping
/// (writable, no "nh") or a thread's guard page (no "nh") that took part of
/// a hole is not.  Another arena's reservation would pass: that takes an
/// arena no bigger than the hole, made in the microseconds it exists.
fn still_reserved(addr: usize, len: usize) -> bool {
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else { return false };
    let (end, mut at, mut inside) = (addr + len, addr, false);
    for l in smaps.lines() {
        if let Some(flags) = l.strip_prefix("VmFlags:") {
            if inside && !flags.split_whitespace().any(|f| f == "nh") {
                return false;
            }
            inside = false;
            continue;
        }
        let mut it = l.split_whitespace();
        let Some((a, b)) = it.next().and_then(|r| r.split_once('-')) else { continue };
        let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) else {
            continue;
        };
        let Some(perms) = it.next() else { continue };
        inside = a < end && b > addr;
        if inside {
            if a > at || perms != "---p" {
                return false;
            }
            at = b;
        }
    }
    at >= end
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::fd::FromRawFd;
    use std::sync::atomic::AtomicBool;

    thread_local! {
        /// Makes this thread's next Staging::move_to() fail the way mremap()
        /// does after it has unmapped the target; Some(true): and another
        /// mapping takes the target's second page at once.
        pub(super) static BREAK_NEXT_MOVE: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    }

    /// What another thread's mmap() can do in a hole: a writable page at
    /// `addr`, filled with 0xa5.
    pub(super) fn take_page(addr: usize) {
        // SAFETY: maps only where nothing is mapped.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                PAGE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        assert_eq!(p as usize, addr, "mmap in the hole: {}", std::io::Error::last_os_error());
        // SAFETY: the page just mapped, writable.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0xa5, PAGE_SIZE) };
    }

    /// Run `f` in a forked child, which has this thread only: no other
    /// test's mmap() can land in a hole `f` makes.  Its panic message comes
    /// back as this test's failure.
    fn in_single_threaded_child(f: impl FnOnce()) {
        let mut fds = [0; 2];
        // SAFETY: plain syscalls; the child only runs `f` and _exit()s.
        unsafe {
            assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
            let pid = libc::fork();
            assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
            if pid == 0 {
                libc::close(fds[0]);
                let msg = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                    Ok(()) => String::new(),
                    Err(p) => p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "panicked".into()),
                };
                libc::write(fds[1], msg.as_ptr().cast(), msg.len());
                libc::_exit(if msg.is_empty() { 0 } else { 1 });
            }
            libc::close(fds[1]);
            let mut out = std::fs::File::from_raw_fd(fds[0]);
            let mut msg = String::new();
            std::io::Read::read_to_string(&mut out, &mut msg).unwrap();
            let mut status = 0;
            assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
            assert!(
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                "in the child: {msg}"
            );
        }
    }

    /// Copy `len` bytes at `addr` out of this process the way a client
    /// copies from the server: process_vm_readv(), which faults (EFAULT) on
    /// PROT_NONE memory instead of reading it.
    pub fn vm_read(addr: u64, len: usize) -> Result<Vec<u8>, i32> {
        let mut buf = vec![0u8; len];
        let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: len };
        let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len };
        // SAFETY: plain syscall; the local buffer is ours and writable.
        let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(crate::sys::errno());
        }
        if n as usize != len {
            return Err(libc::EFAULT);
        }
        Ok(buf)
    }

    /// A mapping of /proc/self/smaps, clipped to the range asked for.
    #[derive(Debug)]
    struct Vma {
        start: u64,
        end: u64,
        perms: String,
        flags: Vec<String>,
    }

    /// The mappings that overlap [base, base + len), in address order.
    fn vmas(base: u64, len: u64) -> Vec<Vma> {
        let mut out: Vec<Vma> = Vec::new();
        let mut inside = false;
        for l in std::fs::read_to_string("/proc/self/smaps").unwrap().lines() {
            if let Some(f) = l.strip_prefix("VmFlags:") {
                if inside {
                    out.last_mut().unwrap().flags =
                        f.split_whitespace().map(String::from).collect();
                }
                continue;
            }
            let mut it = l.split_whitespace();
            let Some((a, b)) = it.next().and_then(|r| r.split_once('-')) else { continue };
            let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
                continue;
            };
            let Some(perms) = it.next() else { continue };
            inside = a < base + len && b > base;
            if inside {
                out.push(Vma {
                    start: a.max(base),
                    end: b.min(base + len),
                    perms: perms.into(),
                    flags: Vec::new(),
                });
            }
        }
        out
    }

    /// Number of mappings that overlap [base, base + len) (/proc/self/maps:
    /// cheaper than smaps with tens of thousands of them).
    fn vma_count(base: u64, len: u64) -> usize {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter(|l| {
                let Some((a, b)) = l.split_whitespace().next().and_then(|r| r.split_once('-'))
                else {
                    return false;
                };
                let (a, b) =
                    (u64::from_str_radix(a, 16).unwrap(), u64::from_str_radix(b, 16).unwrap());
                a < base + len && b > base
            })
            .count()
    }

    /// The range is covered by mappings with no hole, all PROT_NONE.
    fn all_reserved(base: u64, len: u64) -> bool {
        let v = vmas(base, len);
        let mut at = base;
        for m in &v {
            if m.start != at || !m.perms.starts_with("---") {
                return false;
            }
            at = m.end;
        }
        at == base + len
    }

    fn page(tag: u8) -> Vec<u8> {
        (0..PAGE_SIZE).map(|i| tag ^ (i as u8)).collect()
    }

    fn arena(pages: u64) -> Arena {
        let id = Identity { virtual_size: pages * PAGE_SIZE as u64, content_sha256: [7; 32] };
        Arena::new(id, Arc::new(AtomicU64::new(0))).unwrap()
    }

    /// The flags a mapping of the arena must carry (smaps VmFlags): 4 KiB
    /// pages always, and merge_page() allowed when the kernel has the series.
    fn assert_arena_flags(a: &Arena, v: &Vma) {
        assert!(v.flags.iter().any(|f| f == "nh"), "MADV_NOHUGEPAGE lost: {v:?}");
        let am = v.flags.iter().any(|f| f == "am");
        assert_eq!(
            am,
            a.merge_mode == MergeMode::Allowed,
            "MADV_ALLOWMERGED vs {:?}: {v:?}",
            a.merge_mode
        );
    }

    #[test]
    fn readable_iff_verified_bytes() {
        let a = arena(64);
        let (base, len) = a.range();
        // Never loaded: faults.
        assert_eq!(vm_read(a.addr(0), PAGE_SIZE), Err(libc::EFAULT));
        assert_eq!(vm_read(a.addr(63), PAGE_SIZE), Err(libc::EFAULT));
        assert_eq!(vmas(base, len).len(), 1);
        for b in (2..6).chain([10]) {
            assert!(matches!(a.acquire(b, &[b as u8; 32]).unwrap(), Acquire::MustLoad));
        }
        // Reserved but not filled: still faults.
        assert_eq!(vm_read(a.addr(2), PAGE_SIZE), Err(libc::EFAULT));
        let run: Vec<u8> = (2..6).flat_map(|b| page(b as u8)).collect();
        a.fill_run(2, &run).unwrap();
        a.fill_run(10, &page(10)).unwrap();
        assert!(a.fill_run(10, &page(10)).is_err(), "a loaded slot is never written again");
        assert!(a.fill_run(20, &page(20)).is_err(), "an unreserved slot is never written");
        assert_eq!(vm_read(a.addr(20), PAGE_SIZE), Err(libc::EFAULT));
        for b in (2..6).chain([10]) {
            assert_eq!(vm_read(a.addr(b), PAGE_SIZE).unwrap(), page(b as u8), "block {b}");
        }
        assert_eq!(vm_read(a.addr(6), PAGE_SIZE), Err(libc::EFAULT));
        assert_eq!(vm_read(a.addr(1), PAGE_SIZE), Err(libc::EFAULT));
        // One VMA per loaded run and per gap; loaded runs are read-only and
        // the moved runs kept the staging area's flags.
        let v = vmas(base, len);
        let perms: Vec<&str> = v.iter().map(|x| &x.perms[..3]).collect();
        assert_eq!(perms, ["---", "r--", "---", "r--", "---"], "{v:?}");
        for m in &v {
            assert_arena_flags(&a, m);
            assert!(!m.flags.iter().any(|f| f == "wr"), "{m:?}");
        }
        assert_eq!(a.loaded_blocks(), 5);

        // A second reference keeps block 3; releasing 3 and 4 once frees
        // only 4, which faults from then on.
        assert!(matches!(a.acquire(3, &[3; 32]).unwrap(), Acquire::Reused));
        assert!(a.acquire(4, &[9; 32]).is_err(), "contradicting hash refused");
        a.release(&[3, 4]);
        assert_eq!(vm_read(a.addr(4), PAGE_SIZE), Err(libc::EFAULT));
        assert_eq!(vm_read(a.addr(3), PAGE_SIZE).unwrap(), page(3));
        assert_eq!(vm_read(a.addr(5), PAGE_SIZE).unwrap(), page(5));
        a.release(&[2, 3, 5, 10]);
        for b in [2, 3, 5, 10] {
            assert_eq!(vm_read(a.addr(b), PAGE_SIZE), Err(libc::EFAULT), "released block {b}");
        }
        assert_eq!(a.loaded_blocks(), 0);
        assert_eq!(a.global_loaded.load(Ordering::Relaxed), 0);
        // release() re-reserves the inaccessible stretch: one mapping again,
        // with the arena's flags.
        let v = vmas(base, len);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_arena_flags(&a, &v[0]);
        // Loaded again after a release: readable again, same address.
        assert!(matches!(a.acquire(4, &[4; 32]).unwrap(), Acquire::MustLoad));
        a.fill_run(4, &page(4)).unwrap();
        assert_eq!(vm_read(a.addr(4), PAGE_SIZE).unwrap(), page(4));
        // A retired arena: the range stays reserved, and faults.
        drop(a);
        assert_eq!(vm_read(base + 4 * PAGE_SIZE as u64, PAGE_SIZE), Err(libc::EFAULT));
        assert_eq!(vmas(base, len).len(), 1);
        assert!(all_reserved(base, len));
    }

    /// The audit's case: a block is released and listed again, so it is
    /// filled again at the same address while a stale client keeps copying
    /// it.  Every copy must fault or give the whole verified page: never
    /// zeros, never the first bytes followed by zeros.  (An in-place
    /// mprotect(RW) + memcpy + mprotect(R) fill fails this within a few
    /// rounds.)
    #[test]
    fn refill_is_atomic_for_concurrent_readers() {
        const START: u64 = 64;
        const N: u64 = 64;
        let a = Arc::new(arena(256));
        let data: Vec<u8> = (START..START + N).flat_map(|b| page(b as u8)).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (a, stop) = (a.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut whole, mut faults, mut i) = (0u64, 0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    // Backwards: the copy into place runs forwards.
                    let b = START + N - 1 - i % N;
                    i += 1;
                    match vm_read(a.addr(b), PAGE_SIZE) {
                        Ok(got) if got == page(b as u8) => whole += 1,
                        Ok(got) => {
                            let good = got
                                .iter()
                                .zip(page(b as u8))
                                .take_while(|(x, y)| **x == *y)
                                .count();
                            let zeros = got.iter().filter(|x| **x == 0).count();
                            return Err(format!(
                                "block {b}: read a page that is not its verified bytes: first {good} bytes right, {zeros} zero bytes (after {whole} good reads)"
                            ));
                        }
                        Err(libc::EFAULT) => faults += 1,
                        Err(e) => return Err(format!("process_vm_readv: errno {e}")),
                    }
                }
                Ok((whole, faults))
            })
        };
        let t0 = std::time::Instant::now();
        let mut rounds = 0;
        while rounds < 300 || (t0.elapsed().as_millis() < 1500 && rounds < 20_000) {
            for b in START..START + N {
                assert!(matches!(a.acquire(b, &[b as u8; 32]).unwrap(), Acquire::MustLoad));
            }
            a.fill_run(START, &data).unwrap();
            let all: Vec<u64> = (START..START + N).collect();
            a.release(&all);
            rounds += 1;
            if reader.is_finished() {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        let (whole, faults) =
            reader.join().unwrap().unwrap_or_else(|e| panic!("after {rounds} refills: {e}"));
        eprintln!("{rounds} refills: {whole} whole pages read, {faults} faults");
        assert!(
            whole > 0 && faults > 0,
            "the reader saw both states ({whole} whole, {faults} faults)"
        );
    }

    #[test]
    fn failed_move_leaves_the_target_reserved() {
        // In a child with one thread: in this process, another test's
        // mmap() could take the hole (the next test's case).
        in_single_threaded_child(|| {
            let a = arena(32);
            let (base, len) = a.range();
            for b in 8..12 {
                a.acquire(b, &[b as u8; 32]).unwrap();
            }
            let run: Vec<u8> = (8..12).flat_map(|b| page(b as u8)).collect();
            BREAK_NEXT_MOVE.with(|x| x.set(Some(false)));
            let e = a.fill_run(8, &run).unwrap_err();
            assert!(e.to_string().contains("mremap"), "{e}");
            for b in 0..32 {
                assert_eq!(vm_read(a.addr(b), PAGE_SIZE), Err(libc::EFAULT), "block {b}");
            }
            assert!(all_reserved(base, len), "{:?}", vmas(base, len));
            assert_eq!(a.loaded_blocks(), 0);
            // The load that failed releases its reservations; the next fills.
            a.release(&[8, 9, 10, 11]);
            for b in 8..12 {
                a.acquire(b, &[b as u8; 32]).unwrap();
            }
            a.fill_run(8, &run).unwrap();
            assert_eq!(vm_read(a.addr(9), PAGE_SIZE).unwrap(), page(9));
        });
    }

    #[test]
    fn a_hole_another_mapping_took_is_never_mapped_over() {
        let a = arena(32);
        for b in 8..12 {
            a.acquire(b, &[b as u8; 32]).unwrap();
        }
        let run: Vec<u8> = (8..12).flat_map(|b| page(b as u8)).collect();
        BREAK_NEXT_MOVE.with(|x| x.set(Some(true)));
        let e = a.fill_run(8, &run).unwrap_err().to_string();
        assert!(e.contains("another mapping took part of it"), "{e}");
        let theirs = vec![0xa5u8; PAGE_SIZE];
        assert_eq!(vm_read(a.addr(9), PAGE_SIZE).unwrap(), theirs);
        // Neither a release (which re-reserves around loaded blocks), nor a
        // new fill, nor dropping the arena maps over it.
        a.release(&[8, 9, 10, 11]);
        assert_eq!(vm_read(a.addr(9), PAGE_SIZE).unwrap(), theirs);
        for b in 8..12 {
            a.acquire(b, &[b as u8; 32]).unwrap();
        }
        let e = a.fill_run(8, &run).unwrap_err();
        assert!(matches!(e, ArenaError::Lost { sector: 64 }), "{e}");
        assert_eq!(vm_read(a.addr(9), PAGE_SIZE).unwrap(), theirs);
        // The rest of the arena still loads.
        a.release(&[8, 9, 10, 11]);
        a.acquire(20, &[20; 32]).unwrap();
        a.fill_run(20, &page(20)).unwrap();
        assert_eq!(vm_read(a.addr(20), PAGE_SIZE).unwrap(), page(20));
        let taken = a.addr(9) as usize;
        drop(a);
        assert_eq!(vm_read(taken as u64, PAGE_SIZE).unwrap(), theirs);
        // SAFETY: the page take_page() mapped.
        unsafe { libc::munmap(taken as *mut libc::c_void, PAGE_SIZE) };
    }

    /// Deterministic pseudo-random numbers (xorshift64*).
    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut x = seed | 1;
        move || {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            x.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
    }

    /// Load `blocks` (sorted) the way the loader does: a reference on each,
    /// then runs of at most `max_run` consecutive blocks to read, one
    /// fill_run() each.  Returns the runs filled.
    fn load(a: &Arena, blocks: &[u64], max_run: usize) -> Vec<(u64, usize)> {
        let to_load: Vec<u64> = blocks
            .iter()
            .copied()
            .filter(|b| matches!(a.acquire(*b, &[0; 32]).unwrap(), Acquire::MustLoad))
            .collect();
        let mut runs = Vec::new();
        let mut i = 0;
        while i < to_load.len() {
            let mut j = i + 1;
            while j < to_load.len() && j - i < max_run && to_load[j] == to_load[j - 1] + 1 {
                j += 1;
            }
            runs.push((to_load[i], j - i));
            i = j;
        }
        let mut buf = Vec::new();
        for (start, n) in &runs {
            buf.clear();
            for b in *start..*start + *n as u64 {
                buf.extend_from_slice(&page(b as u8));
            }
            a.fill_run(*start, &buf).unwrap();
        }
        runs
    }

    /// Mappings expected: one per fill_run() (moved runs never merge) and
    /// one per inaccessible stretch between them.
    fn expected_vmas(a: &Arena, runs: &[(u64, usize)]) -> usize {
        let mut gaps = 0;
        let mut at = 0;
        for (start, n) in runs {
            if *start > at {
                gaps += 1;
            }
            at = start + *n as u64;
        }
        gaps + usize::from(at < a.blocks()) + runs.len()
    }

    fn random_blocks(next: &mut impl FnMut() -> u64, count: usize, of: u64) -> Vec<u64> {
        let mut set = BTreeSet::new();
        while set.len() < count {
            set.insert(next() % of);
        }
        set.into_iter().collect()
    }

    #[test]
    fn vma_count_does_not_grow_with_reloads() {
        let a = arena(4096);
        let (base, len) = a.range();
        let mut next = rng(11);
        let mut prev: Vec<u64> = Vec::new();
        for round in 0..6 {
            // A new list overlapping the previous one, as on a reload.
            let mut set: BTreeSet<u64> = random_blocks(&mut next, 300, 4096).into_iter().collect();
            set.extend(round * 500..round * 500 + 40);
            let blocks: Vec<u64> = set.into_iter().filter(|b| !prev.contains(b)).collect();
            let runs = load(&a, &blocks, 8);
            a.release(&prev);
            let now: BTreeSet<u64> = blocks.iter().copied().collect();
            for (i, b) in (0..4096).enumerate().filter(|(i, _)| i % 7 == 0) {
                let r = vm_read(a.addr(b), PAGE_SIZE);
                if now.contains(&b) {
                    assert_eq!(r.unwrap(), page(b as u8), "round {round} block {b}");
                } else {
                    assert_eq!(r, Err(libc::EFAULT), "round {round} block {b} ({i})");
                }
            }
            let have = vma_count(base, len);
            let want = expected_vmas(&a, &runs);
            assert!(have <= want, "round {round}: {have} mappings, expected at most {want}");
            prev = blocks;
        }
        a.release(&prev);
        assert_eq!(vmas(base, len).len(), 1);
        assert!(all_reserved(base, len));
    }

    #[test]
    fn enomem_names_max_map_count() {
        let m =
            VmError::new("mremap(MREMAP_FIXED)", std::io::Error::from_raw_os_error(libc::ENOMEM))
                .to_string();
        assert!(m.contains("vm.max_map_count"), "{m}");
        let m =
            VmError::new("mremap(MREMAP_FIXED)", std::io::Error::from_raw_os_error(libc::EINVAL))
                .to_string();
        assert!(!m.contains("vm.max_map_count"), "{m}");
    }

    /// Runs enomem_child in a process of its own (it uses up the mapping
    /// limit, which would make the other tests' mmap()s fail).
    #[test]
    fn load_past_max_map_count_fails_cleanly() {
        let max: usize =
            std::fs::read_to_string("/proc/sys/vm/max_map_count").unwrap().trim().parse().unwrap();
        if max > 1_000_000 {
            eprintln!("vm.max_map_count is {max}: too many mappings to run into, skipped");
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "arena::tests::enomem_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("PAGESHARE_ENOMEM_CHILD", "1")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success() && text.contains("ENOMEM CHILD OK"), "{text}");
    }

    #[test]
    #[ignore = "run by load_past_max_map_count_fails_cleanly in a process of its own"]
    fn enomem_child() {
        if std::env::var_os("PAGESHARE_ENOMEM_CHILD").is_none() {
            return;
        }
        let max: u64 =
            std::fs::read_to_string("/proc/sys/vm/max_map_count").unwrap().trim().parse().unwrap();
        // Every other block: each filled block is a mapping, and so is each gap.
        let a = arena(max + 64);
        let (base, len) = a.range();
        let mut b = 1;
        let err = loop {
            assert!(b < max + 64, "never ran out of mappings");
            a.acquire(b, &[0; 32]).unwrap();
            if let Err(e) = a.fill_run(b, &page(b as u8)) {
                break e;
            }
            b += 2;
        };
        assert!(err.to_string().contains("vm.max_map_count"), "{err}");
        // The block that failed faults, and its range is still reserved.
        assert_eq!(vm_read(a.addr(b), PAGE_SIZE), Err(libc::EFAULT));
        let at = a.addr(b);
        assert!(all_reserved(at, PAGE_SIZE as u64), "{:?}", vmas(at, PAGE_SIZE as u64));
        assert_eq!(vm_read(a.addr(b - 2), PAGE_SIZE).unwrap(), page((b - 2) as u8));
        assert_eq!(a.loaded_blocks() as u64, (b - 1) / 2);
        // Releasing everything gives one mapping back.
        let all: Vec<u64> = (1..=b).step_by(2).collect();
        a.release(&all);
        assert_eq!(vma_count(base, len), 1);
        println!("ENOMEM CHILD OK after {} blocks: {err}", (b - 1) / 2);
    }

    /// VMA counts and fill/release times for docs and reviews:
    /// `cargo test --release arena::tests::measure -- --ignored --nocapture`
    #[test]
    #[ignore = "a measurement, not a test"]
    fn measure() {
        fn one(name: &str, pages: u64, lists: &[Vec<u64>]) {
            let a = arena(pages);
            let (base, len) = a.range();
            let mut prev: Vec<u64> = Vec::new();
            for (i, blocks) in lists.iter().enumerate() {
                let t = std::time::Instant::now();
                let runs = load(&a, blocks, 256);
                let fill = t.elapsed().as_secs_f64();
                let loaded = vma_count(base, len);
                let t = std::time::Instant::now();
                a.release(&prev);
                let rel = t.elapsed().as_secs_f64();
                println!(
                    "{name} list {i}: {} blocks, {} runs: fill {:.3} s, {loaded} mappings; release of the previous list {:.3} s, {} mappings",
                    blocks.len(),
                    runs.len(),
                    fill,
                    rel,
                    vma_count(base, len)
                );
                prev = blocks.clone();
            }
            a.release(&prev);
            println!("{name}: all released: {} mappings", vma_count(base, len));
        }
        let mut next = rng(1);
        // 10,000 random blocks of a 1 GiB image, three successive lists.
        let lists: Vec<Vec<u64>> =
            (0..3).map(|_| random_blocks(&mut next, 10_000, 1 << 18)).collect();
        one("random", 1 << 18, &lists);
        // Demo-like: 6,728 blocks in 375 runs of a 3 GiB image.
        let demo = |next: &mut dyn FnMut() -> u64| {
            let mut lens = vec![1u64; 375];
            for _ in 375..6728 {
                lens[(next() % 375) as usize] += 1;
            }
            let mut at = 1000;
            let mut blocks = Vec::new();
            for l in lens {
                at += 1 + next() % 2000;
                blocks.extend(at..at + l);
                at += l;
            }
            blocks
        };
        let lists: Vec<Vec<u64>> = (0..3).map(|_| demo(&mut next)).collect();
        one("demo", 3 << 18, &lists);
    }
}
