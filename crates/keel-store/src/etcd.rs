//! Distributed [`Store`] on etcd v3: Keel's state once it outgrows one host.
//!
//! # Client
//!
//! Built on the `etcd-client` crate (0.21, v3 gRPC over tonic/tokio). It is
//! the maintained, widely used async etcd v3 client for Rust, runs on the
//! tokio runtime Keel already uses, and exposes what this store needs
//! directly: multi-compare transactions, ranges with a fixed read revision
//! and limits, watches with a start revision and compaction reporting, and
//! the lease calls. The alternatives are either unmaintained, v2 (HTTP/JSON,
//! no revisions or transactions) or would mean generating and maintaining
//! our own gRPC bindings. Its build script compiles etcd's `.proto` files,
//! so building Keel needs `protoc` (Debian: `protobuf-compiler`).
//!
//! # TLS
//!
//! Endpoints are `http://` (plain gRPC, no authentication: whoever reaches
//! etcd can rewrite any key) or `https://` with [`EtcdOptions::tls`]: the
//! client verifies etcd's certificate against the given CA only (no
//! system roots) and presents its own certificate, which an etcd run
//! with `--client-cert-auth --trusted-ca-file` requires. The crate's `tls`
//! feature is rustls on ring, as everywhere else in Keel. A handshake that
//! fails (wrong CA, no or foreign client certificate) fails the connect
//! within the request timeout with the TLS reason, not a hang.
//!
//! # Semantics
//!
//! The mapping follows the SQLite store exactly, with etcd's own counters:
//!
//! * Revisions are etcd's cluster-wide revision; `Entry` revisions are the
//!   key's `create_revision`/`mod_revision`. Several Keel namespaces, or
//!   other applications, on one cluster share that counter, so revisions
//!   of one namespace increase but are not consecutive, and `list` returns
//!   the cluster revision (which is what "watch from here + 1" needs).
//! * Conditional writes are one transaction each: compare, then put or
//!   delete, or else read the key, so a `Conflict` reports the revision
//!   that actually beat the writer, read atomically with the failed compare.
//!   A guarded write adds one compare (the guard key's `create_revision`)
//!   to the same transaction and reads the guard key in the else-branch
//!   too, so `GuardLost` and `Conflict` are told apart atomically.
//! * An atomic write of several keys ([`Store::write_all`]) is one
//!   transaction too: all compares, then all puts and deletes at one etcd
//!   revision, or else a read of every key (and the guard key) to say
//!   which precondition failed. Its events share that revision and arrive
//!   in one watch response, like a lease's deletions (below).
//! * Keys are stored under the namespace given to [`EtcdStore::connect`],
//!   normalised to end in `/`: namespace `/keel` stores `/vms/a` as etcd key
//!   `/keel//vms/a`. The separator is what keeps namespaces apart: with
//!   plain concatenation `/keel-1` would see the keys of `/keel-10`.
//!   Namespaces must not nest (`/keel` and `/keel/x`).
//! * A lease's expiry or revocation deletes all its keys in one etcd
//!   revision, so unlike the SQLite store several `Deleted` events may share
//!   a revision. They arrive together in one watch response, so a watch
//!   never delivers half of them; a consumer that resumes after a failure
//!   from "last revision seen + 1" must not stop in the middle of such a
//!   group.
//! * Lease TTLs are whole seconds on etcd: `grant_lease` rounds up, and
//!   etcd raises anything below its minimum (1.5 × election timeout, so
//!   2 s with default settings) to that minimum. Expiry is checked by the
//!   etcd leader about twice a second.
//! * etcd keeps history until someone compacts it. The store does not
//!   compact on its own; Keel's control planes take turns at it
//!   ([`compaction`]), or call [`EtcdStore::compact`]. A watch from a
//!   compacted revision fails with `Compacted`, as the first item of the
//!   stream.
//!
//! # Failures
//!
//! Every request has a deadline ([`EtcdOptions::request_timeout`]): a
//! cluster that is down or has lost its quorum yields `Unavailable` naming
//! the key instead of a hang. A write that ends in `Unavailable` because
//! it timed out or the connection broke may still have been applied, as
//! with any RPC: re-read before retrying. The underlying channel
//! reconnects by itself, so the same `EtcdStore` works again once etcd is
//! back. A watch is one gRPC stream; if the connection breaks (or stops
//! answering HTTP/2 pings) it ends with `Unavailable` naming the last
//! revision it delivered, and the caller resumes from there with a new
//! watch (etcd replays from its history, so nothing is lost).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, GetOptions, Identity, KeyValue,
    PutOptions, TlsOptions, Txn, TxnOp, TxnOpResponse, TxnResponse, WatchOptions, WatchStream,
};
use tokio::sync::mpsc;

