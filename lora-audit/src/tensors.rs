//! Reading safetensors files: read whole (never mapped, so a file changed
//! underneath is an error, not a SIGBUS), validated before use, F32 and
//! F16 converted to BF16 on the host with rayon across tensors.
//!
//! Truncated or corrupt files are errors, never panics: the header and every
//! offset are checked by `safetensors` before any data is touched, and every
//! size computed here is checked.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;

use half::{bf16, f16};
use rayon::prelude::*;
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};

use crate::error::AuditError;

mod header;
use header::Header;

/// A tensor's element type, as far as adapters use them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorDtype {
    /// IEEE float32.
    F32,
    /// IEEE float16.
    F16,
    /// bfloat16.
    BF16,
    /// int64 (probe row ids).
    I64,
    /// int32 (probe row ids).
    I32,
    /// Anything else (named as safetensors names it).
    Other(&'static str),
}

impl TensorDtype {
    /// Bytes per element of a float weight dtype (1 for the others, whose
    /// values no float path reads).
    pub fn element_bytes(self) -> usize {
        element_bytes(self)
    }

    /// The dtype a safetensors header (`"BF16"`) or PyTorch (`"torch.bfloat16"`,
    /// `"bfloat16"`) names; `None` for a name neither uses.
    pub fn from_name(name: &str) -> Option<TensorDtype> {
        let bare = name.strip_prefix("torch.").unwrap_or(name);
        Some(match bare {
            "F32" | "float32" | "float" => TensorDtype::F32,
            "F16" | "float16" | "half" => TensorDtype::F16,
            "BF16" | "bfloat16" => TensorDtype::BF16,
            "I64" | "int64" | "long" => TensorDtype::I64,
            "I32" | "int32" | "int" => TensorDtype::I32,
            "F64" | "float64" | "double" => TensorDtype::Other("F64"),
            "I8" | "int8" => TensorDtype::Other("I8"),
            "U8" | "uint8" => TensorDtype::Other("U8"),
            "I16" | "int16" | "short" => TensorDtype::Other("I16"),
            "U16" | "uint16" => TensorDtype::Other("U16"),
            "U32" | "uint32" => TensorDtype::Other("U32"),
            "U64" | "uint64" => TensorDtype::Other("U64"),
            "BOOL" | "bool" => TensorDtype::Other("BOOL"),
            "F8_E4M3" | "float8_e4m3fn" => TensorDtype::Other("F8_E4M3"),
            "F8_E5M2" | "float8_e5m2" => TensorDtype::Other("F8_E5M2"),
            _ => return None,
        })
    }

    fn of(dtype: Dtype) -> TensorDtype {
        match dtype {
            Dtype::F32 => TensorDtype::F32,
            Dtype::F16 => TensorDtype::F16,
            Dtype::BF16 => TensorDtype::BF16,
            Dtype::I64 => TensorDtype::I64,
            Dtype::I32 => TensorDtype::I32,
            Dtype::F64 => TensorDtype::Other("F64"),
            Dtype::I8 => TensorDtype::Other("I8"),
            Dtype::U8 => TensorDtype::Other("U8"),
            Dtype::I16 => TensorDtype::Other("I16"),
            Dtype::U16 => TensorDtype::Other("U16"),
            Dtype::U32 => TensorDtype::Other("U32"),
            Dtype::U64 => TensorDtype::Other("U64"),
            Dtype::BOOL => TensorDtype::Other("BOOL"),
            _ => TensorDtype::Other("an unsupported dtype"),
        }
    }

    /// Whether adapter weights may have this type (F32, F16, BF16).
    pub fn is_float_weight(self) -> bool {
        matches!(self, TensorDtype::F32 | TensorDtype::F16 | TensorDtype::BF16)
    }
}

impl std::fmt::Display for TensorDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorDtype::F32 => f.write_str("F32"),
            TensorDtype::F16 => f.write_str("F16"),
            TensorDtype::BF16 => f.write_str("BF16"),
            TensorDtype::I64 => f.write_str("I64"),
            TensorDtype::I32 => f.write_str("I32"),
            TensorDtype::Other(name) => f.write_str(name),
        }
    }
}

/// A tensor's name, type and shape, from the header alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The name.
    pub name: String,
    /// The element type.
    pub dtype: TensorDtype,
    /// The shape.
    pub shape: Vec<usize>,
}

