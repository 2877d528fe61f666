//! `keel vm disk add|remove|resize NAME DISK`.

use ureq::http::Method;

use super::output;
use super::{encode, Client};
use crate::api::disks::{AddDiskRequest, RemoveDiskRequest, ResizeDiskRequest};
use crate::api::vms::VmResponse;
use crate::args::{DiskVerb, OutputFormat};

pub fn run(client: &Client, out: OutputFormat, verb: DiskVerb) -> anyhow::Result<()> {
    let (vm, said, resp): (String, String, VmResponse) = match verb {
        DiskVerb::Add(args) => {
            let body = AddDiskRequest {
                name: args.disk.clone(),
                size_mib: args.size,
                revision: None,
            };
            let path = format!("/api/v1/vms/{}/disks", encode(&args.name));
            let resp = client.call(Method::POST, &path, Some(&body))?;
            (
                args.name,
                format!("disk {} ({} MiB) added", args.disk, args.size),
                resp,
            )
        }
        DiskVerb::Remove(args) => {
            let path = format!(
                "/api/v1/vms/{}/disks/{}",
                encode(&args.name),
                encode(&args.disk)
            );
            let resp: VmResponse =
                client.call(Method::DELETE, &path, Some(&RemoveDiskRequest::default()))?;
            let running = resp.vm.status.instance.as_ref();
            let plugged = running.is_some_and(|i| i.plugged.iter().any(|p| p.disk == args.disk));
            let started = running
                .and_then(|i| i.started_with.as_ref())
                .is_some_and(|s| s.disks.contains(&args.disk));
            let then = if plugged {
                "; the running guest has it unplugged (`keel vm get` shows when)"
            } else if started {
                "; the running instance keeps it until its next start (restart required)"
            } else {
                ""
            };
            let said = format!(
                "disk {} removed from the spec{then}; its file stays in the VM's disk dir \
                 until the VM is deleted",
                args.disk
            );
            (args.name, said, resp)
        }
        DiskVerb::Resize(args) => {
            let body = ResizeDiskRequest {
                size_mib: args.size,
                revision: None,
            };
            let path = format!(
                "/api/v1/vms/{}/disks/{}/resize",
                encode(&args.name),
                encode(&args.disk)
            );
            let resp = client.call(Method::POST, &path, Some(&body))?;
            (
                args.name,
                format!("disk {} is {} MiB", args.disk, args.size),
                resp,
            )
        }
    };
    output::print(out, &resp, || {
        format!("{vm}: {said} (revision {})\n", resp.revision)
    })
}
