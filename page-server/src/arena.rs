//! Where preloaded blocks live.
//!
//! One arena per image identity: an anonymous private mapping as large as
//! the image's virtual disk (MAP_NORESERVE; only loaded blocks use memory),
//! marked MADV_NOHUGEPAGE and MADV_ALLOWMERGED.  Block `b` (sector `8b`)
//! lives at `base + b * 4096`, always, and nowhere else.  So an address that
//! was ever published for this image can only ever hold that block's
//! verified content, or nothing (not present: merge_pages fails): a client
//! with a stale table can never map wrong data.  When an arena is no longer
//! used its range is replaced by a PROT_NONE reservation that is never
//! unmapped, so the addresses are never reused for anything else either.
//!
//! Slots are reference counted by the generations (and the load in progress)
//! that list them; a slot whose count drops to zero is freed with
//! MADV_DONTNEED.  The mapping is PROT_READ except while the loader fills it.

use crate::identity::Identity;
use crate::sys::{MADV_ALLOWMERGED, PAGE_SIZE};
use std::collections::HashMap;
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

pub struct Arena {
    base: usize,
    len: usize,
    pub identity: Identity,
    pub merge_mode: MergeMode,
    slots: Mutex<HashMap<u64, Slot>>,
    /// Loaded blocks over all arenas (for limits.max_total_bytes and stats).
    global_loaded: Arc<AtomicU64>,
}

// SAFETY: the raw mapping is only touched through methods that serialise on
// `slots` or write to slots the caller holds exclusively (see fill()).
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

pub enum Acquire {
    /// Already loaded with the same hash: reference taken, nothing to read.
    Reused,
    /// New slot reserved for the caller, who must fill() it or release it.
    MustLoad,
}

impl Arena {
    pub fn new(identity: Identity, global_loaded: Arc<AtomicU64>) -> Result<Arena, String> {
        let len = (identity.virtual_size as usize).div_ceil(PAGE_SIZE).max(1) * PAGE_SIZE;
        // SAFETY: a fresh anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
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
        Ok(Arena { base, len, identity, merge_mode, slots: Mutex::new(HashMap::new()), global_loaded })
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
        match slots.get_mut(&block) {
            Some(s) if s.loaded && s.hash == *hash => {
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
                slots.insert(block, Slot { hash: *hash, refs: 1, loaded: false });
                Ok(Acquire::MustLoad)
            }
        }
    }

    /// Make the whole arena writable (true) or read-only again (false).
    /// One mprotect over the whole mapping, so the VMA is never split.
    pub fn set_writable(&self, on: bool) -> Result<(), String> {
        let prot = if on { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: our own mapping, whole range.
        if unsafe { libc::mprotect(self.base as *mut libc::c_void, self.len, prot) } != 0 {
            return Err(format!("mprotect: {}", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Copy verified bytes into a slot reserved by acquire() -> MustLoad.
    /// The arena must be writable (set_writable(true)).
    pub fn fill(&self, block: u64, data: &[u8]) -> Result<(), String> {
        assert_eq!(data.len(), PAGE_SIZE);
        let mut slots = self.slots.lock().expect("arena lock");
        let slot = slots.get_mut(&block).ok_or("fill of an unreserved slot")?;
        if slot.loaded {
            return Err("fill of a loaded slot".into());
        }
        let dst = self.addr(block) as usize;
        assert!(dst + PAGE_SIZE <= self.base + self.len);
        // SAFETY: dst is a page inside our mapping, reserved for this caller
        // and not yet published (not loaded), so no one reads it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, PAGE_SIZE) };
        slot.loaded = true;
        self.global_loaded.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Drop one reference on each block; free slots nobody lists any more.
    pub fn release(&self, blocks: &[u64]) {
        let mut slots = self.slots.lock().expect("arena lock");
        let mut free: Vec<u64> = Vec::new();
        for b in blocks {
            if let Some(s) = slots.get_mut(b) {
                s.refs -= 1;
                if s.refs == 0 {
                    if s.loaded {
                        self.global_loaded.fetch_sub(1, Ordering::Relaxed);
                        free.push(*b);
                    }
                    slots.remove(b);
                }
            }
        }
        free.sort_unstable();
        // Free contiguous runs with one madvise each.  The slot can be
        // reserved again only after we drop the lock, and fill() happens
        // after that, so the discard never races a fill of the same page.
        let mut i = 0;
        while i < free.len() {
            let mut j = i + 1;
            while j < free.len() && free[j] == free[j - 1] + 1 {
                j += 1;
            }
            let addr = self.addr(free[i]) as usize;
            let len = (j - i) * PAGE_SIZE;
            // SAFETY: pages inside our mapping that no generation lists.
            unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_DONTNEED) };
            i = j;
        }
    }

    pub fn loaded_blocks(&self) -> usize {
        self.slots.lock().expect("arena lock").values().filter(|s| s.loaded).count()
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
            // Could not re-reserve: at least drop the contents.
            // SAFETY: our own mapping.
            unsafe { libc::madvise(self.base as *mut libc::c_void, self.len, libc::MADV_DONTNEED) };
        }
    }
}