/// A host tensor converted to BF16.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// The shape.
    pub shape: Vec<usize>,
    /// Row-major BF16 elements.
    pub data: Vec<bf16>,
}

/// An adapter's tensors by name, as BF16.
pub type AdapterTensors = BTreeMap<String, HostTensor>;

/// A validated safetensors file read whole into memory. The header is
/// parsed once, at open; tensor lookups read the kept header. The file is
/// read, never memory-mapped: a file that someone truncates or rewrites
/// while it is open gives a short or inconsistent buffer, which validation
/// refuses, never a SIGBUS.
pub struct LoadedSafetensors {
    path: String,
    bytes: Vec<u8>,
    /// Bytes before the data section (the length prefix and the header).
    data_start: usize,
    header: Metadata,
}

impl LoadedSafetensors {
    /// Read `path` and validate its header against its length.
    pub fn open(path: &Path) -> Result<LoadedSafetensors, AuditError> {
        let bytes = std::fs::read(path).map_err(|e| AuditError::io(path, e))?;
        let path = path.display().to_string();
        let (header_len, header) = SafeTensors::read_metadata(&bytes).map_err(|e| AuditError::Safetensors {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        Ok(LoadedSafetensors {
            path,
            bytes,
            data_start: 8 + header_len,
            header,
        })
    }

    /// One tensor: its type, shape and raw little-endian bytes (a view into
    /// the read file; the offsets were validated at open).
    pub fn tensor(&self, name: &str) -> Result<(TensorDtype, &[usize], &[u8]), AuditError> {
        tensor_of(&self.header, self.bytes(), self.data_start, &self.path, name)
    }

    fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The parsed view (header validated against the whole buffer).
    pub fn view(&self) -> Result<SafeTensors<'_>, AuditError> {
        SafeTensors::deserialize(self.bytes()).map_err(|e| AuditError::Safetensors {
            path: self.path.clone(),
            reason: e.to_string(),
        })
    }

    /// The `__metadata__` strings of the header.
    pub fn metadata(&self) -> Result<BTreeMap<String, String>, AuditError> {
        let (_, meta) = SafeTensors::read_metadata(self.bytes()).map_err(|e| AuditError::Safetensors {
            path: self.path.clone(),
            reason: e.to_string(),
        })?;
        Ok(meta.metadata().clone().unwrap_or_default().into_iter().collect())
    }

    /// Every tensor's name, type and shape, sorted by name.
    pub fn infos(&self) -> Result<Vec<TensorInfo>, AuditError> {
        Ok(infos_of(&self.header))
    }

    /// The file name, for messages.
    pub fn path(&self) -> &str {
        &self.path
    }
}

/// A safetensors file of which only the header is read: tensor bytes are
/// then read on demand with positioned reads straight into their final
/// place (for the hot swap path: no intermediate copy, no page faults on a
/// memory map, no unmapping). The header is validated like a mapped file's:
/// offsets contiguous, sizes matching shapes and dtypes, the data section
/// exactly filling the file.
pub struct SafetensorsFile {
    path: String,
    file: File,
    data_start: u64,
    header: Header,
}

/// The largest header accepted (safetensors' own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("data_start", &self.data_start)
            .finish_non_exhaustive()
    }
}

/// A safetensors file whose header bytes are read but not yet parsed: its
/// data section can be read (as raw bytes) while another thread parses and
/// audits the header. Nothing read through it is trusted before
/// [`UnparsedSafetensors::parse`] has validated the header against the file.
pub struct UnparsedSafetensors {
    path: String,
    file: File,
    text: Vec<u8>,
    data_start: u64,
    file_len: u64,
}

impl std::fmt::Debug for UnparsedSafetensors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnparsedSafetensors")
            .field("path", &self.path)
            .field("data_start", &self.data_start)
            .field("file_len", &self.file_len)
            .finish_non_exhaustive()
    }
}