pub mod compaction;

use crate::{
    check_batch, Entry, Guard, LeaseId, Precondition, Revision, Store, StoreError, Watch,
    WatchEvent, Write,
};

/// Keys per range request when listing: keeps each response well below the
/// gRPC message limit and etcd's per-request memory, however big a prefix.
const LIST_PAGE: i64 = 500;
/// A paginated list reads every page at the first page's revision; if that
/// revision is compacted away between pages, the list starts over.
const LIST_ATTEMPTS: usize = 3;
/// Watch responses are not fragmented, so one revision (a lease revoking
/// many keys) is one message; allow it to be far larger than tonic's 4 MiB.
const MAX_MESSAGE: usize = 64 << 20;
const WATCH_CHANNEL: usize = 256;
/// etcd's own upper bound on a lease TTL (`MaxLeaseTTL`), in seconds.
const MAX_TTL_SECS: u64 = 9_000_000_000;

/// Connection tuning for [`EtcdStore::connect_with`].
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// Deadline of every request, including opening a watch. Also the
    /// connect timeout.
    pub request_timeout: Duration,
    /// HTTP/2 ping interval while a request or watch is open: detects a
    /// dead peer that never closed the TCP connection (a partition, a
    /// frozen VM), which would otherwise stall a watch forever. etcd
    /// disconnects clients that ping more often than every 5 s.
    pub keep_alive_interval: Duration,
    /// How long a ping may go unanswered before the connection is dropped.
    pub keep_alive_timeout: Duration,
    /// TLS for `https://` endpoints; `None` for `http://` ones.
    pub tls: Option<EtcdTls>,
}

/// What the client trusts and presents on `https://` endpoints (PEM).
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// The CA etcd's server certificate must chain to; the only root.
    pub ca_pem: Vec<u8>,
    /// The client certificate and its private key, which etcd checks
    /// with `--client-cert-auth`; `None` presents none.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("EtcdTls")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field("client_certificate", &self.identity.is_some())
            .finish()
    }
}

impl Default for EtcdOptions {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(5),
            keep_alive_interval: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(5),
            tls: None,
        }
    }
}

/// [`Store`] on an etcd v3 cluster, under a key namespace. Cloning is cheap
/// and shares the connection.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    namespace: Arc<str>,
    timeout: Duration,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("namespace", &self.namespace)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Why a request got no usable answer.
enum Failure {
    Etcd(etcd_client::Error),
    Timeout(Duration),
}

impl Failure {
    fn is_lease_not_found(&self) -> bool {
        match self {
            // Put/txn with, or revoke of, an unknown lease.
            Failure::Etcd(etcd_client::Error::GRpcStatus(s)) => {
                i32::from(s.code()) == grpc_code::NOT_FOUND
                    && s.message().contains("lease not found")
            }
            // What the client reports when the first keep-alive answer has
            // TTL <= 0, etcd's way of saying the lease does not exist.
            Failure::Etcd(etcd_client::Error::LeaseKeepAliveError(m)) => {
                m.contains("lease not found")
            }
            _ => false,
        }
    }

    fn is_compacted(&self) -> bool {
        matches!(self, Failure::Etcd(etcd_client::Error::GRpcStatus(s))
            if i32::from(s.code()) == grpc_code::OUT_OF_RANGE && s.message().contains("compacted"))
    }

    fn reason(&self, write: bool) -> String {
        match self {
            Failure::Etcd(etcd_client::Error::GRpcStatus(s)) => {
                // The transport's causes (a TLS alert, a refused
                // certificate) are only in the source chain.
                let mut text = format!("gRPC status {:?}: {}", s.code(), s.message());
                let mut source = std::error::Error::source(s);
                while let Some(e) = source {
                    let cause = e.to_string();
                    if !text.contains(&cause) {
                        text.push_str(&format!(": {cause}"));
                    }
                    source = e.source();
                }
                text
            }
            Failure::Etcd(e) => format!("etcd request failed: {e}"),
            Failure::Timeout(t) if write => {
                format!("no answer from etcd within {t:?} (the write may still have been applied)")
            }
            Failure::Timeout(t) => format!("no answer from etcd within {t:?}"),
        }
    }
}

