//! Caps on what clients can make the server keep: VMs, snapshots per VM,
//! images, and event streams followed at once (`keel serve --max-vms`,
//! `--max-snapshots-per-vm`, `--max-images`, `--max-follows`). Creating
//! past a cap is a 409 naming the cap and its flag: the request is fine,
//! the current state refuses it, as with a name already taken. An image
//! larger than `--max-image-size` is a 413 naming `size` instead: that
//! request can never succeed.
//!
//! The VM cap is held exactly by one server's racing creates (each takes
//! a place first, `vm_count`). The other counts are read just before the
//! create, so creates racing each other may pass those caps by as many as
//! run at once; they bound growth, they are not exact quotas.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;

use super::ApiError;

pub const DEFAULT_MAX_VMS: usize = 10_000;
pub const DEFAULT_MAX_SNAPSHOTS_PER_VM: usize = 100;
pub const DEFAULT_MAX_IMAGES: usize = 1_000;
pub const DEFAULT_MAX_FOLLOWS: usize = 256;
/// 64 GiB: a cloud image is a few hundred MiB to a few GiB; a bigger one
/// is more likely a mistake (a URL to a whole disk dump) than an image.
pub const DEFAULT_MAX_IMAGE_BYTES: u64 = 64 << 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiLimits {
    pub max_vms: usize,
    pub max_snapshots_per_vm: usize,
    pub max_images: usize,
    pub max_follows: usize,
    /// The largest image file an import (upload or URL) may write.
    pub max_image_bytes: u64,
}

impl Default for ApiLimits {
    fn default() -> Self {
        Self {
            max_vms: DEFAULT_MAX_VMS,
            max_snapshots_per_vm: DEFAULT_MAX_SNAPSHOTS_PER_VM,
            max_images: DEFAULT_MAX_IMAGES,
            max_follows: DEFAULT_MAX_FOLLOWS,
            max_image_bytes: DEFAULT_MAX_IMAGE_BYTES,
        }
    }
}

/// Refuses a create when `existing` already reaches `cap`.
pub fn check_cap(existing: u64, cap: usize, what: &str, flag: &str) -> Result<(), ApiError> {
    if existing < cap as u64 {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::CONFLICT,
        format!(
            "limit reached: at most {cap} {what} (keel serve {flag}); \
             delete some or raise the limit"
        ),
    )
    .with_field(flag.trim_start_matches('-')))
}

/// The follow streams in progress, each holding a [`FollowSlot`].
#[derive(Debug, Default)]
pub struct FollowSlots {
    active: AtomicUsize,
}

/// One follow stream's place; given back when dropped.
#[derive(Debug)]
pub struct FollowSlot(Arc<FollowSlots>);

impl Drop for FollowSlot {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl FollowSlots {
    /// A slot if fewer than `cap` streams are followed, else the 409.
    pub fn acquire(self: &Arc<Self>, cap: usize) -> Result<FollowSlot, ApiError> {
        let taken = self
            .active
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < cap).then_some(n + 1)
            });
        match taken {
            Ok(_) => Ok(FollowSlot(self.clone())),
            Err(n) => Err(check_cap(
                n as u64,
                cap,
                "event streams followed at once",
                "--max-follows",
            )
            .expect_err("the cap is reached")),
        }
    }

    pub fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_given_back_when_its_stream_ends() {
        let slots = Arc::new(FollowSlots::default());
        let first = slots.acquire(1).unwrap();
        let err = slots.acquire(1).unwrap_err();
        assert_eq!(err.status(), StatusCode::CONFLICT);
        assert!(err.message().contains("--max-follows"), "{err}");
        drop(first);
        assert_eq!(slots.active(), 0);
        slots.acquire(1).unwrap();
    }
}
