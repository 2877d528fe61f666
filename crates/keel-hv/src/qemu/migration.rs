//! Live migration between two qemu drivers (two nodes, or two data dirs on
//! one host).
//!
//! What moves is guest memory and device state, in one stream from the
//! source QEMU to a target QEMU started with `-incoming defer`. The disks do
//! not move: both QEMUs open the same image files, which is why the disk dir
//! must be shared storage (`QemuConfig::disk_dir`). The target opens them
//! inactive (no image locks, no I/O); at the switch-over the source flushes
//! and releases them and the target activates them, so only one QEMU writes
//! an image at any time.
//!
//! QMP, target: `migrate-incoming {uri}` right after QMP is up (before the
//! monitor takes the connection), plus `query-migrate` to learn the TCP port.
//! Source: `migrate-set-capabilities` (events, so the monitor logs the
//! phases; auto-converge as tuned), `migrate-set-parameters` (bandwidth
//! cap and downtime limit, if set),
//! `migrate {uri}`; then `query-migrate` to poll and `migrate_cancel`.
//!
//! Transport. Default: a Unix socket in the target's instance directory. It
//! needs no port allocation, cannot collide with other services, is
//! reachable only by local processes allowed into the data dir, and is all
//! one host needs (tests, benchmarks). With `QemuConfig::migration_address`
//! set, the target listens on TCP on that address, on the first free port
//! of `migration_ports` (or one the kernel picks; `query-migrate` reports
//! the real port), which is what separate hosts need.
//!
//! TLS. With `QemuConfig::migration_tls` (a credentials directory, see
//! [`super::tls`]) both ends add a `tls-creds-x509` object with
//! `verify-peer` on and set it as the migration's `tls-creds`; the target
//! then hands out `tls+tcp:<addr>:<port>` (Keel's own scheme, sent to QEMU
//! as `tcp:`), and the source sets `tls-hostname` to the target node's
//! name, which the target's certificate must carry. A target refuses a
//! source without a certificate of the cluster CA, and one of another node
//! than the source it was prepared for (`tls-authz`, see [`authz`]); a
//! source refuses a target without one naming it; neither falls back to
//! plain TCP. A source
//! with credentials does not send to a plain `tcp:` target either, and one
//! without credentials cannot send to a `tls+tcp:` target: the transport is
//! the target's to choose, and a mismatch fails before QEMU sends a byte.
//!
//! Only `unix:`, `tcp:` and `tls+tcp:` URIs are accepted from callers: the
//! URI comes from the store, and QEMU's `exec:` would run a command.
//!
//! Explicit state: `query-migrate` reports the last migration in *either*
//! direction, so an instance that arrived by migration says `completed`
//! before it ever sent anything. Whether an instance was told to send is
//! therefore Keel's own record (`migration-out.json`, written before
//! `migrate` is sent), and QEMU's status is read as the source's progress
//! only when that record exists. The record also keeps the final outcome,
//! which still answers once the source process is gone (the controller kills
//! it after a completed migration). A source that is gone before any
//! outcome was seen reports `Unknown`, not a failure: it may have sent
//! everything. The target, started with `-S`, then waits paused with the
//! whole state (or exits, if the stream broke), and Keel settles the
//! migration by that; `resume_incoming` (`cont`) lets it run.
//!
//! Reading `completed` (QEMU 7.2, `migration/migration.c`): the sending side
//! reports `total-time` and `downtime` with it, the receiving side never
//! does. And the sender switches its status to `completed` a moment before
//! it fills in those figures (`migration_calculate_complete`), so a poll can
//! see `completed` with zeros; that is still reported as active.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use keel_api::{Clock, Millis, SystemClock};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

mod authz;
mod precopy;

use super::layout::{read_json, InstancePaths, MAX_SOCKET_PATH};
use super::monitor::Phase;
use super::qmp::{QmpClient, QmpError};
use super::{blocking, unavailable, QemuDriver};
use crate::{DomainState, HvError, IncomingParams, MigrationParams, MigrationProgress};

