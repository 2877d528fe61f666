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
//! set, the target listens on TCP on that address with a port the kernel
//! picks (`tcp:<addr>:0`; `query-migrate` reports the real port), which is
//! what separate hosts need. Only `unix:` and `tcp:` URIs are accepted from
//! callers: the URI comes from the store, and QEMU's `exec:` would run a
//! command.
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

use std::net::SocketAddr;
use std::path::Path;

use keel_api::{Clock, Millis, SystemClock};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

mod precopy;

use super::layout::{read_json, write_json_atomic, InstancePaths, MAX_SOCKET_PATH};
use super::monitor::Phase;
use super::qmp::{QmpClient, QmpError};
use super::{unavailable, QemuDriver};
use crate::{DomainState, HvError, MigrationParams, MigrationProgress};

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

/// Accepts `unix:<absolute path>` and `tcp:<host>:<port>` (IPv6 hosts in
/// brackets), nothing else.
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
    if let Some(rest) = uri.strip_prefix("tcp:") {
        let bad = |why: &str| Err(format!("migration URI {uri:?}: {why}"));
        let Some((host, port)) = rest.rsplit_once(':') else {
            return bad("expected tcp:<host>:<port>");
        };
        match port.parse::<u16>() {
            Ok(p) if p > 0 => {}
            _ => return bad("port must be 1-65535"),
        }
        let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
            None => {
                !host.is_empty()
                    && host
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
            }
        };
        if !host_ok {
            return bad("invalid host");
        }
        return Ok(());
    }
    Err(format!(
        "unsupported migration URI {uri:?}: expected unix:<path> or tcp:<host>:<port>"
    ))
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
        QmpError::Command { .. } => HvError::Failed {
            instance: instance.to_string(),
            op,
            reason: e.to_string(),
        },
        _ => unavailable(instance, op, e.to_string()),
    }
}

pub fn read_outgoing(
    paths: &InstancePaths,
    instance: &str,
    op: &'static str,
) -> Result<Option<OutgoingMigration>, HvError> {
    read_json(&paths.migration_out).map_err(|e| unavailable(instance, op, e.to_string()))
}

impl QemuDriver {
    /// Target side, right after the new QEMU's QMP answered: start
    /// listening and return the URI for the source.
    pub(super) async fn listen_incoming(
        &self,
        paths: &InstancePaths,
        client: &QmpClient,
    ) -> Result<String, String> {
        let address = self.inner.config.migration_address;
        let listen = match address {
            // The data dir is checked to be UTF-8 at driver start.
            None => format!("unix:{}", paths.migrate_sock.display()),
            Some(ip) => format!("tcp:{}", SocketAddr::new(ip, 0)),
        };
        client
            .execute("migrate-incoming", Some(json!({ "uri": listen })))
            .await
            .map_err(|e| format!("migrate-incoming {listen}: {e}"))?;
        let Some(ip) = address else {
            return Ok(listen);
        };
        let info = query_migrate(client)
            .await
            .map_err(|e| format!("query-migrate after migrate-incoming: {e}"))?;
        let port = info
            .listening_port()
            .ok_or_else(|| format!("QEMU did not report the port it listens on for {listen}"))?;
        Ok(format!("tcp:{}", SocketAddr::new(ip, port)))
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
        };
        validate_uri(uri).map_err(failed)?;
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
            precopy::precopy_for(self.inner.accelerator, qemu) == precopy::Precopy::SourcePaused;
        let record = OutgoingMigration {
            uri: uri.to_string(),
            started_at: SystemClock.now_ms(),
            outcome: None,
            paused_source,
            source_resumed: false,
        };
        // Before the command: an instance with a migration under way always
        // has its record, whatever happens to this call.
        write_json_atomic(&domain.paths.migration_out, &record)
            .map_err(|e| unavailable(instance, OP, format!("write migration record: {e}")))?;
        if paused_source {
            tracing::info!(instance, ?qemu, "TCG dirty tracking loses writes before QEMU 9.0: pausing the source for the migration");
            if let Err(e) = client.execute("stop", None).await {
                let _ = client.execute("cont", None).await;
                let _ = std::fs::remove_file(&domain.paths.migration_out);
                return Err(qmp_err(e));
            }
        }
        match client.execute("migrate", Some(json!({ "uri": uri }))).await {
            Ok(_) => {
                tracing::info!(instance, uri, "migration started");
                Ok(())
            }
            Err(e @ QmpError::Command { .. }) => {
                // Refused: nothing started, so nothing to report later.
                if paused_source {
                    let _ = client.execute("cont", None).await;
                }
                let _ = std::fs::remove_file(&domain.paths.migration_out);
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
            if let Err(e) = write_json_atomic(&domain.paths.migration_out, &rec) {
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
        if let Err(e) = write_json_atomic(&paths.migration_out, &*rec) {
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

        let active =
            info(json!({"status": "active", "ram": {"transferred": 5, "total": 9, "mbps": 1.5}}));
        assert_eq!(
            active.progress(&active.stage()),
            MigrationProgress::Active {
                transferred_bytes: 5,
                total_bytes: 9
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
            "fd:3",
            "unix:/x\n",
            "",
        ] {
            assert!(validate_uri(bad).is_err(), "{bad}");
        }
    }
}