impl UnparsedSafetensors {
    /// The path it was opened from, as shown in errors.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Open `path` and read its header bytes (length checked against the file).
    pub fn open(path: &Path) -> Result<UnparsedSafetensors, AuditError> {
        use std::os::unix::fs::FileExt;
        let shown = path.display().to_string();
        let corrupt = |reason: String| AuditError::Safetensors {
            path: shown.clone(),
            reason,
        };
        let file = File::open(path).map_err(|e| AuditError::io(path, e))?;
        let file_len = file.metadata().map_err(|e| AuditError::io(path, e))?.len();
        let mut prefix = [0u8; 8];
        file.read_exact_at(&mut prefix, 0)
            .map_err(|_| corrupt("shorter than its 8-byte header length".into()))?;
        let n = u64::from_le_bytes(prefix);
        if n > MAX_HEADER_BYTES || n.saturating_add(8) > file_len {
            return Err(corrupt(format!(
                "header length {n} does not fit a file of {file_len} bytes"
            )));
        }
        let mut text = vec![0u8; n as usize];
        file.read_exact_at(&mut text, 8).map_err(|e| AuditError::io(path, e))?;
        Ok(UnparsedSafetensors {
            path: shown,
            file,
            text,
            data_start: 8 + n,
            file_len,
        })
    }

    /// Bytes after the header: the data section, if the header agrees.
    pub fn data_len(&self) -> u64 {
        self.file_len - self.data_start
    }

    /// Fill `buf` with the data section's bytes at `offset` (from the
    /// section's start).
    pub fn read_data_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let at = self
            .data_start
            .checked_add(offset)
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "offset past the end of a file"))?;
        self.file.read_exact_at(buf, at)
    }

    /// Parse and validate the header: offsets contiguous, sizes matching
    /// shapes and dtypes, the data section exactly filling the file.
    pub fn parse(&self) -> Result<SafetensorsFile, AuditError> {
        let corrupt = |reason: String| AuditError::Safetensors {
            path: self.path.clone(),
            reason,
        };
        let header = Header::parse(&self.text).map_err(corrupt)?;
        if self.data_start.checked_add(header.data_len() as u64) != Some(self.file_len) {
            return Err(corrupt(format!(
                "the header describes {} data bytes, the file holds {}",
                header.data_len(),
                self.data_len()
            )));
        }
        Ok(SafetensorsFile {
            path: self.path.clone(),
            file: self
                .file
                .try_clone()
                .map_err(|e| AuditError::io(Path::new(&self.path), e))?,
            data_start: self.data_start,
            header,
        })
    }
}

impl SafetensorsFile {
    /// Open `path` and read and validate its header.
    pub fn open(path: &Path) -> Result<SafetensorsFile, AuditError> {
        UnparsedSafetensors::open(path)?.parse()
    }

    /// Absolute byte offset of the data section.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// One tensor: its type, shape, and where its bytes lie in the file
    /// (absolute byte offset and length).
    pub fn tensor(&self, name: &str) -> Result<(TensorDtype, &[usize], u64, usize), AuditError> {
        let info = self.header.get(name).ok_or_else(|| AuditError::Tensor {
            name: name.to_string(),
            reason: format!("not in {}", self.path),
        })?;
        Ok((
            TensorDtype::of(info.dtype),
            &info.shape,
            self.data_start + info.start as u64,
            info.end - info.start,
        ))
    }

    /// Fill `buf` with the file's bytes at `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.read_exact_at(buf, offset)
    }

    /// Every tensor's name, type and shape, sorted by name.
    pub fn infos(&self) -> Vec<TensorInfo> {
        self.header
            .entries()
            .iter()
            .map(|e| TensorInfo {
                name: e.name.clone(),
                dtype: TensorDtype::of(e.dtype),
                shape: e.shape.clone(),
            })
            .collect()
    }

    /// The file name, for messages.
    pub fn path(&self) -> &str {
        &self.path
    }
}

fn tensor_of<'b>(
    header: &'b Metadata,
    bytes: &'b [u8],
    data_start: usize,
    path: &str,
    name: &str,
) -> Result<(TensorDtype, &'b [usize], &'b [u8]), AuditError> {
    let info = header.info(name).ok_or_else(|| AuditError::Tensor {
        name: name.to_string(),
        reason: format!("not in {path}"),
    })?;
    let (start, end) = info.data_offsets;
    let data = bytes
        .get(data_start + start..data_start + end)
        .ok_or_else(|| AuditError::Safetensors {
            path: path.to_string(),
            reason: format!("tensor `{name}` lies outside the file"),
        })?;
    Ok((TensorDtype::of(info.dtype), &info.shape, data))
}

