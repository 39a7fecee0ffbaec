//! Entry-index builders for routed-expert LoRA: per expanded row, the index
//! `expert * max_loras + adapter` into a `[num_experts * max_loras]` pair
//! table, or -1, for [`super::bgmv::bgmv`]. CUDA kernel family:
//! `cuda/moe_index.cu`.

use super::{to_i32, to_u32};
use crate::buffer::{DeviceBuffer, check_range};
use crate::cuda_rt::{Family, Kernel, Launch};
use crate::device::{Backend, Device};
use crate::error::{KernelError, invalid};

const THREADS: u32 = 256;

/// The routing shape both builders share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeRouting {
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Adapter slots per expert in the table.
    pub max_loras: usize,
    /// Routed experts of the layer.
    pub n_experts: usize,
}

impl MoeRouting {
    fn check(&self) -> Result<(), KernelError> {
        if self.top_k == 0 || self.max_loras == 0 || self.n_experts == 0 {
            return Err(invalid("routing", format!("{self:?}: every count must be at least 1")));
        }
        let entries = self
            .n_experts
            .checked_mul(self.max_loras)
            .ok_or_else(|| invalid("routing", "table size overflows"))?;
        to_i32("routing.n_experts * max_loras", entries).map(|_| ())
    }
}

/// Mirror of `struct MoeDecodeIndexParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DecodeParams {
    row_adapter: u64,
    topk_ids: u64,
    idx: u64,
    fault: u64,
    n_expanded: i32,
    top_k: i32,
    max_loras: i32,
    n_experts: i32,
}
const _: () = assert!(size_of::<DecodeParams>() == 48);

/// Mirror of `struct MoeSortedIndexParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SortedParams {
    sorted_token: u64,
    expert_offsets: u64,
    row_adapter: u64,
    idx: u64,
    fault: u64,
    n_sorted: i32,
    n_experts: i32,
    top_k: i32,
    max_loras: i32,
    n_tokens: i32,
    pad: i32,
}
const _: () = assert!(size_of::<SortedParams>() == 64);

fn grid_for(n: usize) -> Result<(u32, u32, u32), KernelError> {
    Ok((to_u32("grid", n.div_ceil(THREADS as usize).clamp(1, 65_535))?, 1, 1))
}

/// Decode: for the `n_tokens * top_k` expanded rows,
/// `idx[r] = row_adapter[r / top_k] < 0 ? -1 : topk_ids[r] * max_loras + row_adapter[r / top_k]`.
pub fn moe_decode_index(
    device: &Device,
    row_adapter: &DeviceBuffer<i32>,
    topk_ids: &DeviceBuffer<i32>,
    n_tokens: usize,
    routing: MoeRouting,
    idx: &mut DeviceBuffer<i32>,
) -> Result<(), KernelError> {
    routing.check()?;
    device.expect_same("row_adapter", row_adapter.device())?;
    device.expect_same("topk_ids", topk_ids.device())?;
    device.expect_same("idx", idx.device())?;
    let n_expanded = n_tokens
        .checked_mul(routing.top_k)
        .ok_or_else(|| invalid("n_tokens", "overflows"))?;
    check_range("row_adapter", 0, n_tokens, row_adapter.len())?;
    check_range("topk_ids", 0, n_expanded, topk_ids.len())?;
    check_range("idx", 0, n_expanded, idx.len())?;
    if n_expanded == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(_) => {
            let ra = row_adapter.download_range(0, n_tokens)?;
            let ids = topk_ids.download_range(0, n_expanded)?;
            let mut out = Vec::with_capacity(n_expanded);
            for (r, &e) in ids.iter().enumerate() {
                let a = ra[r / routing.top_k];
                out.push(if a < 0 {
                    -1
                } else if a as usize >= routing.max_loras {
                    let (position, index, n_entries) = (r / routing.top_k, i64::from(a), routing.max_loras);
                    return Err(KernelError::BadIndex {
                        arg: "row_adapter",
                        position,
                        index,
                        n_entries,
                    });
                } else if e < 0 || e as usize >= routing.n_experts {
                    let (index, n_entries) = (i64::from(e), routing.n_experts);
                    return Err(KernelError::BadIndex {
                        arg: "topk_ids",
                        position: r,
                        index,
                        n_entries,
                    });
                } else {
                    e * routing.max_loras as i32 + a
                });
            }
            idx.write(0, &out)
        }
        Backend::Cuda(c) => {
            let params = DecodeParams {
                row_adapter: row_adapter.device_addr(),
                topk_ids: topk_ids.device_addr(),
                idx: idx.device_addr(),
                fault: c.fault_addr(),
                n_expanded: to_i32("n_tokens * top_k", n_expanded)?,
                top_k: to_i32("top_k", routing.top_k)?,
                max_loras: to_i32("max_loras", routing.max_loras)?,
                n_experts: to_i32("n_experts", routing.n_experts)?,
            };
            let launch = Launch {
                grid: grid_for(n_expanded)?,
                block: THREADS,
                smem: 0,
            };
            // SAFETY: the params mirror the kernel's struct; row_adapter holds
            // n_tokens values, topk_ids and idx hold n_tokens * top_k (checked above).
            unsafe {
                c.launch(
                    Kernel {
                        family: Family::MoeIndex,
                        name: "moe_decode_index_i32",
                    },
                    launch,
                    &params,
                )
            }
        }
    }
}

