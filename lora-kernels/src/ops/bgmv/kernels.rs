//! Every decode kernel, named once: a typed id and its `extern "C"` entry
//! point in `cuda/bgmv.cu`, `cuda/bgmv_entry.cu` or `cuda/bgmv_rows.cu`. The
//! launch code names kernels only through [`DecodeKernel`]; a test checks
//! the table against the sources both ways (every name defined there, every
//! decode entry point there named here).

use super::plan::{EntryKernel, OutputKind};
use crate::cuda_rt::{Family, Kernel};
use crate::error::{KernelError, invalid};

/// A decode kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DecodeKernel {
    /// The fused kernel; `listed`: its form reading `bgmv_list`'s items
    /// (tensor cores only).
    Fused {
        cluster: usize,
        tensor_cores: bool,
        listed: bool,
        y: OutputKind,
    },
    /// The item list's first launch.
    ItemList,
    /// The two-phase shrink (every row its own item).
    Shrink { tensor_cores: bool },
    /// The two-phase expand (every row its own item).
    Expand { y: OutputKind },
    /// The entry-clustered form (BF16 y only); the spread kernel's prefetch
    /// is a flag of its parameter block, so it is named without one.
    Entry {
        kernel: EntryKernel,
        stride: usize,
        prefetch: bool,
    },
    /// The row-register form.
    Rows { straight_line: bool, y: OutputKind },
}

use DecodeKernel::{Entry, Expand, Fused, ItemList, Rows, Shrink};
use EntryKernel::{Registers, Spread, Staged};
use OutputKind::{Bf16, F32};

const fn fused(cluster: usize, tensor_cores: bool, listed: bool, y: OutputKind) -> DecodeKernel {
    Fused {
        cluster,
        tensor_cores,
        listed,
        y,
    }
}

const fn entry(kernel: EntryKernel, stride: usize, prefetch: bool) -> DecodeKernel {
    Entry {
        kernel,
        stride,
        prefetch,
    }
}

/// The table.
const NAMES: [(DecodeKernel, &str); 38] = [
    (fused(1, false, false, Bf16), "bgmv_c1_bf16"),
    (fused(1, false, false, F32), "bgmv_c1_f32"),
    (fused(2, false, false, Bf16), "bgmv_c2_bf16"),
    (fused(2, false, false, F32), "bgmv_c2_f32"),
    (fused(8, false, false, Bf16), "bgmv_c8_bf16"),
    (fused(8, false, false, F32), "bgmv_c8_f32"),
    (fused(1, true, false, Bf16), "bgmv_tc_c1_bf16"),
    (fused(1, true, false, F32), "bgmv_tc_c1_f32"),
    (fused(2, true, false, Bf16), "bgmv_tc_c2_bf16"),
    (fused(2, true, false, F32), "bgmv_tc_c2_f32"),
    (fused(8, true, false, Bf16), "bgmv_tc_c8_bf16"),
    (fused(8, true, false, F32), "bgmv_tc_c8_f32"),
    (fused(1, true, true, Bf16), "bgmv_tc_c1_bf16_list"),
    (fused(1, true, true, F32), "bgmv_tc_c1_f32_list"),
    (fused(2, true, true, Bf16), "bgmv_tc_c2_bf16_list"),
    (fused(2, true, true, F32), "bgmv_tc_c2_f32_list"),
    (fused(8, true, true, Bf16), "bgmv_tc_c8_bf16_list"),
    (fused(8, true, true, F32), "bgmv_tc_c8_f32_list"),
    (ItemList, "bgmv_list"),
    (Shrink { tensor_cores: false }, "bgmv2_shrink_rows"),
    (Shrink { tensor_cores: true }, "bgmv2_shrink_tc_rows"),
    (Expand { y: Bf16 }, "bgmv2_expand_rows_bf16"),
    (Expand { y: F32 }, "bgmv2_expand_rows_f32"),
    (entry(Staged { cluster: 8 }, 16, false), "bgmv_entry_c8_r16"),
    (entry(Staged { cluster: 8 }, 32, false), "bgmv_entry_c8_r32"),
    (entry(Staged { cluster: 8 }, 64, false), "bgmv_entry_c8_r64"),
    (entry(Staged { cluster: 4 }, 16, false), "bgmv_entry_c4_r16"),
    (entry(Staged { cluster: 4 }, 32, false), "bgmv_entry_c4_r32"),
    (entry(Staged { cluster: 4 }, 64, false), "bgmv_entry_c4_r64"),
    (entry(Staged { cluster: 8 }, 16, true), "bgmv_entry_c8_r16_pf"),
    (entry(Staged { cluster: 4 }, 16, true), "bgmv_entry_c4_r16_pf"),
    (entry(Registers, 16, false), "bgmv_entry_c8_r16_reg"),
    (entry(Registers, 16, true), "bgmv_entry_c8_r16_reg_pf"),
    (entry(Spread, 16, false), "bgmv_entry_spread_r16"),
    (
        Rows {
            straight_line: false,
            y: Bf16,
        },
        "bgmv_rows_bf16",
    ),
    (
        Rows {
            straight_line: false,
            y: F32,
        },
        "bgmv_rows_f32",
    ),
    (
        Rows {
            straight_line: true,
            y: Bf16,
        },
        "bgmv_rows_full_bf16",
    ),
    (
        Rows {
            straight_line: true,
            y: F32,
        },
        "bgmv_rows_full_f32",
    ),
];

