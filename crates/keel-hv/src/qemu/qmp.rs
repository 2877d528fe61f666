//! A small async QMP client over a Unix socket.
//!
//! Why not the `qapi` crate: it would give generated types for every QMP
//! command, but those are generated from one QEMU release's schema and
//! deserialize strictly, so a field added or removed in the QEMU a node
//! actually runs turns into a decode error; it also pulls in a large generated
//! crate, `futures` and `tower-service` for the dozen commands Keel sends
//! (`qmp_capabilities`, `query-status`, `system_powerdown`, `quit`, and the
//! snapshot and migration commands). QMP itself is JSON lines, so a client
//! that tolerates unknown fields is short.
//!
//! One connection carries both command replies and asynchronous events. A
//! reader task owns the read half: replies are matched to callers by `id`
//! (QEMU answers in order, but the id makes a late reply after a caller's
//! timeout harmless), events go to a channel the monitor task drains.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QmpError {
    #[error("connect to {path}: {reason}")]
    Connect { path: PathBuf, reason: String },
    #[error("QMP {what} not answered within {after:?}")]
    Timeout { what: String, after: Duration },
    #[error("QMP protocol error: {0}")]
    Protocol(String),
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    #[error("QMP connection closed")]
    Disconnected,
    #[error("QMP I/O error: {0}")]
    Io(String),
}

/// An asynchronous QMP event, e.g. `SHUTDOWN`.
#[derive(Debug, Clone, PartialEq)]
pub struct QmpEvent {
    pub event: String,
    pub data: Value,
}

/// `SHUTDOWN` event data. QEMU sends it before it exits for any reason
/// other than a signal it cannot catch.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ShutdownEvent {
    #[serde(default)]
    pub guest: bool,
    pub reason: String,
}

impl QmpEvent {
    pub fn as_shutdown(&self) -> Option<ShutdownEvent> {
        if self.event != "SHUTDOWN" {
            return None;
        }
        serde_json::from_value(self.data.clone()).ok()
    }
}

/// `query-status` result; only the fields Keel reads.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct StatusInfo {
    pub status: String,
    #[serde(default)]
    pub running: bool,
}

type Reply = Result<Value, QmpError>;

struct Shared {
    pending: Mutex<HashMap<u64, oneshot::Sender<Reply>>>,
    /// Set once the reader saw EOF or an error; later commands fail at once.
    closed: Mutex<Option<QmpError>>,
}

pub struct QmpClient {
    path: PathBuf,
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    reader: JoinHandle<()>,
    timeout: Duration,
}

impl std::fmt::Debug for QmpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QmpClient")
            .field("path", &self.path)
            .finish()
    }
}

impl Drop for QmpClient {
    fn drop(&mut self) {
        // Without this the reader would keep the socket open and QEMU, which
        // serves one QMP client at a time, would never accept the next one.
        self.reader.abort();
    }
}

