//! A client for qemu-guest-agent (QGA) over the instance's virtio-serial
//! channel (`qga.sock`, QEMU listens, `org.qemu.guest_agent.0` in the
//! guest).
//!
//! The wire format is QMP's (one JSON object per line, `execute` and
//! `return`/`error`), but the peer is the guest, which Keel does not
//! trust to be alive or in step:
//! - The channel outlives connections: a reply to a command whose caller
//!   gave up is still delivered, to whoever connects next. Every session
//!   therefore starts with `guest-sync-delimited` (after a 0xFF byte that
//!   makes the agent drop any half-read request): its reply is preceded by
//!   0xFF and carries a fresh random id, and everything read before it is
//!   discarded.
//! - Every call is bounded by a timeout; a silent agent costs at most that.
//! - Every reply is bounded in size ([`MAX_REPLY`]), and what is kept of it
//!   is bounded too (addresses, interfaces, string lengths: see
//!   `keel_api::readiness`), with control characters escaped: it ends up
//!   in the VM's record and on operators' terminals. A reply over the bound
//!   fails that command and ends the session (the rest of it is still in
//!   the channel), never the probe: the guest loses those details, its VM
//!   keeps being reconciled.
//! - `guest-shutdown` answers nothing on success (the guest goes away).
//!
//! A connection is opened per session and dropped after it: QEMU serves one
//! client per chardev, and a held connection would keep a second Keel (or a
//! debugging `socat`) out.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

use keel_api::readiness::{
    MAX_GUEST_ADDRESSES, MAX_GUEST_INTERFACES, MAX_GUEST_TEXT, MAX_HOSTNAME,
};

use super::qmp::ReplyBody;
use crate::guest_info::{guest_text, parse_address};
use crate::{GuestInfo, GuestIp};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QgaError {
    #[error("connect to guest agent channel {path}: {reason}")]
    Connect { path: String, reason: String },
    #[error("guest agent did not answer {what} within {after:?}")]
    Timeout { what: String, after: Duration },
    #[error("guest agent command {command} failed: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    #[error("guest agent protocol error: {0}")]
    Protocol(String),
    #[error("guest agent channel closed")]
    Disconnected,
    #[error("guest agent I/O error: {0}")]
    Io(String),
    #[error("guest agent reply over {} KiB, ignored", MAX_REPLY / 1024)]
    ReplyTooLarge,
    #[error("guest agent session abandoned after: {0}")]
    Abandoned(String),
}

/// Longest reply accepted. A real `guest-network-get-interfaces` of a guest
/// with a dozen interfaces (statistics included) is under 10 KiB; the bound
/// is what one reply may cost the host in memory, whatever the guest sends.
pub const MAX_REPLY: usize = 64 * 1024;

pub struct QgaSession {
    read: BufReader<OwnedReadHalf>,
    write: OwnedWriteHalf,
    timeout: Duration,
    /// Why the session cannot be trusted to be in step any more (a reply
    /// was cut or not awaited to its end): its next read would be the rest.
    broken: Option<String>,
}

