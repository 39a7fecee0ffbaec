//! Slot repack: write a pool slot's regions on the device from the raw bytes
//! of an adapter file already copied there.
//!
//! A swap can then move the file's data section to the device as it is, in
//! large copies that need no knowledge of where each tensor goes, while the
//! host still audits the header; once the audit has placed every tensor, one
//! launch writes the slot image (rank padding and unadapted places as zeros,
//! F16 / F32 rounded to BF16 like the host packer). Every region is checked
//! against both buffers on the host before anything is launched.

use bytemuck::{Pod, Zeroable};
use half::{bf16, f16};

use crate::buffer::{DeviceBuffer, check_range};
use crate::cuda_rt::{Family, Kernel, Launch};
use crate::device::{Backend, Device, Lane};
use crate::error::{KernelError, invalid};
use crate::ops::to_u32;

/// Element type of a region's source bytes (little-endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum RepackDtype {
    /// bfloat16, copied as is.
    Bf16 = 0,
    /// IEEE half, converted exactly to f32 then rounded to BF16.
    F16 = 1,
    /// IEEE single, rounded to BF16 (nearest even).
    F32 = 2,
}

impl RepackDtype {
    /// Bytes per source element.
    pub fn size(self) -> usize {
        match self {
            RepackDtype::Bf16 | RepackDtype::F16 => 2,
            RepackDtype::F32 => 4,
        }
    }
}

/// One destination block `[dst_rows, dst_cols]` of BF16 at element
/// `dst_elem`, whose top-left `[rows, src_cols]` comes from the row-major
/// source at byte `src_byte`; every other element is zero. `rows == 0`
/// writes zeros only.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct RepackRegion {
    /// First source byte (any alignment).
    pub src_byte: u64,
    /// First destination element.
    pub dst_elem: u64,
    /// Source rows.
    pub rows: u32,
    /// Source elements per row.
    pub src_cols: u32,
    /// Destination rows (`>= rows`).
    pub dst_rows: u32,
    /// Destination elements per row (`>= src_cols`).
    pub dst_cols: u32,
    /// A [`RepackDtype`] as `u32`.
    pub dtype: u32,
    /// Zero.
    pub pad: u32,
}

// SAFETY: `#[repr(C)]`, integers only, no padding (40 bytes, checked by the
// layout test), mirrored by `RepackRegion` in cuda/repack.cu; all-zero bytes
// are a valid value.
unsafe impl cudarc::driver::DeviceRepr for RepackRegion {}
// SAFETY: see above.
unsafe impl cudarc::driver::ValidAsZeroBits for RepackRegion {}

impl RepackRegion {
    fn dtype(&self) -> Result<RepackDtype, KernelError> {
        match self.dtype {
            0 => Ok(RepackDtype::Bf16),
            1 => Ok(RepackDtype::F16),
            2 => Ok(RepackDtype::F32),
            other => Err(invalid(
                "regions",
                format!("dtype {other} is not 0 (BF16), 1 (F16) or 2 (F32)"),
            )),
        }
    }