impl QmpClient {
    /// Connects, reads the greeting and leaves capability negotiation mode.
    /// `timeout` bounds the handshake and, later, each command.
    pub async fn connect(
        path: &Path,
        timeout: Duration,
    ) -> Result<(QmpClient, mpsc::UnboundedReceiver<QmpEvent>), QmpError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|e| QmpError::Connect {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        let (read, mut write) = stream.into_split();
        let mut read = BufReader::new(read);

        let greeting = tokio::time::timeout(timeout, read_message(&mut read))
            .await
            .map_err(|_| QmpError::Timeout {
                what: "greeting".into(),
                after: timeout,
            })??;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!(
                "expected a greeting, got {greeting}"
            )));
        }
        write_message(&mut write, &json!({"execute": "qmp_capabilities", "id": 0})).await?;
        // No events are sent before negotiation ends, so the next message is
        // the answer.
        let answer = tokio::time::timeout(timeout, read_message(&mut read))
            .await
            .map_err(|_| QmpError::Timeout {
                what: "qmp_capabilities".into(),
                after: timeout,
            })??;
        reply_of("qmp_capabilities", &answer)?;

        let shared = Arc::new(Shared {
            pending: Mutex::new(HashMap::new()),
            closed: Mutex::new(None),
        });
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let reader = tokio::spawn(read_loop(read, shared.clone(), events_tx));
        Ok((
            QmpClient {
                path: path.to_path_buf(),
                writer: tokio::sync::Mutex::new(write),
                shared,
                next_id: AtomicU64::new(1),
                reader,
                timeout,
            },
            events_rx,
        ))
    }

    pub fn is_closed(&self) -> bool {
        self.shared.closed.lock().expect("qmp lock").is_some()
    }

    pub async fn execute(&self, command: &str, arguments: Option<Value>) -> Reply {
        self.execute_within(command, arguments, self.timeout).await
    }

    /// `execute` with its own bound, for commands that legitimately take
    /// longer than a status query (internal snapshots write image metadata).
    /// A command that times out still runs to completion inside QEMU, which
    /// handles monitor commands one after the other: a later command is
    /// only executed after it.
    pub async fn execute_within(
        &self,
        command: &str,
        arguments: Option<Value>,
        timeout: Duration,
    ) -> Reply {
        if let Some(err) = self.shared.closed.lock().expect("qmp lock").clone() {
            return Err(err);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.shared.pending.lock().expect("qmp lock").insert(id, tx);
        let mut msg = json!({"execute": command, "id": id});
        if let Some(arguments) = arguments {
            msg["arguments"] = arguments;
        }
        let sent = async {
            let mut writer = self.writer.lock().await;
            write_message(&mut writer, &msg).await?;
            rx.await.map_err(|_| QmpError::Disconnected)?
        };
        let result = tokio::time::timeout(timeout, sent).await;
        self.shared.pending.lock().expect("qmp lock").remove(&id);
        match result {
            Ok(reply) => reply.map_err(|e| match e {
                QmpError::Command { class, desc, .. } => QmpError::Command {
                    command: command.to_string(),
                    class,
                    desc,
                },
                other => other,
            }),
            Err(_) => Err(QmpError::Timeout {
                what: command.to_string(),
                after: timeout,
            }),
        }
    }

    pub async fn query_status(&self) -> Result<StatusInfo, QmpError> {
        let value = self.execute("query-status", None).await?;
        serde_json::from_value(value)
            .map_err(|e| QmpError::Protocol(format!("query-status result: {e}")))
    }

    /// Presses the ACPI power button; the guest decides what to do.
    pub async fn system_powerdown(&self) -> Result<(), QmpError> {
        self.execute("system_powerdown", None).await.map(drop)
    }

    /// Asks QEMU to exit now. The reply may be lost in the exit, so a
    /// closed connection counts as success.
    pub async fn quit(&self) -> Result<(), QmpError> {
        match self.execute("quit", None).await {
            Ok(_) | Err(QmpError::Disconnected) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

async fn read_loop(
    mut read: BufReader<OwnedReadHalf>,
    shared: Arc<Shared>,
    events: mpsc::UnboundedSender<QmpEvent>,
) {
    let end = loop {
        let msg = match read_message(&mut read).await {
            Ok(msg) => msg,
            Err(e) => break e,
        };
        if let Some(event) = msg.get("event").and_then(Value::as_str) {
            // A monitor that stopped listening is not an error for replies.
            let _ = events.send(QmpEvent {
                event: event.to_string(),
                data: msg.get("data").cloned().unwrap_or(Value::Null),
            });
            continue;
        }
        let Some(id) = msg.get("id").and_then(Value::as_u64) else {
            // Replies to commands sent without an id; Keel sends none.
            continue;
        };
        let waiter = shared.pending.lock().expect("qmp lock").remove(&id);
        if let Some(waiter) = waiter {
            let _ = waiter.send(reply_of("", &msg));
        }
    };
    *shared.closed.lock().expect("qmp lock") = Some(end.clone());
    for (_, waiter) in shared.pending.lock().expect("qmp lock").drain() {
        let _ = waiter.send(Err(end.clone()));
    }
}

/// What a reply carries. QMP and the guest agent frame replies alike
/// (`{"return": …}` or `{"error": {"class", "desc"}}`); each maps these to
/// its own error type.
pub(super) enum ReplyBody {
    Return(Value),
    Error {
        class: String,
        desc: String,
    },
    /// Neither: an event, or not a QMP-framed message at all.
    NotAReply,
}

pub(super) fn reply_body(msg: &Value) -> ReplyBody {
    if let Some(ret) = msg.get("return") {
        return ReplyBody::Return(ret.clone());
    }
    if let Some(err) = msg.get("error") {
        let field = |k: &str| {
            err.get(k)
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string()
        };
        return ReplyBody::Error {
            class: field("class"),
            desc: field("desc"),
        };
    }
    ReplyBody::NotAReply
}

fn reply_of(command: &str, msg: &Value) -> Reply {
    match reply_body(msg) {
        ReplyBody::Return(ret) => Ok(ret),
        ReplyBody::Error { class, desc } => Err(QmpError::Command {
            command: command.to_string(),
            class,
            desc,
        }),
        ReplyBody::NotAReply => Err(QmpError::Protocol(format!(
            "expected a reply to {command}, got {msg}"
        ))),
    }
}

/// QMP messages are single-line JSON objects. A huge line means we are not
/// talking to QMP; stop reading instead of buffering without bound.
const MAX_MESSAGE: usize = 1 << 20;

async fn read_message(read: &mut BufReader<OwnedReadHalf>) -> Result<Value, QmpError> {
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut *read)
            .take(MAX_MESSAGE as u64 + 1)
            .read_until(b'\n', &mut line)
            .await
            .map_err(|e| QmpError::Io(e.to_string()))?;
        if n == 0 {
            return Err(QmpError::Disconnected);
        }
        if n > MAX_MESSAGE {
            return Err(QmpError::Protocol(format!(
                "message longer than {MAX_MESSAGE} bytes"
            )));
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        return serde_json::from_slice(&line)
            .map_err(|e| QmpError::Protocol(format!("invalid JSON from QEMU: {e}")));
    }
}

async fn write_message(write: &mut OwnedWriteHalf, msg: &Value) -> Result<(), QmpError> {
    let mut bytes = serde_json::to_vec(msg).expect("a Value serializes");
    bytes.push(b'\n');
    write
        .write_all(&bytes)
        .await
        .map_err(|e| QmpError::Io(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A scripted QMP server: answers each command by name, emitting
    /// an event before replying to `system_powerdown`.
    async fn fake_qemu(listener: UnixListener) {
        let (stream, _) = listener.accept().await.unwrap();
        let (read, mut write) = stream.into_split();
        let mut lines = BufReader::new(read).lines();
        write
            .write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\r\n")
            .await
            .unwrap();
        while let Some(line) = lines.next_line().await.unwrap() {
            let msg: Value = serde_json::from_str(&line).unwrap();
            let id = msg["id"].clone();
            let reply = match msg["execute"].as_str().unwrap() {
                "qmp_capabilities" => json!({"return": {}, "id": id}),
                "query-status" => {
                    json!({"return": {"status": "running", "running": true, "singlestep": false}, "id": id})
                }
                "system_powerdown" => {
                    let ev = json!({"event": "POWERDOWN", "data": {}, "timestamp": {"seconds": 1, "microseconds": 2}});
                    write
                        .write_all(format!("{ev}\r\n").as_bytes())
                        .await
                        .unwrap();
                    json!({"return": {}, "id": id})
                }
                "hang" => continue,
                "quit" => {
                    let ev = json!({"event": "SHUTDOWN", "data": {"guest": false, "reason": "host-qmp-quit"}});
                    write
                        .write_all(format!("{ev}\r\n").as_bytes())
                        .await
                        .unwrap();
                    return;
                }
                _ => {
                    json!({"error": {"class": "CommandNotFound", "desc": "nope"}, "id": id})
                }
            };
            write
                .write_all(format!("{reply}\r\n").as_bytes())
                .await
                .unwrap();
        }
    }

    async fn setup() -> (
        tempfile::TempDir,
        QmpClient,
        mpsc::UnboundedReceiver<QmpEvent>,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(fake_qemu(listener));
        let (client, events) = QmpClient::connect(&path, Duration::from_millis(500))
            .await
            .unwrap();
        (dir, client, events)
    }

    #[tokio::test]
    async fn commands_events_errors_and_disconnect() {
        let (_dir, client, mut events) = setup().await;
        let status = client.query_status().await.unwrap();
        assert_eq!(status.status, "running");
        client.system_powerdown().await.unwrap();
        assert_eq!(events.recv().await.unwrap().event, "POWERDOWN");

        let err = client.execute("bogus", None).await.unwrap_err();
        assert_eq!(
            err,
            QmpError::Command {
                command: "bogus".into(),
                class: "CommandNotFound".into(),
                desc: "nope".into()
            }
        );
        let err = client.execute("hang", None).await.unwrap_err();
        assert!(matches!(err, QmpError::Timeout { .. }), "{err}");

        client.quit().await.unwrap();
        let ev = events.recv().await.unwrap();
        assert_eq!(
            ev.as_shutdown().unwrap(),
            ShutdownEvent {
                guest: false,
                reason: "host-qmp-quit".into()
            }
        );
        assert!(
            events.recv().await.is_none(),
            "events end with the connection"
        );
        assert!(client.is_closed());
        assert_eq!(
            client.query_status().await.unwrap_err(),
            QmpError::Disconnected
        );
    }

    #[tokio::test]
    async fn a_peer_that_is_not_qmp_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            s.write_all(b"{\"hello\": 1}\n").await.unwrap();
            let mut buf = [0u8; 16];
            let _ = s.read(&mut buf).await;
        });
        let err = QmpClient::connect(&path, Duration::from_millis(500))
            .await
            .unwrap_err();
        assert!(matches!(err, QmpError::Protocol(_)), "{err}");

        let err = QmpClient::connect(&dir.path().join("missing.sock"), Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(matches!(err, QmpError::Connect { .. }), "{err}");
    }
}