impl QgaSession {
    /// Connects and resynchronises (see the module doc); `timeout` bounds
    /// the connect-and-sync and, later, each command.
    pub async fn open(path: &Path, timeout: Duration) -> Result<QgaSession, QgaError> {
        let stream = tokio::time::timeout(timeout, UnixStream::connect(path))
            .await
            .map_err(|_| QgaError::Timeout {
                what: "connect".into(),
                after: timeout,
            })?
            .map_err(|e| QgaError::Connect {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
        let (read, write) = stream.into_split();
        let mut session = QgaSession {
            read: BufReader::new(read),
            write,
            timeout,
            broken: None,
        };
        session.sync().await?;
        Ok(session)
    }

    async fn sync(&mut self) -> Result<(), QgaError> {
        let id: u32 = rand::random::<u32>() & 0x7fff_ffff;
        let msg = json!({"execute": "guest-sync-delimited", "arguments": {"id": id}});
        let mut bytes = vec![0xff];
        bytes.extend(serde_json::to_vec(&msg).expect("serializes"));
        bytes.push(b'\n');
        self.write
            .write_all(&bytes)
            .await
            .map_err(|e| QgaError::Io(e.to_string()))?;
        let timeout = self.timeout;
        let read = &mut self.read;
        tokio::time::timeout(timeout, async move {
            loop {
                skip_past_delimiter(read).await?;
                let reply = read_line(read).await?;
                if reply.get("return").and_then(Value::as_u64) == Some(u64::from(id)) {
                    return Ok(());
                }
                // A sync reply of an earlier session: keep reading.
            }
        })
        .await
        .map_err(|_| QgaError::Timeout {
            what: "guest-sync-delimited".into(),
            after: timeout,
        })?
    }

    /// Runs `command` and returns its `return` value, within `timeout`
    /// (`None`: the session's).
    pub async fn execute(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        timeout: Option<Duration>,
    ) -> Result<Value, QgaError> {
        if let Some(why) = &self.broken {
            return Err(QgaError::Abandoned(why.clone()));
        }
        self.send(command, arguments).await?;
        let after = timeout.unwrap_or(self.timeout);
        let reply = tokio::time::timeout(after, read_line(&mut self.read))
            .await
            .map_err(|_| QgaError::Timeout {
                what: command.to_string(),
                after,
            })
            .and_then(|r| r);
        match reply {
            Ok(reply) => reply_of(command, &reply),
            Err(e) => {
                self.broken = Some(format!("{command}: {e}"));
                Err(e)
            }
        }
    }

    async fn send(&mut self, command: &str, arguments: Option<Value>) -> Result<(), QgaError> {
        let mut msg = json!({ "execute": command });
        if let Some(args) = arguments {
            msg["arguments"] = args;
        }
        let mut bytes = serde_json::to_vec(&msg).expect("serializes");
        bytes.push(b'\n');
        tokio::time::timeout(self.timeout, self.write.write_all(&bytes))
            .await
            .map_err(|_| QgaError::Timeout {
                what: format!("sending {command}"),
                after: self.timeout,
            })?
            .map_err(|e| QgaError::Io(e.to_string()))
    }

    /// `guest-info`'s version.
    pub async fn version(&mut self) -> Result<Option<String>, QgaError> {
        let info = self.execute("guest-info", None, None).await?;
        Ok(info
            .get("version")
            .and_then(Value::as_str)
            .map(|v| guest_text(v, MAX_GUEST_TEXT)))
    }

    /// The addresses of the interfaces, loopback included, as many as are
    /// kept (see [`parse_interfaces`]).
    pub async fn addresses(&mut self) -> Result<Interfaces, QgaError> {
        let ifaces = self
            .execute("guest-network-get-interfaces", None, None)
            .await?;
        Ok(parse_interfaces(&ifaces))
    }

    pub async fn hostname(&mut self) -> Result<Option<String>, QgaError> {
        let v = self.execute("guest-get-host-name", None, None).await?;
        Ok(parse_hostname(&v))
    }

    /// Freezes every freezable filesystem; the count. `timeout` bounds it
    /// (a guest with busy filesystems may take a while to flush).
    pub async fn fs_freeze(&mut self, timeout: Duration) -> Result<u32, QgaError> {
        let v = self
            .execute("guest-fsfreeze-freeze", None, Some(timeout))
            .await?;
        count(&v, "guest-fsfreeze-freeze")
    }

    pub async fn fs_thaw(&mut self, timeout: Duration) -> Result<u32, QgaError> {
        let v = self
            .execute("guest-fsfreeze-thaw", None, Some(timeout))
            .await?;
        count(&v, "guest-fsfreeze-thaw")
    }

    /// `"thawed"` or `"frozen"`.
    pub async fn fs_freeze_status(&mut self) -> Result<String, QgaError> {
        let v = self.execute("guest-fsfreeze-status", None, None).await?;
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| QgaError::Protocol(format!("fsfreeze-status returned {}", excerpt(&v))))
    }

    /// `guest-shutdown` (powerdown). On success the agent sends nothing, so
    /// a reply is awaited only briefly, for an error; silence or the
    /// channel closing is taken as accepted.
    pub async fn shutdown(&mut self) -> Result<(), QgaError> {
        self.shutdown_mode("powerdown").await
    }

    /// `guest-shutdown` with `mode: reboot`: the guest restarts its OS,
    /// which QEMU turns into a reset of the same process.
    pub async fn reboot(&mut self) -> Result<(), QgaError> {
        self.shutdown_mode("reboot").await
    }

    /// The agent answers `guest-shutdown` only when it fails: on success
    /// the guest goes down with no reply, so silence is success.
    async fn shutdown_mode(&mut self, mode: &str) -> Result<(), QgaError> {
        self.send("guest-shutdown", Some(json!({ "mode": mode })))
            .await?;
        let wait = self.timeout.min(Duration::from_secs(1));
        match tokio::time::timeout(wait, read_line(&mut self.read)).await {
            Err(_) | Ok(Err(QgaError::Disconnected)) => Ok(()),
            Ok(Err(e)) => Err(e),
            Ok(Ok(reply)) => reply_of("guest-shutdown", &reply).map(drop),
        }
    }
}

fn count(v: &Value, command: &str) -> Result<u32, QgaError> {
    v.as_u64().map(|n| n as u32).ok_or_else(|| {
        QgaError::Protocol(format!("{command} returned {}, not a count", excerpt(v)))
    })
}

fn reply_of(command: &str, msg: &Value) -> Result<Value, QgaError> {
    match super::qmp::reply_body(msg) {
        ReplyBody::Return(ret) => Ok(ret),
        ReplyBody::Error { class, desc } => Err(QgaError::Command {
            command: command.to_string(),
            class: guest_text(&class, MAX_GUEST_TEXT),
            desc: guest_text(&desc, MAX_GUEST_TEXT),
        }),
        ReplyBody::NotAReply => Err(QgaError::Protocol(format!(
            "expected a reply to {command}, got {}",
            excerpt(msg)
        ))),
    }
}

/// Enough of a guest's JSON to say what it was, safe to print.
fn excerpt(v: &Value) -> String {
    guest_text(&v.to_string(), 128)
}

/// Discards everything up to and including the next 0xFF, without keeping
/// it: what precedes a sync reply is stale, and may be any size.
async fn skip_past_delimiter(read: &mut BufReader<OwnedReadHalf>) -> Result<(), QgaError> {
    loop {
        let buf = read
            .fill_buf()
            .await
            .map_err(|e| QgaError::Io(e.to_string()))?;
        if buf.is_empty() {
            return Err(QgaError::Disconnected);
        }
        match buf.iter().position(|b| *b == 0xff) {
            Some(at) => {
                read.consume(at + 1);
                return Ok(());
            }
            None => {
                let n = buf.len();
                read.consume(n);
            }
        }
    }
}

async fn read_line(read: &mut BufReader<OwnedReadHalf>) -> Result<Value, QgaError> {
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut *read)
            .take(MAX_REPLY as u64 + 1)
            .read_until(b'\n', &mut line)
            .await
            .map_err(|e| QgaError::Io(e.to_string()))?;
        if n == 0 {
            return Err(QgaError::Disconnected);
        }
        if n > MAX_REPLY {
            return Err(QgaError::ReplyTooLarge);
        }
        // A stray delimiter byte (a late sync reply) is not JSON.
        let text: Vec<u8> = line.iter().copied().filter(|b| *b != 0xff).collect();
        if text.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        return serde_json::from_slice(&text)
            .map_err(|e| QgaError::Protocol(format!("invalid JSON from the guest agent: {e}")));
    }
}

