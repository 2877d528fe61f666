//! Resource names. They become file and socket names on the host, so the
//! rules are strict: DNS-label style, which cannot contain `/`, `..` or NUL.

use crate::ValidationError;

pub const MAX_NAME_LEN: usize = 63;

/// The longest suffix Keel appends to a VM's name for the ids it derives:
/// instance ids `<vm>-<seq>` and migration ids `<vm>-m<seq>`, `seq` a u64
/// (at most 20 digits). Those ids are names too (directories, QEMU's
/// `-name`), so a VM name leaves room for it.
pub const VM_NAME_SUFFIX_LEN: usize = "-m".len() + 20;

/// 41: every id derived from a VM name of this length still fits.
pub const MAX_VM_NAME_LEN: usize = MAX_NAME_LEN - VM_NAME_SUFFIX_LEN;

/// A VM's name: a [`validate_name`] name short enough that every instance
/// and migration id Keel will ever derive from it is valid as well.
pub fn validate_vm_name(field: &str, name: &str) -> Result<(), ValidationError> {
    validate_name(field, name)?;
    if name.len() > MAX_VM_NAME_LEN {
        return Err(ValidationError::new(
            field,
            format!(
                "{} characters; a VM name has at most {MAX_VM_NAME_LEN}, so that the \
                 instance ids derived from it (<name>-<n>) fit in {MAX_NAME_LEN}",
                name.len()
            ),
        ));
    }
    Ok(())
}

/// Accepts `[a-z0-9]([-a-z0-9]*[a-z0-9])?` of at most 63 characters.
pub fn validate_name(field: &str, name: &str) -> Result<(), ValidationError> {
    if name.is_empty() {
        return Err(ValidationError::new(field, "must not be empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(ValidationError::new(
            field,
            format!("{} characters; at most {MAX_NAME_LEN} allowed", name.len()),
        ));
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
    {
        return Err(ValidationError::new(
            field,
            format!(
                "{:?} is not allowed; use lowercase letters, digits and '-'",
                bad
            ),
        ));
    }
    if name.starts_with('-') || name.ends_with('-') {
        return Err(ValidationError::new(
            field,
            "must start and end with a letter or digit",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rejects_path_tricks() {
        for bad in [
            "", "a/b", "..", "a..b/", "a\0b", "-a", "a-", "A", "a b", "é",
        ] {
            let err = validate_name("name", bad).unwrap_err();
            assert_eq!(err.field, "name", "{bad:?}");
        }
        assert!(validate_name("name", &"a".repeat(64)).is_err());
        assert!(validate_name("name", &"a".repeat(63)).is_ok());
        assert!(validate_name("name", "web-1").is_ok());
    }

    #[test]
    fn every_instance_id_derived_from_the_longest_vm_name_is_valid() {
        let vm = "v".repeat(MAX_VM_NAME_LEN);
        validate_vm_name("name", &vm).unwrap();
        for id in [format!("{vm}-{}", u64::MAX), format!("{vm}-m{}", u64::MAX)] {
            validate_name("instance", &id).unwrap();
        }
        let err = validate_vm_name("name", &"v".repeat(MAX_VM_NAME_LEN + 1)).unwrap_err();
        assert_eq!(err.field, "name");
        assert!(err.to_string().contains("at most 41"), "{err}");
    }

    proptest! {
        #[test]
        fn accepted_names_are_safe_path_components(s in ".{0,80}") {
            if validate_name("name", &s).is_ok() {
                prop_assert!(!s.contains('/') && !s.contains('\0') && !s.contains(".."));
                prop_assert!(s.len() <= MAX_NAME_LEN && !s.is_empty());
            }
        }
    }
}
