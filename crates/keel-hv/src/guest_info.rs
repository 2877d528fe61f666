//! What a driver tells about the guest itself (as opposed to the process
//! that runs it): its agent, its addresses, its serial console.

use serde::{Deserialize, Serialize};

/// Whether the guest agent (qemu-guest-agent) answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum AgentState {
    /// It answered a sync within the driver's timeout.
    Answering {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        version: Option<String>,
    },
    /// No answer (not installed, not started yet, hung), with why.
    Silent { reason: String },
}

impl AgentState {
    pub fn is_answering(&self) -> bool {
        matches!(self, AgentState::Answering { .. })
    }
}

/// One address of one guest interface, as the agent reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestIp {
    /// Made [terminal-safe](keel_api::untrusted) and bounded on the way in.
    pub interface: String,
    /// Parsed: what the guest sent was an address, not any text.
    pub address: std::net::IpAddr,
    /// At most 32 (IPv4) or 128 (IPv6).
    pub prefix: u8,
}

impl GuestIp {
    /// `None` unless `address` is an IP address and `prefix` fits it.
    pub fn parse(interface: &str, address: &str, prefix: u64) -> Option<GuestIp> {
        let (address, prefix) = parse_address(address, prefix)?;
        Some(GuestIp {
            interface: guest_text(interface, keel_api::readiness::MAX_INTERFACE_NAME),
            address,
            prefix,
        })
    }
}

/// `address/prefix` if `address` is an IP address and `prefix` fits it.
pub fn parse_address(address: &str, prefix: u64) -> Option<(std::net::IpAddr, u8)> {
    let address: std::net::IpAddr = address.parse().ok()?;
    let max = if address.is_ipv4() { 32 } else { 128 };
    (prefix <= max).then_some((address, prefix as u8))
}

/// A string from the guest as it may be kept: control characters escaped
/// (it will be printed on operators' terminals), then cut to `max` bytes.
pub fn guest_text(raw: &str, max: usize) -> String {
    keel_api::untrusted::bounded(&keel_api::untrusted::terminal_safe(raw), max).into_owned()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestInfo {
    pub agent: AgentState,
    /// Empty unless the agent answered.
    #[serde(default)]
    pub ips: Vec<GuestIp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// What of the agent's answers was cut or ignored, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl GuestInfo {
    pub fn silent(reason: impl Into<String>) -> Self {
        Self {
            agent: AgentState::Silent {
                reason: keel_api::untrusted::bounded(
                    &reason.into(),
                    keel_api::readiness::MAX_REASON,
                )
                .into_owned(),
            },
            ips: Vec::new(),
            hostname: None,
            note: None,
        }
    }
}

/// Whether a snapshot's filesystems were frozen while it was taken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuiesceOutcome {
    pub quiesced: bool,
    /// Why not, or what went wrong thawing.
    pub note: Option<String>,
}

/// Both directions of a serial console.
pub trait ConsoleIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> ConsoleIo for T {}

/// An attached console session. Dropping it detaches and frees the
/// instance's one console slot.
pub struct ConsoleStream {
    pub io: Box<dyn ConsoleIo>,
    _session: Option<Box<dyn Send + Sync>>,
}

impl ConsoleStream {
    /// `session` is held for as long as the stream lives (the driver's
    /// one-session-at-a-time claim).
    pub fn new(io: Box<dyn ConsoleIo>, session: Option<Box<dyn Send + Sync>>) -> Self {
        Self {
            io,
            _session: session,
        }
    }
}

impl std::fmt::Debug for ConsoleStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleStream").finish_non_exhaustive()
    }
}

/// One console session per instance: the claim, released on drop.
#[derive(Debug, Default, Clone)]
pub struct ConsoleSlots {
    held: std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
}

pub struct ConsoleClaim {
    slots: ConsoleSlots,
    instance: String,
}

impl ConsoleSlots {
    /// `None` if a session is attached already.
    pub fn claim(&self, instance: &str) -> Option<ConsoleClaim> {
        let mut held = self.held.lock().expect("console slots");
        held.insert(instance.to_string()).then(|| ConsoleClaim {
            slots: self.clone(),
            instance: instance.to_string(),
        })
    }
}

impl Drop for ConsoleClaim {
    fn drop(&mut self) {
        self.slots
            .held
            .lock()
            .expect("console slots")
            .remove(&self.instance);
    }
}

/// Incremental search for `needle` in a growing log: remembers how far it
/// has looked, keeping the last `needle.len() - 1` bytes so a match that
/// straddles two reads is found.
#[derive(Debug, Clone, Default)]
pub struct LogScan {
    pub offset: u64,
    tail: Vec<u8>,
    pub found: bool,
    /// The guest's reset count this scan belongs to: a guest that reset
    /// boots again, and what it printed before says nothing of this boot.
    pub resets: u32,
}

impl LogScan {
    /// A scan of what the guest prints after its `resets`-th reset, which
    /// came when the log was `offset` bytes long.
    pub fn after_reset(resets: u32, offset: u64) -> Self {
        Self {
            offset,
            resets,
            ..Self::default()
        }
    }

    /// Goes on from `offset` instead: what lay between is gone (or was
    /// never there), so no match may straddle the jump.
    pub fn jump_to(&mut self, offset: u64) {
        self.offset = offset;
        self.tail.clear();
    }

    /// Feeds the bytes that follow `self.offset`.
    pub fn feed(&mut self, needle: &[u8], chunk: &[u8]) {
        if self.found || needle.is_empty() {
            self.found = true;
            return;
        }
        let mut window = std::mem::take(&mut self.tail);
        window.extend_from_slice(chunk);
        if window.windows(needle.len()).any(|w| w == needle) {
            self.found = true;
        }
        let keep = needle.len().saturating_sub(1).min(window.len());
        self.tail = window[window.len() - keep..].to_vec();
        self.offset += chunk.len() as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_finds_a_marker_split_across_reads() {
        let mut scan = LogScan::default();
        scan.feed(b"KEEL-GUEST-READY", b"boot... KEEL-GUE");
        assert!(!scan.found);
        scan.feed(b"KEEL-GUEST-READY", b"ST-READY boot_id=1\n");
        assert!(scan.found);
        assert_eq!(scan.offset, 35);
        let mut scan = LogScan::default();
        for b in b"xxKEEL-GUEST-READYxx" {
            scan.feed(b"KEEL-GUEST-READY", &[*b]);
        }
        assert!(scan.found);
        let mut scan = LogScan::default();
        scan.feed(b"READY", b"READ");
        scan.feed(b"READY", b"x READ");
        assert!(!scan.found, "no match across a gap");
    }

    #[test]
    fn one_console_session_per_instance() {
        let slots = ConsoleSlots::default();
        let first = slots.claim("web-1").unwrap();
        assert!(slots.claim("web-1").is_none());
        assert!(slots.claim("web-2").is_some());
        drop(first);
        assert!(slots.claim("web-1").is_some());
    }
}