/// What is kept of a `guest-network-get-interfaces` answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Interfaces {
    pub ips: Vec<GuestIp>,
    /// What was left out, for the readiness's note.
    pub dropped: Vec<String>,
}

/// `guest-network-get-interfaces` → addresses, tolerating missing fields.
/// Keeps the first [`MAX_GUEST_INTERFACES`] interfaces and the first
/// [`MAX_GUEST_ADDRESSES`] addresses in all, names cut to
/// [`keel_api::readiness::MAX_INTERFACE_NAME`], and drops what is not an IP address with a
/// prefix that fits it.
pub fn parse_interfaces(v: &Value) -> Interfaces {
    let ifaces = v.as_array().map(Vec::as_slice).unwrap_or_default();
    let mut out = Interfaces::default();
    let (mut offered, mut unparsed) = (0usize, 0usize);
    for iface in ifaces.iter().take(MAX_GUEST_INTERFACES) {
        let raw_name = iface.get("name").and_then(Value::as_str).unwrap_or("?");
        let name = guest_text(raw_name, keel_api::readiness::MAX_INTERFACE_NAME);
        for addr in iface
            .get("ip-addresses")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let parsed = addr
                .get("ip-address")
                .and_then(Value::as_str)
                .zip(addr.get("prefix").and_then(Value::as_u64))
                .and_then(|(address, prefix)| parse_address(address, prefix));
            let Some((address, prefix)) = parsed else {
                unparsed += 1;
                continue;
            };
            offered += 1;
            if out.ips.len() < MAX_GUEST_ADDRESSES {
                out.ips.push(GuestIp {
                    interface: name.clone(),
                    address,
                    prefix,
                });
            }
        }
    }
    if ifaces.len() > MAX_GUEST_INTERFACES {
        out.dropped.push(format!(
            "kept the first {MAX_GUEST_INTERFACES} of {} interfaces",
            ifaces.len()
        ));
    }
    if unparsed > 0 {
        out.dropped.push(format!(
            "dropped {unparsed} addresses that were not an IP address with a fitting prefix"
        ));
    }
    if offered > out.ips.len() {
        out.dropped
            .push(format!("kept {} of {offered} addresses", out.ips.len()));
    }
    out
}

