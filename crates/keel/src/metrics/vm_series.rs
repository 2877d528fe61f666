//! The per-VM series of `/metrics`, encoded from the rows of
//! [`super::vm_figures`] into a registry made for one scrape: a VM that
//! stopped or moved since the last scrape simply has no series in the
//! next, with no bookkeeping of what to remove.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::vm_figures::VmFigures;
use super::Labels;

type FloatCounter = Counter<f64, AtomicU64>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// Registers a family under `name` and returns it for filling.
fn family<
    M: prometheus_client::metrics::TypedMetric
        + prometheus_client::encoding::EncodeMetric
        + Default
        + Clone
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
>(
    registry: &mut Registry,
    name: &str,
    help: &str,
) -> Family<Labels, M> {
    let family = Family::<Labels, M>::default();
    registry.register(name, help, family.clone());
    family
}

/// The registry of one scrape's per-VM series (prefix `keel_vm_`).
pub fn registry(rows: &[VmFigures]) -> Registry {
    let mut registry = Registry::with_prefix("keel_vm");
    let r = &mut registry;
    let cpu = family::<FloatCounter>(
        r,
        "cpu_seconds",
        "CPU time of the VM's QEMU process (all threads: vCPUs and device emulation)",
    );
    let vcpus = family::<Gauge>(r, "vcpus", "vCPUs configured");
    let configured = family::<Gauge>(r, "memory_configured_bytes", "Guest memory configured");
    let rss = family::<Gauge>(
        r,
        "memory_rss_bytes",
        "Resident memory of the VM's QEMU process (guest memory it touched, and QEMU's own)",
    );
    let guest_total = family::<Gauge>(
        r,
        "memory_guest_total_bytes",
        "Memory the guest's kernel manages, as its balloon driver reports it (VMs with a balloon device whose guest reports)",
    );
    let guest_free = family::<Gauge>(
        r,
        "memory_guest_free_bytes",
        "Memory the guest's kernel does not use at all, as its balloon driver reports it",
    );
    let guest_available = family::<Gauge>(
        r,
        "memory_guest_available_bytes",
        "Memory the guest could use without swapping (caches given up included), as its balloon driver reports it",
    );
    let uptime = family::<FloatGauge>(
        r,
        "uptime_seconds",
        "Since the current instance was first seen running",
    );
    let restarts = family::<Counter>(
        r,
        "restarts",
        "Instances started after the VM's first: restarts after exits, user restarts, moves to another node",
    );
    let resets = family::<Counter>(
        r,
        "guest_resets",
        "Resets (reboots) inside the current instance",
    );
    let ready = family::<Gauge>(
        r,
        "ready",
        "1 if the guest is up per its readiness setting, else 0",
    );
    let read_bytes = family::<Counter>(r, "disk_read_bytes", "Bytes the guest read from the disk");
    let write_bytes = family::<Counter>(r, "disk_write_bytes", "Bytes the guest wrote to the disk");
    let read_ops = family::<Counter>(r, "disk_read_ops", "Read requests the disk completed");
    let write_ops = family::<Counter>(r, "disk_write_ops", "Write requests the disk completed");
    let read_time = family::<FloatCounter>(
        r,
        "disk_read_time_seconds",
        "Time the completed reads took, summed: rate(...time...) / rate(...ops...) is the mean read latency",
    );
    let write_time = family::<FloatCounter>(
        r,
        "disk_write_time_seconds",
        "Time the completed writes took, summed: rate(...time...) / rate(...ops...) is the mean write latency",
    );
    let rx_bytes = family::<Counter>(
        r,
        "network_receive_bytes",
        "Bytes the guest received on the NIC (bridged NICs only: user-mode networking has no counters)",
    );
    let tx_bytes = family::<Counter>(
        r,
        "network_transmit_bytes",
        "Bytes the guest sent on the NIC (bridged NICs only)",
    );
    let rx_packets = family::<Counter>(
        r,
        "network_receive_packets",
        "Packets the guest received on the NIC (bridged NICs only)",
    );
    let tx_packets = family::<Counter>(
        r,
        "network_transmit_packets",
        "Packets the guest sent on the NIC (bridged NICs only)",
    );
    for row in rows {
        let labels: Labels = vec![
            ("vm", row.vm.clone()),
            ("node", row.node.clone()),
            ("instance", row.instance.clone()),
        ];
        vcpus.get_or_create(&labels).set(i64::from(row.cpus));
        configured
            .get_or_create(&labels)
            .set(clamp(row.memory_configured_bytes));
        ready.get_or_create(&labels).set(i64::from(row.ready));
        restarts.get_or_create(&labels).inc_by(row.restarts);
        resets
            .get_or_create(&labels)
            .inc_by(u64::from(row.guest_resets));
        if let Some(up) = row.uptime_seconds {
            uptime.get_or_create(&labels).set(up);
        }
        if let Some(seconds) = row.cpu_seconds {
            cpu.get_or_create(&labels).inc_by(seconds);
        }
        if let Some(bytes) = row.rss_bytes {
            rss.get_or_create(&labels).set(clamp(bytes));
        }
        if let Some(guest) = &row.guest_memory {
            for (family, figure) in [
                (&guest_total, guest.total_bytes),
                (&guest_free, guest.free_bytes),
                (&guest_available, guest.available_bytes),
            ] {
                if let Some(bytes) = figure {
                    family.get_or_create(&labels).set(clamp(bytes));
                }
            }
        }
        for d in &row.disks {
            let mut l = labels.clone();
            l.push(("disk", d.disk.clone()));
            read_bytes.get_or_create(&l).inc_by(d.read_bytes);
            write_bytes.get_or_create(&l).inc_by(d.write_bytes);
            read_ops.get_or_create(&l).inc_by(d.read_ops);
            write_ops.get_or_create(&l).inc_by(d.write_ops);
            read_time.get_or_create(&l).inc_by(nanos(d.read_time_ns));
            write_time.get_or_create(&l).inc_by(nanos(d.write_time_ns));
        }
        for n in &row.nics {
            let mut l = labels.clone();
            l.push(("nic", n.nic.clone()));
            rx_bytes.get_or_create(&l).inc_by(n.receive_bytes);
            tx_bytes.get_or_create(&l).inc_by(n.transmit_bytes);
            rx_packets.get_or_create(&l).inc_by(n.receive_packets);
            tx_packets.get_or_create(&l).inc_by(n.transmit_packets);
        }
    }
    registry
}

fn clamp(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn nanos(ns: u64) -> f64 {
    ns as f64 / 1e9
}
