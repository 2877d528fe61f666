//! The etcd run's anchor: the store writes its VMs make on their way to
//! Running, made straight to a fresh etcd member of the same kind by this
//! process through Keel's own etcd client, with no Keel process running.
//! That is what the store alone costs on this machine at this
//! concurrency; the etcd run's all Running over it is what the rest of
//! Keel (its API, placement, agents and their looks) adds.
//!
//! The writes are the etcd run's, each VM's in its order and with the
//! same preconditions, at the sizes its records have:
//! - the create: the record and its audit event (one transaction, from
//!   `--clients` writers, as the API clients do);
//! - the placement: the record and its node copy, every VM created
//!   meanwhile (up to 32) in one transaction, as the leader places a burst;
//! - the start, then Running: each the record, its node copy and its
//!   phase event, from one writer per agent, a VM's two in order and the
//!   agent's VMs side by side.
//!
//! and with the etcd run's watches open and drained: each agent's on its
//! node's copies, and two on the records (the leader's, and the one the
//! bench counts Running from).
//!
//! Made twice, each on an etcd of its own: as fast as the writers go
//! (the time the store alone needs), and with the creates paced at the
//! target's rate (`--floor-pace`), where etcd's CPU per VM tells how much
//! of the machine the store alone leaves the rest at that rate, and a
//! create's time tells what the store alone answers in, the part of the
//! API's latency no Keel change can take away.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use keel_store::etcd::EtcdStore;
use keel_store::{Precondition, Revision, Store, Write};
use tokio::sync::mpsc;

use super::percentile;
use super::scrape::cpu_seconds;

/// The leader places at most this many VMs in one store write.
const PLACEMENT_BATCH: usize = 32;
/// Bytes of a VM record of the etcd run as stored at each step (JSON:
/// created, placed, starting, running), as measured from one.
const RECORD_BYTES: [usize; 4] = [480, 490, 830, 990];
/// Bytes of the create's audit event, as measured.
const AUDIT_BYTES: usize = 280;
/// Bytes of a phase event, as measured.
const EVENT_BYTES: usize = 130;

#[derive(Debug, Clone, serde::Serialize)]
pub struct StoreFloor {
    /// From the first create until every VM's Running write was answered
    /// and every change had reached the watches.
    pub seconds: f64,
    /// Store writes made (each one transaction), and the puts in them.
    pub transactions: usize,
    pub puts: usize,
    /// Changes the watches received.
    pub watch_events: usize,
    /// etcd's CPU over those seconds, in ms per VM.
    pub etcd_cpu_ms_per_vm: f64,
    /// Creates asked per second, when paced; None: as fast as answered.
    pub pace_per_s: Option<f64>,
    /// Creates answered per second, over the create phase.
    pub create_per_s: f64,
    /// A create's transaction, from asking to its answer.
    pub create_p50_ms: f64,
    pub create_p99_ms: f64,
}

/// Watches on the records, beside the agents' on their copies.
const RECORD_WATCHES: usize = 2;
/// How long the watches may lag the last write before the run fails.
const WATCH_CATCH_UP: Duration = Duration::from_secs(60);