/// `guest-get-host-name` → the name, escaped and cut to [`MAX_HOSTNAME`].
pub fn parse_hostname(v: &Value) -> Option<String> {
    v.get("host-name")
        .and_then(Value::as_str)
        .map(|h| guest_text(h, MAX_HOSTNAME))
}

/// One bounded look: sync, version, host name, addresses. A guest whose
/// agent does not answer is `Silent` with the reason, never an error; one
/// whose answers are too big or malformed is answering, without the
/// details it spoiled, and a note saying so.
pub async fn probe(path: &Path, timeout: Duration) -> GuestInfo {
    let mut session = match QgaSession::open(path, timeout).await {
        Ok(s) => s,
        Err(e) => return GuestInfo::silent(e.to_string()),
    };
    let version = match session.version().await {
        Ok(v) => v,
        Err(e) => return GuestInfo::silent(e.to_string()),
    };
    let mut notes = Vec::new();
    // An agent that answers but refuses these (a guest's allow/deny list)
    // is still answering; its addresses are just unknown. The host name
    // goes first: it is small, and a spoiled address list ends the session.
    let hostname = match session.hostname().await {
        Ok(h) => h,
        Err(e) => {
            notes.extend(note_of("guest-get-host-name", &e));
            None
        }
    };
    let ips = match session.addresses().await {
        Ok(kept) => {
            notes.extend(kept.dropped);
            kept.ips
        }
        Err(e) => {
            notes.extend(note_of("guest-network-get-interfaces", &e));
            Vec::new()
        }
    };
    GuestInfo {
        agent: crate::AgentState::Answering { version },
        ips,
        hostname,
        note: (!notes.is_empty()).then(|| {
            keel_api::untrusted::bounded(&notes.join("; "), keel_api::readiness::MAX_REASON)
                .into_owned()
        }),
    }
}

