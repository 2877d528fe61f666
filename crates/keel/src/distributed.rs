//! Distributed mode: where the state lives (`--store sqlite` or
//! `--store etcd://…`). The API tokens every control plane accepts are
//! hashed records in the store (`crate::token_book`).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use anyhow::Context;
use keel_store::etcd::EtcdStore;
use keel_store::Store;

/// The etcd key namespace when `--store etcd://…` names none.
pub const DEFAULT_NAMESPACE: &str = "/keel";

/// `--store`: `sqlite` (the data dir's keel.db, one process does
/// everything) or `etcd://HOST:PORT[,HOST:PORT…][/NAMESPACE]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum StoreSpec {
    #[default]
    Sqlite,
    Etcd {
        /// `http://HOST:PORT` each.
        endpoints: Vec<String>,
        /// Starts with `/`, no trailing `/`.
        namespace: String,
    },
}

impl StoreSpec {
    pub fn is_etcd(&self) -> bool {
        matches!(self, StoreSpec::Etcd { .. })
    }

    /// Connects to the etcd cluster; `None` for SQLite (opened by `serve`).
    pub async fn connect_etcd(&self) -> anyhow::Result<Option<Arc<dyn Store>>> {
        let StoreSpec::Etcd {
            endpoints,
            namespace,
        } = self
        else {
            return Ok(None);
        };
        let store = EtcdStore::connect(endpoints, namespace)
            .await
            .with_context(|| format!("connecting to the store {self}"))?;
        Ok(Some(Arc::new(store)))
    }
}

impl FromStr for StoreSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "sqlite" {
            return Ok(StoreSpec::Sqlite);
        }
        let usage = "expected `sqlite` or `etcd://HOST:PORT[,HOST:PORT…][/NAMESPACE]`";
        let Some(rest) = s.strip_prefix("etcd://") else {
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
            endpoints.push(format!("http://{host}"));
        }
        Ok(StoreSpec::Etcd {
            endpoints,
            namespace,
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
            } => {
                let hosts: Vec<&str> = endpoints
                    .iter()
                    .map(|e| e.strip_prefix("http://").unwrap_or(e))
                    .collect();
                write!(f, "etcd://{}{namespace}", hosts.join(","))
            }
        }
    }
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
            })
        );
        let spec: StoreSpec = "etcd://a:1,b:2/prod/keel/".parse().unwrap();
        assert_eq!(
            spec,
            StoreSpec::Etcd {
                endpoints: vec!["http://a:1".into(), "http://b:2".into()],
                namespace: "/prod/keel".into(),
            }
        );
        assert_eq!(spec.to_string(), "etcd://a:1,b:2/prod/keel");
        for bad in [
            "",
            "etcd",
            "etcd://",
            "etcd://host",
            "etcd://host:notaport",
            "etcd://a:1,,b:2",
            "http://a:1",
        ] {
            assert!(bad.parse::<StoreSpec>().is_err(), "{bad:?} parsed");
        }
    }
}
