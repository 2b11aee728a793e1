//! The header's JSON, parsed with a hand-written top-level visitor so that a
//! repeated key is an error instead of silently keeping the last value (what
//! `serde_json` maps do), and so that a failure inside one entry can name the
//! tensor it belongs to.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::Path;

use serde::Deserialize;
use serde::de::{self, MapAccess, Visitor};

use super::safetensors_error::SafetensorsError;

/// The key under which free-form string metadata is stored.
pub(crate) const METADATA_KEY: &str = "__metadata__";

/// One tensor entry as written, before its dtype and offsets are checked.
#[derive(Debug, Deserialize)]
pub(crate) struct RawTensor {
    pub(crate) dtype: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) data_offsets: (u64, u64),
}

/// The top-level object: tensors in file order, plus metadata.
#[derive(Debug, Default)]
pub(crate) struct RawHeader {
    pub(crate) tensors: Vec<(String, RawTensor)>,
    pub(crate) metadata: BTreeMap<String, String>,
}

/// Where the parser was when it failed, to type the error.
#[derive(Debug, Default)]
enum Place {
    #[default]
    Top,
    Metadata,
    Tensor(String),
    Duplicate(String),
}

struct TopVisitor<'p> {
    place: &'p mut Place,
}

impl<'de> Visitor<'de> for TopVisitor<'_> {
    type Value = RawHeader;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object of tensor entries")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
        let mut out = RawHeader::default();
        let mut seen: HashSet<String> = HashSet::new();
        let mut seen_metadata = false;
        while let Some(key) = map.next_key::<String>()? {
            if key == METADATA_KEY {
                if seen_metadata {
                    *self.place = Place::Duplicate(key);
                    return Err(de::Error::custom("duplicate __metadata__"));
                }
                seen_metadata = true;
                *self.place = Place::Metadata;
                let m: Option<BTreeMap<String, String>> = map.next_value()?;
                out.metadata = m.unwrap_or_default();
            } else {
                if seen.contains(&key) {
                    *self.place = Place::Duplicate(key);
                    return Err(de::Error::custom("duplicate tensor name"));
                }
                *self.place = Place::Tensor(key);
                let t: RawTensor = map.next_value()?;
                if let Place::Tensor(key) = std::mem::take(self.place) {
                    seen.insert(key.clone());
                    out.tensors.push((key, t));
                }
            }
            *self.place = Place::Top;
        }
        Ok(out)
    }
}

/// Parses the (UTF-8) header text of `path`.
pub(crate) fn parse_raw(path: &Path, text: &str) -> Result<RawHeader, SafetensorsError> {
    let mut place = Place::Top;
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = de::Deserializer::deserialize_map(&mut de, TopVisitor { place: &mut place })
        .and_then(|raw| de.end().map(|()| raw));
    parsed.map_err(|e| {
        let path = path.to_path_buf();
        let msg = e.to_string();
        match place {
            Place::Top => SafetensorsError::InvalidJson { path, msg },
            Place::Metadata => SafetensorsError::InvalidMetadata { path, msg },
            Place::Tensor(name) => SafetensorsError::InvalidTensor { path, name, msg },
            Place::Duplicate(name) => SafetensorsError::DuplicateTensor { path, name },
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<RawHeader, SafetensorsError> {
        parse_raw(Path::new("t.safetensors"), s)
    }

    #[test]
    fn keeps_file_order_and_metadata() {
        let raw = parse(
            r#"{"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":{"k":"v"},"a":{"dtype":"U8","shape":[],"data_offsets":[4,5]}}  "#,
        )
        .unwrap();
        let names: Vec<_> = raw.tensors.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["b", "a"]);
        assert_eq!(raw.metadata.get("k").map(String::as_str), Some("v"));
    }

    #[test]
    fn duplicates_are_errors() {
        let e = parse(r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#)
            .unwrap_err();
        assert!(
            matches!(e, SafetensorsError::DuplicateTensor { ref name, .. } if name == "a"),
            "{e}"
        );
        let e = parse(r#"{"__metadata__":{},"__metadata__":{}}"#).unwrap_err();
        assert!(matches!(e, SafetensorsError::DuplicateTensor { .. }), "{e}");
    }

    #[test]
    fn errors_name_their_place() {
        let e = parse(r#"{"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#).unwrap_err();
        assert!(
            matches!(e, SafetensorsError::InvalidTensor { ref name, .. } if name == "w"),
            "{e}"
        );
        let e = parse(r#"{"__metadata__":{"k":1}}"#).unwrap_err();
        assert!(matches!(e, SafetensorsError::InvalidMetadata { .. }), "{e}");
        let e = parse(r#"{} x"#).unwrap_err();
        assert!(matches!(e, SafetensorsError::InvalidJson { .. }), "{e}");
        let e = parse(r#"[]"#).unwrap_err();
        assert!(matches!(e, SafetensorsError::InvalidJson { .. }), "{e}");
    }
}
