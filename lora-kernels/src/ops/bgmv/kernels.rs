//! Every decode kernel, named once: a typed id and its `extern "C"` entry
//! points in `cuda/bgmv.cu`, `cuda/bgmv_entry.cu` or `cuda/bgmv_rows.cu`.
//! A kernel that writes y has two: the plain one and `_dora`, the same body
//! with the DoRA epilogue ([`crate::ops::dora`]) compiled in; which one a
//! launch runs is [`Epilogue::of`] the call's targets, the one rule. The
//! launch code names kernels only through [`DecodeKernel`]; a test checks
//! the table against the sources both ways (every name defined there, every
//! decode entry point there named here).

use super::plan::{EntryKernel, OutputKind};
use crate::cuda_rt::{Family, Kernel};
use crate::error::{KernelError, invalid};
use crate::ops::LoraTarget;

/// Whether a launch's kernel has the DoRA epilogue compiled in. The plan
/// never looks at it: a call runs the kernel its plan names, in the
/// instantiation its targets need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Epilogue {
    /// No target carries a DoRA epilogue: the kernels compiled without it
    /// (no rescale lookup, no branch, no registers for it).
    Plain,
    /// Some target does: the `_dora` kernels, which rescale the rows of
    /// entries that have a `g` there and write every other row's `y + Δ`
    /// bit for bit as the plain kernel does.
    Dora,
}