/// Makes `vms` VMs' writes on the etcd at `url` (nothing else on it),
/// their creates at `pace_per_s` if given.
pub fn measure(
    url: &str,
    etcd_pid: u32,
    vms: usize,
    clients: usize,
    agents: usize,
    pace_per_s: Option<f64>,
) -> anyhow::Result<StoreFloor> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the store floor's runtime")?;
    runtime.block_on(async {
        let store: Arc<dyn Store> = Arc::new(
            EtcdStore::connect(&[url.to_string()], "/keel-bench-floor")
                .await
                .context("connecting to the store floor's etcd")?,
        );
        let agents = agents.max(1);
        let mut prefixes: Vec<String> = (0..agents).map(|a| format!("/vm-shards/node{a}/")).collect();
        prefixes.extend(std::iter::repeat_n("/vms/".to_string(), RECORD_WATCHES));
        let received = Arc::new(AtomicUsize::new(0));
        let mut watchers = tokio::task::JoinSet::new();
        for prefix in prefixes {
            let mut watch = store.watch(&prefix, 1).await?;
            let received = received.clone();
            watchers.spawn(async move {
                while let Some(Ok(_)) = watch.next().await {
                    received.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        let cpu_before = cpu_seconds(etcd_pid)?;
        let started = Instant::now();
        let counted = Arc::new(Counted {
            store,
            transactions: AtomicUsize::new(0),
            puts: AtomicUsize::new(0),
        });
        let creates = Creates {
            vms,
            clients: clients.max(1),
            pace_per_s,
        };
        let (create_ms, create_s) = run(counted.clone(), creates, agents).await?;
        // Until every change has reached the watches: each record write
        // to the record watches, and each after the create (the copy's) to
        // its agent's.
        let expected = vms * (RECORD_BYTES.len() * RECORD_WATCHES + RECORD_BYTES.len() - 1);
        let written = Instant::now();
        while received.load(Ordering::Relaxed) < expected {
            if written.elapsed() > WATCH_CATCH_UP {
                anyhow::bail!(
                    "the watches received {} of {expected} changes within {WATCH_CATCH_UP:?} of the last write",
                    received.load(Ordering::Relaxed)
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let seconds = started.elapsed().as_secs_f64();
        let etcd_cpu = cpu_seconds(etcd_pid)? - cpu_before;
        watchers.abort_all();
        Ok(StoreFloor {
            seconds,
            transactions: counted.transactions.load(Ordering::Relaxed),
            puts: counted.puts.load(Ordering::Relaxed),
            watch_events: received.load(Ordering::Relaxed),
            etcd_cpu_ms_per_vm: 1000.0 * etcd_cpu / vms.max(1) as f64,
            pace_per_s,
            create_per_s: vms as f64 / create_s.max(1e-9),
            create_p50_ms: percentile(&create_ms, 0.50),
            create_p99_ms: percentile(&create_ms, 0.99),
        })
    })
}

/// The store, counting the transactions and puts made through it.
struct Counted {
    store: Arc<dyn Store>,
    transactions: AtomicUsize,
    puts: AtomicUsize,
}

impl Counted {
    async fn write(&self, writes: Vec<Write>) -> Result<Revision, keel_store::StoreError> {
        self.transactions.fetch_add(1, Ordering::Relaxed);
        self.puts.fetch_add(writes.len(), Ordering::Relaxed);
        self.store.write_all(writes, None).await
    }
}

/// A VM and the revision of its last write (its node copy, once placed,
/// is written with the record, so at the same revision).
struct Vm {
    index: usize,
    record: Revision,
}

fn name(index: usize) -> String {
    format!("vm-{index:05}")
}

fn put(key: String, bytes: usize, precondition: Precondition) -> Write {
    Write::Put {
        key,
        value: vec![b'x'; bytes],
        precondition,
    }
}

/// The creates: how many, from how many writers, at what pace.
#[derive(Clone, Copy)]
struct Creates {
    vms: usize,
    clients: usize,
    pace_per_s: Option<f64>,
}

/// Every VM's writes; each create's time in ms, and the seconds from the
/// first create until the last was answered.
async fn run(
    store: Arc<Counted>,
    creates: Creates,
    agents: usize,
) -> anyhow::Result<(Vec<f64>, f64)> {
    let (created_tx, created_rx) = mpsc::unbounded_channel();
    let mut agent_txs = Vec::new();
    let mut tasks = tokio::task::JoinSet::new();
    for agent in 0..agents {
        let (tx, rx) = mpsc::unbounded_channel();
        agent_txs.push(tx);
        tasks.spawn(start_and_run(store.clone(), agent, rx));
    }
    tasks.spawn(place(store.clone(), created_rx, agent_txs));
    let next = Arc::new(AtomicUsize::new(0));
    let first = tokio::time::Instant::now();
    let mut writers = tokio::task::JoinSet::new();
    for _ in 0..creates.clients {
        let (store, next, created) = (store.clone(), next.clone(), created_tx.clone());
        writers.spawn(async move {
            let mut create_ms = Vec::new();
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                if index >= creates.vms {
                    return anyhow::Ok(create_ms);
                }
                if let Some(pace) = creates.pace_per_s {
                    // On the pace's schedule, as a steady stream of users
                    // would ask: never ahead of it, and behind it only when
                    // the store is.
                    tokio::time::sleep_until(first + Duration::from_secs_f64(index as f64 / pace))
                        .await;
                }
                let vm = name(index);
                let writes = vec![
                    put(format!("/vms/{vm}"), RECORD_BYTES[0], Precondition::Absent),
                    put(
                        format!("/events/_audit/{index}"),
                        AUDIT_BYTES,
                        Precondition::Absent,
                    ),
                ];
                let asked = Instant::now();
                let record = store.write(writes).await?;
                create_ms.push(asked.elapsed().as_secs_f64() * 1000.0);
                let _ = created.send(Vm { index, record });
            }
        });
    }
    drop(created_tx);
    let mut create_ms = Vec::with_capacity(creates.vms);
    while let Some(done) = writers.join_next().await {
        create_ms.extend(done.context("a store floor writer panicked")??);
    }
    let create_s = first.elapsed().as_secs_f64();
    while let Some(done) = tasks.join_next().await {
        done.context("a store floor writer panicked")??;
    }
    Ok((create_ms, create_s))
}

/// The leader's part: places what has been created, a batch at a time.
async fn place(
    store: Arc<Counted>,
    mut created: mpsc::UnboundedReceiver<Vm>,
    agents: Vec<mpsc::UnboundedSender<Vm>>,
) -> anyhow::Result<()> {
    while let Some(first) = created.recv().await {
        let mut batch = vec![first];
        while batch.len() < PLACEMENT_BATCH {
            match created.try_recv() {
                Ok(vm) => batch.push(vm),
                Err(_) => break,
            }
        }
        let mut writes = Vec::with_capacity(2 * batch.len());
        for vm in &batch {
            let node = vm.index % agents.len();
            let vm_name = name(vm.index);
            writes.push(put(
                format!("/vms/{vm_name}"),
                RECORD_BYTES[1],
                Precondition::Revision(vm.record),
            ));
            writes.push(put(
                format!("/vm-shards/node{node}/{vm_name}"),
                RECORD_BYTES[1],
                Precondition::Absent,
            ));
        }
        let revision = store.write(writes).await?;
        for mut vm in batch {
            vm.record = revision;
            let _ = agents[vm.index % agents.len()].send(vm);
        }
    }
    Ok(())
}

/// An agent's part: each of its VMs' start and Running writes, in order,
/// its VMs side by side.
async fn start_and_run(
    store: Arc<Counted>,
    agent: usize,
    mut placed: mpsc::UnboundedReceiver<Vm>,
) -> anyhow::Result<()> {
    let mut vms = tokio::task::JoinSet::new();
    while let Some(vm) = placed.recv().await {
        let store = store.clone();
        vms.spawn(async move {
            let vm_name = name(vm.index);
            let mut record = vm.record;
            for (step, bytes) in RECORD_BYTES[2..].iter().enumerate() {
                let writes = vec![
                    put(
                        format!("/vms/{vm_name}"),
                        *bytes,
                        Precondition::Revision(record),
                    ),
                    put(
                        format!("/vm-shards/node{agent}/{vm_name}"),
                        *bytes,
                        Precondition::Revision(record),
                    ),
                    put(
                        format!("/events/{vm_name}/{record}-{step}"),
                        EVENT_BYTES,
                        Precondition::Absent,
                    ),
                ];
                record = store.write(writes).await?;
            }
            anyhow::Ok(())
        });
        while let Some(done) = vms.try_join_next() {
            done.context("a store floor VM panicked")??;
        }
    }
    while let Some(done) = vms.join_next().await {
        done.context("a store floor VM panicked")??;
    }
    Ok(())
}
