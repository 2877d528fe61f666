//! Below the free-space floor the driver creates no disk: the start fails
//! before QEMU runs, with a reason naming the floor and its flag (the VM
//! controller carries it into the VM's message), and leaves nothing.

mod common;

use common::{spec, Fixture};
use keel_hv::{HvError, Hypervisor};

#[tokio::test]
async fn no_disk_is_created_below_the_free_space_floor() {
    // A floor above any real filesystem's free space.
    let Some(fx) = Fixture::with(|mut c| {
        c.min_free_disk_bytes = u64::MAX / 4;
        c
    })
    .await
    else {
        return;
    };
    let err = fx
        .hv()
        .start(&spec("floorvm", "floorvm-1"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, HvError::Failed { reason, .. }
            if reason.contains("not creating disk data of VM floorvm")
                && reason.contains("--min-free-disk-mib")),
        "{err:?}"
    );
    assert!(!fx.hv().disk_path("floorvm", "data").exists());
    assert!(fx.hv().info("floorvm-1").await.unwrap_err().is_not_found());
}