/// gRPC status codes, compared as numbers: `etcd-client` exposes tonic's
/// `Status` but not its `Code` type, and depending on tonic directly would
/// have to track whichever tonic version the client uses.
mod grpc_code {
    pub const NOT_FOUND: i32 = 5;
    pub const OUT_OF_RANGE: i32 = 11;
}

fn unavailable(subject: &str, failure: &Failure, write: bool) -> StoreError {
    StoreError::Unavailable {
        key: subject.to_string(),
        reason: failure.reason(write),
    }
}

fn compact_failed(revision: Revision, failure: &Failure) -> StoreError {
    unavailable(
        &format!("history before revision {revision}"),
        failure,
        true,
    )
}

/// What a failed first request over TLS most likely means. With TLS 1.3
/// the client's handshake completes before etcd checks the client
/// certificate, so a refused certificate shows as a closed connection
/// (or a `BadCertificate` alert) on the first request, not as a handshake
/// error; say so rather than leave "operation was canceled".
fn tls_hint(tls: &EtcdTls, failure: &Failure) -> String {
    let Failure::Etcd(etcd_client::Error::GRpcStatus(status)) = failure else {
        return String::new();
    };
    let text = failure.reason(false);
    if text.contains("invalid peer certificate") {
        return "; etcd's server certificate is not signed by the trusted CA (or does not \
                name this endpoint)"
            .into();
    }
    // Codes Unknown (2), Cancelled (1), Unavailable (14) with a transport
    // cause: the connection itself failed.
    let transport = std::error::Error::source(status).is_some();
    if !transport {
        return String::new();
    }
    if tls.identity.is_none() {
        "; etcd closed the TLS connection: it requires a client certificate \
         (--client-cert-auth) and this client presents none"
            .into()
    } else {
        "; etcd closed the TLS connection: it refused this client's certificate \
         (not signed by its --trusted-ca-file, expired, or without clientAuth)"
            .into()
    }
}

fn lease_subject(lease: LeaseId) -> String {
    format!("lease {lease}")
}

impl EtcdStore {
    /// Connects to the cluster at `endpoints` (`http://host:port`), storing
    /// keys under `namespace` (see the module docs). Fails with
    /// `Unavailable` if no endpoint answers within the request timeout.
    pub async fn connect(endpoints: &[String], namespace: &str) -> Result<Self, StoreError> {
        Self::connect_with(endpoints, namespace, EtcdOptions::default()).await
    }

    pub async fn connect_with(
        endpoints: &[String],
        namespace: &str,
        options: EtcdOptions,
    ) -> Result<Self, StoreError> {
        let subject = format!("etcd {} (namespace {namespace:?})", endpoints.join(","));
        let mut connect_options = ConnectOptions::new()
            .with_connect_timeout(options.request_timeout)
            .with_keep_alive(options.keep_alive_interval, options.keep_alive_timeout)
            // etcd's default policy treats pings without open streams as
            // abuse and eventually sends GOAWAY.
            .with_keep_alive_while_idle(false)
            // Without this, a request or watch on a member that lost the
            // quorum waits silently; with it etcd fails it, and we report
            // Unavailable.
            .with_require_leader(true);
        if let Some(tls) = &options.tls {
            let mut tls_options =
                TlsOptions::new().ca_certificate(Certificate::from_pem(&tls.ca_pem));
            if let Some((cert, key)) = &tls.identity {
                tls_options = tls_options.identity(Identity::from_pem(cert, key));
            }
            connect_options = connect_options.with_tls(tls_options);
        }
        // Bounded as a whole: the client's own connect timeout covers the
        // TCP connect, not every way a TLS handshake can stall.
        let client = match tokio::time::timeout(
            options.request_timeout,
            Client::connect(endpoints, Some(connect_options)),
        )
        .await
        {
            Ok(connected) => {
                connected.map_err(|e| unavailable(&subject, &Failure::Etcd(e), false))?
            }
            Err(_) => {
                return Err(unavailable(
                    &subject,
                    &Failure::Timeout(options.request_timeout),
                    false,
                ))
            }
        };
        let store = Self {
            client,
            namespace: normalise_namespace(namespace).into(),
            timeout: options.request_timeout,
        };
        // The client connects lazily; one round trip now turns a wrong
        // endpoint into an error at startup rather than at the first write.
        let mut kv = store.client.kv_client();
        store
            .call(kv.get(
                store.namespace.as_bytes(),
                Some(GetOptions::new().with_prefix().with_count_only()),
            ))
            .await
            .map_err(|f| {
                let mut error = unavailable(&subject, &f, false);
                if let (Some(tls), StoreError::Unavailable { reason, .. }) =
                    (&options.tls, &mut error)
                {
                    reason.push_str(&tls_hint(tls, &f));
                }
                error
            })?;
        Ok(store)
    }

