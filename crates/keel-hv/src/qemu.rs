//! QEMU driver: filled in by the QEMU work.
