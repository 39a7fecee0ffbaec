//! A safetensors header parsed straight into a name-sorted table.
//!
//! The hot swap path reads a header of several hundred tensors on every
//! swap. Parsing it through the `safetensors` crate buffers every entry as a
//! generic JSON value first (its metadata key is flattened), then hashes
//! names twice; this parser visits the JSON map once into typed entries.
//!
//! Its rules are the `safetensors` crate's (0.6), read from its source, so
//! that [`SafetensorsFile`](super::SafetensorsFile) and
//! [`LoadedSafetensors`](super::LoadedSafetensors) (which uses the crate
//! itself) accept and refuse the same files; a property test holds them to
//! it:
//! - the header bytes are UTF-8 and one JSON object (whitespace around it);
//! - `__metadata__` is null or an object of strings, at most once;
//! - every other key is a tensor: `{dtype, shape, data_offsets}` (each at
//!   most once, other fields ignored but fully parsed, as the crate buffers
//!   them) or the same three as a 3-element array;
//! - a name given twice keeps its LAST entry (the crate collects the tensors
//!   into a map), though every entry must parse;
//! - then, in offset order, offsets contiguous from zero and each tensor's
//!   byte length its shape times its dtype's size (checked arithmetic).

use std::collections::HashMap;
use std::fmt;

use safetensors::Dtype;
use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};

/// One tensor of a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HeaderEntry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte range within the data section.
    pub start: usize,
    pub end: usize,
}

/// A validated header: entries sorted by name, and the data section's length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Header {
    entries: Vec<HeaderEntry>,
    data_len: usize,
}

/// A tensor entry's three fields.
struct RawEntry {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

const ENTRY_FIELDS: &[&str] = &["dtype", "shape", "data_offsets"];

/// Deserializes a tensor entry as serde's derive does for the crate's
/// `TensorInfo`: a map (fields once each, unknown ones parsed and dropped) or
/// a 3-element sequence.
struct EntrySeed;

impl<'de> DeserializeSeed<'de> for EntrySeed {
    type Value = RawEntry;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<RawEntry, D::Error> {
        d.deserialize_struct("TensorInfo", ENTRY_FIELDS, EntryVisitor)
    }
}

struct EntryVisitor;

impl<'de> Visitor<'de> for EntryVisitor {
    type Value = RawEntry;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("struct TensorInfo")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<RawEntry, M::Error> {
        let (mut dtype, mut shape, mut offsets) = (None, None, None);
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "dtype" if dtype.is_some() => return Err(M::Error::duplicate_field("dtype")),
                "dtype" => dtype = Some(map.next_value::<Dtype>()?),
                "shape" if shape.is_some() => return Err(M::Error::duplicate_field("shape")),
                "shape" => shape = Some(map.next_value::<Vec<usize>>()?),
                "data_offsets" if offsets.is_some() => return Err(M::Error::duplicate_field("data_offsets")),
                "data_offsets" => offsets = Some(map.next_value::<(usize, usize)>()?),
                _ => map.next_value_seed(StrictIgnore)?,
            }
        }
        Ok(RawEntry {
            dtype: dtype.ok_or_else(|| M::Error::missing_field("dtype"))?,
            shape: shape.ok_or_else(|| M::Error::missing_field("shape"))?,
            data_offsets: offsets.ok_or_else(|| M::Error::missing_field("data_offsets"))?,
        })
    }

    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<RawEntry, S::Error> {
        let dtype = seq
            .next_element::<Dtype>()?
            .ok_or_else(|| S::Error::invalid_length(0, &self))?;
        let shape = seq
            .next_element::<Vec<usize>>()?
            .ok_or_else(|| S::Error::invalid_length(1, &self))?;
        let data_offsets = seq
            .next_element::<(usize, usize)>()?
            .ok_or_else(|| S::Error::invalid_length(2, &self))?;
        Ok(RawEntry {
            dtype,
            shape,
            data_offsets,
        })
    }
}

/// Parses any JSON value completely and drops it: what serde's buffering
/// of an ignored field does (numbers range-checked, string escapes decoded),
/// unlike `IgnoredAny`, which `serde_json` skips without those checks.
struct StrictIgnore;

