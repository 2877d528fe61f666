//! What a qcow2 file names as its backing file, read from its header.
//!
//! Read directly rather than through `qemu-img info`: the header is a few
//! bytes at a fixed place, this runs for every image-made disk at every
//! start and for every overlay an image delete looks at, and it needs no
//! lock on a disk a running QEMU holds.

use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

const MAGIC: [u8; 4] = *b"QFI\xfb";
/// QEMU refuses longer backing file names too.
const MAX_BACKING_NAME: u32 = 1023;

/// The backing file `path` names, as written in its header; `None` for a
/// qcow2 without one, or a file that is not qcow2 at all (a raw image has
/// no base).
pub fn backing_file(path: &Path) -> io::Result<Option<PathBuf>> {
    use std::os::unix::ffi::OsStringExt;
    let mut file = std::fs::File::open(path)?;
    let mut header = [0u8; 20];
    match file.read_exact(&mut header) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    if header[..4] != MAGIC {
        return Ok(None);
    }
    let offset = u64::from_be_bytes(header[8..16].try_into().expect("8 bytes"));
    let size = u32::from_be_bytes(header[16..20].try_into().expect("4 bytes"));
    if offset == 0 || size == 0 {
        return Ok(None);
    }
    if size > MAX_BACKING_NAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{}: qcow2 header names a backing file of {size} bytes",
                path.display()
            ),
        ));
    }
    let mut name = vec![0u8; size as usize];
    file.seek(SeekFrom::Start(offset))?;
    file.read_exact(&mut name)?;
    Ok(Some(PathBuf::from(std::ffi::OsString::from_vec(name))))
}

/// The guest-visible size of the qcow2 at `path`, in bytes (the header's
/// `size` field); `None` for a file that is not qcow2.
pub fn virtual_size(path: &Path) -> io::Result<Option<u64>> {
    let mut file = std::fs::File::open(path)?;
    let mut header = [0u8; 32];
    match file.read_exact(&mut header) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    if header[..4] != MAGIC {
        return Ok(None);
    }
    Ok(Some(u64::from_be_bytes(
        header[24..32].try_into().expect("8 bytes"),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn qemu_img(args: &[&str]) {
        let out = Command::new("qemu-img").args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn reads_the_backing_file_qemu_img_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n).to_string_lossy().into_owned();
        qemu_img(&["create", "-q", "-f", "qcow2", &p("base.qcow2"), "1M"]);
        qemu_img(&["create", "-q", "-f", "raw", &p("base.raw"), "1M"]);
        let base = p("base.qcow2");
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            &base,
            &p("over.qcow2"),
        ]);
        assert_eq!(
            backing_file(Path::new(&p("over.qcow2"))).unwrap(),
            Some(PathBuf::from(&base))
        );
        assert_eq!(backing_file(Path::new(&base)).unwrap(), None);
        assert_eq!(backing_file(Path::new(&p("base.raw"))).unwrap(), None);
        assert!(backing_file(Path::new(&p("absent"))).is_err());
        assert_eq!(virtual_size(Path::new(&base)).unwrap(), Some(1 << 20));
        assert_eq!(virtual_size(Path::new(&p("base.raw"))).unwrap(), None);
    }
}