impl DecodeKernel {
    /// The entry point, if the sources define this kernel.
    pub(super) fn name(self) -> Option<&'static str> {
        let key = match self {
            Entry {
                kernel: Spread, stride, ..
            } => entry(Spread, stride, false),
            other => other,
        };
        NAMES.iter().find(|(k, _)| *k == key).map(|(_, name)| *name)
    }

    /// The kernel to launch, or a typed error naming the plan (a plan the
    /// checks accepted always has one; the table test keeps it so).
    pub(super) fn kernel(self) -> Result<Kernel, KernelError> {
        let name = self
            .name()
            .ok_or_else(|| invalid("plan", format!("no kernel {self:?}")))?;
        let family = match self {
            Entry { .. } => Family::BgmvEntry,
            Rows { .. } => Family::BgmvRows,
            _ => Family::Bgmv,
        };
        Ok(Kernel { family, name })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCES: [&str; 3] = [
        include_str!("../../../cuda/bgmv.cu"),
        include_str!("../../../cuda/bgmv_entry.cu"),
        include_str!("../../../cuda/bgmv_rows.cu"),
    ];

    /// Every decode entry point the sources define: plain `extern "C"`
    /// kernels, and the names the kernel macros are invoked with.
    fn defined() -> Vec<String> {
        let mut names = Vec::new();
        for src in SOURCES {
            for line in src.lines() {
                let line = line.trim();
                if let Some(rest) = line.strip_prefix("extern \"C\" __global__")
                    && !line.ends_with('\\')
                    && let Some(open) = rest.find("(const ")
                {
                    let head = &rest[..open];
                    if let Some(name) = head.split_whitespace().last().filter(|n| n.starts_with("bgmv")) {
                        names.push(name.to_string());
                    }
                }
                for mac in ["BGMV_KERNEL_C1(", "BGMV_KERNEL_CL(", "BGE_KERNEL(", "BGR_KERNEL("] {
                    if let Some(args) = line.strip_prefix(mac)
                        && let Some(name) = args.split(',').next().filter(|n| n.starts_with("bgmv"))
                    {
                        names.push(name.to_string());
                    }
                }
            }
        }
        names
    }

    #[test]
    fn the_table_names_every_decode_kernel_of_the_sources_once() {
        let defined = defined();
        for (kernel, name) in NAMES {
            assert!(
                defined.iter().any(|d| d == name),
                "{kernel:?}: {name} is not in the sources"
            );
            assert_eq!(kernel.name(), Some(name));
        }
        for d in &defined {
            assert_eq!(
                NAMES.iter().filter(|(_, n)| n == d).count(),
                1,
                "{d}: defined in the sources, named {} times in the table",
                NAMES.iter().filter(|(_, n)| n == d).count()
            );
        }
        assert_eq!(defined.len(), NAMES.len());
        for (i, (a, _)) in NAMES.iter().enumerate() {
            assert!(NAMES[..i].iter().all(|(b, _)| b != a), "{a:?} twice");
        }
    }

    #[test]
    fn kernels_outside_the_table_are_typed_errors() {
        assert!(fused(3, false, false, Bf16).kernel().is_err());
        // The item list serves the tensor-core kernels only.
        for cluster in [1, 2, 4, 8] {
            assert!(fused(cluster, false, true, Bf16).kernel().is_err());
            assert!(fused(cluster, false, true, F32).kernel().is_err());
        }
        assert!(entry(Staged { cluster: 4 }, 32, true).kernel().is_err());
        assert!(entry(Registers, 32, false).kernel().is_err());
        assert_eq!(entry(Spread, 16, true).name(), Some("bgmv_entry_spread_r16"));
        assert!(entry(Spread, 32, false).name().is_none());
    }
}