impl Epilogue {
    /// The one rule: the `_dora` kernels where any target of the call
    /// carries a DoRA epilogue (a DoRA pool attaches one to every call).
    pub(super) fn of(targets: &[LoraTarget<'_>]) -> Self {
        if targets.iter().any(|t| t.dora.is_some()) {
            Epilogue::Dora
        } else {
            Epilogue::Plain
        }
    }
}

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

/// A kernel that writes y: its plain entry point and its `_dora` one.
macro_rules! with_dora {
    ($name:literal) => {
        [$name, concat!($name, "_dora")]
    };
}

/// A kernel that writes no y (the item list, the two-phase shrink): one
/// entry point serves both epilogues.
macro_rules! one {
    ($name:literal) => {
        [$name, $name]
    };
}

/// The table: each kernel's entry points, plain and `_dora`.
const NAMES: [(DecodeKernel, [&str; 2]); 38] = [
    (fused(1, false, false, Bf16), with_dora!("bgmv_c1_bf16")),
    (fused(1, false, false, F32), with_dora!("bgmv_c1_f32")),
    (fused(2, false, false, Bf16), with_dora!("bgmv_c2_bf16")),
    (fused(2, false, false, F32), with_dora!("bgmv_c2_f32")),
    (fused(8, false, false, Bf16), with_dora!("bgmv_c8_bf16")),
    (fused(8, false, false, F32), with_dora!("bgmv_c8_f32")),
    (fused(1, true, false, Bf16), with_dora!("bgmv_tc_c1_bf16")),
    (fused(1, true, false, F32), with_dora!("bgmv_tc_c1_f32")),
    (fused(2, true, false, Bf16), with_dora!("bgmv_tc_c2_bf16")),
    (fused(2, true, false, F32), with_dora!("bgmv_tc_c2_f32")),
    (fused(8, true, false, Bf16), with_dora!("bgmv_tc_c8_bf16")),
    (fused(8, true, false, F32), with_dora!("bgmv_tc_c8_f32")),
    (fused(1, true, true, Bf16), with_dora!("bgmv_tc_c1_bf16_list")),
    (fused(1, true, true, F32), with_dora!("bgmv_tc_c1_f32_list")),
    (fused(2, true, true, Bf16), with_dora!("bgmv_tc_c2_bf16_list")),
    (fused(2, true, true, F32), with_dora!("bgmv_tc_c2_f32_list")),
    (fused(8, true, true, Bf16), with_dora!("bgmv_tc_c8_bf16_list")),
    (fused(8, true, true, F32), with_dora!("bgmv_tc_c8_f32_list")),
    (ItemList, one!("bgmv_list")),
    (Shrink { tensor_cores: false }, one!("bgmv2_shrink_rows")),
    (Shrink { tensor_cores: true }, one!("bgmv2_shrink_tc_rows")),
    (Expand { y: Bf16 }, with_dora!("bgmv2_expand_rows_bf16")),
    (Expand { y: F32 }, with_dora!("bgmv2_expand_rows_f32")),
    (entry(Staged { cluster: 8 }, 16, false), with_dora!("bgmv_entry_c8_r16")),
    (entry(Staged { cluster: 8 }, 32, false), with_dora!("bgmv_entry_c8_r32")),
    (entry(Staged { cluster: 8 }, 64, false), with_dora!("bgmv_entry_c8_r64")),
    (entry(Staged { cluster: 4 }, 16, false), with_dora!("bgmv_entry_c4_r16")),
    (entry(Staged { cluster: 4 }, 32, false), with_dora!("bgmv_entry_c4_r32")),
    (entry(Staged { cluster: 4 }, 64, false), with_dora!("bgmv_entry_c4_r64")),
    (
        entry(Staged { cluster: 8 }, 16, true),
        with_dora!("bgmv_entry_c8_r16_pf"),
    ),
    (
        entry(Staged { cluster: 4 }, 16, true),
        with_dora!("bgmv_entry_c4_r16_pf"),
    ),
    (entry(Registers, 16, false), with_dora!("bgmv_entry_c8_r16_reg")),
    (entry(Registers, 16, true), with_dora!("bgmv_entry_c8_r16_reg_pf")),
    (entry(Spread, 16, false), with_dora!("bgmv_entry_spread_r16")),
    (
        Rows {
            straight_line: false,
            y: Bf16,
        },
        with_dora!("bgmv_rows_bf16"),
    ),
    (
        Rows {
            straight_line: false,
            y: F32,
        },
        with_dora!("bgmv_rows_f32"),
    ),
    (
        Rows {
            straight_line: true,
            y: Bf16,
        },
        with_dora!("bgmv_rows_full_bf16"),
    ),
    (
        Rows {
            straight_line: true,
            y: F32,
        },
        with_dora!("bgmv_rows_full_f32"),
    ),
];

impl DecodeKernel {
    /// The entry point with `epilogue`, if the sources define this kernel.
    pub(super) fn name(self, epilogue: Epilogue) -> Option<&'static str> {
        let key = match self {
            Entry {
                kernel: Spread, stride, ..
            } => entry(Spread, stride, false),
            other => other,
        };
        let at = match epilogue {
            Epilogue::Plain => 0,
            Epilogue::Dora => 1,
        };
        NAMES.iter().find(|(k, _)| *k == key).map(|(_, names)| names[at])
    }

