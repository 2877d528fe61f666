//! `keel serve --hypervisor sim --sim-nodes N`: more simulated nodes in
//! this one process beside the local one, so that placement by capacity
//! and rules can be driven at scale on SQLite, which no `keel agent` can
//! share (`keel bench scale --nodes`). Each extra node is a node of its
//! own, as a `keel agent` would be: its own sim driver pretending to be
//! its own host, its own VM controller, heartbeat and runtime, on the one
//! store; only the processes are saved. Never with QEMU: a node is a host.

use std::future::Future;
use std::sync::Arc;

use anyhow::{bail, Context};
use keel_api::{Clock, HostResources};
use keel_ctrl::vm_decodes::VmDecoder;
use keel_ctrl::{run_vm_controller_with, LifecycleConfig, RuntimeConfig, VmController};
use keel_hv::sim::{SimConfig, SimHypervisor};
use keel_hv::Hypervisor;
use keel_store::TypedStore;
use tokio::sync::watch;

use crate::metrics::Metrics;

/// One extra simulated node: its name and the host its driver reports.
#[derive(Debug, Clone, PartialEq)]
pub struct SimNode {
    pub name: String,
    pub host: Option<HostResources>,
}

/// The nodes beyond the first (`first` itself, the local node): `count`
/// in all, named `FIRST-2` … `FIRST-N`, their hosts taken in turn from
/// `hosts` (mixed sizes), or all like the first's when `hosts` is empty.
pub fn extra_nodes(
    first: &str,
    count: usize,
    hosts: &[HostResources],
    first_host: Option<HostResources>,
) -> anyhow::Result<Vec<SimNode>> {
    if count == 0 {
        bail!("--sim-nodes: at least 1 (the local node)");
    }
    Ok((2..=count)
        .map(|i| SimNode {
            name: format!("{first}-{i}"),
            host: if hosts.is_empty() {
                first_host
            } else {
                Some(hosts[(i - 1) % hosts.len()])
            },
        })
        .collect())
}

/// What the simulated nodes share with the local node: the store, the
/// clock, the settings (each node's own name put in) and the metrics.
pub struct Shared<'a> {
    pub store: &'a TypedStore,
    pub clock: &'a Arc<dyn Clock>,
    pub lifecycle: &'a LifecycleConfig,
    pub sim: &'a SimConfig,
    pub runtime: &'a RuntimeConfig,
    pub metrics: &'a Arc<Metrics>,
    /// One decoding of each VM record for every node here.
    pub decoder: &'a VmDecoder,
}

/// Registers each node (so placement sees it at once) and returns the
/// future that runs their controllers until `stop`.
pub async fn start(
    nodes: &[SimNode],
    shared: Shared<'_>,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<impl Future<Output = ()>> {
    let Shared {
        store,
        clock,
        lifecycle,
        sim,
        runtime,
        metrics,
        decoder,
    } = shared;
    let mut runs = Vec::with_capacity(nodes.len());
    for (i, node) in nodes.iter().enumerate() {
        let sim = SimConfig {
            host: node.host,
            ..sim.clone()
        };
        let hv = Arc::new(SimHypervisor::new(clock.clone(), 1 + i as u64, sim));
        let facts = hv.facts().await;
        let lifecycle = LifecycleConfig {
            node: node.name.clone(),
            ..lifecycle.clone()
        };
        let ctrl = Arc::new(
            VmController::new(store.clone(), hv, clock.clone(), lifecycle)
                .decoding_with(decoder.clone())
                .with_observer(metrics.clone()),
        );
        ctrl.heartbeat_and_renew(Some(&facts))
            .await
            .with_context(|| format!("registering simulated node {}", node.name))?;
        runs.push(run_vm_controller_with(
            ctrl,
            clock.clone(),
            runtime.clone(),
            stop.clone(),
        ));
    }
    Ok(async move {
        futures_util::future::join_all(runs).await;
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_nodes_take_the_hosts_in_turn() {
        let small = HostResources {
            cpus: 4,
            memory_mib: 8192,
        };
        let big = HostResources {
            cpus: 32,
            memory_mib: 65536,
        };
        let nodes = extra_nodes("bench", 4, &[small, big], None).unwrap();
        let got: Vec<_> = nodes.iter().map(|n| (n.name.as_str(), n.host)).collect();
        assert_eq!(
            got,
            [
                ("bench-2", Some(big)),
                ("bench-3", Some(small)),
                ("bench-4", Some(big))
            ]
        );
        assert!(extra_nodes("bench", 1, &[], None).unwrap().is_empty());
        assert!(extra_nodes("bench", 0, &[], None).is_err());
        let same = extra_nodes("n", 2, &[], Some(small)).unwrap();
        assert_eq!(same[0].host, Some(small));
    }
}
