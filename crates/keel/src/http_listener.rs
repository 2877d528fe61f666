//! Keel's HTTP listeners (the API, an agent's console port), bounded so
//! that no client can exhaust them or the process.
//!
//! Why: `axum::serve` has no header-read timeout and no connection cap.
//! 1,100 half-sent request heads held the API for more than 75 s (`accept
//! error: Too many open files`), and 250 idle connections to an agent's
//! console port took the descriptors its fence renewal needed, so its
//! keeper killed an AlwaysOn guest.
//!
//! How:
//! - A request's head must arrive within [`Limits::header_timeout`], also
//!   on a kept-alive connection between requests (hyper's
//!   `header_read_timeout`, on a timer).
//! - At most [`Limits::max_connections`] connections at once, and at most
//!   [`Limits::max_per_peer`] from one address. A connection past either
//!   cap takes the place of the oldest one (of that peer, or overall) that
//!   has not yet sent a whole request head: a flood of half-open
//!   connections only ever displaces itself, while a real client's head
//!   arrives in moments and makes it safe. Where every connection has sent
//!   a request, the newcomer is closed at once.
//! - An accept that fails for want of descriptors waits a moment and
//!   tries again, instead of spinning.
//! - With TLS (the API), the handshake happens in the connection's own
//!   task, bounded by the same header timeout, and the connection counts
//!   as unproven until its first request head: a client that stalls in the
//!   handshake holds no place for long and is the first displaced. A
//!   client that sends plain HTTP to the TLS port gets a plain 400 saying
//!   so, not a hang or a reset.
//! - A request answered before its body was read (a refusal) gets
//!   `Connection: close`: hyper closes such a connection, and a client
//!   that pooled it would send its next request into a closed socket
//!   (seen: `Peer disconnected` on the POST after a 403).

use std::collections::BTreeMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio_rustls::TlsAcceptor;
use tower_service::Service;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_connections: usize,
    pub max_per_peer: usize,
    pub header_timeout: Duration,
    /// How long a shutdown waits for requests under way.
    pub drain_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 1024,
            max_per_peer: 256,
            header_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(10),
        }
    }
}

impl Limits {
    /// The defaults, shrunk to a quarter of this process's descriptor limit
    /// (a quarter per listener, with two listeners at most, leaves half for
    /// the store, QMP sockets, logs and the fence lease).
    pub fn for_this_process() -> Limits {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit we own.
        let nofile = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
            limit.rlim_cur as usize
        } else {
            1024
        };
        let max_connections = (nofile / 4).clamp(16, Limits::default().max_connections);
        Limits {
            max_connections,
            max_per_peer: (max_connections / 4).max(4),
            ..Limits::default()
        }
    }
}

/// One connection's place in the table.
struct Connection {
    peer: IpAddr,
    /// A whole request head has arrived on it.
    proven: AtomicBool,
    evict: Notify,
}

/// The connections open now, oldest first (ids only grow).
#[derive(Default)]
struct Table {
    next_id: u64,
    open: BTreeMap<u64, Arc<Connection>>,
}

impl Table {
    /// A place for a new connection from `peer`, displacing the oldest
    /// unproven one where a cap is reached; `None`: refuse it.
    fn admit(&mut self, peer: IpAddr, limits: &Limits) -> Option<(u64, Arc<Connection>)> {
        let from_peer = self.open.values().filter(|c| c.peer == peer).count();
        if from_peer >= limits.max_per_peer {
            self.displace(|c| c.peer == peer)?;
        } else if self.open.len() >= limits.max_connections {
            self.displace(|_| true)?;
        }
        let id = self.next_id;
        self.next_id += 1;
        let conn = Arc::new(Connection {
            peer,
            proven: AtomicBool::new(false),
            evict: Notify::new(),
        });
        self.open.insert(id, conn.clone());
        Some((id, conn))
    }

    /// Closes the oldest unproven connection that `which` picks.
    fn displace(&mut self, which: impl Fn(&Connection) -> bool) -> Option<()> {
        let (&id, _) = self
            .open
            .iter()
            .find(|(_, c)| which(c) && !c.proven.load(Ordering::Relaxed))?;
        let conn = self.open.remove(&id)?;
        conn.evict.notify_one();
        Some(())
    }
}

