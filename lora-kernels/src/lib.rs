//! `lora-kernels`: the device layer and the LoRA kernels of the workspace.
//!
//! It gives the rest of the workspace one device API that runs on a CUDA GPU
//! and, through a real CPU reference backend, on any machine:
//!
//! - [`Device`]: the CPU backend or one CUDA device (context, stream, fault
//!   word); [`Device::best`] takes CUDA when it is usable.
//! - [`DeviceBuffer`]: typed device memory with fixed addresses (tables store
//!   them); [`PinnedHostBuffer`] for fast uploads.
//! - [`PairEntry`]: the pair-table contract with the pools (addresses of A and
//!   B, scale, rank); [`EmbedOverlayEntry`] and [`LmHeadOverlayEntry`] for overlays.
//! - [`ops`]: the kernels — row-indexed apply ([`bgmv`]), segment apply
//!   ([`sgmv`], [`one_adapter`]), MoE index builders, overlay kernels, the
//!   embedding LoRA ([`embed_lora`]) — each a
//!   CUDA kernel (`cuda/*.cu`, compiled by NVRTC at first use for the device's
//!   own architecture, `sm_90a` on compute capability 9.0 with a CUDA 12+
//!   NVRTC, cached per context)
//!   and a CPU reference with the same
//!   signature and math; and [`linear_f32`], the f32 `x · w^T` of a base
//!   projection (cuBLAS SGEMM on CUDA, a reference loop on the CPU).
//! - [`DeviceGraph`]: CUDA-graph capture and replay of apply calls.
//! - [`testing`]: GPU test gating (`LORA_REQUIRE_GPU`), seeded random pools.
//!
//! What it must never do: need a CUDA toolkit to build (cudarc loads
//! `libcuda` / `libnvrtc` / `libcublas` at run time, and their absence is a typed error,
//! never a panic); allocate or synchronise inside an apply call; let another
//! crate name a cudarc type. On the CPU, a table address that does not
//! resolve to a live allocation is an error, never undefined behaviour.
//!
//! ```
//! use half::bf16;
//! use lora_kernels::{Device, LoraTarget, Rows, RowsMut, bgmv, testing::{RandomPairs, Rng}};
//! let dev = Device::cpu();
//! let pairs = RandomPairs::new(&mut Rng::new(7), 16, 8, 4, &[4, 2]);
//! let pool = pairs.upload(&dev).unwrap();
//! let x = dev.upload(&vec![bf16::ONE; 3 * 16]).unwrap();
//! let idx = dev.upload(&[1i32, -1, 0]).unwrap();
//! let mut y = dev.alloc_zeros::<f32>(3 * 8).unwrap();
//! let target = LoraTarget { table: &pool.table, table_offset: 0, n_entries: 2, out_dim: 8, y_col_offset: 0, dora: None };
//! bgmv(&dev, Rows::dense(&x, 3, 16), &idx, &[target], 4, RowsMut::dense(&mut y, 3, 8)).unwrap();
//! let y = y.download().unwrap();
//! assert!(y[8..16].iter().all(|v| *v == 0.0)); // row 1 has no adapter
//! assert!(y[..8].iter().any(|v| *v != 0.0));
//! ```

mod buffer;
mod cpu_mem;
mod cuda_rt;
mod device;
mod error;
mod graph;
mod nccl;
pub mod ops;
mod table;
pub mod testing;

pub use buffer::{DeviceBuffer, DeviceElem, PinnedHostBuffer};
pub use device::{Device, DeviceKind, Lane, compile_all_kernels, kernel_sources};
pub use error::{FaultFlags, KernelError};
pub use graph::{DeviceEvent, DeviceGraph};
pub use nccl::{NcclComm, NcclId};
pub use ops::bgmv::plan::{Chain, DecodeForm, DecodePlan, EntryKernel, FusedForm, ItemList, TwoPhaseForm};
pub use ops::bgmv::{
    BGMV_MAX_RANK, DecodeOptions, ENTRY_MAX_ROWS, ENTRY_REGISTERS_MAX_DIM, ENTRY_REGISTERS_MAX_ROWS, ROWS_MAX_IN,
    ROWS_MAX_OUT, ROWS_STRIDE, bgmv, bgmv_candidates, bgmv_plan, bgmv_with,
};
pub use ops::dora::{DoraEpilogue, DoraNorm, dora_row_scale};
pub use ops::embed_lora::{EmbeddingPairs, embed_lora};
pub use ops::limits::{Choice, DeviceLimits};
pub use ops::linear::linear_f32;
pub use ops::moe_index::{MoeRouting, moe_decode_index, moe_sorted_index};
pub use ops::overlay::{embed_overlay, embed_overlay_at, lm_head_overlay, row_diff};
pub use ops::rank_split::{RankPart, expand_gathered, shrink_part};
pub use ops::repack::{
    RepackDtype, RepackRegion, ValueScan, first_non_finite, queue_value_scan, repack, repack_if_finite,
};
pub use ops::sgmv::plan::{ExpandKernel, PrefillCall, PrefillPlan, ShrinkKernel};
pub use ops::sgmv::{PrefillOptions, Segments, SgmvPhase, one_adapter, sgmv, sgmv_candidates, sgmv_plan, sgmv_with};
pub use ops::{LoraTarget, LoraWorkspace, MAX_TARGETS, OutputElem, Rows, RowsMut, WorkspaceSpec};
pub use table::{EmbedOverlayEntry, LmHeadOverlayEntry, PairEntry};