fn infos_of(header: &Metadata) -> Vec<TensorInfo> {
    let mut infos: Vec<TensorInfo> = header
        .tensors()
        .into_iter()
        .map(|(name, t)| TensorInfo {
            name,
            dtype: TensorDtype::of(t.dtype),
            shape: t.shape.clone(),
        })
        .collect();
    infos.sort_by(|a, b| a.name.cmp(&b.name));
    infos
}

/// Read an adapter's weights (`adapter_model.safetensors`, or the file named)
/// into BF16 host tensors: F32 and F16 are rounded to nearest even, BF16 is
/// copied (values are not judged; see [`first_non_finite`]). A `.bin` path
/// is refused (a pickle is never unpickled); any other element type is an
/// error naming the tensor.
pub fn load_adapter_safetensors(path: &Path) -> Result<AdapterTensors, AuditError> {
    let path = if path.is_dir() {
        path.join("adapter_model.safetensors")
    } else {
        path.to_path_buf()
    };
    if path.extension().is_some_and(|e| e == "bin") {
        return Err(AuditError::Tensor {
            name: path.display().to_string(),
            reason: "a pickle (.bin) adapter is never loaded; save it with safe_serialization=True".into(),
        });
    }
    let mapped = LoadedSafetensors::open(&path)?;
    load_bf16(&mapped, |_| true)
}

/// Convert the tensors of `mapped` selected by `keep` to BF16, in parallel.
/// Values are converted, not judged: a caller that serves them checks them
/// with [`first_non_finite`] ([`prepare_adapter`](crate::prepare_adapter)
/// does).
pub fn load_bf16(mapped: &LoadedSafetensors, keep: impl Fn(&str) -> bool + Sync) -> Result<AdapterTensors, AuditError> {
    let view = mapped.view()?;
    let tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> =
        view.tensors().into_iter().filter(|(n, _)| keep(n)).collect();
    tensors
        .into_par_iter()
        .map(|(name, t)| {
            let data = to_bf16(&name, TensorDtype::of(t.dtype()), t.data())?;
            Ok((
                name,
                HostTensor {
                    shape: t.shape().to_vec(),
                    data,
                },
            ))
        })
        .collect()
}

/// Read one float tensor (F32, F16 or BF16) as F32, exactly.
pub fn load_f32(mapped: &LoadedSafetensors, name: &str) -> Result<(Vec<usize>, Vec<f32>), AuditError> {
    // The kept header: no re-parse per tensor.
    let (dtype, shape, bytes) = mapped.tensor(name)?;
    let data = match dtype {
        TensorDtype::F32 | TensorDtype::F16 | TensorDtype::BF16 => (0..bytes.len() / element_bytes(dtype))
            .filter_map(|i| stored_f32(dtype, bytes, i))
            .collect(),
        other => {
            return Err(AuditError::Tensor {
                name: name.to_string(),
                reason: format!("expected a float tensor, got {other}"),
            });
        }
    };
    Ok((shape.to_vec(), data))
}

/// Read an integer tensor (I64 or I32) as `i64`.
pub fn load_i64(mapped: &LoadedSafetensors, name: &str) -> Result<(Vec<usize>, Vec<i64>), AuditError> {
    let (dtype, shape, bytes) = mapped.tensor(name)?;
    let data = match dtype {
        TensorDtype::I64 => bytes
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
            .collect(),
        TensorDtype::I32 => bytes
            .chunks_exact(4)
            .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
        other => {
            return Err(AuditError::Tensor {
                name: name.to_string(),
                reason: format!("expected an I64 or I32 tensor, got {other}"),
            });
        }
    };
    Ok((shape.to_vec(), data))
}

/// Bytes per element of a float weight dtype (1 for the others, which no
/// float path reads).
fn element_bytes(dtype: TensorDtype) -> usize {
    match dtype {
        TensorDtype::F32 => 4,
        TensorDtype::F16 | TensorDtype::BF16 => 2,
        _ => 1,
    }
}

