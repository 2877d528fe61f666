//! `keel vm console NAME`: the serial console over the API's WebSocket,
//! like `virsh console`. On a terminal, stdin is put in raw mode (every
//! key goes to the guest, Ctrl-C included) and restored on exit; Ctrl-]
//! detaches. Without a terminal, stdin is sent as it is and, at its end,
//! the session lingers [`LINGER`] for the guest's answer, then detaches.
//!
//! The WebSocket client is tokio-tungstenite (axum's `ws` builds it
//! anyway), on a runtime of its own: the rest of the CLI is blocking.

use std::io::{IsTerminal, Read, Write};
use std::time::Duration;

use anyhow::{bail, Context};
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;

use super::{encode, ApiFailure, Client};
use crate::api::ErrorBody;

/// Ctrl-]
pub const ESCAPE: u8 = 0x1d;
/// How long a non-interactive session waits for output after stdin ended.
pub const LINGER: Duration = Duration::from_secs(2);

pub fn run(client: &Client, name: &str) -> anyhow::Result<()> {
    let url = format!(
        "{}/api/v1/vms/{}/console",
        client
            .base()
            .replacen("https://", "wss://", 1)
            .replacen("http://", "ws://", 1),
        encode(name)
    );
    let mut request = url
        .as_str()
        .into_client_request()
        .with_context(|| format!("console URL {url}"))?;
    request.headers_mut().insert(
        "authorization",
        HeaderValue::from_str(client.authorization()).context("API token")?,
    );
    let interactive = std::io::stdin().is_terminal();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        // wss with the same verification as every other request.
        let connector = client
            .trust()
            .client_config()
            .map(tokio_tungstenite::Connector::Rustls);
        let connected =
            tokio_tungstenite::connect_async_tls_with_config(request, None, true, connector).await;
        if connected.is_err() {
            if let Some(refusal) = client.trust().refusal(client.base()) {
                bail!(refusal);
            }
        }
        let (socket, _) = match connected {
            Ok(ok) => ok,
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
                let status = resp.status().as_u16();
                let body = resp.body().clone().unwrap_or_default();
                let body: ErrorBody = serde_json::from_slice(&body).unwrap_or(ErrorBody {
                    error: String::from_utf8_lossy(&body).into_owned(),
                    field: None,
                });
                return Err(ApiFailure { status, body }.into());
            }
            Err(e) => bail!("console of VM {name}: {e}"),
        };
        let _raw = if interactive {
            eprintln!("Connected to the console of VM {name}. Escape character is ^] (Ctrl-]).");
            Some(RawMode::enter()?)
        } else {
            None
        };
        let (mut to_server, mut from_server) = socket.split();
        let mut input = stdin_chunks();
        let mut stdout = std::io::stdout();
        let mut linger: Option<tokio::time::Instant> = None;
        loop {
            let deadline = linger.unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(86_400 * 365));
            tokio::select! {
                chunk = input.recv(), if linger.is_none() => match chunk {
                    Some(mut bytes) => {
                        let detach = interactive && bytes.contains(&ESCAPE);
                        if detach {
                            let at = bytes.iter().position(|b| *b == ESCAPE).expect("contains");
                            bytes.truncate(at);
                        }
                        if !bytes.is_empty() && to_server.send(Message::binary(bytes)).await.is_err() {
                            break;
                        }
                        if detach {
                            break;
                        }
                    }
                    None => linger = Some(tokio::time::Instant::now() + LINGER),
                },
                msg = from_server.next() => match msg {
                    Some(Ok(Message::Binary(b))) => {
                        stdout.write_all(&b)?;
                        stdout.flush()?;
                    }
                    Some(Ok(Message::Text(t))) => {
                        stdout.write_all(t.as_bytes())?;
                        stdout.flush()?;
                    }
                    Some(Ok(Message::Close(_))) | None => {
                        if interactive {
                            eprint!("\r\n");
                        }
                        eprintln!("console of VM {name} closed by the server");
                        return Ok(());
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => bail!("console of VM {name}: {e}"),
                },
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        let _ = to_server.send(Message::Close(None)).await;
        if interactive {
            eprint!("\r\n");
        }
        eprintln!("detached from the console of VM {name}");
        Ok(())
    })
}

/// Stdin in chunks, read on a thread of its own (a blocking read cannot be
/// cancelled; the thread ends with the process).
fn stdin_chunks() -> tokio::sync::mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = [0u8; 1024];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
            }
        }
    });
    rx
}

/// The terminal in raw mode until dropped (restored on every exit path,
/// errors included).
struct RawMode {
    saved: libc::termios,
}

impl RawMode {
    fn enter() -> anyhow::Result<RawMode> {
        // SAFETY: termios is plain data; tcgetattr fills it for fd 0.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd 0 and a termios this function owns.
        if unsafe { libc::tcgetattr(0, &mut saved) } != 0 {
            return Err(std::io::Error::last_os_error()).context("reading terminal settings");
        }
        let mut raw = saved;
        // SAFETY: cfmakeraw only edits the struct it is given.
        unsafe { libc::cfmakeraw(&mut raw) };
        // SAFETY: fd 0 and a termios that outlives the call.
        if unsafe { libc::tcsetattr(0, libc::TCSANOW, &raw) } != 0 {
            return Err(std::io::Error::last_os_error()).context("setting raw mode");
        }
        Ok(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: restores the settings read in `enter` on the same fd.
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &self.saved) };
    }
}
