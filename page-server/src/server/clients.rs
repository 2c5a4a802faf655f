//! Client sessions on the image sockets: a client gets the current table
//! (or NO_TABLE and why) on connect and every new generation after it,
//! acknowledges each with SWITCHED and reports STATS; a client that
//! misbehaves or does not switch in time gets BYE.  Control clients are
//! accepted and read here too; their requests are in control.rs.

use super::generations::Generation;
use super::Server;
use crate::arena::MergeMode;
use crate::feedback::tally::GuestId;
use crate::proto::{self, *};
use crate::table;
use serde_json::{json, Value};
use std::fmt;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::rc::Rc;
use std::time::{Duration, Instant};

/// STATS as clients from before the migration counters send it.
const STATS_LEN_V1: usize = 48;
/// STATS with the migration counters.  Longer ones are read too: what
/// follows is for counters a later client may add.
const STATS_LEN: usize = 96;
/// STATS with the proof fields (fallback_unproven and the proof state).
const STATS_LEN_PROOF: usize = 112;

/// Whether a client uses its table, and if not, why (STATS offset 104,
/// PROTOCOL.md): what `status` and the metrics count per image.
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Proof {
    /// The client does not say (older than the field, or no STATS yet).
    #[default]
    Unknown,
    /// It uses a table proven for the file it reads: its guest shares.
    Sharing,
    /// It has no table (none published, or withdrawn).
    NoTable,
    /// It has a table but has not read with it yet.
    Unchecked,
    /// Its table is not about the file it reads (another file, format or
    /// layout): it reads from disk until a table for its file comes.
    Unproven,
    /// Its base file changed after the server verified it: it reads from
    /// disk until the server proves that file again.
    BaseChanged,
}

impl Proof {
    pub(super) const ALL: [Proof; 6] = [
        Proof::Sharing,
        Proof::NoTable,
        Proof::Unchecked,
        Proof::Unproven,
        Proof::BaseChanged,
        Proof::Unknown,
    ];

    fn from_code(code: u64) -> Proof {
        match code {
            1 => Proof::Sharing,
            2 => Proof::NoTable,
            3 => Proof::Unchecked,
            4 => Proof::Unproven,
            5 => Proof::BaseChanged,
            _ => Proof::Unknown,
        }
    }

    /// The client's proof state in a STATS payload (Unknown if it does
    /// not send one).
    pub(super) fn from_stats(p: &[u8]) -> Proof {
        if p.len() < STATS_LEN_PROOF {
            return Proof::Unknown;
        }
        Proof::from_code(u64_at(p, 104).unwrap_or(0))
    }

    pub(super) fn as_str(self) -> &'static str {
        match self {
            Proof::Unknown => "unknown",
            Proof::Sharing => "sharing",
            Proof::NoTable => "no-table",
            Proof::Unchecked => "unchecked",
            Proof::Unproven => "unproven",
            Proof::BaseChanged => "base-changed",
        }
    }
}

/// What a client's latest STATS says: its counters since it connected.
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ClientCounters {
    pub(super) lookups: u64,
    pub(super) hits: u64,
    pub(super) merged: u64,
    pub(super) merge_errors: u64,
    pub(super) fallbacks: u64,
    /// Live migration by block reference: guest pages sent as references
    /// and sent in full instead (on a source), references filled by
    /// merging, by copying, from the base image, and not at all (on a
    /// destination).
    pub(super) migration_refs_sent: u64,
    pub(super) migration_refs_refused: u64,
    pub(super) migration_refs_merged: u64,
    pub(super) migration_refs_copied: u64,
    pub(super) migration_refs_read: u64,
    pub(super) migration_refs_failed: u64,
    /// Blocks read from disk because no table was proven for the file the
    /// client reads (0 from clients older than the field).
    pub(super) fallback_unproven: u64,
}

/// A STATS payload of a length no client sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BadStats {
    pub(super) len: usize,
}

impl fmt::Display for BadStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "STATS of {} bytes (must be {STATS_LEN_V1}, or at least {STATS_LEN})", self.len)
    }
}

impl std::error::Error for BadStats {}

