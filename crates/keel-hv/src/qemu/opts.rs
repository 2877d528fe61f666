//! How values are written into QEMU's `-object`/`-drive`-style options.

use std::path::Path;

/// QEMU option values are comma separated; a literal comma is doubled.
pub fn opt_escape(path: &Path) -> String {
    path.to_string_lossy().replace(',', ",,")
}
