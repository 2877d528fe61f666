//! The fence keeper on its own (`keel keeper` is the same code in the main
//! binary): lets keel-hv's own tests run QEMU under a keeper without the
//! `keel` binary. See `keel_hv::qemu::keeper`.

// Production code handles its errors; `unwrap` is for tests (which
// compile this crate with cfg(test)), `expect` states an invariant.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

fn main() {
    std::process::exit(keel_hv::qemu::keeper::main_with_args(
        std::env::args().skip(1),
    ));
}