/// [`serve`] within [`Limits::for_this_process`] until `stop` turns true:
/// how the API and an agent's console port run.
/// With `tls`, every connection speaks HTTPS.
pub async fn serve_until(
    listener: TcpListener,
    app: Router,
    tls: Option<TlsAcceptor>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    let stopped = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    serve(listener, app, Limits::for_this_process(), tls, stopped).await
}

/// Serves `app` on `listener` within `limits` until `shutdown` completes,
/// then lets requests under way finish for up to the drain timeout.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let table = Arc::new(Mutex::new(Table::default()));
    let (stopping, stop_rx) = tokio::sync::watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // EMFILE/ENFILE and the like: what frees descriptors is
                    // time (timeouts, displaced connections), not retries.
                    tracing::warn!(error = %e, "accept failed; retrying in 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let admitted = table
            .lock()
            .expect("connection table")
            .admit(peer.ip(), &limits);
        let Some((id, conn)) = admitted else {
            tracing::debug!(%peer, "connection refused: every place is taken by a live request");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let table = table.clone();
        let stop_rx = stop_rx.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let evicted = conn.evict.notified();
            tokio::pin!(evicted);
            // Registered now, so a displacement during the handshake is seen.
            evicted.as_mut().enable();
            match tls {
                None => {
                    drive(
                        stream,
                        &conn,
                        evicted,
                        app,
                        limits,
                        stop_rx,
                        Peer {
                            addr: peer,
                            certs: None,
                        },
                    )
                    .await
                }
                Some(acceptor) => {
                    let handshake =
                        tokio::time::timeout(limits.header_timeout, handshake(&acceptor, stream));
                    let stream = tokio::select! {
                        done = handshake => match done {
                            Ok(Some(stream)) => Some(stream),
                            Ok(None) => None,
                            Err(_) => {
                                tracing::debug!(%peer, "TLS handshake timed out");
                                None
                            }
                        },
                        () = evicted.as_mut() => {
                            tracing::debug!(%peer, "connection displaced during its TLS handshake");
                            None
                        }
                    };
                    if let Some(stream) = stream {
                        let certs = stream
                            .get_ref()
                            .1
                            .peer_certificates()
                            .map(|c| PeerCertificates(Arc::new(c.to_vec())));
                        let peer = Peer { addr: peer, certs };
                        drive(stream, &conn, evicted, app, limits, stop_rx, peer).await;
                    }
                }
            }
            table.lock().expect("connection table").open.remove(&id);
        });
    }
    drop(listener);
    let _ = stopping.send(true);
    let drained = async {
        while !table.lock().expect("connection table").open.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    if tokio::time::timeout(limits.drain_timeout, drained)
        .await
        .is_err()
    {
        tracing::warn!(
            "requests still under way after {:?}; closing them",
            limits.drain_timeout
        );
    }
    Ok(())
}