    /// The etcd key prefix every key of this store lives under.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Discards history before `revision` (cluster-wide, for every
    /// namespace): watches from an earlier revision then fail with
    /// `Compacted`. Deployments that do not let etcd auto-compact should
    /// call this periodically, or etcd's database grows until it hits its
    /// quota and refuses writes.
    pub async fn compact(&self, revision: Revision) -> Result<(), StoreError> {
        self.try_compact(revision)
            .await
            .map_err(|f| compact_failed(revision, &f))
    }

    /// [`Self::compact`], telling why it failed.
    async fn try_compact(&self, revision: Revision) -> Result<(), Failure> {
        let mut kv = self.client.kv_client();
        self.call(kv.compact(to_etcd(revision), None))
            .await
            .map(drop)
    }

    async fn call<T>(
        &self,
        request: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, Failure> {
        match tokio::time::timeout(self.timeout, request).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(Failure::Etcd(e)),
            Err(_) => Err(Failure::Timeout(self.timeout)),
        }
    }

    fn etcd_key(&self, key: &str) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.namespace.len() + key.len());
        k.extend_from_slice(self.namespace.as_bytes());
        k.extend_from_slice(key.as_bytes());
        k
    }

    /// `[start, end)` of the etcd keys under Keel prefix `prefix`.
    fn range(&self, prefix: &str) -> (Vec<u8>, Vec<u8>) {
        let start = self.etcd_key(prefix);
        if start.is_empty() {
            // etcd's spelling of "every key".
            return (vec![0], vec![0]);
        }
        let end = prefix_end(&start);
        (start, end)
    }

    fn entry(&self, kv: &KeyValue) -> Result<Entry, StoreError> {
        Ok(Entry {
            key: strip_namespace(&self.namespace, kv.key())?,
            value: kv.value().to_vec(),
            create_revision: from_etcd(kv.create_revision()),
            mod_revision: from_etcd(kv.mod_revision()),
        })
    }

    async fn put_inner(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
        lease: Option<LeaseId>,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        check_guard_revision(guard)?;
        let k = self.etcd_key(key);
        let mut compares = holds(&k, precondition);
        let expected = precondition.expected();
        // No lease (0) on a plain put is what detaches a key from its lease.
        let options = PutOptions::new().with_lease(lease.unwrap_or(0));
        let mut reads = vec![read_revision(&k)];
        if let Some(guard) = guard {
            let g = self.etcd_key(&guard.key);
            compares.push(guard_holds(&g, guard));
            reads.push(read_revision(&g));
        }
        let txn = Txn::new()
            .when(compares)
            .and_then(vec![TxnOp::put(k.clone(), value, Some(options))])
            .or_else(reads);
        let mut kv = self.client.kv_client();
        let response = self.call(kv.txn(txn)).await.map_err(|f| match lease {
            Some(lease) if f.is_lease_not_found() => StoreError::LeaseNotFound { lease },
            _ => unavailable(key, &f, true),
        })?;
        self.written(key, expected, guard, response)
    }

    async fn delete_inner(
        &self,
        key: &str,
        revision: Revision,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        check_guard_revision(guard)?;
        let k = self.etcd_key(key);
        let mut compares = exists_at(&k, revision);
        let mut reads = vec![read_revision(&k)];
        if let Some(guard) = guard {
            let g = self.etcd_key(&guard.key);
            compares.push(guard_holds(&g, guard));
            reads.push(read_revision(&g));
        }
        let txn = Txn::new()
            .when(compares)
            .and_then(vec![TxnOp::delete(k.clone(), None)])
            .or_else(reads);
        let mut kv = self.client.kv_client();
        let response = self
            .call(kv.txn(txn))
            .await
            .map_err(|f| unavailable(key, &f, true))?;
        self.written(key, Some(revision), guard, response)
    }

    /// [`Store::write_all`] as one transaction: every write's compares
    /// (and the guard's) together, then all the puts and deletes, which
    /// etcd applies at one revision; or else a keys-only read of every key
    /// (and the guard key), from which the failure is told atomically.
    async fn write_all_inner(
        &self,
        mut writes: Vec<Write>,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        check_batch(&writes)?;
        check_guard_revision(guard)?;
        let first = writes[0].key().to_string();
        let mut compares = Vec::with_capacity(writes.len() * 2 + 1);
        let mut then = Vec::with_capacity(writes.len());
        let mut reads = Vec::with_capacity(writes.len() + 1);
        for write in &mut writes {
            let k = self.etcd_key(write.key());
            match write {
                Write::Put {
                    value,
                    precondition,
                    ..
                } => {
                    compares.extend(holds(&k, *precondition));
                    // Lease 0, as a plain put: detaches a leased key.
                    let options = PutOptions::new().with_lease(0);
                    then.push(TxnOp::put(k.clone(), std::mem::take(value), Some(options)));
                }
                Write::Delete { revision, .. } => {
                    compares.extend(exists_at(&k, *revision));
                    then.push(TxnOp::delete(k.clone(), None));
                }
            }
            reads.push(read_revision(&k));
        }
        if let Some(guard) = guard {
            let g = self.etcd_key(&guard.key);
            compares.push(guard_holds(&g, guard));
            reads.push(read_revision(&g));
        }
        let txn = Txn::new().when(compares).and_then(then).or_else(reads);
        let mut kv = self.client.kv_client();
        let response = self
            .call(kv.txn(txn))
            .await
            .map_err(|f| unavailable(&first, &f, true))?;
        if response.succeeded() {
            return response
                .header()
                .map(|h| from_etcd(h.revision()))
                .ok_or_else(|| StoreError::Unavailable {
                    key: first,
                    reason: "etcd answered a write without a response header".into(),
                });
        }
        let read = read_revisions(&response);
        if let Some(guard) = guard {
            let guard_read = read.get(writes.len()).copied().flatten();
            if guard_read.map(|(_, c)| c) != Some(guard.create_revision) {
                return Err(guard.lost());
            }
        }
        for (i, write) in writes.iter().enumerate() {
            let Some(current) = read.get(i) else {
                break;
            };
            if let Some(conflict) = write.conflict(current.map(|(m, _)| m)) {
                return Err(conflict);
            }
        }
        Err(StoreError::Unavailable {
            key: first,
            reason: "etcd refused an atomic write, yet its reads show every precondition holding"
                .into(),
        })
    }

    /// The revision of a successful write transaction, or what its
    /// else-branch read: `GuardLost` if the guard key (read second) is not
    /// the guard's incarnation, else the `Conflict` on the key (read first).
    fn written(
        &self,
        key: &str,
        expected: Option<Revision>,
        guard: Option<&Guard>,
        response: TxnResponse,
    ) -> Result<Revision, StoreError> {
        if response.succeeded() {
            return response
                .header()
                .map(|h| from_etcd(h.revision()))
                .ok_or_else(|| StoreError::Unavailable {
                    key: key.to_string(),
                    reason: "etcd answered a write without a response header".into(),
                });
        }
        let reads = read_revisions(&response);
        if let Some(guard) = guard {
            match reads.get(1) {
                Some(read) if read.map(|(_, c)| c) == Some(guard.create_revision) => {}
                Some(_) => return Err(guard.lost()),
                None => {
                    return Err(StoreError::Unavailable {
                        key: key.to_string(),
                        reason: "etcd answered a failed compare without the read of the guard"
                            .into(),
                    })
                }
            }
        }
        let actual = reads.first().map(|read| read.map(|(m, _)| m));
        match actual {
            Some(actual) => Err(StoreError::Conflict {
                key: key.to_string(),
                expected,
                actual,
            }),
            None => Err(StoreError::Unavailable {
                key: key.to_string(),
                reason: "etcd answered a failed compare without the read of the key".into(),
            }),
        }
    }

    /// One paginated read of `prefix`. `Err(Ok(_))` is final; `Err(Err(_))`
    /// is a failed request, which `list` retries if history moved on.
    async fn list_at(
        &self,
        prefix: &str,
    ) -> Result<(Vec<Entry>, Revision), Result<StoreError, Failure>> {
        let (mut start, end) = self.range(prefix);
        let mut kv = self
            .client
            .kv_client()
            .max_decoding_message_size(MAX_MESSAGE);
        let mut entries = Vec::new();
        let mut revision = 0;
        loop {
            let mut options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(LIST_PAGE);
            if revision > 0 {
                options = options.with_revision(revision);
            }
            let mut response = self
                .call(kv.get(start.clone(), Some(options)))
                .await
                .map_err(Err)?;
            if revision == 0 {
                revision = response.header().map_or(0, |h| h.revision());
                if revision <= 0 {
                    return Err(Ok(StoreError::Unavailable {
                        key: prefix.to_string(),
                        reason: "etcd answered a range without a revision".into(),
                    }));
                }
            }
            let more = response.more();
            let kvs = response.take_kvs();
            for kv in &kvs {
                entries.push(self.entry(kv).map_err(Ok)?);
            }
            match kvs.last() {
                Some(last) if more => {
                    start = last.key().to_vec();
                    start.push(0);
                }
                _ => return Ok((entries, from_etcd(revision))),
            }
        }
    }
}

