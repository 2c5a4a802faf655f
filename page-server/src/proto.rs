//! Socket protocol framing (page-server/PROTOCOL.md): SOCK_STREAM, every
//! message is an 8-byte header {u32 type; u32 payload length} (little
//! endian) and the payload; file descriptors travel with SCM_RIGHTS on the
//! sendmsg() that carries the header.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

pub const HDR: usize = 8;

// server -> client (image sockets)
pub const MSG_TABLE: u32 = 1;
pub const MSG_NO_TABLE: u32 = 2;
pub const MSG_BYE: u32 = 3;
// client -> server (image sockets)
pub const MSG_SWITCHED: u32 = 16;
pub const MSG_STATS: u32 = 17;
pub const MSG_READS: u32 = 18;
pub const MSG_LISTED_READ: u32 = 19;
// control socket
pub const MSG_STATUS_REQ: u32 = 32;
pub const MSG_STATUS_REPLY: u32 = 33;
pub const MSG_RELOAD_REQ: u32 = 34;
pub const MSG_RELOAD_REPLY: u32 = 35;

/// Largest payload a client may send; anything larger is a protocol error.
pub const MAX_CLIENT_PAYLOAD: usize = 4096;
/// Largest payload the server sends (status replies).
pub const MAX_SERVER_PAYLOAD: usize = 16 << 20;

pub const TABLE_PAYLOAD_LEN: usize = 136;
/// Version of the TABLE message payload (the table memfd has its own).
pub const TABLE_MSG_VERSION: u32 = 2;
/// TABLE proof flags: bit 0 = the image file fields (96..136) are valid.
pub const PROOF_FILE: u32 = 1;
/// TABLE image format codes.
pub const FORMAT_RAW: u32 = 1;
pub const FORMAT_QCOW2: u32 = 2;
pub const NO_GENERATION: u64 = u64::MAX;

/// What a TABLE message says (PROTOCOL.md, "TABLE").  Plain fields: this
/// file is also built alone by the framing fuzz target.
pub struct TableMsg<'a> {
    pub flags: u32,
    pub generation: u64,
    pub entries: u64,
    pub table_bytes: u64,
    pub virtual_size: u64,
    pub content_sha256: &'a [u8; 32],
    pub server_pid: u32,
    /// "raw" or "qcow2": the format the image was read with.
    pub format: &'a str,
    pub published_at: f64,
    /// The image file the load that published this generation verified:
    /// st_dev, st_ino, st_size, mtime and ctime in ns.
    pub file_dev: u64,
    pub file_ino: u64,
    pub file_size: u64,
    pub file_mtime_ns: i64,
    pub file_ctime_ns: i64,
}

pub fn format_code(format: &str) -> u32 {
    match format {
        "raw" => FORMAT_RAW,
        "qcow2" => FORMAT_QCOW2,
        _ => 0,
    }
}

/// The 136-byte TABLE payload, version 2, little endian.
pub fn table_payload(m: &TableMsg) -> Vec<u8> {
    let mut p = Vec::with_capacity(TABLE_PAYLOAD_LEN);
    p.extend_from_slice(&TABLE_MSG_VERSION.to_le_bytes()); // 0
    p.extend_from_slice(&m.flags.to_le_bytes()); // 4
    p.extend_from_slice(&m.generation.to_le_bytes()); // 8
    p.extend_from_slice(&m.entries.to_le_bytes()); // 16
    p.extend_from_slice(&m.table_bytes.to_le_bytes()); // 24
    p.extend_from_slice(&m.virtual_size.to_le_bytes()); // 32
    p.extend_from_slice(m.content_sha256); // 40
    p.extend_from_slice(&m.server_pid.to_le_bytes()); // 72
    p.extend_from_slice(&format_code(m.format).to_le_bytes()); // 76
    p.extend_from_slice(&m.published_at.to_bits().to_le_bytes()); // 80
    p.extend_from_slice(&PROOF_FILE.to_le_bytes()); // 88
    p.extend_from_slice(&0u32.to_le_bytes()); // 92 reserved
    p.extend_from_slice(&m.file_dev.to_le_bytes()); // 96
    p.extend_from_slice(&m.file_ino.to_le_bytes()); // 104
    p.extend_from_slice(&m.file_size.to_le_bytes()); // 112
    p.extend_from_slice(&m.file_mtime_ns.to_le_bytes()); // 120
    p.extend_from_slice(&m.file_ctime_ns.to_le_bytes()); // 128
    assert_eq!(p.len(), TABLE_PAYLOAD_LEN);
    p
}