    /// Check the region against a source of `src_bytes` and a destination of
    /// `dst_elems`; returns the destination elements it covers.
    fn check(&self, src_bytes: usize, dst_elems: usize) -> Result<usize, KernelError> {
        let dtype = self.dtype()?;
        if self.rows > self.dst_rows || self.src_cols > self.dst_cols {
            return Err(invalid(
                "regions",
                format!(
                    "source [{}, {}] does not fit destination [{}, {}]",
                    self.rows, self.src_cols, self.dst_rows, self.dst_cols
                ),
            ));
        }
        let overflow = || invalid("regions", "region size overflows");
        let src_len = (self.rows as usize)
            .checked_mul(self.src_cols as usize)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(overflow)?;
        let dst_len = (self.dst_rows as usize)
            .checked_mul(self.dst_cols as usize)
            .ok_or_else(overflow)?;
        let src_at = usize::try_from(self.src_byte).map_err(|_| overflow())?;
        let dst_at = usize::try_from(self.dst_elem).map_err(|_| overflow())?;
        if src_len > 0 {
            check_range("region source", src_at, src_len, src_bytes)?;
        }
        check_range("region destination", dst_at, dst_len, dst_elems)?;
        Ok(dst_len)
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct RepackParams {
    regions: u64,
    src: u64,
    dst: u64,
    /// The flag word of a [`ValueScan`], or 0 (no gate).
    gate: u64,
}

/// Blocks per region along x: enough to spread a 14336 x 16 block over the
/// SMs without leaving small regions with idle blocks for long.
const BLOCKS_PER_REGION: u32 = 8;

/// Write `regions` of `dst` from the first `src_bytes` bytes of `src` (raw
/// bytes, any type; BF16 is just its carrier here). `scratch` receives the
/// region table (at least `regions.len()` entries; its contents are
/// replaced). Every region is checked first; regions must not overlap in
/// `dst` (not checked: the caller's layout guarantees it).
pub fn repack(
    device: &Device,
    src: &DeviceBuffer<bf16>,
    src_bytes: usize,
    regions: &[RepackRegion],
    scratch: &mut DeviceBuffer<RepackRegion>,
    dst: &mut DeviceBuffer<bf16>,
) -> Result<(), KernelError> {
    repack_gated(device, Lane::Compute, src, src_bytes, regions, scratch, None, dst)
}

/// [`repack`], unless `scan` (queued before it on `hits`, over regions of
/// the same source blocks) found a value that is not finite: then `dst` is
/// left as it was. Nothing waits for the scan: the device skips the writes
/// itself, so the scan, the repack and the copies before them stay queued
/// back to back; [`ValueScan::read`] afterwards says which case it was.
/// It runs on the scan's lane.
#[allow(clippy::too_many_arguments)]
pub fn repack_if_finite(
    device: &Device,
    scan: &ValueScan,
    hits: &DeviceBuffer<u64>,
    src: &DeviceBuffer<bf16>,
    src_bytes: usize,
    regions: &[RepackRegion],
    scratch: &mut DeviceBuffer<RepackRegion>,
    dst: &mut DeviceBuffer<bf16>,
) -> Result<(), KernelError> {
    if scan.regions != regions.len() {
        return Err(invalid(
            "regions",
            format!("{} regions; the value scan covered {}", regions.len(), scan.regions),
        ));
    }
    device.expect_same("hits", hits.device())?;
    check_range("hits", 0, scan.regions + 1, hits.len())?;
    repack_gated(
        device,
        scan.lane,
        src,
        src_bytes,
        regions,
        scratch,
        Some((hits, scan.regions)),
        dst,
    )
}

/// [`repack`] on `lane`, gated on the flag word at `gate.1` of `gate.0` when given.
#[allow(clippy::too_many_arguments)]
fn repack_gated(
    device: &Device,
    lane: Lane,
    src: &DeviceBuffer<bf16>,
    src_bytes: usize,
    regions: &[RepackRegion],
    scratch: &mut DeviceBuffer<RepackRegion>,
    gate: Option<(&DeviceBuffer<u64>, usize)>,
    dst: &mut DeviceBuffer<bf16>,
) -> Result<(), KernelError> {
    device.expect_same("src", src.device())?;
    device.expect_same("dst", dst.device())?;
    device.expect_same("scratch", scratch.device())?;
    check_range("src_bytes", 0, src_bytes, 2 * src.len())?;
    check_range("regions", 0, regions.len(), scratch.len())?;
    let mut work = 0usize;
    for r in regions {
        work = work.saturating_add(r.check(src_bytes, dst.len())?);
    }
    if regions.is_empty() || work == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(_) => {
            if let Some((hits, at)) = gate
                && hits.download_range(at, 1)?.first() != Some(&u64::MAX)
            {
                return Ok(());
            }
            let src_alloc = src.cpu_alloc().ok_or_else(|| invalid("src", "not a CPU buffer"))?;
            device.before_write("repack")?;
            let dst_len = dst.len();
            dst.cpu_modify(0, dst_len, |out| {
                src_alloc.with_bytes(|bytes| {
                    for r in regions {
                        repack_reference(r, bytes, out);
                    }
                })
            })
        }
        Backend::Cuda(c) => {
            let launch = region_launch(lane, regions, scratch)?;
            let gate = match gate {
                Some((hits, at)) => hits.addr_at(at)?,
                None => 0,
            };
            let params = RepackParams {
                regions: scratch.device_addr(),
                src: src.device_addr(),
                dst: dst.device_addr(),
                gate,
            };
            // SAFETY: params mirror the kernel's struct; every region was
            // checked to lie inside `src` (first `src_bytes` bytes) and `dst`,
            // `scratch` holds the checked table the kernel reads, and a gate
            // is the address of a word inside `hits` (checked by `addr_at`),
            // which the kernel only reads.
            // On the copy lane the caller has ordered the kernel against
            // compute-stream users of `dst`.
            unsafe { c.launch_on(lane, kernel("repack_regions"), launch, &params) }
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct ScanParams {
    regions: u64,
    src: u64,
    hits: u64,
    any: u64,
}

/// A value scan queued by [`queue_value_scan`]: its answers are in the
/// `hits` buffer it was given once the device reaches them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a queued scan is only an answer once it is read"]
pub struct ValueScan {
    regions: usize,
    lane: Lane,
}

impl ValueScan {
    /// Regions the scan covers.
    pub fn regions(&self) -> usize {
        self.regions
    }

    /// The answers: per region, the first element found not finite. Waits
    /// for the work queued before it on the device (the copies, the scan,
    /// and a [`repack_if_finite`] gated on it).
    pub fn read(&self, hits: &DeviceBuffer<u64>) -> Result<Vec<Option<u64>>, KernelError> {
        let found = hits.download_range_on(self.lane, 0, self.regions)?;
        Ok(found.into_iter().map(|e| (e != u64::MAX).then_some(e)).collect())
    }
}

/// For each of `regions`, the first element of its source block (the
/// row-major index in its `rows × src_cols` elements) that is not finite
/// once converted to BF16 as [`repack`] converts it: a NaN, an infinity, or
/// an F32 value that rounds past BF16's range. `None` where every element is
/// finite. Reads `src` only; `scratch` receives the region table and `hits`
/// (at least `regions.len() + 1` words) the device's answers. Returns once
/// the answers are on the host, so it waits for the work queued before it
/// on the device (the copies that filled `src`).
pub fn first_non_finite(
    device: &Device,
    src: &DeviceBuffer<bf16>,
    src_bytes: usize,
    regions: &[RepackRegion],
    scratch: &mut DeviceBuffer<RepackRegion>,
    hits: &mut DeviceBuffer<u64>,
) -> Result<Vec<Option<u64>>, KernelError> {
    queue_value_scan(device, Lane::Compute, src, src_bytes, regions, scratch, hits)?.read(hits)
}

/// Queue [`first_non_finite`]'s scan without waiting for it: `hits` (at
/// least `regions.len() + 1` words) receives per region the first element
/// not finite (all ones where none is), then a flag word that stays all
/// ones only if every region is finite — the gate of [`repack_if_finite`].
/// Queued on `lane`, as are the repack gated on it and the answer's read.
pub fn queue_value_scan(
    device: &Device,
    lane: Lane,
    src: &DeviceBuffer<bf16>,
    src_bytes: usize,
    regions: &[RepackRegion],
    scratch: &mut DeviceBuffer<RepackRegion>,
    hits: &mut DeviceBuffer<u64>,
) -> Result<ValueScan, KernelError> {
    device.expect_same("src", src.device())?;
    device.expect_same("scratch", scratch.device())?;
    device.expect_same("hits", hits.device())?;
    check_range("src_bytes", 0, src_bytes, 2 * src.len())?;
    check_range("regions", 0, regions.len(), scratch.len())?;
    check_range("hits", 0, regions.len() + 1, hits.len())?;
    let mut work = 0usize;
    for r in regions {
        r.dtype()?;
        // The destination is not read: only the source extent is checked.
        let source_only = RepackRegion {
            dst_elem: 0,
            dst_rows: r.rows,
            dst_cols: r.src_cols,
            ..*r
        };
        work = work.saturating_add(source_only.check(src_bytes, usize::MAX)?);
    }
    let scan = ValueScan {
        regions: regions.len(),
        lane,
    };
    match device.backend() {
        Backend::Cpu(_) => {
            let src_alloc = src.cpu_alloc().ok_or_else(|| invalid("src", "not a CPU buffer"))?;
            let mut answers: Vec<u64> = src_alloc.with_bytes(|bytes| {
                regions
                    .iter()
                    .map(|r| first_non_finite_reference(r, bytes).unwrap_or(u64::MAX))
                    .collect()
            });
            let any = if answers.iter().all(|&a| a == u64::MAX) {
                u64::MAX
            } else {
                0
            };
            answers.push(any);
            hits.write_on(lane, 0, &answers)?;
        }
        Backend::Cuda(c) => {
            hits.write_on(lane, 0, &vec![u64::MAX; regions.len() + 1])?;
            if regions.is_empty() || work == 0 {
                return Ok(scan);
            }
            let launch = region_launch(lane, regions, scratch)?;
            let params = ScanParams {
                regions: scratch.device_addr(),
                src: src.device_addr(),
                hits: hits.device_addr(),
                any: hits.addr_at(regions.len())?,
            };
            // SAFETY: params mirror the kernel's struct; every region's source
            // block was checked to lie inside the first `src_bytes` bytes of
            // `src`, `scratch` holds the checked table and `hits` has a word
            // per region plus the flag word `any` points at; the kernel writes
            // `hits` only.
            unsafe { c.launch_on(lane, kernel("first_non_finite"), launch, &params)? };
        }
    }
    Ok(scan)
}

/// The CPU reference of [`first_non_finite`] for one checked region.
fn first_non_finite_reference(r: &RepackRegion, src: &[u8]) -> Option<u64> {
    let dtype = r.dtype().ok()?;
    let size = dtype.size();
    let n = r.rows as usize * r.src_cols as usize;
    let base = r.src_byte as usize;
    (0..n)
        .find(|&i| {
            let b = &src[base + i * size..base + (i + 1) * size];
            !source_as_bf16(dtype, b).is_finite()
        })
        .map(|i| i as u64)
}

/// One source element as the repack writes it.
fn source_as_bf16(dtype: RepackDtype, b: &[u8]) -> bf16 {
    match dtype {
        RepackDtype::Bf16 => bf16::from_bits(u16::from_le_bytes([b[0], b[1]])),
        RepackDtype::F16 => bf16::from_f32(f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()),
        RepackDtype::F32 => bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
    }
}

/// A kernel of the repack family.
fn kernel(name: &'static str) -> Kernel {
    Kernel {
        family: Family::Repack,
        name,
    }
}

/// The grid of a per-region launch over `regions` (x: blocks per region,
/// y: region), with the table written to `scratch`; more regions than a
/// grid's y extent are refused before `scratch` is touched.
fn region_launch(
    lane: Lane,
    regions: &[RepackRegion],
    scratch: &mut DeviceBuffer<RepackRegion>,
) -> Result<Launch, KernelError> {
    if regions.len() > 65_535 {
        return Err(invalid("regions", format!("{} regions; at most 65535", regions.len())));
    }
    scratch.write_on(lane, 0, regions)?;
    Ok(Launch {
        grid: (BLOCKS_PER_REGION, to_u32("regions", regions.len())?, 1),
        block: 256,
        smem: 0,
    })
}

/// The CPU reference of one region (checked by the caller).
fn repack_reference(r: &RepackRegion, src: &[u8], dst: &mut [bf16]) {
    let Ok(dtype) = r.dtype() else {
        return;
    };
    let size = dtype.size();
    let (rows, src_cols, dst_cols) = (r.rows as usize, r.src_cols as usize, r.dst_cols as usize);
    let base = r.src_byte as usize;
    let out = &mut dst[r.dst_elem as usize..r.dst_elem as usize + r.dst_rows as usize * dst_cols];
    for (row, line) in out.chunks_exact_mut(dst_cols.max(1)).enumerate() {
        for (col, d) in line.iter_mut().enumerate() {
            *d = if row < rows && col < src_cols {
                let at = base + (row * src_cols + col) * size;
                source_as_bf16(dtype, &src[at..at + size])
            } else {
                bf16::ZERO
            };
        }
    }
}

#[cfg(test)]
mod tests;