/// `(mod_revision, create_revision)` of each key a failed transaction's
/// else-branch read, in request order; `None` for a key that is absent.
fn read_revisions(response: &TxnResponse) -> Vec<Option<(Revision, Revision)>> {
    response
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get.kvs().first().map(|kv| {
                (
                    from_etcd(kv.mod_revision()),
                    from_etcd(kv.create_revision()),
                )
            })),
            _ => None,
        })
        .collect()
}

/// Compares that hold iff `precondition` holds for the key.
fn holds(key: &[u8], precondition: Precondition) -> Vec<Compare> {
    match precondition {
        Precondition::Absent => vec![Compare::create_revision(key.to_vec(), CompareOp::Equal, 0)],
        Precondition::Revision(r) => exists_at(key, r),
    }
}

/// Compares that hold iff the key exists with `mod_revision == revision`.
/// etcd compares a missing key's `mod_revision` as 0, so without the
/// existence check `Revision(0)` would create the key.
fn exists_at(key: &[u8], revision: Revision) -> Vec<Compare> {
    vec![
        Compare::create_revision(key.to_vec(), CompareOp::Greater, 0),
        Compare::mod_revision(key.to_vec(), CompareOp::Equal, to_etcd(revision)),
    ]
}

/// Holds iff the guard key exists as the guard's incarnation. A missing
/// key's `create_revision` compares as 0, so a guard naming revision 0
/// must never get here (see [`check_guard_revision`]).
fn guard_holds(guard_key: &[u8], guard: &Guard) -> Compare {
    Compare::create_revision(
        guard_key.to_vec(),
        CompareOp::Equal,
        to_etcd(guard.create_revision),
    )
}

