//! A TCP proxy the test controls, between one process and the store: it
//! forwards; or holds every byte without closing anything (a black hole:
//! connections hang, new ones are accepted and never answered, as when a
//! network drops packets, and nothing sent is lost, as TCP retransmits
//! it after the heal); or delays each chunk, both ways, by a seeded
//! random time, keeping the stream's order.
//!
//! It runs on a thread and a runtime of its own, so a test whose own
//! runtime blocks (on a CLI call, say) does not slow the traffic.

use std::net::SocketAddr;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    Forward,
    /// Nothing passes, nothing is closed.
    BlackHole,
    /// Each chunk waits a random time in `min..=max`, and never overtakes
    /// the chunk before it.
    Delay {
        min: Duration,
        max: Duration,
    },
}

pub struct TcpProxy {
    pub addr: SocketAddr,
    mode: watch::Sender<ProxyMode>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TcpProxy {
    /// A proxy on an ephemeral loopback port to `upstream`; `seed` decides
    /// the delays (each connection and direction its own stream of them).
    pub fn start(upstream: SocketAddr, seed: u64) -> TcpProxy {
        let (mode, mode_rx) = watch::channel(ProxyMode::Forward);
        let (shutdown, shutdown_rx) = oneshot::channel();
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        std_listener.set_nonblocking(true).unwrap();
        let addr = std_listener.local_addr().unwrap();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = TcpListener::from_std(std_listener).unwrap();
                tokio::select! {
                    _ = accept_loop(listener, upstream, mode_rx, seed) => {}
                    _ = shutdown_rx => {}
                }
            });
            // Dropping the runtime drops every connection's tasks.
        });
        TcpProxy {
            addr,
            mode,
            shutdown: Some(shutdown),
            thread: Some(thread),
        }
    }

    pub fn set(&self, mode: ProxyMode) {
        self.mode.send_replace(mode);
    }

    pub fn mode(&self) -> ProxyMode {
        *self.mode.borrow()
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    mode: watch::Receiver<ProxyMode>,
    seed: u64,
) {
    let mut connection = 0u64;
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        connection += 1;
        let mode = mode.clone();
        let seeds = (
            seed ^ connection.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            seed ^ connection.wrapping_mul(0xc2b2_ae3d_27d4_eb4f),
        );
        tokio::spawn(async move {
            let mut waiting = mode.clone();
            // Accepted, but a black hole answers nothing: the store is
            // reached only once it heals.
            if passable(&mut waiting).await.is_none() {
                return;
            }
            let Ok(server) = TcpStream::connect(upstream).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (client_read, client_write) = client.into_split();
            let (server_read, server_write) = server.into_split();
            tokio::join!(
                pump(client_read, server_write, mode.clone(), seeds.0),
                pump(server_read, client_write, mode, seeds.1),
            );
        });
    }
}

/// Waits until the mode lets bytes through; `None` once the proxy is gone.
async fn passable(mode: &mut watch::Receiver<ProxyMode>) -> Option<()> {
    mode.wait_for(|m| *m != ProxyMode::BlackHole)
        .await
        .ok()
        .map(|_| ())
}

/// One direction: reads chunks and hands each to the writer with the time
/// it may leave.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<ProxyMode>,
    seed: u64,
) {
    let (chunks, mut queued) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let mut writer_mode = mode.clone();
    let writer = async move {
        while let Some((at, bytes)) = queued.recv().await {
            tokio::time::sleep_until(at).await;
            if passable(&mut writer_mode).await.is_none() || to.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    let reader = async move {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut buf = vec![0u8; 64 * 1024];
        let mut last = Instant::now();
        loop {
            if passable(&mut mode).await.is_none() {
                return;
            }
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let delay = match *mode.borrow() {
                ProxyMode::Delay { min, max } => rng.gen_range(min..=max),
                _ => Duration::ZERO,
            };
            last = last.max(Instant::now() + delay);
            if chunks.send((last, buf[..n].to_vec())).is_err() {
                return;
            }
        }
    };
    tokio::join!(reader, writer);
}
