//! Where preloaded blocks live.
//!
//! One arena per image identity: an anonymous private mapping as large as
//! the image's virtual disk (MAP_NORESERVE; only loaded blocks use memory),
//! marked MADV_NOHUGEPAGE and MADV_ALLOWMERGED.  Block `b` (sector `8b`)
//! lives at `base + b * 4096`, always, and nowhere else.
//!
//! **Invariant: an arena address is readable if and only if it currently
//! holds its block's verified bytes.**  The mapping is created PROT_NONE.
//! fill() makes just the run of blocks it fills writable, copies the
//! verified bytes and makes the run PROT_READ.  release() first makes a run
//! PROT_NONE and only then discards it with MADV_DONTNEED, so a concurrent
//! reader (merge_pages(), process_vm_readv() of a stalled client) either
//! faults or sees the verified bytes, never zeros and never other bytes.  If
//! the PROT_NONE step fails the bytes are kept (they are still the verified
//! ones) and freeing them is retried on the next release.  A client with a
//! stale table can therefore never map or copy wrong data.  When an arena
//! is no longer used its range is replaced by a PROT_NONE reservation that
//! is never unmapped, so the addresses are never reused for anything else.
//!
//! The per-run mprotect() splits the mapping into one VMA per run of loaded
//! blocks (and one per gap): about 2 * runs + 1 VMAs, counted against
//! `vm.max_map_count`.  When the kernel refuses a split (ENOMEM) the load
//! fails with a message that names that sysctl.
//!
//! Slots are reference counted by the generations (and the load in progress)
//! that list them; a slot whose count drops to zero is freed as above.

use crate::identity::Identity;
use crate::sys::{MADV_ALLOWMERGED, PAGE_SIZE};
use std::collections::{BTreeSet, HashMap};
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

/// "mprotect(...): <error>", with the vm.max_map_count hint for ENOMEM
/// (the kernel's answer when a split would exceed the mapping limit).
fn mprotect_error(what: &str, e: std::io::Error) -> String {
    if e.raw_os_error() == Some(libc::ENOMEM) {
        let max = std::fs::read_to_string("/proc/sys/vm/max_map_count").unwrap_or_default();
        format!(
            "{what}: {e}: the process would exceed vm.max_map_count ({}) memory mappings (each run of loaded blocks is its own mapping); raise vm.max_map_count",
            max.trim()
        )
    } else {
        format!("{what}: {e}")
    }
}

