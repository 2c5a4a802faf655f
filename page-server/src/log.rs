//! Logging to stderr.  Under systemd (JOURNAL_STREAM set) each line starts
//! with a syslog priority prefix "<N>" so the journal records the level.

use std::io::Write;
use std::sync::OnceLock;

fn journal() -> bool {
    static J: OnceLock<bool> = OnceLock::new();
    *J.get_or_init(|| std::env::var_os("JOURNAL_STREAM").is_some())
}

fn emit(prio: u8, level: &str, msg: &str) {
    let mut err = std::io::stderr().lock();
    for line in msg.lines() {
        let _ = if journal() {
            writeln!(err, "<{prio}>{line}")
        } else {
            let t = crate::sys::now_unix();
            writeln!(err, "{t:.3} pageshare-server[{}] {level}: {line}", std::process::id())
        };
    }
}

pub fn error(msg: &str) {
    emit(3, "error", msg);
}
pub fn warn(msg: &str) {
    emit(4, "warning", msg);
}
pub fn info(msg: &str) {
    emit(6, "info", msg);
}
