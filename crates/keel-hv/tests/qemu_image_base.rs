//! A disk made from an image never runs on another base: the image
//! deleted anyway (as a Keel without the delete checks did), another file
//! imported under its name, the disk restored from a snapshot taken on the
//! first, and the next start fails, saying why, with no QEMU started.
//! Real QEMU, qemu-img and files; the driver's own image store and disks.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{wait_for, Fixture, STOP};
use keel_api::{BootSpec, DiskSpec, Image, ImageKind};
use keel_hv::images::ImageStore;
use keel_hv::{DomainSpec, DomainState, Hypervisor};

const VM: &str = "imgbase";

async fn import(store: &ImageStore, name: &str, fill: u8) -> (Image, std::path::PathBuf) {
    let mut upload = store.begin(name).await.unwrap();
    upload.write(&vec![fill; 1 << 20]).await.unwrap();
    let staged = store.finish(upload, ImageKind::Disk, 1).await.unwrap();
    let image = staged.image.clone();
    let path = store.commit(staged).unwrap();
    (image, path)
}

fn spec(instance: &str, image: &Image, create_disks: bool) -> DomainSpec {
    DomainSpec {
        vm: VM.into(),
        instance: instance.into(),
        cpus: 1,
        memory_mib: 64,
        disks: disks(),
        boot: BootSpec::default(),
        create_disks: if create_disks {
            keel_hv::DiskCreation::all_of(&disks())
        } else {
            keel_hv::DiskCreation::none()
        },
        network: Default::default(),
        cloud_init: None,
        fenced: true,
        images: vec![image.clone()],
        hardware: None,
        hotplug_ports: 0,
        plugged: Vec::new(),
        clone_from: None,
        recorded_firmware: None,
        tpm: None,
        balloon: false,
    }
}

fn disks() -> Vec<DiskSpec> {
    vec![DiskSpec {
        name: "root".into(),
        size_mib: 1,
        image: Some("base".into()),
    }]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_whose_image_was_imported_again_is_never_started_on_the_new_file() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    let store = ImageStore::open(
        &fx.dir.path().canonicalize().unwrap().join("images"),
        Path::new("qemu-img"),
        Duration::from_secs(30),
    )
    .unwrap();
    let (first, first_file) = import(&store, "base", 0xaa).await;

    // The first start makes the overlay on the image (and notes it); the
    // guest has nothing to boot, which does not matter here.
    hv.start(&spec("imgbase-1", &first, true)).await.unwrap();
    hv.kill("imgbase-1").await.unwrap();
    let state = wait_for(hv, "imgbase-1", STOP, DomainState::is_exited).await;
    assert!(state.is_exited(), "{state:?}");
    hv.cleanup("imgbase-1").await.unwrap();
    let root = hv.disk_path(VM, "root");
    assert_eq!(
        keel_hv::qcow2::backing_file(&root).unwrap(),
        Some(first_file.clone())
    );
    let users = store.overlays_on(&first).unwrap();
    assert_eq!(
        users.iter().map(|u| &u.overlay).collect::<Vec<_>>(),
        [&root],
        "the driver noted its overlay, so a delete is refused: {users:?}"
    );
    hv.snapshot_disks(VM, &disks(), None, "s1").await.unwrap();

    // Deleted all the same, and other content imported under the name.
    store.remove(&first).unwrap();
    let (second, second_file) = import(&store, "base", 0xbb).await;
    assert_ne!(first_file, second_file);

    // The restore is refused with the reason; so is a start.
    let restored = hv.restore_disks(VM, &disks(), "s1").await.unwrap_err();
    let text = restored.to_string();
    assert!(
        text.contains("not restored onto it") && text.contains(&first_file.display().to_string()),
        "{text}"
    );
    let err = hv
        .start(&spec("imgbase-2", &second, false))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("not starting it on a different base")
            && text.contains(&first_file.display().to_string())
            && text.contains(&second.sha256),
        "{text}"
    );
    assert!(hv.info("imgbase-2").await.unwrap_err().is_not_found());
    assert_eq!(
        keel_hv::qcow2::backing_file(&root).unwrap(),
        Some(first_file),
        "the disk still names the content it was made on"
    );

    // Deleting the VM's disks drops the note: the image is free again.
    hv.delete_disks(VM).await.unwrap();
    assert!(store.overlays_on(&first).unwrap().is_empty());
}
