//! The `#[repr(C)]` table entries kernels read from device memory. Each
//! mirrors a struct in `cuda/common.cuh` or `cuda/overlay.cu`; the layout
//! tests below hold the sizes and offsets equal.

use bytemuck::{Pod, Zeroable};

/// One (adapter, module) LoRA pair as the kernels see it.
///
/// `a` is the device address of A stored `[stride, in]` row-major BF16
/// (rows `rank..stride` zero), `b` the address of B stored `[out, stride]`
/// row-major BF16 (columns `rank..stride` zero), `scale` the pair's scaling
/// and `rank` its true rank; `rank == 0` means no pair (the row or segment is
/// skipped). The stride is the pool's `max_rank` (dense pool) or the expert
/// stride (expert pool) and is passed to every apply call. Kernels read only
/// the first `rank` rows of A and columns of B.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Pod, Zeroable)]
pub struct PairEntry {
    /// Device address of A.
    pub a: u64,
    /// Device address of B.
    pub b: u64,
    /// The pair's scaling (alpha / r, or alpha / sqrt(r) under rsLoRA).
    pub scale: f32,
    /// The pair's true rank; 0 = no pair.
    pub rank: u32,
}

/// One slot's embedding overlay, read by the embedding lookup kernel.
///
/// `slot_map` is the address of an `i32[vocab]` array (the overlay row of a
/// vocab id, or -1), `rows` the address of the compacted override rows
/// `[n_rows, h]` BF16 in ascending id order. `slot_map == 0` means the slot
/// has no embedding overlay.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Pod, Zeroable)]
pub struct EmbedOverlayEntry {
    /// Address of `slot_map` (`i32[vocab]`), or 0.
    pub slot_map: u64,
    /// Address of the override rows (`[n_rows, h]` BF16).
    pub rows: u64,
    /// Number of override rows.
    pub n_rows: u32,
    /// Zero (keeps the struct free of implicit padding).
    pub pad: u32,
}

/// One slot's lm_head overlay, read by the lm_head overlay kernel.
///
/// `ids` is the address of `u32[count]` vocab ids and `rows` the address of
/// `[count, h]` BF16 rows; the kernel writes `dot(hidden, rows[k])` to
/// `logits[ids[k]]`. `count == 0` means the slot's head is not overlaid. A
/// tied head points `rows` at the embedding overlay's rows.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Pod, Zeroable)]
pub struct LmHeadOverlayEntry {
    /// Address of the vocab ids (`u32[count]`).
    pub ids: u64,
    /// Address of the rows (`[count, h]` BF16).
    pub rows: u64,
    /// Number of overridden ids.
    pub count: u32,
    /// Zero (keeps the struct free of implicit padding).
    pub pad: u32,
}

// SAFETY: each type is `#[repr(C)]`, made only of integers and floats with no
// padding (checked by the layout tests), and matches its CUDA struct, so the
// device may read and copy it byte for byte; all-zero bytes are a valid value.
unsafe impl cudarc::driver::DeviceRepr for PairEntry {}
// SAFETY: see above.
unsafe impl cudarc::driver::ValidAsZeroBits for PairEntry {}
// SAFETY: see above.
unsafe impl cudarc::driver::DeviceRepr for EmbedOverlayEntry {}
// SAFETY: see above.
unsafe impl cudarc::driver::ValidAsZeroBits for EmbedOverlayEntry {}
// SAFETY: see above.
unsafe impl cudarc::driver::DeviceRepr for LmHeadOverlayEntry {}
// SAFETY: see above.
unsafe impl cudarc::driver::ValidAsZeroBits for LmHeadOverlayEntry {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_the_cuda_structs() {
        assert_eq!(size_of::<PairEntry>(), 24);
        assert_eq!(offset_of!(PairEntry, b), 8);
        assert_eq!(offset_of!(PairEntry, scale), 16);
        assert_eq!(offset_of!(PairEntry, rank), 20);
        assert_eq!(size_of::<EmbedOverlayEntry>(), 24);
        assert_eq!(offset_of!(EmbedOverlayEntry, n_rows), 16);
        assert_eq!(size_of::<LmHeadOverlayEntry>(), 24);
        assert_eq!(offset_of!(LmHeadOverlayEntry, count), 16);
    }
}
