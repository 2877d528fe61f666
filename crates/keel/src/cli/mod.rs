//! The command-line client: each verb is one or a few HTTP requests to
//! `keel serve`. Errors carry the server's message and the field it names.

mod apply;
mod client;
mod console;
mod events;
mod freeze;
mod image;
mod image_url;
mod literal_resolver;
mod live_progress;
mod migration;
pub mod net;
mod node;
pub mod output;
pub mod placement;
pub mod server_trust;
mod snapshot;
mod token;
mod upload_progress;
mod vm;
mod vm_cdrom;
mod vm_clone;
mod vm_disk;
mod vm_export;
mod vm_firmware;
mod vm_ha;
mod vm_migrate;
mod vm_top;
pub mod wait;

pub use client::{encode, ApiFailure, Client};

use crate::args::{
    EventsArgs, ImageCommand, MigrationCommand, NodeCommand, RestoreArgs, SnapshotCommand,
    TokenCommand, VmCommand,
};

pub fn vm(cmd: VmCommand) -> anyhow::Result<()> {
    vm::run(cmd)
}

pub fn token(cmd: TokenCommand) -> anyhow::Result<()> {
    token::run(cmd)
}

pub fn events(args: EventsArgs) -> anyhow::Result<()> {
    events::run(args)
}

pub fn node(cmd: NodeCommand) -> anyhow::Result<()> {
    node::run(cmd)
}

pub fn snapshot(cmd: SnapshotCommand) -> anyhow::Result<()> {
    snapshot::run(cmd)
}

pub fn restore(args: RestoreArgs) -> anyhow::Result<()> {
    snapshot::restore(args)
}

pub fn migration(cmd: MigrationCommand) -> anyhow::Result<()> {
    migration::run(cmd)
}

pub fn apply(args: crate::args::ApplyArgs) -> anyhow::Result<()> {
    apply::run(args)
}

pub fn image(cmd: ImageCommand) -> anyhow::Result<()> {
    image::run(cmd)
}