// NO_TABLE reasons
pub const NT_LOADING: u32 = 1;
pub const NT_NO_LIST: u32 = 2;
pub const NT_REFUSED: u32 = 3;
pub const NT_IMAGE_CHANGED: u32 = 4;
pub const NT_SHUTDOWN: u32 = 5;

pub fn frame(kind: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HDR + payload.len());
    v.extend_from_slice(&kind.to_le_bytes());
    v.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    v.extend_from_slice(payload);
    v
}

/// Send one whole message (with optional fds) on a non-blocking socket.
/// A message that does not fit in the socket buffer at once is an error:
/// our messages are small, so a full buffer means the peer stopped reading.
pub fn send_msg(fd: RawFd, msg: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut iov = libc::iovec { iov_base: msg.as_ptr() as *mut libc::c_void, iov_len: msg.len() };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8).max(1)];
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    if !fds.is_empty() {
        mh.msg_control = cbuf.as_mut_ptr().cast();
        mh.msg_controllen = space;
        // SAFETY: the control buffer is large enough for one cmsg with fds.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&mh);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(c) as *mut RawFd,
                fds.len(),
            );
        }
    }
    loop {
        // SAFETY: mh describes valid buffers.
        let n = unsafe { libc::sendmsg(fd, &mh, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n as usize != msg.len() {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "peer is not reading (socket buffer full)",
            ));
        }
        return Ok(());
    }
}

/// recvmsg() into `buf`; returns bytes read (0 = EOF) and any fds received.
/// Fds are returned owned (closed on drop) so a hostile peer cannot make us
/// leak descriptors.
pub fn recv_some(fd: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>, bool)> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut cbuf = [0u64; 64];
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf.as_mut_ptr().cast();
    mh.msg_controllen = std::mem::size_of_val(&cbuf);
    let n = loop {
        // SAFETY: mh describes valid buffers.
        let n = unsafe { libc::recvmsg(fd, &mut mh, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        break n as usize;
    };
    let mut fds = Vec::new();
    // SAFETY: walking the control buffer the kernel filled.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&mh);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&mh, c);
        }
    }
    Ok((n, fds, mh.msg_flags & libc::MSG_CTRUNC != 0))
}

/// A header announcing a payload over the limit: the stream cannot be
/// trusted past it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OversizedMessage {
    pub kind: u32,
    pub len: usize,
    pub max: usize,
}

impl std::fmt::Display for OversizedMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "message type {} announces {} bytes (limit {})", self.kind, self.len, self.max)
    }
}

impl std::error::Error for OversizedMessage {}

/// Split complete messages off the front of `buf`.
/// Err on a header announcing more than `max` bytes.
pub fn take_messages(
    buf: &mut Vec<u8>,
    max: usize,
) -> Result<Vec<(u32, Vec<u8>)>, OversizedMessage> {
    let mut out = Vec::new();
    let mut pos = 0;
    while buf.len() - pos >= HDR {
        let kind = u32::from_le_bytes(buf[pos..pos + 4].try_into().expect("4"));
        let len = u32::from_le_bytes(buf[pos + 4..pos + 8].try_into().expect("4")) as usize;
        if len > max {
            return Err(OversizedMessage { kind, len, max });
        }
        if buf.len() - pos - HDR < len {
            break;
        }
        out.push((kind, buf[pos + HDR..pos + HDR + len].to_vec()));
        pos += HDR + len;
    }
    buf.drain(..pos);
    Ok(out)
}

pub fn u64_at(p: &[u8], off: usize) -> Option<u64> {
    p.get(off..off + 8).map(|b| u64::from_le_bytes(b.try_into().expect("8")))
}