impl<'de> DeserializeSeed<'de> for StrictIgnore {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictIgnore {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<(), S::Error> {
        while seq.next_element_seed(StrictIgnore)?.is_some() {}
        Ok(())
    }
    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<(), M::Error> {
        while map.next_key::<String>()?.is_some() {
            map.next_value_seed(StrictIgnore)?;
        }
        Ok(())
    }
}

struct EntriesVisitor;

impl<'de> Visitor<'de> for EntriesVisitor {
    type Value = Vec<HeaderEntry>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map of tensor names to {dtype, shape, data_offsets}")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
        let mut entries: Vec<HeaderEntry> = Vec::with_capacity(map.size_hint().unwrap_or(0));
        // Name -> index in `entries`: a repeated name takes the later entry's
        // place, as the crate's map insert does.
        let mut seen: HashMap<String, usize> = HashMap::new();
        let mut metadata_seen = false;
        while let Some(name) = map.next_key::<String>()? {
            if name == "__metadata__" {
                if metadata_seen {
                    return Err(M::Error::duplicate_field("__metadata__"));
                }
                metadata_seen = true;
                // Strings only, as the crate's `Option<HashMap<String, String>>`.
                map.next_value::<Option<HashMap<String, String>>>()?;
                continue;
            }
            let raw = map.next_value_seed(EntrySeed)?;
            let entry = HeaderEntry {
                name,
                dtype: raw.dtype,
                shape: raw.shape,
                start: raw.data_offsets.0,
                end: raw.data_offsets.1,
            };
            match seen.get(&entry.name) {
                Some(&i) => entries[i] = entry,
                None => {
                    seen.insert(entry.name.clone(), entries.len());
                    entries.push(entry);
                }
            }
        }
        Ok(entries)
    }
}

impl Header {
    /// Parse and validate the JSON header `text`.
    pub(crate) fn parse(text: &[u8]) -> Result<Header, String> {
        // The crate checks the whole header is UTF-8 before parsing it.
        let text = std::str::from_utf8(text).map_err(|e| format!("header is not UTF-8: {e}"))?;
        let mut de = serde_json::Deserializer::from_str(text);
        let mut entries = de
            .deserialize_map(EntriesVisitor)
            .map_err(|e| format!("invalid header: {e}"))?;
        de.end().map_err(|e| format!("invalid header: {e}"))?;

        // Offsets: contiguous from zero in offset order, as safetensors checks.
        let mut by_offset: Vec<&HeaderEntry> = entries.iter().collect();
        by_offset.sort_unstable_by_key(|e| (e.start, e.end));
        let mut next = 0usize;
        for e in by_offset {
            if e.start != next || e.end < e.start {
                return Err(format!(
                    "tensor `{}` has data offsets {}..{} where {next} was next",
                    e.name, e.start, e.end
                ));
            }
            let bits = e
                .shape
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .and_then(|n| n.checked_mul(e.dtype.bitsize()))
                .ok_or_else(|| format!("tensor `{}`: shape {:?} overflows", e.name, e.shape))?;
            if bits % 8 != 0 || bits / 8 != e.end - e.start {
                return Err(format!(
                    "tensor `{}`: shape {:?} of {:?} is not {} bytes",
                    e.name,
                    e.shape,
                    e.dtype,
                    e.end - e.start
                ));
            }
            next = e.end;
        }
        // Names are unique (a repeated one kept its last entry).
        entries.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        Ok(Header {
            entries,
            data_len: next,
        })
    }

    /// The entry named `name`.
    pub(crate) fn get(&self, name: &str) -> Option<&HeaderEntry> {
        self.entries
            .binary_search_by(|e| e.name.as_str().cmp(name))
            .ok()
            .and_then(|i| self.entries.get(i))
    }

    /// Every entry, sorted by name.
    pub(crate) fn entries(&self) -> &[HeaderEntry] {
        &self.entries
    }

