//! Marks of a start's progress, each a debug event on the
//! `keel_start_phase` target with the VM, the mark and the wall-clock time
//! in microseconds: `RUST_LOG=info,keel_start_phase=debug` shows where a
//! slow start spent its time, and `keel bench start` cuts every start it
//! makes into phases from them. With the target off (the default), a mark
//! costs one look at the log filter.

/// The log target of the marks.
pub const TARGET: &str = "keel_start_phase";

/// Marks that `vm`'s start reached `mark` now.
pub fn mark(vm: &str, mark: &'static str) {
    tracing::debug!(target: "keel_start_phase", vm = %vm, mark = %mark, at_us = now_us(), "start mark");
}

/// Microseconds since the Unix epoch, the marks' clock.
pub fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}