/// No key has `create_revision` 0; a guard that says so holds nothing (and
/// its compare would match a missing key).
fn check_guard_revision(guard: Option<&Guard>) -> Result<(), StoreError> {
    match guard {
        Some(g) if g.create_revision == 0 => Err(g.lost()),
        _ => Ok(()),
    }
}

/// The else-branch of a conditional write: the key's current revision,
/// without its value (it may be large, and only the revision is reported).
fn read_revision(key: &[u8]) -> TxnOp {
    TxnOp::get(key.to_vec(), Some(GetOptions::new().with_keys_only()))
}

fn normalise_namespace(namespace: &str) -> String {
    let trimmed = namespace.trim_end_matches('/');
    if trimmed.is_empty() && namespace.is_empty() {
        String::new()
    } else {
        format!("{trimmed}/")
    }
}

fn strip_namespace(namespace: &str, etcd_key: &[u8]) -> Result<String, StoreError> {
    let lossy = || String::from_utf8_lossy(etcd_key).into_owned();
    let Some(rest) = etcd_key.strip_prefix(namespace.as_bytes()) else {
        return Err(StoreError::Corrupt {
            key: lossy(),
            reason: format!("etcd returned a key outside namespace {namespace:?}"),
        });
    };
    String::from_utf8(rest.to_vec()).map_err(|e| StoreError::Corrupt {
        key: lossy(),
        reason: format!("key is not UTF-8: {e}"),
    })
}

/// The smallest key greater than every key starting with `prefix`; `\0`
/// ("to the end") if there is none.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Keel revisions beyond etcd's `i64` cannot exist in etcd; saturating keeps
/// a compare against one failing instead of wrapping.
fn to_etcd(revision: Revision) -> i64 {
    i64::try_from(revision).unwrap_or(i64::MAX)
}

fn from_etcd(revision: i64) -> Revision {
    u64::try_from(revision).unwrap_or(0)
}