/// Element `index` of raw little-endian float bytes, exactly as stored
/// (widened to `f32`); `None` past the end or for a non-float dtype.
fn stored_f32(dtype: TensorDtype, bytes: &[u8], index: usize) -> Option<f32> {
    let at = index.checked_mul(element_bytes(dtype))?;
    match dtype {
        TensorDtype::F32 => {
            let b = bytes.get(at..at.checked_add(4)?)?;
            Some(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        }
        TensorDtype::F16 | TensorDtype::BF16 => {
            let b = bytes.get(at..at.checked_add(2)?)?;
            let bits = u16::from_le_bytes([b[0], b[1]]);
            Some(if dtype == TensorDtype::F16 {
                f16::from_bits(bits).to_f32()
            } else {
                bf16::from_bits(bits).to_f32()
            })
        }
        _ => None,
    }
}

/// The one conversion to the served type: F32 and F16 round to nearest
/// even (a finite F32 above the BF16 range becomes an infinity), BF16 is
/// copied. Shared by the loaders and the value checks so that both see the
/// same served values.
fn served_bf16(dtype: TensorDtype, chunk: &[u8]) -> bf16 {
    match (dtype, chunk) {
        (TensorDtype::F32, &[a, b, c, d]) => bf16::from_f32(f32::from_le_bytes([a, b, c, d])),
        (TensorDtype::F16, &[a, b]) => bf16::from_f32(f16::from_bits(u16::from_le_bytes([a, b])).to_f32()),
        (_, &[a, b]) => bf16::from_bits(u16::from_le_bytes([a, b])),
        // Unreachable: callers pass whole elements of a float dtype.
        _ => bf16::NAN,
    }
}

/// The index of the first value that is not finite (NaN, +inf, -inf), or
/// `None` when every value is finite. For BF16 data already converted to
/// the served type ([`HostTensor::data`], a pool's host staging buffer).
pub fn first_non_finite(values: &[bf16]) -> Option<usize> {
    // By the bits, whole words at a time (see `first_non_finite_raw`).
    first_non_finite_raw(TensorDtype::BF16, bytemuck::cast_slice(values)).map(|(index, _)| index)
}

/// The first element of raw little-endian F32 / F16 / BF16 tensor bytes
/// (as safetensors stores them) that is not finite AS SERVED, i.e. after the
/// same BF16 conversion the loaders apply (a finite F32 above about
/// 3.39e38 rounds to an infinity): its index and its stored value, exactly
/// as `f32`, for [`Refusal::non_finite`](crate::Refusal::non_finite).
/// `None` when every element is finite, and for other dtypes (which are
/// refused as `REJECT[dtype]` before their values matter).
pub fn first_non_finite_raw(dtype: TensorDtype, bytes: &[u8]) -> Option<(usize, f32)> {
    if !dtype.is_float_weight() {
        return None;
    }
    let size = element_bytes(dtype);
    // Chunks in parallel for large tensors; the first hit in order wins.
    const CHUNK: usize = 1 << 20;
    let index = bytes
        .par_chunks(CHUNK * size)
        .enumerate()
        .find_map_first(|(c, chunk)| non_finite_position(dtype, chunk).map(|i| c * CHUNK + i))?;
    Some((index, stored_f32(dtype, bytes, index).unwrap_or(f32::NAN)))
}

/// The first element of `bytes` not finite as served, by its bits alone
/// (no conversion): BF16 and F16 with an all-ones exponent; F32 whose
/// magnitude is an infinity, a NaN or at least `0x7F7F_8000`, the smallest
/// that rounds (to nearest even) to a BF16 infinity. Blocks of 64 elements
/// are tested branch-free first, so the scan runs at memory speed.
fn non_finite_position(dtype: TensorDtype, bytes: &[u8]) -> Option<usize> {
    fn scan<const N: usize>(bytes: &[u8], bad: impl Fn([u8; N]) -> bool) -> Option<usize> {
        const BLOCK: usize = 64;
        bytes.chunks(BLOCK * N).enumerate().find_map(|(b, block)| {
            let elems = block.chunks_exact(N).map(|e| {
                let mut a = [0u8; N];
                a.copy_from_slice(e);
                a
            });
            if !elems.clone().fold(false, |any, e| any | bad(e)) {
                return None;
            }
            elems.clone().position(&bad).map(|i| b * BLOCK + i)
        })
    }
    /// The aligned fast path: whole words, blocks folded branch-free.
    fn scan_words<W: bytemuck::Pod + Copy>(words: &[W], bad: impl Fn(W) -> bool) -> Option<usize> {
        const BLOCK: usize = 256;
        words.chunks(BLOCK).enumerate().find_map(|(b, block)| {
            if !block.iter().fold(false, |any, &w| any | bad(w)) {
                return None;
            }
            block.iter().position(|&w| bad(w)).map(|i| b * BLOCK + i)
        })
    }
    let bf16_bad = |b: u16| u16::from_le(b) & 0x7FFF >= 0x7F80;
    let f16_bad = |b: u16| u16::from_le(b) & 0x7C00 == 0x7C00;
    let f32_bad = |b: u32| u32::from_le(b) & 0x7FFF_FFFF >= 0x7F7F_8000;
    match dtype {
        TensorDtype::BF16 => match bytemuck::try_cast_slice::<u8, u16>(bytes) {
            Ok(words) => scan_words(words, bf16_bad),
            Err(_) => scan::<2>(bytes, |e| bf16_bad(u16::from_ne_bytes(e))),
        },
        TensorDtype::F16 => match bytemuck::try_cast_slice::<u8, u16>(bytes) {
            Ok(words) => scan_words(words, f16_bad),
            Err(_) => scan::<2>(bytes, |e| f16_bad(u16::from_ne_bytes(e))),
        },
        TensorDtype::F32 => match bytemuck::try_cast_slice::<u8, u32>(bytes) {
            Ok(words) => scan_words(words, f32_bad),
            Err(_) => scan::<4>(bytes, |e| f32_bad(u32::from_ne_bytes(e))),
        },
        _ => None,
    }
}

/// The stored value of element `index` of tensor `name` in `mapped`, for a
/// refusal message.
pub(crate) fn stored_value(mapped: &LoadedSafetensors, name: &str, index: usize) -> Result<f32, AuditError> {
    let (dtype, _, bytes) = mapped.tensor(name)?;
    stored_f32(dtype, bytes, index).ok_or_else(|| AuditError::Tensor {
        name: name.to_string(),
        reason: format!("no float element {index}"),
    })
}

/// Convert raw little-endian bytes of a float tensor to BF16.
fn to_bf16(name: &str, dtype: TensorDtype, bytes: &[u8]) -> Result<Vec<bf16>, AuditError> {
    if !dtype.is_float_weight() {
        return Err(AuditError::Tensor {
            name: name.to_string(),
            reason: format!("dtype {dtype}; adapter weights must be F32, F16 or BF16"),
        });
    }
    Ok(bytes
        .chunks_exact(element_bytes(dtype))
        .map(|e| served_bf16(dtype, e))
        .collect())
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod non_finite_bits {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The bit test agrees with converting to BF16 and asking, for every
        /// F32, F16 and BF16 bit pattern tried.
        #[test]
        fn the_bit_test_is_the_conversion(bits in any::<u32>()) {
            let f32_bytes = bits.to_le_bytes();
            prop_assert_eq!(
                non_finite_position(TensorDtype::F32, &f32_bytes).is_some(),
                !served_bf16(TensorDtype::F32, &f32_bytes).is_finite()
            );
            let half = (bits as u16).to_le_bytes();
            for dtype in [TensorDtype::F16, TensorDtype::BF16] {
                prop_assert_eq!(
                    non_finite_position(dtype, &half).is_some(),
                    !served_bf16(dtype, &half).is_finite()
                );
            }
        }
    }

    #[test]
    fn the_rounding_edge_of_f32() {
        for (bits, bad) in [
            (0x7F7F_7FFFu32, false),
            (0x7F7F_8000, true),
            (0xFF7F_8000, true),
            (0x7F80_0001, true),
        ] {
            assert_eq!(
                non_finite_position(TensorDtype::F32, &bits.to_le_bytes()).is_some(),
                bad,
                "{bits:#x}"
            );
            assert_eq!(
                !served_bf16(TensorDtype::F32, &bits.to_le_bytes()).is_finite(),
                bad,
                "{bits:#x}"
            );
        }
        // Position past the first block, on the aligned and the unaligned path.
        let mut v = vec![0u8; 2 * 600 + 1];
        v[2 * 450..2 * 451].copy_from_slice(&0x7FC0u16.to_le_bytes());
        assert_eq!(non_finite_position(TensorDtype::BF16, &v[..1200]), Some(450));
        let mut w = vec![0u8; 1];
        w.extend_from_slice(&v[..1200]);
        assert_eq!(non_finite_position(TensorDtype::BF16, &w[1..]), Some(450));
    }
}
