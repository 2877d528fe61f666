//! `--wait` on the VM's watch (`GET /api/v1/vms?watch=true&name=NAME`):
//! each change of the VM's record as the store makes it, so a wait ends
//! the moment its goal holds instead of at the next poll (every 200 ms,
//! which cost a start a tenth of a second on average). A stream that
//! cannot be opened or breaks (an older server, the follow slots taken, a
//! proxy that cuts it) hands the wait back to the poll.

use std::sync::mpsc;
use std::thread;

use keel_api::VirtualMachine;
use keel_store::Revision;
use serde::Deserialize;

use crate::api::vms::VmResponse;
use crate::cli::{encode, Client};

/// One line of the watch, as the server writes it (`api::vm_watch`).
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
enum Line {
    Put {
        revision: Revision,
        vm: Box<VirtualMachine>,
    },
    Synced {},
    Deleted {},
}

/// What the watch told of the VM.
#[derive(Debug)]
pub enum Seen {
    /// The VM as stored now.
    Vm(Box<VmResponse>),
    /// It does not exist (not listed, or deleted).
    Gone,
    /// The stream ended or could not be read; why.
    Broke(String),
}

/// Follows VM `name` on a thread of its own (a stream read blocks, and the
/// wait has a deadline): its states, in store order, until the stream ends
/// or the receiver is dropped. The thread then ends with the process or at
/// the VM's next change.
pub fn states(client: &Client, name: &str) -> mpsc::Receiver<Seen> {
    let (tx, rx) = mpsc::channel();
    let client = client.clone();
    let path = format!("/api/v1/vms?watch=true&name={}", encode(name));
    thread::spawn(move || {
        let mut listed = false;
        let followed = client.stream_lines::<Line>(&path, |line| {
            let seen = match line {
                Line::Put { revision, vm } => {
                    listed = true;
                    Seen::Vm(Box::new(VmResponse { revision, vm: *vm }))
                }
                Line::Synced {} if listed => return Ok(true),
                Line::Synced {} | Line::Deleted {} => Seen::Gone,
            };
            Ok(tx.send(seen).is_ok())
        });
        let why = match followed {
            Ok(()) => "the server ended the watch".to_string(),
            Err(e) => format!("{e:#}"),
        };
        let _ = tx.send(Seen::Broke(why));
    });
    rx
}
