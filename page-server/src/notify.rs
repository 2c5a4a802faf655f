//! sd_notify(3) without libsystemd: datagrams to $NOTIFY_SOCKET.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

pub struct Notifier {
    sock: Option<(UnixDatagram, SocketAddr)>,
    /// Half of WATCHDOG_USEC, if the watchdog is on for this process.
    pub watchdog_every: Option<Duration>,
}

impl Notifier {
    pub fn from_env() -> Notifier {
        let sock = std::env::var("NOTIFY_SOCKET").ok().and_then(|p| {
            let addr = if let Some(name) = p.strip_prefix('@') {
                SocketAddr::from_abstract_name(name.as_bytes()).ok()?
            } else {
                SocketAddr::from_pathname(&p).ok()?
            };
            Some((UnixDatagram::unbound().ok()?, addr))
        });
        let pid_ok = std::env::var("WATCHDOG_PID")
            .ok()
            .map(|p| p.parse::<u32>().ok() == Some(std::process::id()))
            .unwrap_or(true);
        let watchdog_every = std::env::var("WATCHDOG_USEC")
            .ok()
            .and_then(|u| u.parse::<u64>().ok())
            .filter(|&u| u > 0 && pid_ok)
            .map(|u| Duration::from_micros(u / 2));
        Notifier { sock, watchdog_every }
    }

    pub fn send(&self, state: &str) {
        if let Some((s, addr)) = &self.sock {
            if let Err(e) = s.send_to_addr(state.as_bytes(), addr) {
                crate::log::warn(&format!("sd_notify({}): {e}", state.replace('\n', " ")));
            }
        }
    }
}