/// `migration-out.json`: this instance was told to send itself to `uri`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutgoingMigration {
    pub uri: String,
    pub started_at: Millis,
    /// `Completed` or `Failed`, once seen by `migration_status`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<MigrationProgress>,
    /// Keel paused the guest before sending it (TCG before QEMU 9.0, see
    /// `precopy`); one that did not hand over is resumed once.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused_source: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub source_resumed: bool,
}

/// The parts of `query-migrate`'s MigrationInfo Keel reads. Every field is
/// optional: QEMU omits what does not apply (all of them before any
/// migration).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct MigrateInfo {
    #[serde(default)]
    pub status: Option<String>,
    #[serde(default)]
    pub ram: Option<RamStats>,
    #[serde(default, rename = "total-time")]
    pub total_time: Option<u64>,
    #[serde(default)]
    pub downtime: Option<u64>,
    #[serde(default, rename = "error-desc")]
    pub error_desc: Option<String>,
    /// Where an incoming migration listens (the real port for `tcp:...:0`).
    #[serde(default, rename = "socket-address")]
    pub socket_address: Vec<Value>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct RamStats {
    #[serde(default)]
    pub transferred: u64,
    #[serde(default)]
    pub total: u64,
    #[serde(default)]
    pub remaining: u64,
}

/// QEMU's migration status, coarsened to what a caller acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stage {
    Idle,
    Active,
    Completed,
    Failed(String),
}

impl MigrateInfo {
    pub fn stage(&self) -> Stage {
        match self.status.as_deref() {
            None | Some("none") => Stage::Idle,
            Some("completed") => match self.total_time {
                // Without total-time: the incoming migration that brought
                // this instance here, which says nothing about sending.
                None => Stage::Idle,
                // Switched over, figures not filled in yet.
                Some(0) => Stage::Active,
                Some(_) => Stage::Completed,
            },
            Some("failed") => Stage::Failed(
                self.error_desc
                    .clone()
                    .unwrap_or_else(|| "migration failed".into()),
            ),
            Some("cancelled") => Stage::Failed("cancelled".into()),
            // setup, active, pre-switchover, device, wait-unplug,
            // cancelling, postcopy-*, colo, and anything newer: not over.
            // `cancelling` may still end in `completed`, which the trait
            // reports as such.
            Some(_) => Stage::Active,
        }
    }

    /// As the source reports it; `stage` already settled for `Idle`.
    pub fn progress(&self, stage: &Stage) -> MigrationProgress {
        let ram = self.ram.clone().unwrap_or_default();
        match stage {
            Stage::Idle => MigrationProgress::None,
            Stage::Active => MigrationProgress::Active {
                transferred_bytes: ram.transferred,
                total_bytes: ram.total,
                remaining_bytes: ram.remaining,
            },
            Stage::Completed => MigrationProgress::Completed {
                total_ms: self.total_time.unwrap_or(0),
                downtime_ms: self.downtime,
            },
            Stage::Failed(reason) => MigrationProgress::Failed {
                reason: reason.clone(),
            },
        }
    }

    /// The TCP port an incoming migration listens on.
    fn listening_port(&self) -> Option<u16> {
        self.socket_address.iter().find_map(|a| {
            if a.get("type")?.as_str()? != "inet" {
                return None;
            }
            // A string in QMP's InetSocketAddress; accept a number too.
            match a.get("port")? {
                Value::String(s) => s.parse().ok(),
                Value::Number(n) => n.as_u64()?.try_into().ok(),
                _ => None,
            }
        })
    }
}

/// The URI scheme of a TLS-protected TCP stream: Keel's own, so the
/// transport travels with the URI the target hands out.
pub const TLS_SCHEME: &str = "tls+tcp:";

/// The id of the `tls-creds-x509` object Keel adds to a QEMU for its
/// migration stream.
const TLS_CREDS_ID: &str = "keel-migration-tls";

