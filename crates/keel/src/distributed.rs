//! Distributed mode: where the state lives (`--store sqlite`,
//! `--store etcds://…` or, with `--insecure-store`, `--store etcd://…`).
//! The TLS files and the insecure switch are `crate::store_access`. The
//! API tokens every control plane accepts are hashed records in the store
//! (`crate::token_book`).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use anyhow::Context;
use keel_store::etcd::{EtcdOptions, EtcdStore, EtcdTls};
use keel_store::node_shards::ShardedStore;
use keel_store::Store;

/// The etcd key namespace when `--store etcd://…` names none.
pub const DEFAULT_NAMESPACE: &str = "/keel";

/// `--store`: `sqlite` (the data dir's keel.db, one process does
/// everything), `etcds://HOST:PORT[,HOST:PORT…][/NAMESPACE]` (etcd over
/// TLS with a client certificate) or `etcd://…` (plain gRPC).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum StoreSpec {
    #[default]
    Sqlite,
    Etcd {
        /// `https://HOST:PORT` each for `etcds://`, `http://` for `etcd://`.
        endpoints: Vec<String>,
        /// Starts with `/`, no trailing `/`.
        namespace: String,
        /// What an `etcds://` store trusts and presents, filled in from
        /// the flags by `store_access::StoreAccessArgs::resolve`.
        tls: Option<EtcdTls>,
    },
}

const HTTPS: &str = "https://";
const HTTP: &str = "http://";

impl StoreSpec {
    pub fn is_etcd(&self) -> bool {
        matches!(self, StoreSpec::Etcd { .. })
    }

    /// `etcds://`: etcd over TLS.
    pub fn is_tls(&self) -> bool {
        matches!(self, StoreSpec::Etcd { endpoints, .. }
            if endpoints.iter().all(|e| e.starts_with(HTTPS)))
    }

    /// Connects to the etcd cluster; `None` for SQLite (opened by `serve`).
    pub async fn connect_etcd(&self) -> anyhow::Result<Option<Arc<dyn Store>>> {
        Ok(self
            .connect_cluster()
            .await?
            .map(|store| store as Arc<dyn Store>))
    }

    /// Connects to the etcd cluster, writing VM records with their
    /// per-node copies ([`with_node_copies`]); `None` for SQLite.
    pub async fn connect_cluster(&self) -> anyhow::Result<Option<Arc<ShardedStore>>> {
        Ok(self
            .connect_plain()
            .await?
            .map(|store| with_node_copies(Arc::new(store))))
    }

    /// Connects to the etcd cluster as it is, without the VM records'
    /// per-node copies: for what needs etcd itself (compacting its
    /// history), or to wrap with them ([`with_node_copies`]).
    pub async fn connect_plain(&self) -> anyhow::Result<Option<EtcdStore>> {
        let StoreSpec::Etcd {
            endpoints,
            namespace,
            tls,
        } = self
        else {
            return Ok(None);
        };
        if self.is_tls() && tls.is_none() {
            anyhow::bail!("--store {self}: etcds:// needs --etcd-ca, --etcd-cert and --etcd-key");
        }
        if !self.is_tls() {
            tracing::warn!(
                store = %self,
                "the store is plain etcd:// (--insecure-store): no TLS and no authentication, \
                 anyone who reaches etcd can rewrite every VM, node and the leader key; \
                 use etcds:// with --etcd-ca/--etcd-cert/--etcd-key"
            );
        }
        let options = EtcdOptions {
            tls: tls.clone(),
            ..EtcdOptions::default()
        };
        let store = EtcdStore::connect_with(endpoints, namespace, options)
            .await
            .with_context(|| format!("connecting to the store {self}"))?;
        Ok(Some(store))
    }
}

/// The cluster's store as every Keel process writes it: each VM record
/// with a copy under every node it concerns, in the same write
/// (`keel_store::node_shards`), so a node's agent watches only its own
/// (`ShardedStore::node_view`). Whatever writes VM records to the
/// cluster's etcd goes through this, or the agents miss its writes until
/// the next repair ([`repair_node_copies`]).
pub fn with_node_copies(inner: Arc<dyn Store>) -> Arc<ShardedStore> {
    Arc::new(ShardedStore::new(
        inner,
        keel_ctrl::keys::VMS_PREFIX,
        keel_ctrl::node_concern::record_nodes(),
    ))
}

