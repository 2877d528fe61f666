//! What Keel's tests share, in one place: where the test guest is (and
//! whether real-QEMU tests run at all), which processes a test left
//! behind, a VM spec to start from, and a private etcd. Dev-only: the
//! crates list it under `[dev-dependencies]`, never `[dependencies]`.

pub mod guest;
pub mod private_etcd;
pub mod procs;
pub mod spec;