/// Accepts `unix:<absolute path>`, `tcp:<host>:<port>` and
/// `tls+tcp:<host>:<port>` (IPv6 hosts in brackets), nothing else.
pub fn validate_uri(uri: &str) -> Result<(), String> {
    if uri.chars().any(char::is_control) {
        return Err(format!("migration URI {uri:?} contains control characters"));
    }
    if let Some(path) = uri.strip_prefix("unix:") {
        if !Path::new(path).is_absolute() {
            return Err(format!(
                "migration URI {uri:?}: the socket path must be absolute"
            ));
        }
        if path.len() > MAX_SOCKET_PATH {
            return Err(format!(
                "migration URI {uri:?}: socket path longer than {MAX_SOCKET_PATH} bytes"
            ));
        }
        return Ok(());
    }
    if let Some(rest) = uri
        .strip_prefix("tcp:")
        .or_else(|| uri.strip_prefix(TLS_SCHEME))
    {
        tcp_host(rest).map_err(|why| format!("migration URI {uri:?}: {why}"))?;
        return Ok(());
    }
    Err(format!(
        "unsupported migration URI {uri:?}: expected unix:<path>, tcp:<host>:<port> or \
         tls+tcp:<host>:<port>"
    ))
}

/// The host of `<host>:<port>` (without an IPv6 address's brackets), if
/// both are well-formed.
fn tcp_host(rest: &str) -> Result<&str, &'static str> {
    let Some((host, port)) = rest.rsplit_once(':') else {
        return Err("expected tcp:<host>:<port>");
    };
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => return Err("port must be 1-65535"),
    }
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) if v6.parse::<std::net::Ipv6Addr>().is_ok() => Ok(v6),
        Some(_) => Err("invalid host"),
        None if !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-') =>
        {
            Ok(host)
        }
        None => Err("invalid host"),
    }
}

/// Adds (or re-adds, reading the files anew) the migration's TLS
/// credentials object to a QEMU: `endpoint` is `server` on the target,
/// `client` on the source.
async fn add_tls_creds(client: &QmpClient, dir: &Path, endpoint: &str) -> Result<(), QmpError> {
    // Left by an earlier attempt; a missing object is the usual case.
    let _ = client
        .execute("object-del", Some(json!({ "id": TLS_CREDS_ID })))
        .await;
    client
        .execute(
            "object-add",
            Some(json!({
                "qom-type": "tls-creds-x509",
                "id": TLS_CREDS_ID,
                // Checked to be UTF-8 when the driver started.
                "dir": dir.to_string_lossy(),
                "endpoint": endpoint,
                "verify-peer": true,
            })),
        )
        .await
        .map(drop)
}

pub async fn query_migrate(client: &QmpClient) -> Result<MigrateInfo, QmpError> {
    let value = client.execute("query-migrate", None).await?;
    serde_json::from_value(value)
        .map_err(|e| QmpError::Protocol(format!("query-migrate result: {e}")))
}

/// QEMU refusing a command is a failure of the request; anything else (no
/// answer, connection lost) says nothing about the instance: unavailable.
fn qmp_error(instance: &str, op: &'static str, e: QmpError) -> HvError {
    match e {
        QmpError::Command { .. } => HvError::failed_by(instance, op, "", e),
        _ => HvError::unavailable_by(instance, op, "", e),
    }
}

pub fn read_outgoing(
    paths: &InstancePaths,
    instance: &str,
    op: &'static str,
) -> Result<Option<OutgoingMigration>, HvError> {
    read_json(&paths.migration_out).map_err(|e| HvError::unavailable_by(instance, op, "", e))
}

