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
            let resp = client.call(Method::DELETE, &path, Some(&RemoveDiskRequest::default()))?;
            let said = format!(
                "disk {} removed from the spec; its file stays in the VM's disk dir until \
                 the VM is deleted",
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
