//! The fence keeper on its own (`keel keeper` is the same code in the main
//! binary): lets keel-hv's own tests run QEMU under a keeper without the
//! `keel` binary. See `keel_hv::qemu::keeper`.

fn main() {
    std::process::exit(keel_hv::qemu::keeper::main_with_args(
        std::env::args().skip(1),
    ));
}