impl QemuDriver {
    /// How this driver receives migrations, as its node advertises it.
    pub fn migration_endpoint(&self) -> keel_api::MigrationEndpoint {
        use keel_api::MigrationTransport;
        let config = &self.inner.config;
        let Some(ip) = config.migration_address else {
            return keel_api::MigrationEndpoint {
                transport: MigrationTransport::Unix,
                listen: None,
            };
        };
        let ports = match &config.migration_ports {
            Some(r) => format!("{}-{}", r.start(), r.end()),
            None => "any".into(),
        };
        keel_api::MigrationEndpoint {
            transport: if config.migration_tls.is_some() {
                MigrationTransport::TcpTls
            } else {
                MigrationTransport::Tcp
            },
            listen: Some(match ip {
                IpAddr::V4(v4) => format!("{v4}:{ports}"),
                IpAddr::V6(v6) => format!("[{v6}]:{ports}"),
            }),
        }
    }

    /// Target side, right after the new QEMU's QMP answered: start
    /// listening, over TLS only for the source `from` names, and return
    /// the URI for the source.
    pub(super) async fn listen_incoming(
        &self,
        paths: &InstancePaths,
        client: &QmpClient,
        from: &IncomingParams,
    ) -> Result<String, String> {
        let config = &self.inner.config;
        let Some(ip) = config.migration_address else {
            // The data dir is checked to be UTF-8 at driver start.
            let listen = format!("unix:{}", paths.migrate_sock.display());
            client
                .execute("migrate-incoming", Some(json!({ "uri": listen })))
                .await
                .map_err(|e| format!("migrate-incoming {listen}: {e}"))?;
            return Ok(listen);
        };
        let scheme = match &config.migration_tls {
            Some(dir) => {
                add_tls_creds(client, dir, "server")
                    .await
                    .map_err(|e| format!("migration TLS credentials {}: {e}", dir.display()))?;
                let mut set = json!({ "tls-creds": TLS_CREDS_ID });
                if let Some(source) = &from.tls_peer {
                    set["tls-authz"] = json!(authz::admit_only(client, source).await?);
                }
                client
                    .execute("migrate-set-parameters", Some(set))
                    .await
                    .map_err(|e| format!("migrate-set-parameters tls-creds: {e}"))?;
                TLS_SCHEME
            }
            None => "tcp:",
        };
        let port = self.listen_tcp(client, ip).await?;
        Ok(format!("{scheme}{}", SocketAddr::new(ip, port)))
    }

    /// `migrate-incoming` on the first port of the configured range that
    /// binds (from a random point, so that targets started together do not
    /// all try the same ports first), or on one the kernel picks; returns
    /// the port.
    async fn listen_tcp(&self, client: &QmpClient, ip: IpAddr) -> Result<u16, String> {
        let (first, last) = match &self.inner.config.migration_ports {
            Some(range) => (*range.start(), *range.end()),
            None => (0, 0),
        };
        let count = u32::from(last - first) + 1;
        let offset = rand::random::<u32>() % count;
        let mut refusals = Vec::new();
        for i in 0..count {
            let port = first + ((offset + i) % count) as u16;
            let listen = format!("tcp:{}", SocketAddr::new(ip, port));
            match client
                .execute("migrate-incoming", Some(json!({ "uri": listen })))
                .await
            {
                Ok(_) if port != 0 => return Ok(port),
                Ok(_) => {
                    let info = query_migrate(client)
                        .await
                        .map_err(|e| format!("query-migrate after migrate-incoming: {e}"))?;
                    return info.listening_port().ok_or_else(|| {
                        format!("QEMU did not report the port it listens on for {listen}")
                    });
                }
                // Taken (by another target, or anything else): the next.
                // QEMU accepts another `migrate-incoming` after a failed one.
                Err(e @ QmpError::Command { .. }) => {
                    if refusals.len() < 3 {
                        refusals.push(format!("{port}: {e}"));
                    }
                }
                Err(e) => return Err(format!("migrate-incoming {listen}: {e}")),
            }
        }
        Err(format!(
            "no port of {first}-{last} on {ip} could be listened on ({})",
            refusals.join("; ")
        ))
    }

