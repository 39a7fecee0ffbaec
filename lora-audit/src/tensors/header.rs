//! A safetensors header parsed straight into a name-sorted table.
//!
//! The hot swap path reads a header of several hundred tensors on every
//! swap. Parsing it through the `safetensors` crate buffers every entry as a
//! generic JSON value first (its metadata key is flattened), then hashes
//! names twice; this parser visits the JSON map once into typed entries and
//! validates them as `safetensors` does: offsets contiguous from zero in
//! offset order, each tensor's byte length equal to its shape times its
//! dtype's size (checked arithmetic), and no name twice. `__metadata__` is
//! skipped, not read: a malformed metadata map is accepted here.

use std::fmt;

use safetensors::Dtype;
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};

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

#[derive(serde::Deserialize)]
struct RawEntry {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

struct EntriesVisitor;

impl<'de> Visitor<'de> for EntriesVisitor {
    type Value = Vec<HeaderEntry>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map of tensor names to {dtype, shape, data_offsets}")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
        let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some(name) = map.next_key::<String>()? {
            if name == "__metadata__" {
                // Free-form strings; the swap path has no use for them.
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            let raw: RawEntry = map.next_value()?;
            entries.push(HeaderEntry {
                name,
                dtype: raw.dtype,
                shape: raw.shape,
                start: raw.data_offsets.0,
                end: raw.data_offsets.1,
            });
        }
        Ok(entries)
    }
}

impl Header {
    /// Parse and validate the JSON header `text`.
    pub(crate) fn parse(text: &[u8]) -> Result<Header, String> {
        let mut de = serde_json::Deserializer::from_slice(text);
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
        entries.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        if let Some(w) = entries.windows(2).find(|w| w[0].name == w[1].name) {
            return Err(format!("tensor `{}` is named twice", w[0].name));
        }
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
            // The same name twice.
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
            assert!(safetensors_refuses(bad), "safetensors accepts {bad}");
        }
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
