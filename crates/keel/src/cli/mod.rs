//! The command-line client: each verb is one or a few HTTP requests to
//! `keel serve`. Errors carry the server's message and the field it names.

mod client;
mod events;
mod node;
pub mod output;
mod vm;
mod wait;

pub use client::{encode, ApiFailure, Client};

use crate::args::{EventsArgs, NodeCommand, VmCommand};

pub fn vm(cmd: VmCommand) -> anyhow::Result<()> {
    vm::run(cmd)
}

pub fn events(args: EventsArgs) -> anyhow::Result<()> {
    events::run(args)
}

pub fn node(cmd: NodeCommand) -> anyhow::Result<()> {
    node::run(cmd)
}