    pub(super) async fn migrate_out(
        &self,
        instance: &str,
        uri: &str,
        params: &MigrationParams,
    ) -> Result<(), HvError> {
        const OP: &str = "migrate";
        let failed = |reason: String| HvError::Failed {
            instance: instance.to_string(),
            op: OP,
            reason,
            source: None,
        };
        validate_uri(uri).map_err(failed)?;
        let tls_dir = self.inner.config.migration_tls.as_deref();
        // What QEMU is told: Keel's tls+tcp: is QEMU's tcp: with TLS set.
        let (qemu_uri, tls) = match uri.strip_prefix(TLS_SCHEME) {
            Some(rest) => {
                let Some(dir) = tls_dir else {
                    return Err(failed(format!(
                        "the target listens with TLS ({uri}), and this node has no migration \
                         credentials (keel cluster issue-cert)"
                    )));
                };
                let peer = match &params.tls_peer {
                    Some(name) => name.clone(),
                    None => tcp_host(rest).map_err(|e| failed(e.into()))?.to_string(),
                };
                (format!("tcp:{rest}"), Some((dir, peer)))
            }
            None if uri.starts_with("tcp:") && tls_dir.is_some() => {
                return Err(failed(format!(
                    "the target listens without TLS ({uri}); this node has migration \
                     credentials and does not send a guest's memory in the clear"
                )))
            }
            None => (uri.to_string(), None),
        };
        let domain = self.existing(instance, OP)?;
        match domain.phase() {
            Phase::Live { .. } => {}
            Phase::Launching { .. } => {
                return Err(unavailable(instance, OP, "QEMU is still launching".into()))
            }
            Phase::Exited(rec) => {
                return Err(failed(format!("instance has exited ({:?})", rec.cause)))
            }
        }
        // Held until `migrate` is sent: a live snapshot checks for an
        // outgoing migration under the same lock before it pauses the guest.
        let _vm = self.lock_vm(&domain.vm).await;
        let client = domain
            .qmp()
            .await
            .map_err(|e| unavailable(instance, OP, e))?;
        let qmp_err = |e| qmp_error(instance, OP, e);

        if let Some(mut rec) = read_outgoing(&domain.paths, instance, OP)? {
            let info = query_migrate(&client).await.map_err(qmp_err)?;
            self.resume_paused_source(&domain.paths, &client, &mut rec, &info.stage())
                .await
                .map_err(qmp_err)?;
            match info.stage() {
                // A retried call: nothing new to start.
                Stage::Active | Stage::Completed if rec.uri == uri => return Ok(()),
                Stage::Active | Stage::Completed => {
                    return Err(failed(format!(
                        "already migrating to {} (asked for {uri})",
                        rec.uri
                    )))
                }
                // The previous attempt is over: this is a new one.
                Stage::Idle | Stage::Failed(_) => {}
            }
        }
        let status = client.query_status().await.map_err(qmp_err)?;
        if status.status != "running" {
            // A paused source would arrive paused; only running guests move.
            return Err(failed(format!(
                "source is {} (only a running guest is migrated)",
                status.status
            )));
        }
        client
            .execute(
                "migrate-set-capabilities",
                Some(json!({ "capabilities": [
                    { "capability": "events", "state": true },
                    { "capability": "auto-converge", "state": params.auto_converge },
                ] })),
            )
            .await
            .map_err(qmp_err)?;
        let mut set = serde_json::Map::new();
        match &tls {
            Some((dir, peer)) => {
                add_tls_creds(&client, dir, "client").await.map_err(|e| {
                    let context = format!("migration TLS credentials {}", dir.display());
                    HvError::failed_by(instance, OP, context, e)
                })?;
                set.insert("tls-creds".into(), json!(TLS_CREDS_ID));
                set.insert("tls-hostname".into(), json!(peer));
            }
            // An earlier attempt of this instance may have set them.
            None => {
                set.insert("tls-creds".into(), json!(""));
                set.insert("tls-hostname".into(), json!(""));
            }
        }
        if let Some(bytes_per_s) = params
            .max_bandwidth
            .or(self.inner.config.migration_max_bandwidth)
        {
            set.insert("max-bandwidth".into(), json!(bytes_per_s));
        }
        if let Some(ms) = params.downtime_limit_ms {
            set.insert("downtime-limit".into(), json!(ms));
        }
        if !set.is_empty() {
            client
                .execute("migrate-set-parameters", Some(Value::Object(set)))
                .await
                .map_err(qmp_err)?;
        }
        let qemu = precopy::query_version(&client).await.map_err(qmp_err)?;
        let paused_source =
            precopy::precopy_for(self.accelerator().await, qemu) == precopy::Precopy::SourcePaused;
        let record = OutgoingMigration {
            uri: uri.to_string(),
            started_at: SystemClock.now_ms(),
            outcome: None,
            paused_source,
            source_resumed: false,
        };
        // Before the command: an instance with a migration under way always
        // has its record, whatever happens to this call.
        blocking::write_json(&domain.paths.migration_out, &record)
            .await
            .map_err(|e| HvError::unavailable_by(instance, OP, "write migration record", e))?;
        if paused_source {
            tracing::info!(instance, ?qemu, "TCG dirty tracking loses writes before QEMU 9.0: pausing the source for the migration");
            if let Err(e) = client.execute("stop", None).await {
                let _ = client.execute("cont", None).await;
                let _ = blocking::remove_file(domain.paths.migration_out.clone()).await;
                return Err(qmp_err(e));
            }
        }
        match client
            .execute("migrate", Some(json!({ "uri": qemu_uri })))
            .await
        {
            Ok(_) => {
                tracing::info!(instance, uri, tls = tls.is_some(), "migration started");
                Ok(())
            }
            Err(e @ QmpError::Command { .. }) => {
                // Refused: nothing started, so nothing to report later.
                if paused_source {
                    let _ = client.execute("cont", None).await;
                }
                let _ = blocking::remove_file(domain.paths.migration_out.clone()).await;
                Err(qmp_err(e))
            }
            // No answer: it may have started; the record stays and a retry
            // finds out from QEMU.
            Err(e) => Err(qmp_err(e)),
        }
    }

