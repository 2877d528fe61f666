//! `keel node freeze NODE --for 5m`: a bounded freeze for a planned agent
//! restart (see `keel_api::NodeFreeze`).

use keel_api::Node;
use ureq::http::Method;

use super::output;
use super::{encode, Client};
use crate::api::freeze::FreezeRequest;
use crate::api::nodes::NodeResponse;
use crate::args::{FreezeArgs, OutputFormat};

pub fn freeze(client: &Client, out: OutputFormat, args: FreezeArgs) -> anyhow::Result<()> {
    let req = FreezeRequest {
        for_s: args.for_s,
        reason: args.reason,
    };
    let path = format!("/api/v1/nodes/{}/freeze", encode(&args.name));
    let resp: NodeResponse = client.call(Method::POST, &path, Some(&req))?;
    output::print(out, &resp, || {
        format!(
            "node {}: frozen for {}s; its VMs are not taken over until the freeze ends, and its agent ends it when it is back\n",
            args.name, args.for_s
        )
    })
}

/// The freeze, for `node list` and `node info`.
pub fn freeze_text(n: &Node) -> String {
    match &n.freeze {
        None => "-".into(),
        Some(f) => format!("{}s ({})", f.duration_ms / 1000, f.reason),
    }
}