#[async_trait]
impl Store for EtcdStore {
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        let mut kv = self
            .client
            .kv_client()
            .max_decoding_message_size(MAX_MESSAGE);
        let response = self
            .call(kv.get(self.etcd_key(key), None))
            .await
            .map_err(|f| unavailable(key, &f, false))?;
        response.kvs().first().map(|kv| self.entry(kv)).transpose()
    }

    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
    ) -> Result<Revision, StoreError> {
        self.put_inner(key, value, precondition, None, None).await
    }

    async fn put_with_lease(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
        lease: LeaseId,
    ) -> Result<Revision, StoreError> {
        self.put_inner(key, value, precondition, Some(lease), None)
            .await
    }

    async fn delete(&self, key: &str, revision: Revision) -> Result<Revision, StoreError> {
        self.delete_inner(key, revision, None).await
    }

    async fn put_guarded(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.put_inner(key, value, precondition, None, Some(guard))
            .await
    }

    async fn delete_guarded(
        &self,
        key: &str,
        revision: Revision,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.delete_inner(key, revision, Some(guard)).await
    }

    async fn write_all(
        &self,
        writes: Vec<Write>,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        self.write_all_inner(writes, guard).await
    }

    async fn list(&self, prefix: &str) -> Result<(Vec<Entry>, Revision), StoreError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.list_at(prefix).await {
                Ok(listed) => return Ok(listed),
                Err(Ok(error)) => return Err(error),
                Err(Err(f)) if f.is_compacted() && attempt < LIST_ATTEMPTS => continue,
                Err(Err(f)) => return Err(unavailable(prefix, &f, false)),
            }
        }
    }

    async fn count(&self, prefix: &str) -> Result<u64, StoreError> {
        let (start, end) = self.range(prefix);
        let mut kv = self.client.kv_client();
        let options = GetOptions::new().with_range(end).with_count_only();
        let response = self
            .call(kv.get(start, Some(options)))
            .await
            .map_err(|f| unavailable(prefix, &f, false))?;
        Ok(u64::try_from(response.count()).unwrap_or(0))
    }

    async fn watch(&self, prefix: &str, from: Revision) -> Result<Watch, StoreError> {
        let (start, end) = self.range(prefix);
        // etcd's start revision 0 means "from now"; Keel's 0 means "from
        // the beginning", which etcd spells 1.
        let options = WatchOptions::new()
            .with_range(end)
            .with_start_revision(to_etcd(from.max(1)));
        let mut client = self
            .client
            .watch_client()
            .max_decoding_message_size(MAX_MESSAGE);
        let mut stream = self
            .call(client.watch(start, Some(options)))
            .await
            .map_err(|f| unavailable(prefix, &f, false))?;
        // Wait for etcd to confirm the watcher exists, so that a caller that
        // writes right after `watch` returns knows the watch is in place and
        // an unreachable cluster fails here rather than in the stream.
        let created = self
            .call(stream.message())
            .await
            .map_err(|f| unavailable(prefix, &f, false))?;
        let (tx, rx) = mpsc::channel(WATCH_CHANNEL);
        let mut pump = Pump {
            namespace: self.namespace.clone(),
            prefix: prefix.to_string(),
            from,
            last: None,
            out: tx,
        };
        match created {
            Some(response) if response.created() => {
                if !pump.forward(&response).await {
                    return Ok(Watch::new(rx));
                }
            }
            Some(_) => {
                return Err(StoreError::Unavailable {
                    key: prefix.to_string(),
                    reason: "etcd answered a watch request without creating the watch".into(),
                })
            }
            None => {
                return Err(StoreError::Unavailable {
                    key: prefix.to_string(),
                    reason: "etcd closed the watch stream before creating the watch".into(),
                })
            }
        }
        tokio::spawn(pump.run(stream));
        Ok(Watch::new(rx))
    }

    async fn grant_lease(&self, ttl_ms: u64) -> Result<LeaseId, StoreError> {
        let ttl_secs = ttl_ms.div_ceil(1000).clamp(1, MAX_TTL_SECS);
        let mut leases = self.client.lease_client();
        let subject = format!("lease (grant, ttl {ttl_ms} ms)");
        let response = self
            .call(leases.grant(ttl_secs as i64, None))
            .await
            .map_err(|f| unavailable(&subject, &f, true))?;
        if !response.error().is_empty() {
            return Err(StoreError::Unavailable {
                key: subject,
                reason: format!("etcd refused the lease: {}", response.error()),
            });
        }
        Ok(response.id())
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        let mut leases = self.client.lease_client();
        // One request on a fresh keep-alive stream: the trait's keep-alive
        // is a single renewal, and the client has already read the answer
        // (and checked the lease still exists) when this returns. Dropping
        // the keeper and stream closes the stream.
        match self.call(leases.keep_alive(lease)).await {
            Ok(_) => Ok(()),
            Err(f) if f.is_lease_not_found() => Err(StoreError::LeaseNotFound { lease }),
            Err(f) => Err(unavailable(&lease_subject(lease), &f, true)),
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        let mut leases = self.client.lease_client();
        match self.call(leases.revoke(lease)).await {
            Ok(_) => Ok(()),
            Err(f) if f.is_lease_not_found() => Err(StoreError::LeaseNotFound { lease }),
            Err(f) => Err(unavailable(&lease_subject(lease), &f, true)),
        }
    }
}

