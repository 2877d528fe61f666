//! The installer lines of `keel vm get`: the ISO attached as CD-ROM and
//! which device firmware tries first (`cdrom`), and the graphical console
//! (`graphics`).

use keel_api::VirtualMachine;

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
