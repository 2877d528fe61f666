//! Request extractors whose every rejection is an [`ApiError`] naming the
//! field: the JSON body, path names and query parameters. Axum's own
//! extractors answer in plain text; these replace them.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use keel_api::validate_name;
use serde::de::DeserializeOwned;

use super::ApiError;

/// Request bodies larger than this are refused with 413. Room for a VM
/// spec with the largest cloud-init user-data (64 KiB) JSON-escaped.
pub const MAX_BODY_BYTES: usize = 256 * 1024;

/// The raw request body, at most [`MAX_BODY_BYTES`] (else 413).
pub struct BodyBytes(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for BodyBytes {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        Bytes::from_request(req, state)
            .await
            .map(BodyBytes)
            .map_err(|rejection| {
                if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::new(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("request body is larger than {MAX_BODY_BYTES} bytes"),
                    )
                    .with_field("body")
                } else {
                    ApiError::bad_request("body", rejection.body_text())
                }
            })
    }
}

/// A JSON body, parsed by [`parse_json`].
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let BodyBytes(bytes) = BodyBytes::from_request(req, state).await?;
        parse_json(&bytes).map(JsonBody)
    }
}

/// An optional JSON body: an empty (or all-whitespace) body is `None`;
/// anything else must parse like [`JsonBody`].
pub struct OptJsonBody<T>(pub Option<T>);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for OptJsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let BodyBytes(bytes) = BodyBytes::from_request(req, state).await?;
        if bytes.trim_ascii().is_empty() {
            return Ok(OptJsonBody(None));
        }
        parse_json(&bytes).map(|v| OptJsonBody(Some(v)))
    }
}

/// Parses JSON strictly (request types deny unknown fields, see
/// [`super::strict`]; trailing data is refused). Errors are 400 and name the JSON path of the problem, e.g.
/// `spec.memory_mib`, or `body` for the document as a whole.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // serde would also read a struct from a positional array; a body is
    // always an object.
    match bytes.trim_ascii_start().first() {
        Some(b'{') => {}
        None => {
            return Err(ApiError::bad_request(
                "body",
                "empty body; expected a JSON object",
            ))
        }
        Some(_) => return Err(ApiError::bad_request("body", "expected a JSON object")),
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        let field = if inner.is_data() {
            data_error_field(&path, &inner.to_string())
        } else {
            "body".to_string()
        };
        ApiError::bad_request(field, format!("invalid JSON body: {inner}"))
    })?;
    de.end()
        .map_err(|e| ApiError::bad_request("body", format!("invalid JSON body: {e}")))?;
    Ok(value)
}

/// The field a type error is about. For unknown, missing and duplicate fields serde
/// reports the enclosing object, so the field's own name is appended.
fn data_error_field(path: &str, message: &str) -> String {
    // An empty key shows as a trailing `.` (and the root as `.`).
    let base = path.trim_end_matches('.');
    for prefix in ["unknown field `", "missing field `", "duplicate field `"] {
        if let Some(rest) = message.strip_prefix(prefix) {
            if let Some((name, _)) = rest.split_once('`').filter(|(n, _)| !n.is_empty()) {
                if base.is_empty() {
                    return name.to_string();
                }
                if base.ends_with(&format!(".{name}")) || base == name {
                    return base.to_string();
                }
                return format!("{base}.{name}");
            }
        }
    }
    if base.is_empty() {
        "body".to_string()
    } else {
        base.to_string()
    }
}

/// A resource name from the path (`{name}`), validated like stored names:
/// no `/`, `..`, NUL, at most 63 characters.
pub struct NameParam(pub String);

impl<S: Send + Sync> FromRequestParts<S> for NameParam {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(name) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|r| ApiError::bad_request("name", r.body_text()))?;
        validate_name("name", &name)
            .map_err(|e| ApiError::bad_request(e.field.clone(), e.to_string()))?;
        Ok(NameParam(name))
    }
}

/// A VM and one of its snapshots from the path (`{name}/snapshots/{snap}`),
/// validated like [`NameParam`]; a bad snapshot name names the field
/// `snapshot`.
pub struct SnapshotParams {
    pub vm: String,
    pub snapshot: String,
}

impl<S: Send + Sync> FromRequestParts<S> for SnapshotParams {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path((vm, snapshot)) = Path::<(String, String)>::from_request_parts(parts, state)
            .await
            .map_err(|r| ApiError::bad_request("name", r.body_text()))?;
        for (field, value) in [("name", &vm), ("snapshot", &snapshot)] {
            validate_name(field, value)
                .map_err(|e| ApiError::bad_request(e.field.clone(), e.to_string()))?;
        }
        Ok(SnapshotParams { vm, snapshot })
    }
}