/// The expert owning sorted row `i`: the largest `e < n_experts` with
/// `offsets[e] <= i` by binary search, kept only when `i < offsets[e + 1]`.
/// The CUDA kernel runs the same search, so both agree on any offsets.
fn owning_expert(offsets: &[i32], n_experts: usize, i: i64) -> Option<usize> {
    if n_experts == 0 || i64::from(offsets[0]) > i {
        return None;
    }
    let (mut lo, mut hi) = (0usize, n_experts);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if i64::from(offsets[mid]) <= i {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    (i < i64::from(offsets[lo + 1])).then_some(lo)
}

/// Sorted prefill: for each of the `n_sorted` expert-sorted rows, the expert
/// owning the row (from `expert_offsets[n_experts + 1]`) combined with the
/// adapter of the token it came from, `row_adapter[sorted_token[i] / top_k]`.
/// A `sorted_token` outside `0 .. n_tokens * top_k` marks a padding row (-1).
#[allow(clippy::too_many_arguments)]
pub fn moe_sorted_index(
    device: &Device,
    sorted_token: &DeviceBuffer<i32>,
    n_sorted: usize,
    expert_offsets: &DeviceBuffer<i32>,
    row_adapter: &DeviceBuffer<i32>,
    n_tokens: usize,
    routing: MoeRouting,
    idx: &mut DeviceBuffer<i32>,
) -> Result<(), KernelError> {
    routing.check()?;
    for (arg, d) in [
        ("sorted_token", sorted_token.device()),
        ("expert_offsets", expert_offsets.device()),
        ("row_adapter", row_adapter.device()),
        ("idx", idx.device()),
    ] {
        device.expect_same(arg, d)?;
    }
    check_range("sorted_token", 0, n_sorted, sorted_token.len())?;
    check_range("expert_offsets", 0, routing.n_experts + 1, expert_offsets.len())?;
    check_range("row_adapter", 0, n_tokens, row_adapter.len())?;
    check_range("idx", 0, n_sorted, idx.len())?;
    let n_expanded = n_tokens
        .checked_mul(routing.top_k)
        .ok_or_else(|| invalid("n_tokens", "overflows"))?;
    to_i32("n_tokens * top_k", n_expanded)?;
    if n_sorted == 0 {
        return Ok(());
    }
    match device.backend() {
        Backend::Cpu(_) => {
            let st = sorted_token.download_range(0, n_sorted)?;
            let off = expert_offsets.download_range(0, routing.n_experts + 1)?;
            let ra = row_adapter.download_range(0, n_tokens)?;
            let mut out = Vec::with_capacity(n_sorted);
            for (i, &src) in st.iter().enumerate() {
                let expert = owning_expert(&off, routing.n_experts, i as i64);
                let token = usize::try_from(src)
                    .ok()
                    .filter(|&s| s < n_expanded)
                    .map(|s| s / routing.top_k);
                out.push(match (expert, token) {
                    (Some(e), Some(t)) => {
                        let a = ra[t];
                        if a as i64 >= routing.max_loras as i64 {
                            let (index, n_entries) = (i64::from(a), routing.max_loras);
                            return Err(KernelError::BadIndex {
                                arg: "row_adapter",
                                position: t,
                                index,
                                n_entries,
                            });
                        }
                        if a < 0 {
                            -1
                        } else {
                            e as i32 * routing.max_loras as i32 + a
                        }
                    }
                    _ => -1,
                });
            }
            idx.write(0, &out)
        }
        Backend::Cuda(c) => {
            let params = SortedParams {
                sorted_token: sorted_token.device_addr(),
                expert_offsets: expert_offsets.device_addr(),
                row_adapter: row_adapter.device_addr(),
                idx: idx.device_addr(),
                fault: c.fault_addr(),
                n_sorted: to_i32("n_sorted", n_sorted)?,
                n_experts: to_i32("n_experts", routing.n_experts)?,
                top_k: to_i32("top_k", routing.top_k)?,
                max_loras: to_i32("max_loras", routing.max_loras)?,
                n_tokens: to_i32("n_tokens", n_tokens)?,
                pad: 0,
            };
            let launch = Launch {
                grid: grid_for(n_sorted)?,
                block: THREADS,
                smem: 0,
            };
            // SAFETY: the params mirror the kernel's struct; sorted_token and idx
            // hold n_sorted values, expert_offsets n_experts + 1, row_adapter
            // n_tokens (checked above); the kernel reads row_adapter only at
            // src / top_k for 0 <= src < n_tokens * top_k.
            unsafe {
                c.launch(
                    Kernel {
                        family: Family::MoeIndex,
                        name: "moe_sorted_index_i32",
                    },
                    launch,
                    &params,
                )
            }
        }
    }
}

#[cfg(test)]
mod tests;