    pub(super) async fn outgoing_status(
        &self,
        instance: &str,
    ) -> Result<MigrationProgress, HvError> {
        const OP: &str = "query migration";
        let domain = self.existing(instance, OP)?;
        let Some(mut rec) = read_outgoing(&domain.paths, instance, OP)? else {
            return Ok(MigrationProgress::None);
        };
        // Gone without an outcome seen: it may have handed over or not.
        // Only the target can tell (paused with the whole state, or exited).
        let gone = |rec: &OutgoingMigration| {
            rec.outcome.clone().unwrap_or(MigrationProgress::Unknown {
                reason: "source instance exited before the migration's outcome was seen".into(),
            })
        };
        let pid = match domain.phase() {
            Phase::Exited(_) => return Ok(gone(&rec)),
            // A record is only written for a live instance.
            Phase::Launching { .. } => return Ok(MigrationProgress::None),
            Phase::Live { pid } => pid,
        };
        let queried = match domain.qmp().await {
            Ok(client) => match query_migrate(&client).await {
                Ok(info) => {
                    let stage = info.stage();
                    // Only a failure: `Idle` may be, without the VM lock,
                    // the moment between `stop` and `migrate`.
                    if matches!(stage, Stage::Failed(_)) {
                        if let Err(e) = self
                            .resume_paused_source(&domain.paths, &client, &mut rec, &stage)
                            .await
                        {
                            tracing::warn!(
                                instance,
                                "cannot resume the source paused for a failed migration: {e}"
                            );
                        }
                    }
                    Ok(info.progress(&stage))
                }
                Err(e) => Err(e.to_string()),
            },
            Err(e) => Err(e),
        };
        let progress = match queried {
            Ok(progress) => progress,
            Err(failure) => {
                return match domain.state_without_qmp(pid, OP, failure).await? {
                    DomainState::Exited(_) => Ok(gone(&rec)),
                    state => Err(unavailable(
                        instance,
                        OP,
                        format!("no answer from QEMU in state {state:?}"),
                    )),
                }
            }
        };
        // Paused from the start, the guest stood still for the whole run.
        let progress = match progress {
            MigrationProgress::Completed { total_ms, .. } if rec.paused_source => {
                MigrationProgress::Completed {
                    total_ms,
                    downtime_ms: Some(total_ms),
                }
            }
            other => other,
        };
        let terminal = matches!(
            progress,
            MigrationProgress::Completed { .. } | MigrationProgress::Failed { .. }
        );
        if terminal && rec.outcome.as_ref() != Some(&progress) {
            rec.outcome = Some(progress.clone());
            if let Err(e) = blocking::write_json(&domain.paths.migration_out, &rec).await {
                // Only matters once the process is gone; QEMU still knows.
                tracing::warn!(instance, "cannot record migration outcome: {e}");
            }
        }
        Ok(progress)
    }

