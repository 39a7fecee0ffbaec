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
}

impl DeviceLimits {
    /// An NVIDIA H200 (SXM, 132 multiprocessors) with a CUDA 12+ NVRTC.
    pub const H200: DeviceLimits = DeviceLimits {
        capability: (9, 0),
        multiprocessors: 132,
        smem_optin: 232_448,
        smem_per_sm: 233_472,
        wgmma: true,
    };

    /// An sm_80 device like the A100 (108 multiprocessors, no clusters, no wgmma).
    pub const SM80: DeviceLimits = DeviceLimits {
        capability: (8, 0),
        multiprocessors: 108,
        smem_optin: 166_912,
        smem_per_sm: 167_936,
        wgmma: false,
    };

    /// Thread-block clusters, `st.async`, programmatic dependent launch and
    /// the other sm_90 features the cluster forms need.
    pub fn hopper(&self) -> bool {
        self.capability.0 >= 9
    }

    pub(crate) fn of(c: &CudaBackend) -> DeviceLimits {
        DeviceLimits {
            capability: c.compute_capability,
            multiprocessors: c.sm_count as usize,
            smem_optin: c.smem_optin,
            smem_per_sm: c.smem_per_sm,
            wgmma: c.wgmma,
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
