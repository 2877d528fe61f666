//! Distributed mode: where the state lives (`--store sqlite` or
//! `--store etcd://…`), and the API token every control plane of an etcd
//! cluster accepts.

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use anyhow::{bail, Context};
use keel_ctrl::keys::API_TOKEN_KEY;
use keel_store::etcd::EtcdStore;
use keel_store::{Precondition, Store, StoreError};

use crate::auth::{self, Token};

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

/// The API token of a cluster: stored at `/config/api-token` by the first
/// control plane to start (create-if-absent, so racing control planes agree
/// on one: the loser reads the winner's), and written to `data_dir/token`
/// (mode 0600) for the CLI on this host. A first control plane that already
/// has a local token publishes that one, so existing CLI setups keep
/// working.
pub async fn shared_token(store: &dyn Store, token_file: &Path) -> anyhow::Result<Token> {
    for _ in 0..3 {
        if let Some(entry) = store.get(API_TOKEN_KEY).await? {
            let secret = String::from_utf8(entry.value)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .with_context(|| format!("the store's {API_TOKEN_KEY} is empty or not UTF-8"))?;
            let token = Token::new(secret);
            auth::write_local(token_file, &token)?;
            return Ok(token);
        }
        let secret = match auth::read_local(token_file)? {
            Some(local) => local.secret().to_string(),
            None => auth::generate_secret(),
        };
        match store
            .put(
                API_TOKEN_KEY,
                secret.clone().into_bytes(),
                Precondition::Absent,
            )
            .await
        {
            Ok(_) => {
                tracing::info!(key = API_TOKEN_KEY, "published the cluster's API token");
                let token = Token::new(secret);
                auth::write_local(token_file, &token)?;
                return Ok(token);
            }
            // Another control plane published first: use its token.
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    bail!("could not agree on the API token at {API_TOKEN_KEY}: it keeps changing")
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

    #[tokio::test]
    async fn control_planes_agree_on_one_token() {
        let store: Arc<dyn Store> = Arc::new(keel_store::memory::MemoryStore::new());
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (pa, pb) = (auth::token_path(a.path()), auth::token_path(b.path()));
        let (ta, tb) = tokio::join!(shared_token(&*store, &pa), shared_token(&*store, &pb));
        let (ta, tb) = (ta.unwrap(), tb.unwrap());
        assert_eq!(ta.secret(), tb.secret());
        for dir in [&a, &b] {
            let local = auth::read_local(&auth::token_path(dir.path()))
                .unwrap()
                .expect("token file");
            assert_eq!(local.secret(), ta.secret());
        }
        // A later control plane with a different local token adopts the cluster's.
        let c = tempfile::tempdir().unwrap();
        auth::load_or_create(c.path()).unwrap();
        let tc = shared_token(&*store, &auth::token_path(c.path()))
            .await
            .unwrap();
        assert_eq!(tc.secret(), ta.secret());
        assert_eq!(
            auth::read_local(&auth::token_path(c.path()))
                .unwrap()
                .unwrap()
                .secret(),
            ta.secret()
        );
    }
}
