//! The CLI's HTTP client.
//!
//! `ureq` 3 with default features off: a small, well-kept, blocking client
//! with no async runtime to start. The CLI makes a handful of sequential
//! requests to a (by default loopback) HTTPS server, so hyper's client
//! would add tokio and hyper-util plumbing for nothing. TLS is rustls with
//! the verification of [`super::server_trust`] (a pinned fingerprint or
//! `--ca-file`).
//! Environment proxies are ignored: the bearer token goes straight to the
//! Keel server, never through a proxy.

use std::io::{BufRead, BufReader};
use std::time::Duration;

use anyhow::{bail, Context};
use serde::de::DeserializeOwned;
use serde::Serialize;
use ureq::http::{self, Method};
use ureq::Agent;

use crate::api::paging::Paged;
use crate::api::ErrorBody;
use crate::args::ClientArgs;
use crate::auth::{read_token_file, token_path};
use crate::cli::server_trust::{self, ServerTrust, TrustArgs};

const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A request the server refused, with its message and the field it names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{} (HTTP {status})", body.error, field_suffix(&body.field))]
pub struct ApiFailure {
    pub status: u16,
    pub body: ErrorBody,
}

fn field_suffix(field: &Option<String>) -> String {
    field
        .as_ref()
        .map(|f| format!(" [field: {f}]"))
        .unwrap_or_default()
}

/// Cheap to clone: the agents share their connection pools.
#[derive(Clone)]
pub struct Client {
    agent: Agent,
    /// No overall timeout: `events --follow` streams indefinitely.
    stream_agent: Agent,
    base: String,
    authorization: String,
    trust: ServerTrust,
}

impl Client {
    /// A client of `server` (`https://…`, or `http://…` for a loopback
    /// server run with `--insecure-http`) that verifies it by `trust`.
    pub fn new(server: &str, token: &str, trust: ServerTrust) -> anyhow::Result<Self> {
        let base = check_server_url(server)?;
        let agent = |timeout: Option<Duration>| -> Agent {
            let config = Agent::config_builder()
                .http_status_as_error(false)
                .proxy(None)
                .timeout_global(timeout)
                .timeout_connect(Some(Duration::from_secs(5)))
                .build();
            trust.agent(config)
        };
        Ok(Self {
            agent: agent(Some(REQUEST_TIMEOUT)),
            stream_agent: agent(None),
            base,
            authorization: format!("Bearer {}", token.trim()),
            trust,
        })
    }

    /// How this client verifies the server (the console uses the same).
    pub fn trust(&self) -> &ServerTrust {
        &self.trust
    }

    /// From `--server` and `--token`, else the token file in `--data-dir`.
    pub fn from_args(args: &ClientArgs) -> anyhow::Result<Self> {
        let token = match &args.token {
            Some(t) => t.clone(),
            None => {
                let path = args
                    .token_file
                    .clone()
                    .unwrap_or_else(|| token_path(&args.data_dir));
                read_token_file(&path).with_context(|| {
                    format!(
                        "no API token: pass --token or $KEEL_TOKEN, --token-file, or --data-dir / $KEEL_DATA_DIR of the server (looked in {})",
                        path.display()
                    )
                })?
            }
        };
        check_server_url(&args.server)?;
        let trust = server_trust::establish(
            &args.server,
            &TrustArgs {
                ca_file: args.ca_file.clone(),
                accept_fingerprint: args.accept_fingerprint.clone(),
                known_servers: args.known_servers.clone(),
                data_dir: Some(args.data_dir.clone()),
            },
        )?;
        Self::new(&args.server, &token, trust)
    }

    /// The server's base URL, e.g. `http://127.0.0.1:7280`.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The `Authorization` header value every request carries.
    pub fn authorization(&self) -> &str {
        &self.authorization
    }

    /// A GET whose answer is not JSON (e.g. a console log): its bytes.
    pub fn get_bytes(&self, path: &str) -> anyhow::Result<Vec<u8>> {
        let mut resp = self.send(&self.agent, Method::GET, path, Vec::new())?;
        let status = resp.status().as_u16();
        let bytes = resp
            .body_mut()
            .with_config()
            .limit(crate::api::console::MAX_LOG_BYTES + (64 << 10))
            .read_to_vec()
            .with_context(|| format!("reading the response to {path}"))?;
        if !(200..300).contains(&status) {
            return Err(failure(status, &bytes).into());
        }
        Ok(bytes)
    }

