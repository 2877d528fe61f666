//! A control plane compacts etcd's history (`--etcd-compaction-interval`),
//! and keeps serving across it. On an etcd of its own (started with
//! `scripts/start-etcd` on free ports in a temp dir, killed at the end):
//! the shared test etcd keeps its whole history for the conformance
//! suite. Needs the `etcd` binary; `KEEL_SKIP_ETCD_TESTS=1` skips it.

mod procs;

use std::time::{Duration, Instant};

use keel_store::etcd::EtcdStore;
use keel_store::{Store, StoreError};
use keel_testkit::private_etcd::PrivateEtcd;
use procs::{cli, serving_url, spawn_control_plane, vm_json, Workdir};

/// Whether a watch of everything from revision 1 is refused as compacted.
async fn history_compacted(store: &EtcdStore) -> bool {
    match store.watch("/", 1).await {
        Err(StoreError::Compacted { .. }) => true,
        Err(e) => panic!("watch from 1: {e}"),
        Ok(mut w) => matches!(
            tokio::time::timeout(Duration::from_millis(500), w.next()).await,
            Ok(Some(Err(StoreError::Compacted { .. })))
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_compacts_etcds_history_and_keeps_serving() {
    let Some(work) = Workdir::start("etcd-compaction") else {
        return;
    };
    let etcd = PrivateEtcd::start();
    let namespace = "/keel-compaction";
    let store = format!("etcd://127.0.0.1:{}{namespace}", etcd.port());
    let cp = spawn_control_plane(
        &store,
        &work.dir("cp"),
        &["--hypervisor", "sim", "--etcd-compaction-interval", "1s"],
    );
    let server = serving_url(&cp).await;
    let out = cli(
        &work.root,
        &server,
        &["vm", "create", "web", "--memory", "64"],
    );
    assert!(
        out.status.success(),
        "vm create: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        cp.log()
    );

    let etcd_store = EtcdStore::connect(&[etcd.endpoint()], namespace)
        .await
        .expect("connect to the private etcd");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !history_compacted(&etcd_store).await {
        assert!(
            Instant::now() < deadline,
            "etcd's history not compacted within 30 s at a 1 s interval:\n{}",
            cp.log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The control plane logs it once etcd has answered, which may be
    // after the watch above saw the history gone.
    while !cp.log().contains("etcd history compacted") {
        assert!(
            Instant::now() < deadline,
            "the compaction is not logged:\n{}",
            cp.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Past the compaction the control plane still reads and writes.
    let out = cli(&work.root, &server, &["vm", "stop", "web"]);
    assert!(
        out.status.success(),
        "vm stop after the compaction: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        cp.log()
    );
    let vm = vm_json(&work.root, &server, "web").expect("vm get after the compaction");
    assert_eq!(vm["spec"]["power"], "Stopped", "{vm}");
}
