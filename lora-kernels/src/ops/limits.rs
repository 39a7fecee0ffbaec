//! What the launch planners read of a device, and how a caller picks a plan.
//!
//! The planners ([`super::bgmv::plan`], [`super::sgmv::plan`]) are pure
//! functions of a call, a [`DeviceLimits`] and the caller's promises: they
//! never launch and run on any machine, so every launch decision is tested
//! on the CPU against recorded tables (two devices: [`DeviceLimits::H200`]
//! and [`DeviceLimits::SM80`]).

use crate::cuda_rt::CudaBackend;

/// The device properties launch plans depend on, as the driver reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceLimits {
    /// Compute capability (major, minor).
    pub capability: (i32, i32),
    /// Streaming multiprocessors.
    pub multiprocessors: usize,
    /// Dynamic shared memory one block may opt in to, bytes.
    pub smem_optin: usize,
    /// Shared memory of one multiprocessor, bytes.
    pub smem_per_sm: usize,
    /// The kernels are built for the arch-specific target (`sm_90a`), so the
    /// warpgroup-MMA (`wgmma`) kernels run.
    pub wgmma: bool,
    /// Most clusters of 8 blocks resident at once when each multiprocessor
    /// holds 1, 2, 3 or 4 of their blocks, as the driver answers
    /// (`cuOccupancyMaxActiveClusters`, asked once when the device opens).
    /// A cluster must fit whole in one GPC, so fewer fit than the block
    /// slots divided by 8, by how many depends on the chip's GPCs. Zeros
    /// without clusters.
    pub clusters_of_8: [usize; 4],
}

impl DeviceLimits {
    /// An NVIDIA H200 (SXM, 132 multiprocessors) with a CUDA 12+ NVRTC.
    pub const H200: DeviceLimits = DeviceLimits {
        capability: (9, 0),
        multiprocessors: 132,
        smem_optin: 232_448,
        smem_per_sm: 233_472,
        wgmma: true,
        // The driver's answers on an H200 (lora-kernels NOTES.md, runs 40b
        // and 350) and on an H100 SXM, 132 multiprocessors each (v39).
        clusters_of_8: [15, 30, 45, 62],
    };

    /// An sm_80 device like the A100 (108 multiprocessors, no clusters, no wgmma).
    pub const SM80: DeviceLimits = DeviceLimits {
        capability: (8, 0),
        multiprocessors: 108,
        smem_optin: 166_912,
        smem_per_sm: 167_936,
        wgmma: false,
        clusters_of_8: [0; 4],
    };

    /// Thread-block clusters, `st.async`, programmatic dependent launch and
    /// the other sm_90 features the cluster forms need.
    pub fn hopper(&self) -> bool {
        self.capability.0 >= 9
    }

    /// Block slots that clusters of 8 fill at once when each multiprocessor
    /// holds `blocks_per_sm` of their blocks: the driver's count of resident
    /// clusters of 8 ([`DeviceLimits::clusters_of_8`]) times 8.
    pub fn cluster8_block_slots(&self, blocks_per_sm: usize) -> usize {
        match blocks_per_sm {
            0 => 0,
            k => self.clusters_of_8[k.min(4) - 1]
                .saturating_mul(8)
                .min(self.multiprocessors.saturating_mul(k)),
        }
    }

    pub(crate) fn of(c: &CudaBackend) -> DeviceLimits {
        DeviceLimits {
            capability: c.compute_capability,
            multiprocessors: c.sm_count as usize,
            smem_optin: c.smem_optin,
            smem_per_sm: c.smem_per_sm,
            wgmma: c.wgmma,
            clusters_of_8: c.clusters_of_8,
        }
    }
}

/// How a call picks its launch plan: the planner's rule table
/// ([`Choice::Auto`], what every apply uses), or one exact plan
/// (benchmarks and tests of each form; checked against the call, and
/// refused with a typed error where it cannot serve it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Choice<P> {
    /// The rule table's plan for the call and device.
    #[default]
    Auto,
    /// This plan (typically one of the planner's `candidates`).
    Exact(P),
}