/// The query string as `(name, value)` pairs, for handlers to interpret
/// with [`QueryParams::take_bool`] and friends, so a bad value names its
/// parameter and an unknown parameter is refused.
pub struct QueryParams(Vec<(String, String)>);

impl<S: Send + Sync> FromRequestParts<S> for QueryParams {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let query = parts.uri.query().unwrap_or("");
        serde_urlencoded::from_str::<Vec<(String, String)>>(query)
            .map(QueryParams)
            .map_err(|e| ApiError::bad_request("query", format!("invalid query string: {e}")))
    }
}

impl QueryParams {
    pub fn take(&mut self, name: &str) -> Result<Option<String>, ApiError> {
        let mut found = None;
        let mut i = 0;
        while i < self.0.len() {
            if self.0[i].0 == name {
                let (_, value) = self.0.remove(i);
                if found.replace(value).is_some() {
                    return Err(ApiError::bad_request(
                        name,
                        format!("query parameter {name} given more than once"),
                    ));
                }
            } else {
                i += 1;
            }
        }
        Ok(found)
    }

    pub fn take_bool(&mut self, name: &str) -> Result<Option<bool>, ApiError> {
        self.take(name)?
            .map(|v| match v.as_str() {
                "true" | "1" | "" => Ok(true),
                "false" | "0" => Ok(false),
                _ => Err(ApiError::bad_request(
                    name,
                    format!("query parameter {name}={v:?} is not true or false"),
                )),
            })
            .transpose()
    }

    pub fn take_u64(&mut self, name: &str) -> Result<Option<u64>, ApiError> {
        self.take(name)?
            .map(|v| {
                v.parse::<u64>().map_err(|_| {
                    ApiError::bad_request(
                        name,
                        format!("query parameter {name}={v:?} is not a non-negative integer"),
                    )
                })
            })
            .transpose()
    }

    pub fn take_name(&mut self, name: &str) -> Result<Option<String>, ApiError> {
        let value = self.take(name)?;
        if let Some(v) = &value {
            validate_name(name, v)
                .map_err(|e| ApiError::bad_request(e.field.clone(), e.to_string()))?;
        }
        Ok(value)
    }

    /// Refuses parameters no `take*` consumed.
    pub fn finish(self) -> Result<(), ApiError> {
        match self.0.into_iter().next() {
            None => Ok(()),
            Some((name, _)) => Err(ApiError::bad_request(
                name.clone(),
                format!("unknown query parameter {name:?}"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::VmSpec;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Wrapper {
        #[serde(deserialize_with = "crate::api::strict::vm_spec")]
        spec: VmSpec,
    }

    fn field_of(json: &str) -> String {
        parse_json::<Wrapper>(json.as_bytes())
            .unwrap_err()
            .field()
            .unwrap()
            .to_string()
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(
            field_of(r#"{"spec":{"cpus":1,"memory_mib":-5}}"#),
            "spec.memory_mib"
        );
        assert_eq!(
            field_of(r#"{"spec":{"cpus":"x","memory_mib":5}}"#),
            "spec.cpus"
        );
        assert_eq!(
            field_of(r#"{"spec":{"cpus":1,"memory_mib":64,"bogus":1}}"#),
            "spec.bogus"
        );
        assert_eq!(field_of(r#"{"spec":{"cpus":1}}"#), "spec.memory_mib");
        assert_eq!(field_of(r#"{"spex":{}}"#), "spex");
        assert_eq!(field_of(r#"{}"#), "spec");
        assert_eq!(
            field_of(
                r#"{"spec":{"cpus":1,"memory_mib":64,"disks":[{"name":"a","size_mib":"1"}]}}"#
            ),
            "spec.disks[0].size_mib"
        );
        assert_eq!(field_of("[1]"), "body");
        assert_eq!(field_of(" "), "body");
        assert_eq!(field_of(r#"{"":1}"#), "body");
        assert_eq!(field_of(r#"{"spec":{"":1}}"#), "spec");
        assert_eq!(
            field_of(r#"{"spec":{"cpus":1,"cpus":2,"memory_mib":64}}"#),
            "spec.cpus"
        );
        assert_eq!(field_of("{"), "body");
        assert_eq!(field_of(r#"{"spec":{"cpus":1,"memory_mib":64}} x"#), "body");
    }
}