/// A refusal is the guest's choice and says nothing; any other failure is
/// worth telling.
fn note_of(command: &str, e: &QgaError) -> Option<String> {
    (!matches!(e, QgaError::Command { .. })).then(|| format!("{command}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A scripted agent: first sends a stale reply left from an earlier
    /// session (as a real channel does after a caller timed out), then
    /// answers syncs with the delimiter and a few commands.
    async fn fake_agent(listener: UnixListener, hang_on: Option<&'static str>) {
        fake_agent_answering(listener, hang_on, |_| None).await
    }

    /// [`fake_agent`], with the raw reply lines `answer` gives for some
    /// commands instead of its own.
    async fn fake_agent_answering(
        listener: UnixListener,
        hang_on: Option<&'static str>,
        answer: fn(&str) -> Option<Vec<u8>>,
    ) {
        let (stream, _) = listener.accept().await.unwrap();
        let (read, mut write) = stream.into_split();
        let mut read = BufReader::new(read);
        write
            .write_all(b"{\"return\": {\"stale\": true}}\n")
            .await
            .unwrap();
        let mut line = Vec::new();
        loop {
            line.clear();
            if read.read_until(b'\n', &mut line).await.unwrap() == 0 {
                return;
            }
            let text: Vec<u8> = line.iter().copied().filter(|b| *b != 0xff).collect();
            let msg: Value = serde_json::from_slice(&text).unwrap();
            let cmd = msg["execute"].as_str().unwrap().to_string();
            if Some(cmd.as_str()) == hang_on {
                continue;
            }
            if let Some(raw) = answer(&cmd) {
                write.write_all(&raw).await.unwrap();
                continue;
            }
            let reply = match cmd.as_str() {
                "guest-sync-delimited" => {
                    // An old sync reply first: must be skipped by id.
                    write.write_all(b"\xff{\"return\": 1}\n").await.unwrap();
                    let id = &msg["arguments"]["id"];
                    write.write_all(b"\xff").await.unwrap();
                    json!({ "return": id })
                }
                "guest-info" => json!({"return": {"version": "7.2.0"}}),
                "guest-network-get-interfaces" => json!({"return": [
                    {"name": "lo", "ip-addresses": [
                        {"ip-address-type": "ipv4", "ip-address": "127.0.0.1", "prefix": 8}]},
                    {"name": "eth0", "hardware-address": "52:54:00:12:34:56", "ip-addresses": [
                        {"ip-address-type": "ipv4", "ip-address": "10.0.2.15", "prefix": 24},
                        {"ip-address-type": "ipv6", "ip-address": "fe80::5054:ff:fe12:3456", "prefix": 64}]}
                ]}),
                "guest-get-host-name" => json!({"return": {"host-name": "web"}}),
                "guest-fsfreeze-freeze" => json!({"return": 2}),
                "guest-fsfreeze-thaw" => json!({"return": 2}),
                "guest-shutdown" => return,
                _ => json!({"error": {"class": "CommandNotFound", "desc": "nope"}}),
            };
            let mut bytes = serde_json::to_vec(&reply).unwrap();
            bytes.push(b'\n');
            write.write_all(&bytes).await.unwrap();
        }
    }

    fn socket() -> (tempfile::TempDir, std::path::PathBuf, UnixListener) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qga.sock");
        let listener = UnixListener::bind(&path).unwrap();
        (dir, path, listener)
    }

    #[tokio::test]
    async fn sync_skips_stale_replies_and_commands_answer() {
        let (_dir, path, listener) = socket();
        tokio::spawn(fake_agent(listener, None));
        let info = probe(&path, Duration::from_secs(2)).await;
        assert_eq!(
            info.agent,
            crate::AgentState::Answering {
                version: Some("7.2.0".into())
            }
        );
        let addrs: Vec<String> = info.ips.iter().map(|i| i.address.to_string()).collect();
        assert_eq!(addrs, ["127.0.0.1", "10.0.2.15", "fe80::5054:ff:fe12:3456"]);
        assert_eq!(info.ips[1].interface, "eth0");
        assert_eq!(info.ips[1].prefix, 24);
        assert_eq!(info.hostname.as_deref(), Some("web"));
    }

    #[tokio::test]
    async fn freeze_thaw_and_shutdown() {
        let (_dir, path, listener) = socket();
        tokio::spawn(fake_agent(listener, None));
        let mut s = QgaSession::open(&path, Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(s.fs_freeze(Duration::from_secs(2)).await.unwrap(), 2);
        assert_eq!(s.fs_thaw(Duration::from_secs(2)).await.unwrap(), 2);
        let err = s.execute("guest-nope", None, None).await.unwrap_err();
        assert!(matches!(err, QgaError::Command { ref class, .. } if class == "CommandNotFound"));
        s.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn a_silent_agent_is_bounded() {
        let (_dir, path, listener) = socket();
        tokio::spawn(fake_agent(listener, Some("guest-sync-delimited")));
        let started = std::time::Instant::now();
        let info = probe(&path, Duration::from_millis(300)).await;
        assert!(started.elapsed() < Duration::from_secs(2));
        let crate::AgentState::Silent { reason } = info.agent else {
            panic!("{info:?}")
        };
        assert!(reason.contains("guest-sync-delimited"), "{reason}");

        // Nobody listening at all: silent too, with the connect error.
        let info = probe(
            Path::new("/nonexistent/qga.sock"),
            Duration::from_millis(300),
        )
        .await;
        assert!(!info.agent.is_answering());
    }

    #[tokio::test]
    async fn a_hung_freeze_times_out() {
        let (_dir, path, listener) = socket();
        tokio::spawn(fake_agent(listener, Some("guest-fsfreeze-freeze")));
        let mut s = QgaSession::open(&path, Duration::from_secs(2))
            .await
            .unwrap();
        let err = s.fs_freeze(Duration::from_millis(200)).await.unwrap_err();
        assert!(matches!(err, QgaError::Timeout { .. }), "{err}");
    }

    /// The reply of issue 32: one 20 KB interface name and 2,000 addresses
    /// (a few of them not addresses at all), ~100 KB in all.
    fn hostile_interfaces() -> Value {
        let addrs: Vec<Value> = (0..2_000u32)
            .map(|i| match i {
                0 => json!({"ip-address": "not-an-ip\u{1b}[2J", "prefix": 8}),
                1 => json!({"ip-address": "10.0.0.1", "prefix": 200}),
                2 => json!({"ip-address": "10.0.0.2", "prefix": 33}),
                3 => json!({"ip-address": "10.0.0.3"}),
                _ => json!({"ip-address": format!("10.{}.{}.1", i / 256, i % 256), "prefix": 24}),
            })
            .collect();
        let mut ifaces = vec![json!({"name": "x".repeat(20_000), "ip-addresses": addrs})];
        for i in 0..30 {
            ifaces.push(json!({"name": format!("veth{i}"), "ip-addresses": [
                {"ip-address": format!("fd00::{i}"), "prefix": 64}]}));
        }
        Value::Array(ifaces)
    }

    #[test]
    fn what_is_kept_of_a_hostile_interface_list_is_capped() {
        let kept = parse_interfaces(&hostile_interfaces());
        assert_eq!(kept.ips.len(), MAX_GUEST_ADDRESSES);
        let name = &kept.ips[0].interface;
        assert!(
            name.len() <= keel_api::readiness::MAX_INTERFACE_NAME && name.ends_with('…'),
            "{name}"
        );
        assert_eq!(kept.ips[0].address.to_string(), "10.0.4.1");
        assert_eq!(kept.ips[0].prefix, 24);
        assert_eq!(
            kept.dropped,
            [
                "kept the first 16 of 31 interfaces",
                "dropped 4 addresses that were not an IP address with a fitting prefix",
                "kept 64 of 2011 addresses",
            ]
        );
        // Within the caps, interfaces that are not the first are kept too.
        let few = json!([
            {"name": "eth0", "ip-addresses": [{"ip-address": "fe80::1", "prefix": 64}]},
            {"name": "eth\u{1b}]0;pwned\u{7}1", "ip-addresses": [{"ip-address": "10.0.2.15", "prefix": 24}]}
        ]);
        let kept = parse_interfaces(&few);
        assert_eq!(kept.ips.len(), 2);
        assert!(kept.dropped.is_empty(), "{:?}", kept.dropped);
        assert_eq!(kept.ips[1].interface, "eth\\x1b]0;pwned\\x071");
    }

    #[test]
    fn a_hostile_host_name_is_escaped_and_cut() {
        let h = parse_hostname(&json!({"host-name": "web\u{1b}]0;pwned\u{7}\u{1b}[2J"})).unwrap();
        assert_eq!(h, "web\\x1b]0;pwned\\x07\\x1b[2J");
        let h = parse_hostname(&json!({"host-name": "h".repeat(10_000)})).unwrap();
        assert!(h.len() <= MAX_HOSTNAME, "{}", h.len());
    }

    /// The issue's ~100 KB reply, over the bound: the session ends, the
    /// agent still counts as answering, the host name (asked first) is
    /// kept, and the note says what happened.
    #[tokio::test]
    async fn an_oversized_reply_costs_the_guest_its_addresses_only() {
        let (_dir, path, listener) = socket();
        tokio::spawn(fake_agent_answering(listener, None, |cmd| {
            (cmd == "guest-network-get-interfaces").then(|| {
                let mut raw = serde_json::to_vec(&json!({"return": hostile_interfaces()})).unwrap();
                assert!(raw.len() > MAX_REPLY, "{}", raw.len());
                raw.push(b'\n');
                raw
            })
        }));
        let info = probe(&path, Duration::from_secs(2)).await;
        assert!(info.agent.is_answering(), "{info:?}");
        assert_eq!(info.hostname.as_deref(), Some("web"));
        assert!(info.ips.is_empty());
        assert_eq!(
            info.note.as_deref(),
            Some("guest-network-get-interfaces: guest agent reply over 64 KiB, ignored")
        );
    }

    /// A guest that makes every reply an error with a huge description:
    /// what is kept of it is bounded and printable.
    #[tokio::test]
    async fn a_guest_error_text_is_bounded_and_escaped() {
        let (_dir, path, listener) = socket();
        tokio::spawn(fake_agent_answering(listener, None, |cmd| {
            (cmd == "guest-info").then(|| {
                let desc = format!("\u{1b}[2J{}", "d".repeat(50_000));
                let mut raw =
                    serde_json::to_vec(&json!({"error": {"class": "X", "desc": desc}})).unwrap();
                raw.push(b'\n');
                raw
            })
        }));
        let info = probe(&path, Duration::from_secs(2)).await;
        let crate::AgentState::Silent { reason } = info.agent else {
            panic!("{info:?}")
        };
        assert!(reason.len() < 400, "{}", reason.len());
        assert!(
            reason.starts_with("guest agent command guest-info failed: X: \\x1b[2Jddd"),
            "{reason}"
        );
    }
}