    pub fn get<T: DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        self.call(Method::GET, path, None::<&()>)
    }

    /// Every page of a list: follows its `continue` tokens to the end.
    pub fn get_all<T: DeserializeOwned + Paged>(&self, path: &str) -> anyhow::Result<T> {
        let mut list: T = self.get(path)?;
        let sep = if path.contains('?') { '&' } else { '?' };
        while let Some(token) = list.continue_token().map(encode) {
            let next: T = self.get(&format!("{path}{sep}continue={token}"))?;
            list.append(next);
        }
        Ok(list)
    }

    /// `None` on 404.
    pub fn get_opt<T: DeserializeOwned>(&self, path: &str) -> anyhow::Result<Option<T>> {
        match self.call(Method::GET, path, None::<&()>) {
            Ok(v) => Ok(Some(v)),
            Err(e)
                if e.downcast_ref::<ApiFailure>()
                    .is_some_and(|f| f.status == 404) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    pub fn call<T: DeserializeOwned, B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> anyhow::Result<T> {
        self.call_with(&self.agent, method, path, body)
    }

    /// [`Client::call`] without the overall request timeout, for a request
    /// the server takes long to answer (it downloads an image first).
    pub fn call_untimed<T: DeserializeOwned, B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> anyhow::Result<T> {
        self.call_with(&self.stream_agent, method, path, body)
    }

    fn call_with<T: DeserializeOwned, B: Serialize>(
        &self,
        agent: &Agent,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> anyhow::Result<T> {
        let body = match body {
            Some(b) => serde_json::to_vec(b).context("encoding the request")?,
            None => Vec::new(),
        };
        let mut resp = self.send(agent, method, path, body)?;
        let status = resp.status().as_u16();
        let bytes = resp
            .body_mut()
            .read_to_vec()
            .with_context(|| format!("reading the response to {path}"))?;
        if !(200..300).contains(&status) {
            return Err(failure(status, &bytes).into());
        }
        serde_json::from_slice(&bytes)
            .with_context(|| format!("decoding the server's response to {path}"))
    }

    /// PUTs a file as the request body, streamed from disk (with its
    /// length), without the overall request timeout: an upload takes as
    /// long as the file is big. On a terminal its progress shows as one
    /// line (`what`: bytes of the size, rate, ETA).
    pub fn upload<T: DeserializeOwned>(
        &self,
        path: &str,
        file: std::fs::File,
        what: &str,
    ) -> anyhow::Result<T> {
        let url = format!("{}{path}", self.base);
        let size = file
            .metadata()
            .with_context(|| format!("reading the size of {what}"))?
            .len();
        let body = ureq::SendBody::from_owned_reader(
            crate::cli::upload_progress::UploadProgress::new(file, what, size),
        );
        let req = http::Request::builder()
            .method(Method::PUT)
            .uri(&url)
            .header("Authorization", &self.authorization)
            .header("Accept", "application/json")
            .header("Content-Type", "application/octet-stream")
            // Sent as given, so the server reads a length-delimited body
            // as it did when the file itself was the body.
            .header("Content-Length", size)
            .body(body)
            .with_context(|| format!("building PUT {url}"))?;
        let mut resp = match self.stream_agent.run(req) {
            Ok(resp) => resp,
            Err(e) => {
                if let Some(refusal) = self.trust.refusal(&self.base) {
                    bail!(refusal);
                }
                return Err(e).with_context(|| {
                    format!(
                        "uploading to the keel server at {} (PUT {path}); is `keel serve` running?",
                        self.base
                    )
                });
            }
        };
        let status = resp.status().as_u16();
        let bytes = resp
            .body_mut()
            .read_to_vec()
            .with_context(|| format!("reading the response to {path}"))?;
        if !(200..300).contains(&status) {
            return Err(failure(status, &bytes).into());
        }
        serde_json::from_slice(&bytes)
            .with_context(|| format!("decoding the server's response to {path}"))
    }

    /// A GET whose answer is a file (an export), streamed into `out`
    /// without the overall request timeout; returns its length. A short
    /// answer (the server broke off) is an error.
    pub fn download(&self, path: &str, out: &mut impl std::io::Write) -> anyhow::Result<u64> {
        let resp = self.send(&self.stream_agent, Method::GET, path, Vec::new())?;
        let status = resp.status().as_u16();
        let length = resp
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        let mut body = resp.into_body();
        if !(200..300).contains(&status) {
            let bytes = body.read_to_vec().unwrap_or_default();
            return Err(failure(status, &bytes).into());
        }
        let mut reader = body.with_config().limit(u64::MAX).reader();
        let copied = std::io::copy(&mut reader, out)
            .with_context(|| format!("reading the response to {path}"))?;
        if let Some(expected) = length.filter(|l| *l != copied) {
            bail!("the server's answer to {path} broke off after {copied} of {expected} bytes");
        }
        Ok(copied)
    }

    /// Calls `each` with every JSON line of a streaming response until the
    /// server ends it; stops early if `each` returns `Ok(false)`.
    pub fn stream_lines<T: DeserializeOwned>(
        &self,
        path: &str,
        mut each: impl FnMut(T) -> anyhow::Result<bool>,
    ) -> anyhow::Result<()> {
        let resp = self.send(&self.stream_agent, Method::GET, path, Vec::new())?;
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        if !(200..300).contains(&status) {
            let bytes = body.read_to_vec().unwrap_or_default();
            return Err(failure(status, &bytes).into());
        }
        for line in BufReader::new(body.into_reader()).lines() {
            let line = line.context("reading the event stream")?;
            if line.trim().is_empty() {
                continue;
            }
            if let Ok(err) = serde_json::from_str::<ErrorBody>(&line) {
                bail!("the server ended the stream: {}", err.error);
            }
            let item = serde_json::from_str(&line).context("decoding a streamed line")?;
            if !each(item)? {
                break;
            }
        }
        Ok(())
    }

    fn send(
        &self,
        agent: &Agent,
        method: Method,
        path: &str,
        body: Vec<u8>,
    ) -> anyhow::Result<http::Response<ureq::Body>> {
        let url = format!("{}{path}", self.base);
        let mut req = http::Request::builder()
            .method(method.clone())
            .uri(&url)
            .header("Authorization", &self.authorization)
            .header("Accept", "application/json");
        if !body.is_empty() {
            req = req.header("Content-Type", "application/json");
        }
        let req = req
            .body(body)
            .with_context(|| format!("building {method} {url}"))?;
        agent.run(req).or_else(|e| {
            if let Some(refusal) = self.trust.refusal(&self.base) {
                bail!(refusal);
            }
            Err(e).with_context(|| {
                format!(
                    "cannot reach the keel server at {} ({method} {path}); is `keel serve` running? (set --server or $KEEL_SERVER)",
                    self.base
                )
            })
        })
    }
}

/// `server` without its trailing slash, if it is an http(s) URL.
fn check_server_url(server: &str) -> anyhow::Result<String> {
    let base = server.trim_end_matches('/').to_string();
    if !base.starts_with("https://") && !base.starts_with("http://") {
        bail!("--server {server}: expected a URL like https://127.0.0.1:7280");
    }
    Ok(base)
}

fn failure(status: u16, bytes: &[u8]) -> ApiFailure {
    let body = serde_json::from_slice::<ErrorBody>(bytes).unwrap_or_else(|_| ErrorBody {
        error: String::from_utf8_lossy(bytes).trim().to_string(),
        field: None,
    });
    ApiFailure { status, body }
}

/// Percent-encodes a path segment or query value, so a name typed on the
/// command line reaches the server as one segment (and is validated there);
/// `.` too, so no client or proxy can resolve `..` away.
pub fn encode(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || b"-_~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_segments() {
        assert_eq!(encode("web-1"), "web-1");
        assert_eq!(encode("a/b"), "a%2Fb");
        assert_eq!(encode("a\0b"), "a%00b");
        assert_eq!(encode(".."), "%2E%2E");
    }

    #[test]
    fn failure_message_names_the_field() {
        let f = failure(422, br#"{"error":"bad","field":"spec.cpus"}"#);
        assert_eq!(f.to_string(), "bad [field: spec.cpus] (HTTP 422)");
        let f = failure(502, b"gateway down");
        assert_eq!(f.to_string(), "gateway down (HTTP 502)");
    }

    #[test]
    fn takes_only_http_urls() {
        assert!(Client::new("ftp://x", "t", ServerTrust::PlainHttp).is_err());
        assert!(Client::new("https://x/", "t", ServerTrust::PlainHttp).is_ok());
    }
}
