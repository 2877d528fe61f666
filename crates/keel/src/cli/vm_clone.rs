//! `keel vm clone SOURCE NAME [--snapshot S] [--start]`: a snapshot of the
//! source first when none is named (`clone-NAME`, taken live if it runs,
//! and kept, so the clone can be made whenever it first starts), then the
//! clone from it.

use std::time::Duration;

use ureq::http::Method;

use super::output;
use super::snapshot::wait_taken;
use super::{encode, Client};
use crate::api::clone::CloneVmRequest;
use crate::api::snapshots::{CreateSnapshotRequest, SnapshotResponse};
use crate::api::vms::VmResponse;
use crate::args::{CloneArgs, OutputFormat};

pub fn run(client: &Client, out: OutputFormat, args: CloneArgs) -> anyhow::Result<()> {
    let snapshot = match args.snapshot {
        Some(s) => s,
        None => {
            let name = format!("clone-{}", args.name);
            let _: SnapshotResponse = client.call(
                Method::POST,
                &format!("/api/v1/vms/{}/snapshots", encode(&args.source)),
                Some(&CreateSnapshotRequest { name: name.clone() }),
            )?;
            wait_taken(
                client,
                &args.source,
                &name,
                Duration::from_secs(args.timeout),
            )?;
            name
        }
    };
    let req = CloneVmRequest {
        name: args.name.clone(),
        snapshot: snapshot.clone(),
        start: args.start,
        linked: args.linked,
    };
    let resp: VmResponse = client.call(
        Method::POST,
        &format!("/api/v1/vms/{}/clone", encode(&args.source)),
        Some(&req),
    )?;
    output::print(out, &resp, || {
        format!(
            "{}: cloned from {} at snapshot {snapshot} ({}; its disks are {} at its first \
             start) (revision {})\n",
            args.name,
            args.source,
            if args.start { "starting" } else { "stopped" },
            if args.linked {
                "overlays on a frozen copy of the source's, made"
            } else {
                "copied"
            },
            resp.revision
        )
    })
}
