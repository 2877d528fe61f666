//! The fence-lease renewal needs no free descriptor: the renewer keeps the
//! lease file open from the start. 250 idle connections once took an
//! agent's descriptors, its renewal failed with `Too many open files`, and
//! the keeper killed an AlwaysOn guest. One test alone in its binary: it
//! lowers the process's descriptor limit.

use std::time::Duration;

use keel_hv::qemu::keeper::{FenceLease, LEASE_FILE};

#[test]
fn a_renewal_works_with_no_descriptor_left() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(LEASE_FILE);
    let held = FenceLease::held_open(&path).unwrap();
    let unheld = FenceLease::new(&path);
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on rlimits we own; the soft limit is
    // restored before anything is asserted.
    let before = unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        let before = limit;
        limit.rlim_cur = 0;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        before
    };
    let renewed = held.renew(Duration::from_secs(30));
    let by_path = unheld.renew(Duration::from_secs(30));
    // SAFETY: as above.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &before) };
    renewed.expect("the held lease renews without a free descriptor");
    assert!(
        by_path.is_err(),
        "the limit did not bite: the test proves nothing"
    );
    assert!(FenceLease::new(&path).valid_now());
}