impl ClientCounters {
    /// The counters of a STATS payload (PROTOCOL.md): the first 48 bytes
    /// are those of every client; the migration counters that follow, and
    /// fallback_unproven after them, are 0 for a client that does not send
    /// them.
    pub(super) fn from_stats(p: &[u8]) -> Result<Self, BadStats> {
        if p.len() != STATS_LEN_V1 && p.len() < STATS_LEN {
            return Err(BadStats { len: p.len() });
        }
        // Field 0 is the generation the client uses, not a counter.
        let field = |i: usize| u64_at(p, 8 * i).unwrap_or(0);
        Ok(ClientCounters {
            lookups: field(1),
            hits: field(2),
            merged: field(3),
            merge_errors: field(4),
            fallbacks: field(5),
            migration_refs_sent: field(6),
            migration_refs_refused: field(7),
            migration_refs_merged: field(8),
            migration_refs_copied: field(9),
            migration_refs_read: field(10),
            migration_refs_failed: field(11),
            fallback_unproven: if p.len() >= STATS_LEN_PROOF { field(12) } else { 0 },
        })
    }

    /// Add `o` field by field, saturating at u64::MAX: the counters are
    /// what clients say in STATS, and one that says u64::MAX must not
    /// overflow the sums of an image (a panic in a debug build, a wrap to
    /// small numbers in a release one).
    pub(super) fn add(&mut self, o: &ClientCounters) {
        self.lookups = self.lookups.saturating_add(o.lookups);
        self.hits = self.hits.saturating_add(o.hits);
        self.merged = self.merged.saturating_add(o.merged);
        self.merge_errors = self.merge_errors.saturating_add(o.merge_errors);
        self.fallbacks = self.fallbacks.saturating_add(o.fallbacks);
        self.migration_refs_sent = self.migration_refs_sent.saturating_add(o.migration_refs_sent);
        self.migration_refs_refused =
            self.migration_refs_refused.saturating_add(o.migration_refs_refused);
        self.migration_refs_merged =
            self.migration_refs_merged.saturating_add(o.migration_refs_merged);
        self.migration_refs_copied =
            self.migration_refs_copied.saturating_add(o.migration_refs_copied);
        self.migration_refs_read = self.migration_refs_read.saturating_add(o.migration_refs_read);
        self.migration_refs_failed =
            self.migration_refs_failed.saturating_add(o.migration_refs_failed);
        self.fallback_unproven = self.fallback_unproven.saturating_add(o.fallback_unproven);
    }

    pub(super) fn json(&self) -> Value {
        json!({"lookups": self.lookups, "hits": self.hits, "merged": self.merged,
               "merge_errors": self.merge_errors, "fallbacks": self.fallbacks,
               "migration_refs_sent": self.migration_refs_sent,
               "migration_refs_refused": self.migration_refs_refused,
               "migration_refs_merged": self.migration_refs_merged,
               "migration_refs_copied": self.migration_refs_copied,
               "migration_refs_read": self.migration_refs_read,
               "migration_refs_failed": self.migration_refs_failed,
               "fallback_unproven": self.fallback_unproven})
    }
}

pub(super) enum Kind {
    Image(usize),
    Control,
}

pub(super) struct Client {
    pub(super) stream: UnixStream,
    pub(super) kind: Kind,
    pub(super) buf: Vec<u8>,
    /// Generations this client may still use (sent, not yet superseded by a
    /// SWITCHED from the client).
    pub(super) held: Vec<Rc<Generation>>,
    pub(super) waiting_since: Option<Instant>,
    pub(super) pid: i32,
    pub(super) uid: u32,
    /// The guest this client reports for: its pid and start time.
    pub(super) guest: GuestId,
    pub(super) counters: ClientCounters,
    /// What its latest STATS says about its table's proof.
    pub(super) proof: Proof,
    pub(super) connected_at: f64,
    pub(super) bad_messages: u64,
}

impl Client {
    /// The image this client is a client of (None: a control client).
    pub(super) fn image(&self) -> Option<usize> {
        match self.kind {
            Kind::Image(i) => Some(i),
            Kind::Control => None,
        }
    }
}

impl Server {
    /// The ids of the clients of image `idx`.
    pub(super) fn image_clients(&self, idx: usize) -> Vec<u64> {
        self.clients.iter().filter(|(_, c)| c.image() == Some(idx)).map(|(id, _)| *id).collect()
    }