    /// The kernel to launch, or a typed error naming the plan (a plan the
    /// checks accepted always has one; the table test keeps it so).
    pub(super) fn kernel(self, epilogue: Epilogue) -> Result<Kernel, KernelError> {
        let name = self
            .name(epilogue)
            .ok_or_else(|| invalid("plan", format!("no kernel {self:?} ({epilogue:?})")))?;
        let family = match self {
            Entry { .. } => Family::BgmvEntry,
            Rows { .. } => Family::BgmvRows,
            _ => Family::Bgmv,
        };
        // The kernels that write no y serve both epilogues from the plain module.
        let family = match (epilogue, self) {
            (Epilogue::Plain, _) | (_, ItemList | Shrink { .. }) => family,
            (Epilogue::Dora, _) => family.with_dora(),
        };
        Ok(Kernel { family, name })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::ops::dora::DoraEpilogue;
    use crate::table::PairEntry;

    const SOURCES: [&str; 3] = [
        include_str!("../../../cuda/bgmv.cu"),
        include_str!("../../../cuda/bgmv_entry.cu"),
        include_str!("../../../cuda/bgmv_rows.cu"),
    ];

    /// Every decode entry point the sources define: plain `extern "C"`
    /// kernels, and the names the kernel macros and `DECODE_NAME` are given
    /// (each NAME in the plain module, NAME_dora in the DoRA module).
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
                    match head.split_whitespace().last() {
                        Some(name) if name.starts_with("bgmv") => names.push(name.to_string()),
                        Some(call) => {
                            if let Some(name) = call
                                .strip_prefix("DECODE_NAME(")
                                .and_then(|n| n.strip_suffix(')'))
                                .filter(|n| n.starts_with("bgmv"))
                            {
                                names.push(name.to_string());
                                names.push(format!("{name}_dora"));
                            }
                        }
                        None => {}
                    }
                }
                for mac in ["BGMV_KERNEL_C1(", "BGMV_KERNEL_CL(", "BGE_KERNEL(", "BGR_KERNEL("] {
                    if let Some(args) = line.strip_prefix(mac)
                        && let Some(name) = args.split(',').next().filter(|n| n.starts_with("bgmv"))
                    {
                        names.push(name.to_string());
                        names.push(format!("{name}_dora"));
                    }
                }
            }
        }
        names
    }

    /// Every entry point the table names, each once.
    fn named() -> Vec<&'static str> {
        let mut names: Vec<&str> = NAMES.iter().flat_map(|(_, n)| n.iter().copied()).collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    #[test]
    fn the_table_names_every_decode_kernel_of_the_sources_once() {
        let defined = defined();
        for (kernel, names) in NAMES {
            for (name, epilogue) in names.into_iter().zip([Epilogue::Plain, Epilogue::Dora]) {
                assert!(
                    defined.iter().any(|d| d == name),
                    "{kernel:?}: {name} is not in the sources"
                );
                assert_eq!(kernel.name(epilogue), Some(name));
            }
        }
        let named = named();
        for d in &defined {
            assert_eq!(
                defined.iter().filter(|n| *n == d).count(),
                1,
                "{d}: defined twice in the sources"
            );
            assert!(
                named.contains(&d.as_str()),
                "{d}: defined in the sources, not in the table"
            );
        }
        assert_eq!(defined.len(), named.len());
        for (i, (a, _)) in NAMES.iter().enumerate() {
            assert!(NAMES[..i].iter().all(|(b, _)| b != a), "{a:?} twice");
        }
    }

    /// The entry points of one compiled module (its PTX's `.entry` lines).
    fn module_entries(ptx: &str) -> Vec<String> {
        ptx.lines()
            .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
            .filter_map(|l| l.split('(').next())
            .map(|n| n.trim().to_string())
            .collect()
    }

    /// Every (kernel, epilogue) of the table is defined by the module its
    /// launch loads; a plain decode module holds no `_dora` kernel and a
    /// DoRA module nothing else, and no module defines a decode kernel the
    /// table does not name. Needs libnvrtc only.
    #[test]
    #[ignore = "needs libnvrtc: run with --include-ignored where CUDA is installed"]
    fn each_kernel_is_in_the_module_its_launch_loads() {
        use crate::cuda_rt::compile_family;
        let mut entries = Vec::new();
        for family in Family::ALL.into_iter().filter(|f| f.decode_dora().is_some()) {
            match compile_family(family, (9, 0)) {
                Ok(ptx) => entries.push((family, module_entries(&ptx))),
                Err(KernelError::NvrtcMissing) if !crate::testing::gpu_required() => {
                    eprintln!("skipping each_kernel_is_in_the_module_its_launch_loads: libnvrtc not found");
                    return;
                }
                Err(e) => panic!("{family:?}: {e}"),
            }
        }
        let of = |family: Family| &entries.iter().find(|(f, _)| *f == family).unwrap().1;
        for (kernel, _) in NAMES {
            for epilogue in [Epilogue::Plain, Epilogue::Dora] {
                let k = kernel.kernel(epilogue).unwrap();
                assert!(
                    of(k.family).iter().any(|n| n == k.name),
                    "{kernel:?} ({epilogue:?}): {} is not in {:?}",
                    k.name,
                    k.family
                );
            }
        }
        let named = named();
        for (family, names) in &entries {
            let dora = family.with_dora() == *family;
            for name in names.iter().filter(|n| n.starts_with("bgmv")) {
                assert_eq!(name.ends_with("_dora"), dora, "{family:?} defines {name}");
                assert!(named.contains(&name.as_str()), "{family:?}: {name} is not in the table");
            }
        }
    }

    /// Every kernel that writes y has its own `_dora` instantiation; the
    /// item list and the shrink (which write none) serve both.
    #[test]
    fn every_kernel_that_writes_y_has_a_dora_instantiation() {
        for (kernel, [plain, dora]) in NAMES {
            assert!(!plain.ends_with("_dora"), "{plain}");
            match kernel {
                ItemList | Shrink { .. } => assert_eq!(dora, plain),
                _ => assert_eq!(dora, format!("{plain}_dora")),
            }
        }
    }

    /// The launcher's one rule: the `_dora` kernel exactly where some target
    /// of the call carries a DoRA epilogue, whichever target it is.
    #[test]
    fn the_dora_kernel_runs_iff_a_target_carries_the_epilogue() {
        let device = Device::cpu();
        let table = device.alloc_zeros::<PairEntry>(8).unwrap();
        let g_table = device.alloc_zeros::<u64>(8).unwrap();
        let target = |col: usize, dora: bool| LoraTarget {
            table: &table,
            table_offset: 0,
            n_entries: 4,
            out_dim: 16,
            y_col_offset: col,
            dora: dora.then_some(DoraEpilogue {
                table: &g_table,
                table_offset: 4,
                bias: None,
            }),
        };
        let kernels = [
            fused(8, true, false, Bf16),
            Expand { y: F32 },
            entry(Staged { cluster: 8 }, 16, true),
            entry(Registers, 16, false),
            entry(Spread, 16, true),
            Rows {
                straight_line: true,
                y: Bf16,
            },
        ];
        for n_targets in 1..=4 {
            let plain: Vec<_> = (0..n_targets).map(|t| target(16 * t, false)).collect();
            assert_eq!(Epilogue::of(&plain), Epilogue::Plain);
            for k in kernels {
                let name = k.kernel(Epilogue::of(&plain)).unwrap().name;
                assert!(!name.ends_with("_dora"), "{k:?}: {name}");
            }
            for with in 0..n_targets {
                let mut targets = plain.clone();
                targets[with] = target(16 * with, true);
                assert_eq!(Epilogue::of(&targets), Epilogue::Dora);
                for k in kernels {
                    let name = k.kernel(Epilogue::of(&targets)).unwrap().name;
                    assert_eq!(Some(name.trim_end_matches("_dora")), k.name(Epilogue::Plain));
                    assert!(name.ends_with("_dora"), "{k:?}: {name}");
                }
            }
        }
        assert_eq!(Epilogue::of(&[]), Epilogue::Plain);
    }

    #[test]
    fn kernels_outside_the_table_are_typed_errors() {
        for epilogue in [Epilogue::Plain, Epilogue::Dora] {
            assert!(fused(3, false, false, Bf16).kernel(epilogue).is_err());
            // The item list serves the tensor-core kernels only.
            for cluster in [1, 2, 4, 8] {
                assert!(fused(cluster, false, true, Bf16).kernel(epilogue).is_err());
                assert!(fused(cluster, false, true, F32).kernel(epilogue).is_err());
            }
            assert!(entry(Staged { cluster: 4 }, 32, true).kernel(epilogue).is_err());
            assert!(entry(Registers, 32, false).kernel(epilogue).is_err());
            assert!(entry(Spread, 32, false).name(epilogue).is_none());
        }
        assert_eq!(
            entry(Spread, 16, true).name(Epilogue::Plain),
            Some("bgmv_entry_spread_r16")
        );
        assert_eq!(
            entry(Spread, 16, true).name(Epilogue::Dora),
            Some("bgmv_entry_spread_r16_dora")
        );
    }
}