/// Moves one etcd watch stream into a [`Watch`] channel.
struct Pump {
    namespace: Arc<str>,
    prefix: String,
    from: Revision,
    /// Revision of the last event delivered, for the error that ends the
    /// watch: it is where the caller resumes.
    last: Option<Revision>,
    out: mpsc::Sender<Result<WatchEvent, StoreError>>,
}

impl Pump {
    async fn run(mut self, mut stream: WatchStream) {
        loop {
            let message = tokio::select! {
                // Dropping the stream cancels the watch on the server.
                _ = self.out.closed() => return,
                m = stream.message() => m,
            };
            let response = match message {
                Ok(Some(response)) => response,
                Ok(None) => return self.fail("etcd closed the watch stream".into()).await,
                Err(e) => {
                    let reason = Failure::Etcd(e).reason(false);
                    return self.fail(reason).await;
                }
            };
            if !self.forward(&response).await {
                return;
            }
        }
    }

    /// Delivers one watch response; false once the watch is over.
    async fn forward(&mut self, response: &etcd_client::WatchResponse) -> bool {
        if response.compact_revision() > 0 {
            // etcd names the oldest revision it still has; Keel's
            // `compacted` is the newest one it no longer has.
            let error = StoreError::Compacted {
                prefix: self.prefix.clone(),
                from: self.from,
                compacted: from_etcd(response.compact_revision() - 1),
            };
            let _ = self.out.send(Err(error)).await;
            return false;
        }
        for event in response.events() {
            let Some(kv) = event.kv() else {
                self.fail("etcd sent a watch event without a key".into())
                    .await;
                return false;
            };
            let key = match strip_namespace(&self.namespace, kv.key()) {
                Ok(key) => key,
                Err(e) => {
                    let _ = self.out.send(Err(e)).await;
                    return false;
                }
            };
            let mapped = match event.event_type() {
                etcd_client::EventType::Put => WatchEvent::Put(Entry {
                    key,
                    value: kv.value().to_vec(),
                    create_revision: from_etcd(kv.create_revision()),
                    mod_revision: from_etcd(kv.mod_revision()),
                }),
                // A delete event's kv carries the deletion's revision.
                etcd_client::EventType::Delete => WatchEvent::Deleted {
                    key,
                    revision: from_etcd(kv.mod_revision()),
                },
            };
            self.last = Some(mapped.revision());
            if self.out.send(Ok(mapped)).await.is_err() {
                return false;
            }
        }
        if response.canceled() {
            let reason = match response.cancel_reason() {
                "" => "etcd cancelled the watch".to_string(),
                r => format!("etcd cancelled the watch: {r}"),
            };
            self.fail(reason).await;
            return false;
        }
        true
    }

    async fn fail(&self, reason: String) {
        let resume = match self.last {
            Some(last) => format!("; last delivered revision {last}, resume from {}", last + 1),
            None => format!("; nothing delivered, resume from {}", self.from),
        };
        let error = StoreError::Unavailable {
            key: self.prefix.clone(),
            reason: format!("{reason}{resume}"),
        };
        let _ = self.out.send(Err(error)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_end_in_one_separator() {
        assert_eq!(normalise_namespace("/keel"), "/keel/");
        assert_eq!(normalise_namespace("/keel//"), "/keel/");
        assert_eq!(normalise_namespace("/"), "/");
        assert_eq!(normalise_namespace(""), "");
    }

    #[test]
    fn prefix_end_is_the_next_key_range() {
        assert_eq!(prefix_end(b"/a"), b"/b");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn keys_outside_the_namespace_are_corrupt() {
        assert_eq!(strip_namespace("/k/", b"/k//vms/a").unwrap(), "/vms/a");
        assert!(matches!(
            strip_namespace("/k/", b"/other/x"),
            Err(StoreError::Corrupt { .. })
        ));
    }
}
