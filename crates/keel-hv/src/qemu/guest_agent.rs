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

use super::qmp::ReplyBody;
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
}

/// Longest reply line accepted; a bigger one means the peer is not QGA.
const MAX_LINE: u64 = 1 << 20;

pub struct QgaSession {
    read: BufReader<OwnedReadHalf>,
    write: OwnedWriteHalf,
    timeout: Duration,
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
                // Everything up to the delimiter is a stale reply (or noise).
                let mut skipped = Vec::new();
                let n = read
                    .take(MAX_LINE)
                    .read_until(0xff, &mut skipped)
                    .await
                    .map_err(|e| QgaError::Io(e.to_string()))?;
                if n == 0 {
                    return Err(QgaError::Disconnected);
                }
                if skipped.last() != Some(&0xff) {
                    continue;
                }
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
        self.send(command, arguments).await?;
        let after = timeout.unwrap_or(self.timeout);
        let reply = tokio::time::timeout(after, read_line(&mut self.read))
            .await
            .map_err(|_| QgaError::Timeout {
                what: command.to_string(),
                after,
            })??;
        reply_of(command, &reply)
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
            .map(str::to_string))
    }

    /// Every address of every interface, loopback included.
    pub async fn addresses(&mut self) -> Result<Vec<GuestIp>, QgaError> {
        let ifaces = self
            .execute("guest-network-get-interfaces", None, None)
            .await?;
        Ok(parse_interfaces(&ifaces))
    }

    pub async fn hostname(&mut self) -> Result<Option<String>, QgaError> {
        let v = self.execute("guest-get-host-name", None, None).await?;
        Ok(v.get("host-name")
            .and_then(Value::as_str)
            .map(str::to_string))
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
            .ok_or_else(|| QgaError::Protocol(format!("fsfreeze-status returned {v}")))
    }

    /// `guest-shutdown` (powerdown). On success the agent sends nothing, so
    /// a reply is awaited only briefly, for an error; silence or the
    /// channel closing is taken as accepted.
    pub async fn shutdown(&mut self) -> Result<(), QgaError> {
        self.send("guest-shutdown", Some(json!({"mode": "powerdown"})))
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
    v.as_u64()
        .map(|n| n as u32)
        .ok_or_else(|| QgaError::Protocol(format!("{command} returned {v}, not a count")))
}

fn reply_of(command: &str, msg: &Value) -> Result<Value, QgaError> {
    match super::qmp::reply_body(msg) {
        ReplyBody::Return(ret) => Ok(ret),
        ReplyBody::Error { class, desc } => Err(QgaError::Command {
            command: command.to_string(),
            class,
            desc,
        }),
        ReplyBody::NotAReply => Err(QgaError::Protocol(format!(
            "expected a reply to {command}, got {msg}"
        ))),
    }
}

async fn read_line(read: &mut BufReader<OwnedReadHalf>) -> Result<Value, QgaError> {
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut *read)
            .take(MAX_LINE + 1)
            .read_until(b'\n', &mut line)
            .await
            .map_err(|e| QgaError::Io(e.to_string()))?;
        if n == 0 {
            return Err(QgaError::Disconnected);
        }
        if n as u64 > MAX_LINE {
            return Err(QgaError::Protocol("reply line too long".into()));
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

/// `guest-network-get-interfaces` → addresses, tolerating missing fields.
pub fn parse_interfaces(v: &Value) -> Vec<GuestIp> {
    let mut out = Vec::new();
    for iface in v.as_array().into_iter().flatten() {
        let name = iface
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string();
        for addr in iface
            .get("ip-addresses")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let Some(address) = addr.get("ip-address").and_then(Value::as_str) else {
                continue;
            };
            out.push(GuestIp {
                interface: name.clone(),
                address: address.to_string(),
                prefix: addr.get("prefix").and_then(Value::as_u64).unwrap_or(0) as u8,
            });
        }
    }
    out
}

/// One bounded look: sync, version, addresses, host name. A guest whose
/// agent does not answer is `Silent` with the reason, never an error.
pub async fn probe(path: &Path, timeout: Duration) -> GuestInfo {
    let mut session = match QgaSession::open(path, timeout).await {
        Ok(s) => s,
        Err(e) => return GuestInfo::silent(e.to_string()),
    };
    let version = match session.version().await {
        Ok(v) => v,
        Err(e) => return GuestInfo::silent(e.to_string()),
    };
    // An agent that answers but refuses these (a guest's allow/deny list)
    // is still answering; its addresses are just unknown.
    let ips = session.addresses().await.unwrap_or_default();
    let hostname = session.hostname().await.ok().flatten();
    GuestInfo {
        agent: crate::AgentState::Answering { version },
        ips,
        hostname,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A scripted agent: first sends a stale reply left from an earlier
    /// session (as a real channel does after a caller timed out), then
    /// answers syncs with the delimiter and a few commands.
    async fn fake_agent(listener: UnixListener, hang_on: Option<&'static str>) {
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
        let addrs: Vec<&str> = info.ips.iter().map(|i| i.address.as_str()).collect();
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
}