/// The certificate chain a TLS client presented (where the listener asks
/// for one: an agent's console port), on each of its requests.
#[derive(Debug, Clone)]
pub struct PeerCertificates(pub Arc<Vec<rustls_pki_types::CertificateDer<'static>>>);

/// A request body that notes when it has been read to its end.
struct ReadToEnd {
    inner: Incoming,
    read: Arc<AtomicBool>,
}

impl http_body::Body for ReadToEnd {
    type Data = <Incoming as http_body::Body>::Data;
    type Error = <Incoming as http_body::Body>::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, std::task::Poll::Ready(None)) || self.inner.is_end_stream() {
            self.read.store(true, Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Who is at the other end of a connection.
struct Peer {
    addr: std::net::SocketAddr,
    certs: Option<PeerCertificates>,
}

/// The TLS side of a new connection; `None` if it is not TLS (answered
/// with a plain 400) or the handshake fails.
async fn handshake(
    acceptor: &TlsAcceptor,
    mut stream: TcpStream,
) -> Option<tokio_rustls::server::TlsStream<TcpStream>> {
    let peer = stream.peer_addr().ok();
    let mut first = [0u8; 1];
    match stream.peek(&mut first).await {
        Ok(1..) => {}
        _ => return None,
    }
    // 0x16: a TLS handshake record. Anything else is most likely a plain
    // HTTP request, which deserves an answer it can show.
    if first[0] != 0x16 {
        let body =
            "this keel server speaks HTTPS: use https:// (with the CLI: --server https://…)\n";
        let reply = format!(
            "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = stream.write_all(reply.as_bytes()).await;
        let _ = stream.shutdown().await;
        tracing::debug!(?peer, "plain HTTP on the HTTPS port; answered 400");
        return None;
    }
    match acceptor.accept(stream).await {
        Ok(tls) => Some(tls),
        Err(e) => {
            tracing::debug!(?peer, error = %e, "TLS handshake failed");
            None
        }
    }
}

/// Serves HTTP/1 on one connection until it ends, is displaced before its
/// first request head, or the listener stops (then the request under way
/// finishes and no next one is read).
async fn drive<IO>(
    io: IO,
    conn: &Arc<Connection>,
    evicted: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
    app: Router,
    limits: Limits,
    mut stop_rx: tokio::sync::watch::Receiver<bool>,
    peer: Peer,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Peer { addr: peer, certs } = peer;
    let service = {
        let conn = conn.clone();
        hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let (mut parts, incoming) = req.into_parts();
            conn.proven.store(true, Ordering::Relaxed);
            // What axum's own server would add: the audit trail names the
            // address a request came from.
            parts.extensions.insert(axum::extract::ConnectInfo(peer));
            if let Some(certs) = &certs {
                parts.extensions.insert(certs.clone());
            }
            let sends_body = !http_body::Body::is_end_stream(&incoming);
            let read = Arc::new(AtomicBool::new(false));
            let body = ReadToEnd {
                inner: incoming,
                read: read.clone(),
            };
            let req = hyper::Request::from_parts(parts, axum::body::Body::new(body));
            let mut app = app.clone();
            async move {
                let mut resp = app.call(req).await?;
                // Answered before its body was read (a refusal: 401, 403,
                // 413, 429): hyper then closes the connection rather than
                // wait for the rest, so say so, or a client that pools it
                // sends its next request into a closed socket.
                if sends_body && !read.load(Ordering::Relaxed) {
                    resp.headers_mut().insert(
                        hyper::header::CONNECTION,
                        hyper::header::HeaderValue::from_static("close"),
                    );
                }
                Ok::<_, std::convert::Infallible>(resp)
            }
        })
    };
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let served = http
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    tokio::pin!(served);
    let result = tokio::select! {
        result = served.as_mut() => Some(result),
        () = evicted => {
            tracing::debug!(%peer, "connection displaced before its request head");
            None
        }
        () = async { let _ = stop_rx.wait_for(|s| *s).await; } => {
            // The request under way finishes; no next one is read.
            served.as_mut().graceful_shutdown();
            Some(served.await)
        }
    };
    if let Some(Err(e)) = result {
        tracing::debug!(%peer, error = %e, "connection ended");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(total: usize, per_peer: usize) -> Limits {
        Limits {
            max_connections: total,
            max_per_peer: per_peer,
            ..Limits::default()
        }
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([192, 0, 2, last])
    }

    #[test]
    fn a_full_table_displaces_the_oldest_connection_without_a_request() {
        let l = limits(3, 3);
        let mut t = Table::default();
        let (_, a) = t.admit(ip(1), &l).unwrap();
        let (_, b) = t.admit(ip(2), &l).unwrap();
        let (_, _c) = t.admit(ip(3), &l).unwrap();
        a.proven.store(true, Ordering::Relaxed);
        // Full: the oldest unproven (b) goes, the proven one stays.
        let (_, _d) = t.admit(ip(4), &l).unwrap();
        assert_eq!(t.open.len(), 3);
        assert!(t.open.values().any(|c| Arc::ptr_eq(c, &a)));
        assert!(!t.open.values().any(|c| Arc::ptr_eq(c, &b)));
    }

    #[test]
    fn one_peer_displaces_only_its_own_and_a_table_of_live_requests_refuses() {
        let l = limits(10, 2);
        let mut t = Table::default();
        let (_, other) = t.admit(ip(9), &l).unwrap();
        let (_, first) = t.admit(ip(1), &l).unwrap();
        let (_, _second) = t.admit(ip(1), &l).unwrap();
        let (_, _third) = t.admit(ip(1), &l).unwrap();
        assert!(!t.open.values().any(|c| Arc::ptr_eq(c, &first)));
        assert!(t.open.values().any(|c| Arc::ptr_eq(c, &other)));
        assert_eq!(t.open.values().filter(|c| c.peer == ip(1)).count(), 2);
        for c in t.open.values() {
            c.proven.store(true, Ordering::Relaxed);
        }
        assert!(
            t.admit(ip(1), &l).is_none(),
            "both of its places hold requests"
        );
        assert!(t.admit(ip(2), &l).is_some(), "another peer still gets in");
    }
}