    /// `cont` for an incoming instance whose state has arrived (QEMU runs
    /// it with `-S`, so it waits in `paused`).
    pub(super) async fn resume_arrived(&self, instance: &str) -> Result<(), HvError> {
        const OP: &str = "resume incoming migration";
        let domain = self.existing(instance, OP)?;
        if !matches!(domain.phase(), Phase::Live { .. }) {
            return Err(HvError::Failed {
                instance: instance.to_string(),
                op: OP,
                reason: "the instance is not running".into(),
                source: None,
            });
        }
        let client = domain
            .qmp()
            .await
            .map_err(|e| unavailable(instance, OP, e))?;
        let qmp_err = |e| qmp_error(instance, OP, e);
        let status = client.query_status().await.map_err(qmp_err)?;
        match status.status.as_str() {
            "running" => Ok(()),
            "paused" => {
                client.execute("cont", None).await.map_err(qmp_err)?;
                tracing::info!(instance, "incoming migration arrived; resumed");
                Ok(())
            }
            other => Err(HvError::Failed {
                instance: instance.to_string(),
                op: OP,
                reason: format!("not an arrived incoming instance (QEMU status {other})"),
                source: None,
            }),
        }
    }

    pub(super) async fn cancel_outgoing(&self, instance: &str) -> Result<(), HvError> {
        const OP: &str = "cancel migration";
        let domain = self.existing(instance, OP)?;
        if !matches!(domain.phase(), Phase::Live { .. }) {
            // Exited or never ran: no migration can be under way.
            return Ok(());
        }
        // Not while `migrate_out` is between pausing the source and
        // `migrate`: that `Idle` is not one to resume from.
        let _vm = self.lock_vm(&domain.vm).await;
        let Some(mut rec) = read_outgoing(&domain.paths, instance, OP)? else {
            return Ok(());
        };
        let client = domain
            .qmp()
            .await
            .map_err(|e| unavailable(instance, OP, e))?;
        let qmp_err = |e| qmp_error(instance, OP, e);
        let info = query_migrate(&client).await.map_err(qmp_err)?;
        self.resume_paused_source(&domain.paths, &client, &mut rec, &info.stage())
            .await
            .map_err(qmp_err)?;
        if info.stage() == Stage::Active {
            // QEMU stops sending, resumes the guest if the switch-over had
            // paused it, and reports `cancelled`; the target sees the stream
            // end and exits.
            client
                .execute("migrate_cancel", None)
                .await
                .map_err(qmp_err)?;
            tracing::info!(instance, "migration cancel requested");
        }
        Ok(())
    }

