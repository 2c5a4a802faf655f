//! Thin wrappers around the Linux calls the server needs and the kernel
//! series' new constants.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

// ---------------------------------------------------------------------------
// The pageshare kernel series (kernel-syscall/).  These values are defined
// by its uapi header, kernel-syscall/include/uapi/linux/ksm.h, which this
// crate cannot include (it is built alone, e.g. into a Debian package): they
// are copied here, in this one place, and nowhere else in the server.
// tests/kernel/test_uapi_constants.py checks the copy against the header.

/// madvise(2) advice: the kernel may map pages of this range into other
/// processes with merge_pages(2).  A stock kernel answers EINVAL.
pub const MADV_ALLOWMERGED: libc::c_int = 26;
/// madvise(2) advice: undo MADV_ALLOWMERGED.
#[allow(dead_code)]
pub const MADV_DISALLOWMERGED: libc::c_int = 27;
/// Syscall numbers on x86_64 (used by clients, recorded in the status output).
pub const NR_MERGE_PAGE: i64 = 463;
pub const NR_MERGE_PAGES: i64 = 464;
// struct merge_page_vec { __u64 src; __u64 dst; }: what a client passes to
// merge_pages(pidfd, vec, n, flags); src is an address from our table.
// ---------------------------------------------------------------------------

pub const PAGE_SIZE: usize = 4096;

pub fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

pub fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// pidfd_open(getpid()): the handle clients give merge_pages(2).
pub fn pidfd_self() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the result is a new fd we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor returned by the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A sealed, read-only memfd holding `data`: F_SEAL_SHRINK|GROW|WRITE|SEAL.
pub fn sealed_memfd(name: &str, data: &[u8]) -> io::Result<OwnedFd> {
    let cname = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: cname is a valid C string.
    let fd =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    let fd = cvt(fd)?;
    // SAFETY: fresh descriptor.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut off = 0usize;
    while off < data.len() {
        // SAFETY: the pointer and length lie inside `data`.
        let n = unsafe {
            libc::pwrite(
                fd.as_raw_fd(),
                data[off..].as_ptr().cast(),
                data.len() - off,
                off as libc::off_t,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        off += n as usize;
    }
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on our fd.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) })?;
    // SAFETY: fcntl on our fd.
    let got = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) })?;
    if got & seals != seals {
        return Err(io::Error::other(format!("memfd seals {got:#x} lack {seals:#x}")));
    }
    Ok(fd)
}

pub fn set_nonblocking(fd: RawFd, on: bool) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    let new = if on { flags | libc::O_NONBLOCK } else { flags & !libc::O_NONBLOCK };
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFL, new) })?;
    Ok(())
}

/// Peer credentials of a connected Unix socket.
pub fn peer_cred(fd: RawFd) -> Option<libc::ucred> {
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred/len describe a writable buffer of the right size.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0).then_some(cred)
}

/// The start time of process `pid` (clock ticks after boot, field 22 of
/// /proc/PID/stat): with the pid, it names one process for good.  The
/// process is held by a pidfd while its stat is read, and None is returned
/// if it has exited by then (its pid might be another process's already).
pub fn process_start_time(pid: i32) -> Option<u64> {
    if pid <= 0 {
        return None;
    }
    // SAFETY: plain syscall; the result is a new fd we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fd is a fresh descriptor returned by the kernel.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd; a pidfd is readable once its process exited.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    if n != 0 {
        return None;
    }
    stat_start_time(&stat)
}

/// Field 22 (starttime) of a /proc/PID/stat line.  The command name (field
/// 2) is in parentheses and may hold spaces and parentheses itself: count
/// from the last ')'.
pub fn stat_start_time(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Memory of this process, from /proc/self/status (kB values).
pub fn self_memory_kb() -> (u64, u64) {
    let mut rss = 0;
    let mut anon = 0;
    if let Ok(s) = std::fs::read_to_string("/proc/self/status") {
        for line in s.lines() {
            let v =
                || line.split_whitespace().nth(1).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
            if line.starts_with("VmRSS:") {
                rss = v();
            } else if line.starts_with("RssAnon:") {
                anon = v();
            }
        }
    }
    (rss, anon)
}

pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: buf is writable for its length.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

pub fn now_unix() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

pub fn hex(bytes: &[u8]) -> String {
    const H: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(H[(b >> 4) as usize] as char);
        s.push(H[(b & 15) as usize] as char);
    }
    s
}

pub fn unhex32(s: &str) -> Option<[u8; 32]> {
    let b = s.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for i in 0..32 {
        let d = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        out[i] = d(b[2 * i])? << 4 | d(b[2 * i + 1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_of_a_process() {
        let line = "1234 (qemu (x) y) S 1 1234 1234 0 -1 4194560 100 0 0 0 5 6 0 0 20 0 3 0 987654 1000 20";
        assert_eq!(stat_start_time(line), Some(987654));
        assert_eq!(stat_start_time("1 (x) S 1"), None);
        let me = process_start_time(std::process::id() as i32).expect("our own start time");
        let text = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert_eq!(Some(me), stat_start_time(&text));
        assert_eq!(process_start_time(0), None);
        assert_eq!(process_start_time(i32::MAX), None);
    }
}