/// Sets right every VM record's per-node copies (records written by a
/// Keel before them, or around them); logged, never fatal: a record left
/// wrong is set right by its next write.
pub async fn repair_node_copies(store: Arc<ShardedStore>) {
    match store.repair().await {
        Ok(repaired) if repaired == Default::default() => {}
        Ok(repaired) => tracing::info!(
            records = repaired.records,
            orphans = repaired.orphans,
            raced = repaired.raced,
            "VM records' per-node copies set right"
        ),
        Err(err) => tracing::warn!(err = %err, "cannot check the VM records' per-node copies"),
    }
}

impl FromStr for StoreSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "sqlite" {
            return Ok(StoreSpec::Sqlite);
        }
        let usage = "expected `sqlite`, `etcds://HOST:PORT[,HOST:PORT…][/NAMESPACE]` \
                     or `etcd://HOST:PORT[,HOST:PORT…][/NAMESPACE]`";
        let (rest, scheme) = if let Some(rest) = s.strip_prefix("etcds://") {
            (rest, HTTPS)
        } else if let Some(rest) = s.strip_prefix("etcd://") {
            (rest, HTTP)
        } else {
            return Err(format!("{s:?}: {usage}"));
        };
        let (hosts, namespace) = match rest.split_once('/') {
            Some((hosts, ns)) => (hosts, ns.trim_matches('/')),
            None => (rest, ""),
        };
        let namespace = if namespace.is_empty() {
            DEFAULT_NAMESPACE.to_string()
        } else if namespace
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(format!(
                "{s:?}: the namespace must not contain spaces or control characters"
            ));
        } else {
            format!("/{namespace}")
        };
        let mut endpoints = Vec::new();
        for host in hosts.split(',') {
            let port_ok = host
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
            if !port_ok {
                return Err(format!(
                    "{s:?}: endpoint {host:?} is not HOST:PORT; {usage}"
                ));
            }
            endpoints.push(format!("{scheme}{host}"));
        }
        Ok(StoreSpec::Etcd {
            endpoints,
            namespace,
            tls: None,
        })
    }
}

impl fmt::Display for StoreSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreSpec::Sqlite => f.write_str("sqlite"),
            StoreSpec::Etcd {
                endpoints,
                namespace,
                ..
            } => {
                let scheme = if self.is_tls() { "etcds" } else { "etcd" };
                let hosts: Vec<&str> = endpoints.iter().map(|e| host_port(e)).collect();
                write!(f, "{scheme}://{}{namespace}", hosts.join(","))
            }
        }
    }
}

/// `HOST:PORT` of an endpoint URL.
pub fn host_port(endpoint: &str) -> &str {
    endpoint
        .strip_prefix(HTTPS)
        .or_else(|| endpoint.strip_prefix(HTTP))
        .unwrap_or(endpoint)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_store_specs() {
        assert_eq!("sqlite".parse::<StoreSpec>(), Ok(StoreSpec::Sqlite));
        assert_eq!(
            "etcd://127.0.0.1:2379".parse::<StoreSpec>(),
            Ok(StoreSpec::Etcd {
                endpoints: vec!["http://127.0.0.1:2379".into()],
                namespace: "/keel".into(),
                tls: None,
            })
        );
        let tls: StoreSpec = "etcds://127.0.0.1:2379,b:2/k".parse().unwrap();
        assert_eq!(
            tls,
            StoreSpec::Etcd {
                endpoints: vec!["https://127.0.0.1:2379".into(), "https://b:2".into()],
                namespace: "/k".into(),
                tls: None,
            }
        );
        assert!(tls.is_tls());
        assert_eq!(tls.to_string(), "etcds://127.0.0.1:2379,b:2/k");
        let spec: StoreSpec = "etcd://a:1,b:2/prod/keel/".parse().unwrap();
        assert_eq!(
            spec,
            StoreSpec::Etcd {
                endpoints: vec!["http://a:1".into(), "http://b:2".into()],
                namespace: "/prod/keel".into(),
                tls: None,
            }
        );
        assert_eq!(spec.to_string(), "etcd://a:1,b:2/prod/keel");
        for bad in [
            "",
            "etcd",
            "etcd://",
            "etcds://",
            "etcds://host",
            "etcd://host",
            "etcd://host:notaport",
            "etcd://a:1,,b:2",
            "http://a:1",
        ] {
            assert!(bad.parse::<StoreSpec>().is_err(), "{bad:?} parsed");
        }
    }
}
