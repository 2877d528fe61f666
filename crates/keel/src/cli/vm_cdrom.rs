//! `keel vm cdrom NAME --insert IMAGE | --eject [--boot cdrom|disk]`, and
//! the installer lines of `keel vm get`: the ISO attached as CD-ROM and
//! which device firmware tries first (`cdrom`), and the graphical console
//! (`graphics`).
//!
//! The CD-ROM is part of the spec (`spec.boot.cdrom`), so a change is a
//! spec replacement at the revision read: a VM changed meanwhile is a 409,
//! never a lost write. A running instance keeps its CD-ROM until its next
//! start (`restart required: boot`), as for every boot field.

use keel_api::{BootDevice, VirtualMachine};
use ureq::http::Method;

use super::output;
use super::{encode, Client};
use crate::api::vms::{ReplaceSpecRequest, VmResponse};
use crate::args::{CdromArgs, OutputFormat};

pub fn run(client: &Client, out: OutputFormat, args: CdromArgs) -> anyhow::Result<()> {
    let path = format!("/api/v1/vms/{}", encode(&args.name));
    let read: VmResponse = client.get(&path)?;
    let mut spec = read.vm.spec.clone();
    let boot = &mut spec.boot;
    if let Some(image) = &args.insert {
        boot.cdrom = Some(image.clone());
    }
    if args.eject {
        boot.cdrom = None;
        // Nothing left to boot first; the server would refuse it.
        if boot.first == Some(BootDevice::Cdrom) {
            boot.first = None;
        }
    }
    if let Some(first) = args.boot_first {
        boot.first = Some(first);
    }
    let body = ReplaceSpecRequest {
        spec,
        revision: Some(read.revision),
    };
    let resp: VmResponse = client.call(Method::PUT, &format!("{path}/spec"), Some(&body))?;
    let now = match &resp.vm.spec.boot.cdrom {
        Some(iso) => format!("the CD-ROM holds {iso}"),
        None => "the CD-ROM is empty".to_string(),
    };
    let then = if resp.vm.status.instance.is_some() {
        "; the running instance keeps what it started with until its next start"
    } else {
        ""
    };
    output::print(out, &resp, || {
        format!("{}: {now}{then} (revision {})\n", args.name, resp.revision)
    })
}

pub fn describe(vm: &VirtualMachine) -> Vec<(&'static str, String)> {
    cdrom(vm)
        .into_iter()
        .chain(vm.spec.boot.graphics.map(|g| {
            (
                "graphics",
                format!("{g} (a WebSocket at /api/v1/vms/{}/vnc)", vm.name),
            )
        }))
        .collect()
}

fn cdrom(vm: &VirtualMachine) -> Option<(&'static str, String)> {
    let boot = &vm.spec.boot;
    let iso = boot.cdrom.as_ref()?;
    let order = if keel_api::cdrom::cdrom_first(Some(iso), boot.first) {
        "boots first, then the first disk"
    } else {
        "after the first disk"
    };
    Some(("cdrom", format!("{iso} ({order})")))
}
