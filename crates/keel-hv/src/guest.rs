//! Client for Keel's test guest (built by `scripts/build-test-guest`).
//!
//! The guest prints `KEEL-GUEST-READY boot_id=<uuid>` on its console (ttyS0)
//! once booted, and answers one-line commands on its second serial port
//! (ttyS1), which the qemu driver exposes as a Unix socket
//! (`QemuDriver::command_socket`). Tests and benchmarks use it to prove a
//! guest really runs and that acknowledged disk writes survive.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

/// Printed on the console when the guest's command loop is up.
pub const READY_MARKER: &str = "KEEL-GUEST-READY";

/// Longest text `put` accepts: the guest stores `text` in one 512-byte sector.
pub const MAX_PUT_TEXT: usize = 400;

#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    #[error("connect to guest channel {path}: {reason}")]
    Connect { path: PathBuf, reason: String },
    #[error("guest command {command:?} not answered within {after:?}")]
    Timeout { command: String, after: Duration },
    #[error("guest channel closed while waiting for the answer to {command:?}")]
    Closed { command: String },
    #[error("guest channel I/O during {command:?}: {reason}")]
    Io { command: String, reason: String },
    #[error("guest answered {command:?} with {answer:?}")]
    Unexpected { command: String, answer: String },
    #[error("invalid guest command argument: {0}")]
    InvalidArgument(String),
    #[error("no {READY_MARKER} in {path} within {after:?}")]
    NotReady { path: PathBuf, after: Duration },
}

/// `TICKS <n> boot_id=<uuid>`: seconds counted by the guest since it booted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticks {
    pub ticks: u64,
    pub boot_id: String,
}

pub struct GuestChannel {
    path: PathBuf,
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    timeout: Duration,
}