/// mprotect() of part of our own mapping.
fn protect(addr: usize, len: usize, prot: libc::c_int) -> std::io::Result<()> {
    // SAFETY: callers pass page-aligned ranges inside an arena mapping.
    if unsafe { libc::mprotect(addr as *mut libc::c_void, len, prot) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl Arena {
    pub fn new(identity: Identity, global_loaded: Arc<AtomicU64>) -> Result<Arena, String> {
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
            return Err(format!("mmap of {len} bytes for the block arena: {}", std::io::Error::last_os_error()));
        }
        let base = p as usize;
        // SAFETY: advice on our own mapping.
        if unsafe { libc::madvise(p, len, libc::MADV_NOHUGEPAGE) } != 0 {
            crate::log::warn(&format!("madvise(MADV_NOHUGEPAGE): {}", std::io::Error::last_os_error()));
        }
        // SAFETY: as above.
        let merge_mode = if unsafe { libc::madvise(p, len, MADV_ALLOWMERGED) } == 0 {
            MergeMode::Allowed
        } else {
            MergeMode::Degraded(crate::sys::errno())
        };
        let arena = Arena { base, len, identity, merge_mode, slots: Mutex::new(Slots::default()), global_loaded };
        arena.seed_anon_vma()?;
        Ok(arena)
    }

    /// Give the mapping its anon_vma while it is still one VMA, by writing
    /// (and discarding) its first page.  Every later split inherits that
    /// anon_vma, so a released run merges back with its PROT_NONE
    /// neighbours; otherwise each first fill of an untouched area gets an
    /// anon_vma of its own, VMAs with different anon_vmas never merge, and
    /// the VMA count would creep up with every reload.  The arena is not
    /// published yet: nobody can read the page while it is writable.
    fn seed_anon_vma(&self) -> Result<(), String> {
        if let Err(e) = protect(self.base, PAGE_SIZE, libc::PROT_READ | libc::PROT_WRITE) {
            crate::log::warn(&format!("arena: mprotect of its first page: {e} (more VMAs after releases)"));
            return Ok(());
        }
        // SAFETY: the first page of our mapping, writable now.
        unsafe {
            std::ptr::write_volatile(self.base as *mut u8, 0);
            libc::madvise(self.base as *mut libc::c_void, PAGE_SIZE, libc::MADV_DONTNEED);
        }
        protect(self.base, PAGE_SIZE, libc::PROT_NONE)
            .map_err(|e| mprotect_error("arena: mprotect(PROT_NONE) of its first page", e))
    }

    pub fn addr(&self, block: u64) -> u64 {
        self.base as u64 + block * PAGE_SIZE as u64
    }

    pub fn range(&self) -> (u64, u64) {
        (self.base as u64, self.len as u64)
    }

    /// Take a reference on `block` for a list that says its content hashes to
    /// `hash`.  Err if a loaded slot holds content with another hash (the
    /// list contradicts what we verified from this image).
    pub fn acquire(&self, block: u64, hash: &[u8; 32]) -> Result<Acquire, String> {
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
            Some(s) if s.loaded => Err(format!(
                "the list gives sector {} hash {}, but this image's block hashes to {} (verified earlier)",
                block * 8,
                crate::sys::hex(hash),
                crate::sys::hex(&s.hash)
            )),
            Some(_) => Err(format!("block at sector {} is being loaded by another list", block * 8)),
            None => {
                slots.map.insert(block, Slot { hash: *hash, refs: 1, loaded: false });
                Ok(Acquire::MustLoad)
            }
        }
    }

    /// Copy verified bytes into the run of slots `start..start + n` (n =
    /// data.len() / 4096), all reserved by acquire() -> MustLoad.  Only this
    /// run is made writable, and it is PROT_READ again before we return.
    pub fn fill_run(&self, start: u64, data: &[u8]) -> Result<(), String> {
        assert!(!data.is_empty() && data.len() & (PAGE_SIZE - 1) == 0);
        let n = (data.len() / PAGE_SIZE) as u64;
        let mut slots = self.slots.lock().expect("arena lock");
        for b in start..start + n {
            match slots.map.get(&b) {
                None => return Err(format!("fill of an unreserved slot (sector {})", b * 8)),
                Some(s) if s.loaded => return Err(format!("fill of a loaded slot (sector {})", b * 8)),
                Some(_) => {}
            }
        }
        let dst = self.addr(start) as usize;
        assert!(dst + data.len() <= self.base + self.len);
        let what = |op: &str| format!("mprotect({op}) of {n} blocks at sector {} of the arena", start * 8);
        protect(dst, data.len(), libc::PROT_READ | libc::PROT_WRITE)
            .map_err(|e| mprotect_error(&what("PROT_READ|PROT_WRITE"), e))?;
        // SAFETY: dst..dst+len is inside our mapping, now writable, and
        // reserved for this caller and not published (not loaded): nobody
        // reads it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len()) };
        for b in start..start + n {
            slots.map.get_mut(&b).expect("checked above").loaded = true;
        }
        self.global_loaded.fetch_add(n, Ordering::Relaxed);
        // The bytes are verified and in place: readable is right even if
        // this fails (the load fails and releases them).
        protect(dst, data.len(), libc::PROT_READ).map_err(|e| mprotect_error(&what("PROT_READ"), e))
    }

    /// Drop one reference on each block; free slots nobody lists any more:
    /// mprotect(PROT_NONE) first, then MADV_DONTNEED, per contiguous run.
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
                    }
                    self.global_loaded.fetch_sub((j - i) as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    // Never discard a readable page (it would read as
                    // zeros): keep the verified bytes, retry later.
                    failed.push(mprotect_error(&format!("{} blocks at sector {}", j - i, free[i] * 8), e));
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
    }

    pub fn loaded_blocks(&self) -> usize {
        self.slots.lock().expect("arena lock").map.values().filter(|s| s.loaded).count()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let n = self.loaded_blocks() as u64;
        self.global_loaded.fetch_sub(n, Ordering::Relaxed);
        // Replace the pages by a PROT_NONE reservation: memory is freed, the
        // addresses stay taken for the life of the process (never reused).
        // SAFETY: MAP_FIXED over our own mapping only.
        let p = unsafe {
            libc::mmap(
                self.base as *mut libc::c_void,
                self.len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            // Could not re-reserve: make it inaccessible, then drop the
            // contents; never leave readable zeros.
            match protect(self.base, self.len, libc::PROT_NONE) {
                // SAFETY: our own mapping, now inaccessible.
                Ok(()) => unsafe {
                    libc::madvise(self.base as *mut libc::c_void, self.len, libc::MADV_DONTNEED);
                },
                Err(e) => crate::log::error(&format!(
                    "retiring an arena: {}; its verified bytes stay in memory",
                    mprotect_error("mprotect(PROT_NONE)", e)
                )),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// (start, end, perms) of the mappings inside [base, base + len).
    fn vmas(base: u64, len: u64) -> Vec<(u64, u64, String)> {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                let (a, b) = it.next()?.split_once('-')?;
                let (a, b) = (u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?);
                let perms = it.next()?.to_string();
                (a >= base && b <= base + len).then_some((a, b, perms))
            })
            .collect()
    }

    fn page(tag: u8) -> Vec<u8> {
        (0..PAGE_SIZE).map(|i| tag ^ (i as u8)).collect()
    }

    fn arena(pages: u64) -> Arena {
        let id = Identity { virtual_size: pages * PAGE_SIZE as u64, content_sha256: [7; 32] };
        Arena::new(id, Arc::new(AtomicU64::new(0))).unwrap()
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
        // One VMA per loaded run and per gap; loaded runs are read-only.
        let v = vmas(base, len);
        let perms: Vec<&str> = v.iter().map(|x| &x.2[..3]).collect();
        assert_eq!(perms, ["---", "r--", "---", "r--", "---"], "{v:?}");
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
        // The kernel merges the PROT_NONE neighbours back into one mapping.
        let v = vmas(base, len);
        assert_eq!(v.len(), 1, "{v:?}");
        // Loaded again after a release: readable again, same address.
        assert!(matches!(a.acquire(4, &[4; 32]).unwrap(), Acquire::MustLoad));
        a.fill_run(4, &page(4)).unwrap();
        assert_eq!(vm_read(a.addr(4), PAGE_SIZE).unwrap(), page(4));
        // A retired arena: the range stays reserved, and faults.
        drop(a);
        assert_eq!(vm_read(base + 4 * PAGE_SIZE as u64, PAGE_SIZE), Err(libc::EFAULT));
        assert_eq!(vmas(base, len).len(), 1);
    }

    #[test]
    fn enomem_names_max_map_count() {
        let m = mprotect_error("mprotect(PROT_READ)", std::io::Error::from_raw_os_error(libc::ENOMEM));
        assert!(m.contains("vm.max_map_count"), "{m}");
        let m = mprotect_error("mprotect(PROT_READ)", std::io::Error::from_raw_os_error(libc::EINVAL));
        assert!(!m.contains("vm.max_map_count"), "{m}");
    }
}
