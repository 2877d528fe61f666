//! Keel's server (`keel serve`: HTTP API, VM controller, node heartbeat)
//! and its command-line client, in one crate so the integration tests can
//! start the real server in-process.

// Production code handles its errors; `unwrap` is for tests (which
// compile this crate with cfg(test)), `expect` states an invariant.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod agent;
pub mod agent_console;
pub mod agent_link;
pub mod api;
pub mod api_tls;
pub mod api_tls_cluster;
pub mod args;
pub mod auth;
pub mod bench_scale;
pub mod bench_start;
pub mod capacity_args;
pub mod cli;
pub mod config_file;
pub mod distributed;
pub mod doctor;
pub mod etcd_history;
pub mod host;
pub mod host_tools;
pub mod http_listener;
pub mod hypervisor;
pub mod metrics;
pub mod migration_setup;
pub mod node_args;
pub mod prefix_view;
pub mod serve;
pub mod sim_nodes;
pub mod store_access;
pub mod timefmt;
pub mod token_book;
pub mod webui;