impl GuestChannel {
    /// Connects to the command socket. The guest must already be ready (see
    /// [`GuestChannel::wait_ready`]) and the channel synced
    /// ([`GuestChannel::sync`]) before the first command; or use
    /// [`GuestChannel::connect_ready`], which does both.
    pub async fn connect(path: impl AsRef<Path>) -> Result<GuestChannel, GuestError> {
        let path = path.as_ref().to_path_buf();
        let stream = UnixStream::connect(&path)
            .await
            .map_err(|e| GuestError::Connect {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        let (read, writer) = stream.into_split();
        Ok(GuestChannel {
            path,
            reader: BufReader::new(read),
            writer,
            // Emulated (TCG) guests on a busy host are slow, and `put`
            // waits for a flush.
            timeout: Duration::from_secs(15),
        })
    }

    /// Waits for the ready marker in `console_log`, connects to `socket` and
    /// syncs, all within `timeout`.
    pub async fn connect_ready(
        console_log: &Path,
        socket: &Path,
        timeout: Duration,
    ) -> Result<GuestChannel, GuestError> {
        let deadline = Instant::now() + timeout;
        wait_ready(console_log, timeout).await?;
        let mut channel = GuestChannel::connect(socket).await?;
        channel
            .sync(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_secs(1)),
            )
            .await?;
        Ok(channel)
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sends one command line and returns the guest's answer line (without
    /// the line ending). Blank lines and an echo of the command are skipped,
    /// in case the guest's tty echoes. After a timeout the late answer may
    /// still arrive: call [`GuestChannel::sync`] or reconnect.
    pub async fn command(&mut self, command: &str) -> Result<String, GuestError> {
        if command.contains(['\n', '\r']) {
            return Err(GuestError::InvalidArgument(format!(
                "command {command:?} must be one line"
            )));
        }
        let io_err = |e: std::io::Error| GuestError::Io {
            command: command.to_string(),
            reason: e.to_string(),
        };
        self.writer
            .write_all(format!("{command}\n").as_bytes())
            .await
            .map_err(io_err)?;
        let read_answer = async {
            let mut line = String::new();
            loop {
                line.clear();
                let n = self.reader.read_line(&mut line).await.map_err(io_err)?;
                if n == 0 {
                    return Err(GuestError::Closed {
                        command: command.to_string(),
                    });
                }
                let answer = line.trim_matches(|c: char| c == '\r' || c == '\n' || c == '\0');
                if answer.trim().is_empty() || answer == command {
                    continue;
                }
                return Ok(answer.to_string());
            }
        };
        tokio::time::timeout(self.timeout, read_answer)
            .await
            .map_err(|_| GuestError::Timeout {
                command: command.to_string(),
                after: self.timeout,
            })?
    }

    async fn expect(&mut self, command: &str, answer: &str) -> Result<(), GuestError> {
        let got = self.command(command).await?;
        if got == answer {
            Ok(())
        } else {
            Err(GuestError::Unexpected {
                command: command.to_string(),
                answer: got,
            })
        }
    }

    pub async fn ping(&mut self) -> Result<(), GuestError> {
        self.expect("ping", "PONG").await
    }

    /// Brings a fresh connection into step with the guest: pings until a
    /// `PONG` arrives, skipping error answers, then discards anything still
    /// in flight. Needed once after connecting because the guest may open
    /// its serial port a moment after printing the ready marker, and the
    /// UART drops the byte it held while closed: the first command can
    /// arrive truncated (`ing` → `ERR unknown command`) or not at all.
    pub async fn sync(&mut self, timeout: Duration) -> Result<(), GuestError> {
        let deadline = Instant::now() + timeout;
        let attempt = Duration::from_secs(2);
        loop {
            self.writer
                .write_all(b"ping\n")
                .await
                .map_err(|e| GuestError::Io {
                    command: "ping".into(),
                    reason: e.to_string(),
                })?;
            let until = (Instant::now() + attempt).min(deadline);
            while let Some(line) = self.read_line_until(until).await? {
                if line == "PONG" {
                    self.discard_until(Instant::now() + Duration::from_millis(100))
                        .await?;
                    return Ok(());
                }
                if line.starts_with("ERR") {
                    // Our ping arrived mangled and was answered: resend now.
                    break;
                }
            }
            if Instant::now() >= deadline {
                return Err(GuestError::Timeout {
                    command: "ping (sync)".into(),
                    after: timeout,
                });
            }
        }
    }

    /// One answer line, or `None` once `until` passes.
    async fn read_line_until(&mut self, until: Instant) -> Result<Option<String>, GuestError> {
        let mut line = String::new();
        let read = tokio::time::timeout_at(until.into(), self.reader.read_line(&mut line)).await;
        match read {
            Err(_) => Ok(None),
            Ok(Ok(0)) => Err(GuestError::Closed {
                command: "ping (sync)".into(),
            }),
            Ok(Ok(_)) => Ok(Some(line.trim_end_matches(['\r', '\n']).to_string())),
            Ok(Err(e)) => Err(GuestError::Io {
                command: "ping (sync)".into(),
                reason: e.to_string(),
            }),
        }
    }

    async fn discard_until(&mut self, until: Instant) -> Result<(), GuestError> {
        while self.read_line_until(until).await?.is_some() {}
        Ok(())
    }

    /// Stores `text` in sector `slot` of /dev/vda; returns after the guest
    /// flushed it, so it survives the guest powering off.
    pub async fn put(&mut self, slot: u32, text: &str) -> Result<(), GuestError> {
        if text.is_empty() || text.len() > MAX_PUT_TEXT || text.chars().any(char::is_control) {
            return Err(GuestError::InvalidArgument(format!(
                "put text must be 1..={MAX_PUT_TEXT} bytes without control characters"
            )));
        }
        self.expect(&format!("put {slot} {text}"), &format!("OK put {slot}"))
            .await
    }

    /// Reads sector `slot` back; the text stored there by `put`.
    pub async fn get(&mut self, slot: u32) -> Result<String, GuestError> {
        let command = format!("get {slot}");
        let answer = self.command(&command).await?;
        let prefix = format!("VAL {slot}");
        match answer.strip_prefix(&prefix) {
            Some(rest) if rest.is_empty() || rest.starts_with(' ') => {
                Ok(rest.strip_prefix(' ').unwrap_or(rest).to_string())
            }
            _ => Err(GuestError::Unexpected { command, answer }),
        }
    }

    /// The capacity in bytes the guest's kernel has for disk `dev` (`vda`,
    /// `vdb`, …) now.
    pub async fn disk_bytes(&mut self, dev: &str) -> Result<u64, GuestError> {
        let command = format!("size {dev}");
        let answer = self.command(&command).await?;
        answer
            .strip_prefix(&format!("SIZE {dev} "))
            .and_then(|n| n.parse().ok())
            .ok_or(GuestError::Unexpected { command, answer })
    }

    pub async fn ticks(&mut self) -> Result<Ticks, GuestError> {
        let answer = self.command("ticks").await?;
        parse_ticks(&answer).ok_or(GuestError::Unexpected {
            command: "ticks".into(),
            answer,
        })
    }

    /// `false` makes the guest ignore the ACPI power button (a hung guest,
    /// as far as a graceful stop is concerned).
    pub async fn set_acpi(&mut self, enabled: bool) -> Result<(), GuestError> {
        let arg = if enabled { "on" } else { "off" };
        self.expect(&format!("acpi {arg}"), &format!("OK acpi {arg}"))
            .await
    }

    /// Waits until `console_log` contains the ready marker and returns the
    /// boot id printed with it. Polls the file, since QEMU appends to it.
    pub async fn wait_ready(console_log: &Path, timeout: Duration) -> Result<String, GuestError> {
        wait_ready(console_log, timeout).await
    }
}

/// See [`GuestChannel::wait_ready`].
pub async fn wait_ready(console_log: &Path, timeout: Duration) -> Result<String, GuestError> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(bytes) = tokio::fs::read(console_log).await {
            if let Some(boot_id) = find_ready(&String::from_utf8_lossy(&bytes)) {
                return Ok(boot_id);
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(GuestError::NotReady {
                path: console_log.to_path_buf(),
                after: timeout,
            });
        }
        tokio::time::sleep((deadline - now).min(Duration::from_millis(50))).await;
    }
}

/// The boot id of the last ready marker in `console`, if any.
fn find_ready(console: &str) -> Option<String> {
    let at = console.rfind(READY_MARKER)?;
    let line = console[at..].lines().next()?;
    let id = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("boot_id="))
        .unwrap_or("");
    // A marker whose line is not finished yet may have a cut-off id.
    let complete = console[at..].contains('\n');
    complete.then(|| id.to_string())
}