    /// `cont` for a source Keel paused for a migration that did not hand
    /// over (failed, cancelled, or `migrate` never sent), once; the record
    /// then says so.
    async fn resume_paused_source(
        &self,
        paths: &InstancePaths,
        client: &QmpClient,
        rec: &mut OutgoingMigration,
        stage: &Stage,
    ) -> Result<(), QmpError> {
        if !rec.paused_source || rec.source_resumed {
            return Ok(());
        }
        let status = client.query_status().await?;
        if !precopy::may_resume(&status.status, stage) {
            return Ok(());
        }
        client.execute("cont", None).await?;
        tracing::info!(
            ?stage,
            "resumed the source paused for a migration that did not hand over"
        );
        rec.source_resumed = true;
        if let Err(e) = blocking::write_json(&paths.migration_out, &*rec).await {
            tracing::warn!("cannot record the resumed source: {e}");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(v: Value) -> MigrateInfo {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn statuses_map_to_progress() {
        let none = info(json!({}));
        assert_eq!(none.stage(), Stage::Idle);
        assert_eq!(none.progress(&none.stage()), MigrationProgress::None);

        let active = info(json!({"status": "active",
            "ram": {"transferred": 5, "total": 9, "remaining": 4, "mbps": 1.5}}));
        assert_eq!(
            active.progress(&active.stage()),
            MigrationProgress::Active {
                transferred_bytes: 5,
                total_bytes: 9,
                remaining_bytes: 4
            }
        );
        assert_eq!(info(json!({"status": "setup"})).stage(), Stage::Active);
        assert_eq!(info(json!({"status": "cancelling"})).stage(), Stage::Active);
        assert_eq!(info(json!({"status": "device"})).stage(), Stage::Active);

        // The receiving side's view, left on an instance that arrived.
        assert_eq!(info(json!({"status": "completed"})).stage(), Stage::Idle);
        // The sender between switching status and filling in the figures.
        let settling = info(json!({"status": "completed", "total-time": 0, "downtime": 0}));
        assert_eq!(settling.stage(), Stage::Active);

        let done =
            info(json!({"status": "completed", "total-time": 658, "downtime": 3, "setup-time": 1}));
        assert_eq!(
            done.progress(&done.stage()),
            MigrationProgress::Completed {
                total_ms: 658,
                downtime_ms: Some(3)
            }
        );
        let cancelled = info(json!({"status": "cancelled"}));
        assert_eq!(
            cancelled.progress(&cancelled.stage()),
            MigrationProgress::Failed {
                reason: "cancelled".into()
            }
        );
        let failed = info(json!({"status": "failed", "error-desc": "Connection refused"}));
        assert_eq!(failed.stage(), Stage::Failed("Connection refused".into()));
    }

    #[test]
    fn the_listening_port_comes_from_socket_address() {
        let i = info(json!({"socket-address": [
            {"path": "/x/migrate.sock", "type": "unix"},
            {"port": "42333", "ipv4": true, "host": "127.0.0.1", "type": "inet"}
        ]}));
        assert_eq!(i.listening_port(), Some(42333));
        assert_eq!(info(json!({})).listening_port(), None);
    }

    #[test]
    fn only_unix_and_tcp_uris_are_accepted() {
        for ok in [
            "unix:/var/lib/keel/instances/web-1/migrate.sock",
            "tcp:10.0.0.7:49152",
            "tcp:node-b.example:4444",
            "tcp:[fd00::7]:4444",
            "tls+tcp:10.0.0.7:49152",
            "tls+tcp:[fd00::7]:4444",
        ] {
            assert_eq!(validate_uri(ok), Ok(()), "{ok}");
        }
        for bad in [
            "exec:cat > /tmp/x",
            "unix:relative.sock",
            "tcp:10.0.0.7",
            "tcp:10.0.0.7:0",
            "tcp::4444",
            "tcp:fd00::7:4444",
            "tcp:a,b:4444",
            "tls+tcp:10.0.0.7",
            "tls:10.0.0.7:4444",
            "tcp:[nope]:4444",
            "fd:3",
            "unix:/x\n",
            "",
        ] {
            assert!(validate_uri(bad).is_err(), "{bad}");
        }
        assert_eq!(tcp_host("[fd00::7]:4444"), Ok("fd00::7"));
        assert_eq!(tcp_host("node-b:4444"), Ok("node-b"));
    }
}
