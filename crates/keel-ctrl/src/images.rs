//! The image records a start needs: the node checks each image file
//! against its record (the authority on what the file must be) before a VM
//! uses it.

use keel_api::{validate_name, Image, VmSpec};
use keel_store::{StoreError, TypedStore};

use crate::keys::image_key;

/// The records of the images `spec` names. A name that is not valid (a host
/// path in a record from before the image store) or has no record is left
/// out: the driver then fails the start, naming the field, and boots
/// nothing in its place.
pub async fn records_for(store: &TypedStore, spec: &VmSpec) -> Result<Vec<Image>, StoreError> {
    let mut out: Vec<Image> = Vec::new();
    for used in spec.images() {
        if validate_name(&used.field, &used.name).is_err()
            || out.iter().any(|i| i.name == used.name)
        {
            continue;
        }
        if let Some(entry) = store.get::<Image>(&image_key(&used.name)).await? {
            out.push(entry.value);
        }
    }
    Ok(out)
}