    pub(super) fn send_table(&mut self, id: u64, gen: &Rc<Generation>) {
        let Some(c) = self.clients.get_mut(&id) else { return };
        let degraded = matches!(gen.arena.merge_mode, MergeMode::Degraded(_));
        let p = table_payload(&TableMsg {
            flags: if degraded { table::FLAG_DEGRADED } else { 0 },
            generation: gen.number,
            entries: gen.blocks.len() as u64,
            table_bytes: gen.table_bytes as u64,
            virtual_size: gen.arena.identity.virtual_size,
            content_sha256: &gen.arena.identity.content_sha256,
            server_pid: std::process::id(),
            format: &gen.format,
            published_at: gen.published_at,
            file_dev: gen.stamp.dev,
            file_ino: gen.stamp.ino,
            file_size: gen.stamp.size,
            file_mtime_ns: gen.stamp.mtime_ns,
            file_ctime_ns: gen.stamp.ctime_ns,
        });
        let msg = frame(MSG_TABLE, &p);
        match send_msg(c.stream.as_raw_fd(), &msg, &[gen.memfd.as_raw_fd(), self.pidfd.as_raw_fd()])
        {
            Ok(()) => {
                if !c.held.is_empty() && c.waiting_since.is_none() {
                    c.waiting_since = Some(Instant::now());
                }
                c.held.push(gen.clone());
            }
            Err(e) => {
                let why = format!("cannot send the table: {e}");
                self.drop_client(id, &why);
            }
        }
    }

    pub(super) fn send_no_table(&mut self, id: u64, reason: u32, why: &str) {
        let Some(c) = self.clients.get_mut(&id) else { return };
        let mut p = Vec::new();
        p.extend_from_slice(&1u32.to_le_bytes());
        p.extend_from_slice(&reason.to_le_bytes());
        let text: String = why.chars().take(1000).collect();
        p.extend_from_slice(text.as_bytes());
        let r = send_msg(c.stream.as_raw_fd(), &frame(MSG_NO_TABLE, &p), &[]);
        if let Err(e) = r {
            self.drop_client(id, &format!("cannot send: {e}"));
        }
    }