fn parse_ticks(answer: &str) -> Option<Ticks> {
    let mut words = answer.split_whitespace();
    if words.next()? != "TICKS" {
        return None;
    }
    let ticks = words.next()?.parse().ok()?;
    let boot_id = words.next()?.strip_prefix("boot_id=")?.to_string();
    Some(Ticks { ticks, boot_id })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    #[test]
    fn parses_markers_and_ticks() {
        assert_eq!(
            find_ready("boot\nKEEL-GUEST-READY boot_id=abc\n"),
            Some("abc".into())
        );
        assert_eq!(
            find_ready("KEEL-GUEST-READY boot_id=ab"),
            None,
            "line not finished"
        );
        assert_eq!(find_ready("nothing\n"), None);
        assert_eq!(
            parse_ticks("TICKS 12 boot_id=u-1"),
            Some(Ticks {
                ticks: 12,
                boot_id: "u-1".into()
            })
        );
        assert_eq!(parse_ticks("TICKS x boot_id=u"), None);
    }

    /// A fake guest with an echoing tty and CRLF line endings.
    #[tokio::test]
    async fn commands_skip_echo_and_parse_answers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cmd.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let (read, mut write) = stream.into_split();
            let mut lines = BufReader::new(read).lines();
            let mut store = std::collections::HashMap::new();
            while let Some(cmd) = lines.next_line().await.unwrap() {
                let words: Vec<&str> = cmd.splitn(3, ' ').collect();
                let answer = match words.as_slice() {
                    ["ping"] => "PONG".to_string(),
                    ["put", slot, text] => {
                        store.insert(slot.to_string(), text.to_string());
                        format!("OK put {slot}")
                    }
                    ["get", slot] => format!(
                        "VAL {slot} {}",
                        store.get(*slot).cloned().unwrap_or_default()
                    ),
                    ["ticks"] => "TICKS 7 boot_id=b1".into(),
                    ["acpi", arg] => format!("OK acpi {arg}"),
                    ["silent"] => continue,
                    _ => "ERR".into(),
                };
                write
                    .write_all(format!("{cmd}\r\n{answer}\r\n").as_bytes())
                    .await
                    .unwrap();
            }
        });
        let mut ch = GuestChannel::connect(&path)
            .await
            .unwrap()
            .with_timeout(Duration::from_millis(300));
        ch.ping().await.unwrap();
        ch.put(3, "hello world").await.unwrap();
        assert_eq!(ch.get(3).await.unwrap(), "hello world");
        assert_eq!(ch.ticks().await.unwrap().ticks, 7);
        ch.set_acpi(false).await.unwrap();
        assert!(matches!(
            ch.command("silent").await.unwrap_err(),
            GuestError::Timeout { .. }
        ));
        assert!(matches!(
            ch.put(1, "two\nlines").await.unwrap_err(),
            GuestError::InvalidArgument(_)
        ));
    }

    /// The guest lost the first byte of the first command, as a UART that
    /// was not yet open does.
    #[tokio::test]
    async fn sync_recovers_from_a_truncated_first_command() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cmd.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let (read, mut write) = stream.into_split();
            let mut lines = BufReader::new(read).lines();
            let mut first = true;
            while let Some(mut cmd) = lines.next_line().await.unwrap() {
                if std::mem::take(&mut first) {
                    cmd.remove(0);
                }
                let answer = if cmd == "ping" {
                    "PONG"
                } else {
                    "ERR unknown command"
                };
                write
                    .write_all(format!("{answer}\n").as_bytes())
                    .await
                    .unwrap();
            }
        });
        let mut ch = GuestChannel::connect(&path).await.unwrap();
        ch.sync(Duration::from_secs(10)).await.unwrap();
        ch.ping().await.unwrap();
        ch.ping().await.unwrap();
    }

    #[tokio::test]
    async fn wait_ready_times_out_then_finds_the_marker() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("console.log");
        let err = wait_ready(&log, Duration::from_millis(60))
            .await
            .unwrap_err();
        assert!(matches!(err, GuestError::NotReady { .. }), "{err}");
        std::fs::write(&log, "x\nKEEL-GUEST-READY boot_id=42\n").unwrap();
        assert_eq!(
            wait_ready(&log, Duration::from_millis(60)).await.unwrap(),
            "42"
        );
    }
}