    /// Bytes of the data section the header describes.
    pub(crate) fn data_len(&self) -> usize {
        self.data_len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Header, String> {
        Header::parse(s.as_bytes())
    }

    #[test]
    fn sorted_by_name_with_metadata_skipped() {
        let h = parse(
            r#"{"__metadata__":{"format":"pt"},
                "b":{"dtype":"BF16","shape":[2,3],"data_offsets":[8,20]},
                "a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
        )
        .unwrap();
        let names: Vec<_> = h.entries().iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(h.data_len(), 20);
        assert_eq!(h.get("b").map(|e| (e.start, e.end)), Some((8, 20)));
        assert!(h.get("c").is_none());
    }

    #[test]
    fn refuses_what_safetensors_refuses() {
        for bad in [
            // A gap, an overlap, a wrong size, a reversed range.
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
            r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}}"#,
            // Overflowing shape, unknown dtype, missing field, not a map, trailing text.
            r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}"#,
            r#"{"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}}"#,
            r#"{"a":{"dtype":"F32","shape":[2]}}"#,
            r#"[1,2]"#,
            r#"{} x"#,
            // The same name twice: the last entry, which counts, leaves a gap.
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            // The same name twice: the overwritten entry must still parse.
            r#"{"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
            // Metadata: not strings, not a map, twice.
            r#"{"__metadata__":{"x":1},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
            r#"{"__metadata__":[],"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
            r#"{"__metadata__":null,"__metadata__":null}"#,
            // An ignored field the crate still parses: out of range, a lone surrogate.
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1e999}}"#,
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":"\ud800"}}"#,
            r#"{"__metadata__":{"x":"\ud800"}}"#,
            // A field twice; an array entry of the wrong length; a null entry; -0.
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"dtype":"F32"}}"#,
            r#"{"a":["F32",[1],[0,4],5]}"#,
            r#"{"a":["F32",[1]]}"#,
            r#"{"a":null}"#,
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[-0,4]}}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
            assert!(safetensors_refuses(bad), "safetensors accepts {bad}");
        }
    }

    #[test]
    fn accepts_what_safetensors_accepts() {
        let e = r#""dtype":"F32","shape":[1],"data_offsets":[0,4]"#;
        for (good, names) in [
            // A tensor repeated verbatim, and one whose last entry is the valid one.
            (format!(r#"{{"a":{{{e}}},"a":{{{e}}}}}"#), 1),
            (
                format!(r#"{{"a":{{"dtype":"F32","shape":[1],"data_offsets":[4,8]}},"a":{{{e}}}}}"#),
                1,
            ),
            // Null metadata, a repeated metadata key, ignored fields, an array entry.
            (format!(r#"{{"__metadata__":null,"a":{{{e}}}}}"#), 1),
            (format!(r#"{{"__metadata__":{{"x":"y","x":"z"}},"a":{{{e}}}}}"#), 1),
            (
                format!(r#"{{"a":{{{e},"x":{{"k":[1,2.5,null],"k":18446744073709551616}}}}}}"#),
                1,
            ),
            (r#"{"a":["F32",[1],[0,4]]}"#.to_string(), 1),
            ("  {}  ".to_string(), 0),
        ] {
            let h = parse(&good).unwrap_or_else(|e| panic!("{good}: {e}"));
            assert_eq!(h.entries().len(), names, "{good}");
            assert!(!safetensors_refuses(&good), "safetensors refuses {good}");
        }
        let last = parse(&format!(
            r#"{{"a":{{"dtype":"F32","shape":[1],"data_offsets":[4,8]}},"a":{{{e}}}}}"#
        ))
        .unwrap();
        assert_eq!(
            last.get("a").map(|e| (e.start, e.end)),
            Some((0, 4)),
            "the last entry counts"
        );
        assert!(
            Header::parse(b"{\"__metadata__\":{\"x\":\"\xff\"}}").is_err(),
            "not UTF-8"
        );
    }

    /// What the `safetensors` crate says of the same header.
    fn safetensors_refuses(header: &str) -> bool {
        let mut buf = (header.len() as u64).to_le_bytes().to_vec();
        buf.extend_from_slice(header.as_bytes());
        let data_len = parse(header).map(|h| h.data_len()).unwrap_or(0);
        buf.resize(buf.len() + data_len, 0);
        safetensors::SafeTensors::read_metadata(&buf).is_err()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// On headers safetensors writes, both parsers agree entry by entry.
        #[test]
        fn agrees_with_safetensors(shapes in proptest::collection::vec(proptest::collection::vec(0usize..5, 0..3), 1..8)) {
            let data: Vec<(String, Vec<usize>, Vec<u8>)> = shapes
                .iter()
                .enumerate()
                .map(|(i, s)| (format!("t{}", (i * 7) % 11), s.clone(), vec![1u8; 2 * s.iter().product::<usize>()]))
                .collect();
            let mut seen = std::collections::BTreeSet::new();
            let data: Vec<_> = data.into_iter().filter(|(n, ..)| seen.insert(n.clone())).collect();
            let views: Vec<_> = data
                .iter()
                .map(|(n, s, b)| (n.clone(), safetensors::tensor::TensorView::new(Dtype::BF16, s.clone(), b).unwrap()))
                .collect();
            let bytes = safetensors::serialize(views, None).unwrap();
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let ours = Header::parse(&bytes[8..8 + n]).unwrap();
            let (_, theirs) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
            proptest::prop_assert_eq!(ours.entries().len(), theirs.tensors().len());
            proptest::prop_assert_eq!(ours.data_len(), theirs.data_len());
            for e in ours.entries() {
                let t = theirs.info(&e.name).unwrap();
                proptest::prop_assert_eq!((e.dtype, &e.shape, (e.start, e.end)), (t.dtype, &t.shape, t.data_offsets));
            }
        }
    }
}