    pub(super) fn accept(&mut self, kind_of: Option<usize>) {
        loop {
            let l = match kind_of {
                Some(i) => &self.images[i].listener,
                None => &self.control,
            };
            let stream = match l.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    self.client_log(&format!("accept: {e}"));
                    return;
                }
            };
            if self.clients.len() >= self.cfg.limits.max_clients {
                let _ = send_msg(
                    stream.as_raw_fd(),
                    &frame(MSG_BYE, b"too many clients (limits.max_clients)"),
                    &[],
                );
                self.client_log("refused a client: limits.max_clients reached");
                continue;
            }
            let _ = stream.set_nonblocking(true);
            let cred = crate::sys::peer_cred(stream.as_raw_fd());
            let pid = cred.map(|c| c.pid).unwrap_or(0);
            let guest = match kind_of {
                Some(_) => (pid as u32, crate::sys::process_start_time(pid).unwrap_or(0)),
                None => (0, 0),
            };
            let id = self.next_client;
            self.next_client += 1;
            self.clients.insert(
                id,
                Client {
                    stream,
                    kind: match kind_of {
                        Some(i) => Kind::Image(i),
                        None => Kind::Control,
                    },
                    buf: Vec::new(),
                    held: Vec::new(),
                    waiting_since: None,
                    pid,
                    uid: cred.map(|c| c.uid).unwrap_or(u32::MAX),
                    guest,
                    counters: ClientCounters::default(),
                    proof: Proof::Unknown,
                    connected_at: crate::sys::now_unix(),
                    bad_messages: 0,
                },
            );
            if let Some(i) = kind_of {
                self.images[i].clients_total += 1;
                match self.images[i].current.clone() {
                    Some(gen) => self.send_table(id, &gen),
                    None => {
                        let img = &self.images[i];
                        let reason = img.state.no_table_reason();
                        let why = img.message.clone();
                        self.send_no_table(id, reason, &why);
                    }
                }
            }
        }
    }

    /// Log about clients with a budget, so a hostile client cannot flood the journal.
    pub(super) fn client_log(&mut self, msg: &str) {
        let (since, n) = &mut self.log_budget;
        if since.elapsed() > Duration::from_secs(10) {
            if *n > 20 {
                crate::log::warn(&format!("{} client messages suppressed", *n - 20));
            }
            *since = Instant::now();
            *n = 0;
        }
        *n += 1;
        if *n <= 20 {
            crate::log::warn(msg);
        }
    }

    pub(super) fn drop_client(&mut self, id: u64, why: &str) {
        if let Some(c) = self.clients.remove(&id) {
            if let Kind::Image(i) = c.kind {
                self.images[i].closed_counters.add(&c.counters);
                if !why.is_empty() {
                    let msg = format!(
                        "image {}: client pid {} disconnected: {why}",
                        self.images[i].cfg.name, c.pid
                    );
                    self.client_log(&msg);
                }
            }
            // c.held dropped here: generations nobody uses are released.
        }
    }

    fn bye(&mut self, id: u64, why: &str) {
        if let Some(c) = self.clients.get(&id) {
            let _ = send_msg(c.stream.as_raw_fd(), &frame(MSG_BYE, why.as_bytes()), &[]);
        }
        self.drop_client(id, why);
    }

    pub(super) fn read_client(&mut self, id: u64) {
        let mut tmp = [0u8; 8192];
        loop {
            let Some(c) = self.clients.get_mut(&id) else { return };
            match proto::recv_some(c.stream.as_raw_fd(), &mut tmp) {
                Ok((0, _, _)) => {
                    self.drop_client(id, "");
                    return;
                }
                Ok((n, fds, _)) => {
                    if !fds.is_empty() {
                        drop(fds);
                        self.bye(id, "clients must not send file descriptors");
                        return;
                    }
                    c.buf.extend_from_slice(&tmp[..n]);
                    if c.buf.len() > 4 * (MAX_CLIENT_PAYLOAD + HDR) {
                        self.bye(id, "too much unparsed input");
                        return;
                    }
                    let msgs = match take_messages(&mut c.buf, MAX_CLIENT_PAYLOAD) {
                        Ok(m) => m,
                        Err(e) => {
                            self.bye(id, &format!("protocol error: {e}"));
                            return;
                        }
                    };
                    for (kind, payload) in msgs {
                        if !self.clients.contains_key(&id) {
                            return;
                        }
                        self.handle_message(id, kind, &payload);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    self.drop_client(id, &format!("read: {e}"));
                    return;
                }
            }
        }
    }

    fn handle_message(&mut self, id: u64, kind: u32, p: &[u8]) {
        let handled = match self.clients.get(&id).map(|c| &c.kind) {
            Some(Kind::Image(_)) => self.image_message(id, kind, p),
            Some(Kind::Control) => self.control_message(id, kind, p),
            None => return,
        };
        if !handled {
            let c = self.clients.get_mut(&id).expect("present");
            c.bad_messages += 1;
            if c.bad_messages > 100 {
                self.bye(id, "too many unknown messages");
            } else {
                let msg = format!("client pid {}: ignored unknown message type {kind}", c.pid);
                self.client_log(&msg);
            }
        }
    }

    /// A message from a client of an image socket; false if its type is
    /// not one such a client sends.
    fn image_message(&mut self, id: u64, kind: u32, p: &[u8]) -> bool {
        match kind {
            MSG_SWITCHED => {
                let Some(gen) = u64_at(p, 0) else {
                    self.bye(id, "protocol error: SWITCHED needs 8 bytes");
                    return true;
                };
                let c = self.clients.get_mut(&id).expect("present");
                if gen != NO_GENERATION && !c.held.iter().any(|g| g.number == gen) {
                    self.bye(id, &format!("protocol error: SWITCHED to generation {gen}, which this client was never sent"));
                    return true;
                }
                c.held.retain(|g| g.number == gen);
                c.waiting_since = None;
            }
            MSG_STATS => match ClientCounters::from_stats(p) {
                // Cumulative per connection; keep the latest.
                Ok(counters) => {
                    let c = self.clients.get_mut(&id).expect("present");
                    c.counters = counters;
                    c.proof = Proof::from_stats(p);
                }
                Err(e) => self.bye(id, &format!("protocol error: {e}")),
            },
            MSG_READS | MSG_LISTED_READ => self.feedback_message(id, kind, p),
            _ => return false,
        }
        true
    }

    pub(super) fn expire_waiting(&mut self) {
        let limit = Duration::from_secs(self.cfg.limits.client_switch_timeout_secs);
        let late: Vec<u64> = self
            .clients
            .iter()
            .filter(|(_, c)| c.waiting_since.is_some_and(|t| t.elapsed() > limit))
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            self.bye(
                id,
                "did not acknowledge the new generation in time (limits.client_switch_timeout_secs); reconnect",
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{BadStats, ClientCounters, Proof};

    /// A STATS payload of `n` u64 fields 100, 101, ... (generation first).
    fn stats(n: u64) -> Vec<u8> {
        (100..100 + n).flat_map(u64::to_le_bytes).collect()
    }

    #[test]
    fn stats_from_a_client_without_migration_counters_counts_them_as_0() {
        let c = ClientCounters::from_stats(&stats(6)).unwrap();
        let want = ClientCounters {
            lookups: 101,
            hits: 102,
            merged: 103,
            merge_errors: 104,
            fallbacks: 105,
            ..Default::default()
        };
        assert_eq!(c, want);
    }

    #[test]
    fn stats_with_migration_counters_and_fields_a_later_client_adds() {
        let want = ClientCounters {
            lookups: 101,
            hits: 102,
            merged: 103,
            merge_errors: 104,
            fallbacks: 105,
            migration_refs_sent: 106,
            migration_refs_refused: 107,
            migration_refs_merged: 108,
            migration_refs_copied: 109,
            migration_refs_read: 110,
            migration_refs_failed: 111,
            fallback_unproven: 0,
        };
        assert_eq!(ClientCounters::from_stats(&stats(12)), Ok(want));
        // Unknown trailing bytes, whole fields or not, are left alone.
        assert_eq!(ClientCounters::from_stats(&stats(13)), Ok(want));
        let mut odd = stats(12);
        odd.push(7);
        assert_eq!(ClientCounters::from_stats(&odd), Ok(want));
        let j = want.json();
        assert_eq!(j["migration_refs_sent"], 106);
        assert_eq!(j["migration_refs_failed"], 111);
    }

    #[test]
    fn stats_with_the_proof_fields() {
        let mut p = stats(12);
        p.extend_from_slice(&77u64.to_le_bytes());
        for (code, want) in [
            (0, Proof::Unknown),
            (1, Proof::Sharing),
            (2, Proof::NoTable),
            (3, Proof::Unchecked),
            (4, Proof::Unproven),
            (5, Proof::BaseChanged),
            (6, Proof::Unknown),
            (u64::MAX, Proof::Unknown),
        ] {
            let mut q = p.clone();
            q.extend_from_slice(&u64::to_le_bytes(code));
            assert_eq!(Proof::from_stats(&q), want, "code {code}");
            assert_eq!(ClientCounters::from_stats(&q).unwrap().fallback_unproven, 77);
            q.extend_from_slice(&[1, 2, 3]);
            assert_eq!(Proof::from_stats(&q), want, "code {code}, and more after it");
        }
        // Shorter STATS do not say.
        assert_eq!(Proof::from_stats(&p), Proof::Unknown);
        assert_eq!(ClientCounters::from_stats(&p).unwrap().fallback_unproven, 0);
        assert_eq!(Proof::from_stats(&stats(6)), Proof::Unknown);
        assert_eq!(Proof::BaseChanged.as_str(), "base-changed");
    }

    #[test]
    fn stats_of_any_other_length_is_refused() {
        for len in [0, 8, 40, 47, 49, 56, 88, 95] {
            let p = vec![1u8; len];
            assert_eq!(ClientCounters::from_stats(&p), Err(BadStats { len }));
        }
        assert_eq!(
            BadStats { len: 56 }.to_string(),
            "STATS of 56 bytes (must be 48, or at least 96)"
        );
    }

    #[test]
    fn counters_add_up_field_by_field() {
        let one = ClientCounters::from_stats(&stats(12)).unwrap();
        let mut sum = ClientCounters::default();
        sum.add(&one);
        sum.add(&one);
        assert_eq!(sum.lookups, 202);
        assert_eq!(sum.migration_refs_sent, 212);
        assert_eq!(sum.migration_refs_copied, 218);
        assert_eq!(sum.migration_refs_failed, 222);
    }

    #[test]
    fn counters_near_u64_max_saturate() {
        // Every field of a hostile client's STATS near u64::MAX, summed
        // with another client's: u64::MAX, not a panic or a wrap.
        let near: Vec<u8> = (0..12u64).flat_map(|i| (u64::MAX - i).to_le_bytes()).collect();
        let big = ClientCounters::from_stats(&near).unwrap();
        assert_eq!(big.lookups, u64::MAX - 1);
        let mut sum = ClientCounters::default();
        sum.add(&big);
        sum.add(&big);
        let all = ClientCounters {
            lookups: u64::MAX,
            hits: u64::MAX,
            merged: u64::MAX,
            merge_errors: u64::MAX,
            fallbacks: u64::MAX,
            migration_refs_sent: u64::MAX,
            migration_refs_refused: u64::MAX,
            migration_refs_merged: u64::MAX,
            migration_refs_copied: u64::MAX,
            migration_refs_read: u64::MAX,
            migration_refs_failed: u64::MAX,
            fallback_unproven: 0,
        };
        assert_eq!(sum, all);
        sum.add(&ClientCounters::from_stats(&stats(12)).unwrap());
        assert_eq!(sum, all);
        // Below the top, a sum is exact.
        let mut exact = ClientCounters { lookups: u64::MAX - 10, ..Default::default() };
        exact.add(&ClientCounters { lookups: 10, ..Default::default() });
        assert_eq!(exact.lookups, u64::MAX);
        assert_eq!(exact.json()["lookups"], u64::MAX);
    }
}