/// A control request that got no usable reply.
#[derive(Debug)]
pub enum RequestError {
    Connect { path: std::path::PathBuf, source: io::Error },
    Send(io::Error),
    Read(io::Error),
    TooLarge(usize),
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RequestError::Connect { path, source } => write!(f, "{}: {source}", path.display()),
            RequestError::Send(e) => write!(f, "sending the request: {e}"),
            RequestError::Read(e) => write!(f, "reading reply: {e}"),
            RequestError::TooLarge(len) => write!(f, "reply of {len} bytes is too large"),
        }
    }
}

impl std::error::Error for RequestError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RequestError::Connect { source: e, .. }
            | RequestError::Send(e)
            | RequestError::Read(e) => Some(e),
            RequestError::TooLarge(_) => None,
        }
    }
}

/// Blocking client side: send a request and read one reply (for `status`).
pub fn request(
    path: &std::path::Path,
    kind: u32,
    payload: &[u8],
) -> Result<(u32, Vec<u8>), RequestError> {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(path)
        .map_err(|source| RequestError::Connect { path: path.into(), source })?;
    let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(10)));
    s.write_all(&frame(kind, payload)).map_err(RequestError::Send)?;
    let mut hdr = [0u8; HDR];
    s.read_exact(&mut hdr).map_err(RequestError::Read)?;
    let k = u32::from_le_bytes(hdr[..4].try_into().expect("4"));
    let len = u32::from_le_bytes(hdr[4..].try_into().expect("4")) as usize;
    if len > MAX_SERVER_PAYLOAD {
        return Err(RequestError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).map_err(RequestError::Read)?;
    Ok((k, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framing_roundtrip_and_limits() {
        let mut buf = frame(MSG_STATS, &[1, 2, 3]);
        buf.extend(frame(MSG_SWITCHED, &7u64.to_le_bytes()));
        buf.extend(&frame(MSG_STATS, &[9; 10])[..5]); // partial header
        let msgs = take_messages(&mut buf, 4096).unwrap();
        assert_eq!(msgs.len(), 2);
        assert_eq!(msgs[0], (MSG_STATS, vec![1, 2, 3]));
        assert_eq!(buf.len(), 5);
        let mut big = frame(MSG_STATS, &[]);
        big[4..8].copy_from_slice(&100_000u32.to_le_bytes());
        assert!(take_messages(&mut big, 4096).is_err());
    }

    #[test]
    fn table_payload_v2_layout() {
        let p = table_payload(&TableMsg {
            flags: 1,
            generation: 7,
            entries: 1000,
            table_bytes: 32896,
            virtual_size: 0x1122_3344_5566,
            content_sha256: &[0xab; 32],
            server_pid: 4242,
            format: "qcow2",
            published_at: 1.5,
            file_dev: 0x0803,
            file_ino: 0x00de_adbe_ef01,
            file_size: 0x7777_0000,
            file_mtime_ns: 1_795_000_000_123_456_789,
            file_ctime_ns: -5,
        });
        let u32_at = |o: usize| u32::from_le_bytes(p[o..o + 4].try_into().unwrap());
        let i64_at = |o: usize| i64::from_le_bytes(p[o..o + 8].try_into().unwrap());
        assert_eq!(p.len(), 136);
        assert_eq!((u32_at(0), u32_at(4)), (2, 1));
        assert_eq!(
            (u64_at(&p, 8), u64_at(&p, 16), u64_at(&p, 24)),
            (Some(7), Some(1000), Some(32896))
        );
        assert_eq!(u64_at(&p, 32), Some(0x1122_3344_5566));
        assert_eq!(&p[40..72], &[0xab; 32]);
        assert_eq!((u32_at(72), u32_at(76)), (4242, FORMAT_QCOW2));
        assert_eq!(f64::from_bits(u64_at(&p, 80).unwrap()), 1.5);
        assert_eq!((u32_at(88), u32_at(92)), (PROOF_FILE, 0));
        assert_eq!(
            (u64_at(&p, 96), u64_at(&p, 104), u64_at(&p, 112)),
            (Some(0x0803), Some(0x00de_adbe_ef01), Some(0x7777_0000))
        );
        assert_eq!((i64_at(120), i64_at(128)), (1_795_000_000_123_456_789, -5));
        assert_eq!(format_code("raw"), FORMAT_RAW);
    }
}
