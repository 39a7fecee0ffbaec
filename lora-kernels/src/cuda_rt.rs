//! The CUDA backend: context, stream, NVRTC module cache, launches, events,
//! graphs and the cuBLAS handle. Every cudarc call of the crate goes through
//! here or through the CUDA arm of [`crate::buffer`], so the cudarc boundary
//! is one place.
//!
//! cudarc panics when `libcuda` / `libnvrtc` / `libcublas` are missing, so
//! [`open`] (and the first cuBLAS call, [`CudaBackend::sgemm_nt`]) asks
//! `is_culib_present` first and returns a typed error instead.
//!
//! The kernels: CUDA C sources under `lora-kernels/cuda/`, one translation
//! unit per family ([`Family`]: `bgmv.cu`, `bgmv_entry.cu`, `bgmv_rows.cu`,
//! `sgmv.cu`, `moe_index.cu`, `overlay.cu`, `repack.cu`, `dora.cu`, `rank_split.cu`, each compiled on
//! its own after the host's `#define` prelude ([`prelude`]), the shared
//! `common.cuh` and the headers it uses: `ptx.cuh`, and for the decode
//! families `cluster.cuh` and `decode.cuh`), embedded with `include_str!` and compiled by NVRTC at
//! first use for the device's own architecture: `sm_90a` on compute
//! capability 9.0 when the NVRTC found is CUDA 12.0 or newer, so Hopper's
//! arch-specific `wgmma` is available ([`arch_specific`]; the code never
//! leaves the device it was built for); with an older NVRTC, or on another
//! capability, `sm_XY`, where the `mma.sync` forms run. Modules and
//! functions are cached per process and device (`module_cache`). Every
//! kernel-parameter struct is mirrored on the host with its size asserted
//! on both sides. Bad device data (an index past a table, a bad rank) sets
//! a bit in the device's fault word, which `Device::check_faults` reads
//! (the output is then unspecified); on the CPU backend the same data is an
//! error.
//!
//! Launches: [`CudaBackend::launch_chained`] (plain, or a programmatic
//! dependent of the stream's previous kernel: the decode plans' chains,
//! `ops::bgmv::plan::Chain`), [`CudaBackend::launch_resident`] (every block
//! resident at once: cooperative when plain); the scratch of multi-launch
//! ops and the spread kernel's inboxes are held for a sequence of launches
//! ([`CudaBackend::with_scratch`], [`CudaBackend::with_spread_inbox`]); and
//! [`CudaBackend::predecessor`] asks the driver's capture state what a launch
//! issued now would follow ([`Predecessor`]).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::result::CublasError;
use cudarc::driver::sys::{
    CUdevice_attribute, CUevent_flags, CUfunction_attribute, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, DriverError};
use cudarc::nvrtc::{CompileError, CompileOptions};

use crate::error::KernelError;

/// The shared header prepended to every family (no `#include` is needed).
const COMMON: &str = include_str!("../cuda/common.cuh");
/// PTX wrappers (async copies, matrix loads and MMAs), prepended to every family.
const PTX: &str = include_str!("../cuda/ptx.cuh");
/// Cluster, mbarrier and named-barrier helpers of the decode families.
const CLUSTER: &str = include_str!("../cuda/cluster.cuh");
/// The decode families' shared entry checks.
const DECODE: &str = include_str!("../cuda/decode.cuh");

/// The `#define`s of every translation unit: the constants the kernels and
/// the host code share, from the host's one definition of each
/// (`ops::cuda_defines`), so no value is mirrored by hand.
pub(crate) fn prelude() -> String {
    crate::ops::cuda_defines()
        .into_iter()
        .map(|(name, value)| format!("#define {name} {value}\n"))
        .collect()
}

/// A kernel family: one `.cu` file with the headers it includes, compiled
/// as one module on its own. Each decode file is two families: its plain
/// kernels, and the same kernels with the DoRA epilogue compiled in
/// (`decode.cuh`), compiled only when a call first needs one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Family {
    /// The fused and two-phase decode kernels, the item list, the empty launch.
    Bgmv,
    /// The entry-clustered decode kernels.
    BgmvEntry,
    /// The row-register decode kernels.
    BgmvRows,
    /// `Bgmv`'s kernels that write y, with the DoRA epilogue (`NAME_dora`).
    BgmvDora,
    /// `BgmvEntry`'s, with the DoRA epilogue.
    BgmvEntryDora,
    /// `BgmvRows`'s, with the DoRA epilogue.
    BgmvRowsDora,
    Sgmv,
    MoeIndex,
    Overlay,
    Repack,
    /// The kernel the cluster occupancy query names (never launched).
    Occupancy,
    /// DoRA's per-slot rescale, computed at staging (`dora_row_scale`).
    Dora,
    /// The rank-split shrink and gathered expand (the fully-sharded option).
    RankSplit,
}

impl Family {
    pub(crate) const ALL: [Family; 13] = [
        Family::Bgmv,
        Family::BgmvEntry,
        Family::BgmvRows,
        Family::BgmvDora,
        Family::BgmvEntryDora,
        Family::BgmvRowsDora,
        Family::Sgmv,
        Family::MoeIndex,
        Family::Overlay,
        Family::Repack,
        Family::Occupancy,
        Family::Dora,
        Family::RankSplit,
    ];

    /// The family with the DoRA epilogue compiled in, for a decode family
    /// (itself otherwise).
    pub(crate) fn with_dora(self) -> Family {
        match self {
            Family::Bgmv => Family::BgmvDora,
            Family::BgmvEntry => Family::BgmvEntryDora,
            Family::BgmvRows => Family::BgmvRowsDora,
            other => other,
        }
    }

    /// The value of `DECODE_DORA` for a decode family (`decode.cuh`), `None`
    /// for the others.
    pub(crate) fn decode_dora(self) -> Option<bool> {
        match self {
            Family::Bgmv | Family::BgmvEntry | Family::BgmvRows => Some(false),
            Family::BgmvDora | Family::BgmvEntryDora | Family::BgmvRowsDora => Some(true),
            _ => None,
        }
    }

    /// The module's name: its file's, `_dora` before the extension for a
    /// DoRA decode family (what NVRTC and a compile error name).
    pub(crate) fn module_name(self) -> &'static str {
        match self {
            Family::BgmvDora => "bgmv_dora.cu",
            Family::BgmvEntryDora => "bgmv_entry_dora.cu",
            Family::BgmvRowsDora => "bgmv_rows_dora.cu",
            other => other.file(),
        }
    }

    /// The source file the family compiles.
    pub(crate) fn file(self) -> &'static str {
        match self {
            Family::Bgmv | Family::BgmvDora => "bgmv.cu",
            Family::BgmvEntry | Family::BgmvEntryDora => "bgmv_entry.cu",
            Family::BgmvRows | Family::BgmvRowsDora => "bgmv_rows.cu",
            Family::Sgmv => "sgmv.cu",
            Family::MoeIndex => "moe_index.cu",
            Family::Overlay => "overlay.cu",
            Family::Repack => "repack.cu",
            Family::Occupancy => "occupancy.cu",
            Family::Dora => "dora.cu",
            Family::RankSplit => "rank_split.cu",
        }
    }

    fn body(self) -> &'static str {
        match self {
            Family::Bgmv | Family::BgmvDora => include_str!("../cuda/bgmv.cu"),
            Family::BgmvEntry | Family::BgmvEntryDora => include_str!("../cuda/bgmv_entry.cu"),
            Family::BgmvRows | Family::BgmvRowsDora => include_str!("../cuda/bgmv_rows.cu"),
            Family::Sgmv => include_str!("../cuda/sgmv.cu"),
            Family::MoeIndex => include_str!("../cuda/moe_index.cu"),
            Family::Overlay => include_str!("../cuda/overlay.cu"),
            Family::Repack => include_str!("../cuda/repack.cu"),
            Family::Occupancy => include_str!("../cuda/occupancy.cu"),
            Family::Dora => include_str!("../cuda/dora.cu"),
            Family::RankSplit => include_str!("../cuda/rank_split.cu"),
        }
    }

    /// The headers compiled before the family's file, after `common.cuh`.
    fn headers(self) -> &'static [(&'static str, &'static str)] {
        match self {
            _ if self.decode_dora().is_some() => &[("ptx.cuh", PTX), ("cluster.cuh", CLUSTER), ("decode.cuh", DECODE)],
            Family::Sgmv => &[("ptx.cuh", PTX)],
            _ => &[],
        }
    }

    /// The full translation unit NVRTC compiles.
    pub(crate) fn source(self) -> String {
        let mut src = prelude();
        if let Some(dora) = self.decode_dora() {
            src.push_str(&format!("#define DECODE_DORA {}\n", u8::from(dora)));
        }
        src.push_str(&format!("#line 1 \"common.cuh\"\n{COMMON}\n"));
        for (file, body) in self.headers() {
            src.push_str(&format!("#line 1 \"{file}\"\n{body}\n"));
        }
        src.push_str(&format!("#line 1 \"{}\"\n{}", self.file(), self.body()));
        src
    }
}

/// A kernel: its family and its `extern "C"` name.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kernel {
    pub(crate) family: Family,
    pub(crate) name: &'static str,
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Launch {
    pub(crate) grid: (u32, u32, u32),
    pub(crate) block: u32,
    /// Dynamic shared memory bytes.
    pub(crate) smem: u32,
}

pub(crate) fn driver_err(call: &'static str) -> impl Fn(DriverError) -> KernelError {
    move |e| KernelError::Driver {
        call,
        detail: format!("{e:?}"),
    }
}

fn cublas_err(call: &'static str) -> impl Fn(CublasError) -> KernelError {
    move |e| KernelError::Cublas {
        call,
        detail: format!("{e:?}"),
    }
}

/// Modules and functions loaded into one device's primary context.
#[derive(Default)]
struct ModuleCache {
    modules: Mutex<HashMap<Family, Arc<CudaModule>>>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
}

/// Per-ordinal caches: every `Device` on an ordinal shares the primary
/// context, so a family is compiled once per process and device.
fn module_cache(ordinal: usize) -> Arc<ModuleCache> {
    static CACHES: OnceLock<Mutex<HashMap<usize, Arc<ModuleCache>>>> = OnceLock::new();
    let caches = CACHES.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = caches.lock().unwrap_or_else(|p| p.into_inner());
    map.entry(ordinal).or_default().clone()
}

/// One CUDA device as this crate uses it: a context, the compute stream
/// (every apply, every graph), the copy stream (swap copies and repacks,
/// [`crate::Lane::Copy`]), a fault word.
pub(crate) struct CudaBackend {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// Where a swap's copies and repack run beside the compute stream; the
    /// caller orders the two with events ([`crate::Device::record_event_on`],
    /// [`crate::Device::wait_event`]).
    pub(crate) copy_stream: Arc<CudaStream>,
    pub(crate) name: String,
    pub(crate) compute_capability: (i32, i32),
    /// Kernels are built for the arch-specific target (`sm_90a`), so the
    /// wgmma kernels run here ([`arch_specific`]).
    pub(crate) wgmma: bool,
    pub(crate) sm_count: u32,
    pub(crate) l2_bytes: usize,
    /// Shared memory one block may opt in to.
    pub(crate) smem_optin: usize,
    /// Shared memory of one multiprocessor.
    pub(crate) smem_per_sm: usize,
    /// `cuDriverGetVersion` (e.g. 13000 for CUDA 13.0): which driver calls exist.
    pub(crate) driver_version: i32,
    /// Most clusters of 8 resident at once with 1..=4 blocks a
    /// multiprocessor, as the driver answers (`DeviceLimits::clusters_of_8`).
    pub(crate) clusters_of_8: [usize; 4],
    modules: Arc<ModuleCache>,
    fault: Mutex<CudaSlice<u32>>,
    /// Scratch of multi-launch ops (the two-phase decode); locked for the
    /// whole sequence of launches that shares it.
    scratch: Box<Mutex<CudaSlice<u8>>>,
    /// The spread form's inboxes ([`SPREAD_INBOX_WORDS`] a block, a block a
    /// multiprocessor), allocated zeroed; each launch leaves them zero.
    spread_inbox: Box<Mutex<CudaSlice<u64>>>,
    /// The cuBLAS handle, created at first use and bound to `stream`
    /// ([`CudaBackend::sgemm_nt`]); locked for each call, since one handle
    /// must not be used by two threads at once.
    blas: Mutex<Option<CudaBlas>>,
}

/// 64-bit words of one block's inbox in the spread form (`BGS_INBOX_WORDS`:
/// 2 passes x 8 senders x 128 words).
pub(crate) const SPREAD_INBOX_WORDS: usize = 2 * 8 * 128;

/// What a launch issued now on the backend's stream would follow, as far as
/// the driver can tell (`CudaBackend::predecessor`). A programmatic
/// dependent launch overlaps only a kernel it follows in the same stream or
/// graph; a graph's root node follows nothing (a graph launch waits for the
/// stream's previous work whole).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Predecessor {
    /// Not capturing, or a driver too old to say (before CUDA 12.3): a kernel
    /// issued earlier may still be running.
    Unknown,
    /// Captured after kernel nodes only.
    Kernels,
    /// Captured as a root node, or after a node that is not a kernel (a copy,
    /// a memset, an event): no kernel runs while this launch starts.
    NoKernel,
}

/// First driver with `cuStreamGetCaptureInfo_v3` (CUDA 12.3).
pub(crate) const CAPTURE_INFO_V3_DRIVER: i32 = 12030;

/// Bytes of the backend's launch scratch ([`CudaBackend::with_scratch`]).
pub(crate) const SCRATCH_BYTES: usize = 8 << 20;

/// Whether both CUDA libraries can be loaded.
pub(crate) fn libraries_present() -> Result<(), KernelError> {
    // SAFETY: `is_culib_present` only tries `dlopen` on the library's candidate
    // names and drops the handle; it touches no other state.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(KernelError::DriverMissing);
    }
    // SAFETY: as above, for libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(KernelError::NvrtcMissing);
    }
    Ok(())
}

pub(crate) fn open(ordinal: usize) -> Result<CudaBackend, KernelError> {
    libraries_present()?;
    let count = CudaContext::device_count().map_err(driver_err("cuDeviceGetCount"))?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(KernelError::NoSuchDevice { ordinal, count });
    }
    let ctx = CudaContext::new(ordinal).map_err(driver_err("cuDevicePrimaryCtxRetain"))?;
    // SAFETY: this backend issues everything on its compute stream (below),
    // so that stream orders every device-side use of every buffer, except the
    // operations a caller queues on the copy stream by naming `Lane::Copy`
    // (uploads, device copies, the repack and its value scan): those touch
    // only buffers the caller keeps from every compute-stream reader until it
    // has ordered the two streams with this crate's events
    // (`Device::record_event_on`, `Device::wait_event`), as the pool's
    // publish does. So cudarc's cross-stream event tracking is not needed,
    // and its events must not land in captured graphs. The one host-side
    // hazard that tracking also covered — rewriting a pinned host buffer
    // while a copy from it is still queued — is handled by `PinnedHostBuffer`,
    // which records its own event (on the copy's stream) after every upload
    // and waits for it before handing out its memory.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
    let copy_stream = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
    let name = ctx.name().map_err(driver_err("cuDeviceGetName"))?;
    let compute_capability = ctx.compute_capability().map_err(driver_err("cuDeviceGetAttribute"))?;
    let sm_count = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(driver_err("cuDeviceGetAttribute"))?;
    let l2 = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        .map_err(driver_err("cuDeviceGetAttribute"))?;
    let optin = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(driver_err("cuDeviceGetAttribute"))?;
    let per_sm = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
        .map_err(driver_err("cuDeviceGetAttribute"))?;
    let fault = stream.alloc_zeros::<u32>(1).map_err(driver_err("cuMemAlloc"))?;
    let scratch = stream
        .alloc_zeros::<u8>(SCRATCH_BYTES)
        .map_err(driver_err("cuMemAlloc"))?;
    let sms = u32::try_from(sm_count).unwrap_or(1).max(1);
    let mut driver_version = 0;
    // SAFETY: the driver writes one int; on failure it stays 0 ("too old").
    let _ = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) };
    let spread_inbox = stream
        .alloc_zeros::<u64>(sms as usize * SPREAD_INBOX_WORDS)
        .map_err(driver_err("cuMemAlloc"))?;
    let mut backend = CudaBackend {
        ctx,
        stream,
        copy_stream,
        name,
        compute_capability,
        wgmma: arch_specific(compute_capability),
        sm_count: sms,
        l2_bytes: usize::try_from(l2).unwrap_or(0),
        smem_optin: usize::try_from(optin).unwrap_or(48 * 1024),
        smem_per_sm: usize::try_from(per_sm).unwrap_or(64 * 1024),
        driver_version,
        clusters_of_8: [0; 4],
        modules: module_cache(ordinal),
        fault: Mutex::new(fault),
        scratch: Box::new(Mutex::new(scratch)),
        spread_inbox: Box::new(Mutex::new(spread_inbox)),
        blas: Mutex::new(None),
    };
    if compute_capability.0 >= 9 {
        backend.clusters_of_8 = backend.query_clusters_of_8()?;
    }
    // The backend's own buffers were zeroed on the compute stream; copy-lane
    // work (a value scan may raise the fault flag) comes after that.
    backend.copy_lane_after_compute()?;
    Ok(backend)
}

/// Shared memory the driver reserves for each resident block (sm_80 and newer), bytes.
const RESERVED_SMEM_PER_BLOCK: usize = 1024;

/// Whether kernels for `compute_capability` are compiled for its
/// arch-specific target: `sm_90a` (wgmma) on compute capability 9.0, where
/// the NVRTC found is CUDA 12.0 or newer (older ones know only `sm_90`, and
/// the kernels then build without the wgmma forms).
pub(crate) fn arch_specific(compute_capability: (i32, i32)) -> bool {
    static NVRTC: OnceLock<Option<(i32, i32)>> = OnceLock::new();
    arch_specific_with(compute_capability, *NVRTC.get_or_init(nvrtc_version))
}

/// [`arch_specific`] for a given NVRTC version (`None`: no NVRTC).
fn arch_specific_with(compute_capability: (i32, i32), nvrtc: Option<(i32, i32)>) -> bool {
    compute_capability == (9, 0) && nvrtc.is_some_and(|v| v >= (12, 0))
}

/// NVRTC's (major, minor) version, where the library loads.
fn nvrtc_version() -> Option<(i32, i32)> {
    // SAFETY: `is_culib_present` only tries `dlopen` (see `libraries_present`);
    // `nvrtcVersion` writes two ints through valid pointers.
    unsafe {
        if !cudarc::nvrtc::sys::is_culib_present() {
            return None;
        }
        let (mut major, mut minor) = (0, 0);
        let status = cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor);
        (status == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
    }
}

/// Folders searched for CUDA headers (kernels include none today; kept so a
/// family may include `cuda_bf16.h` without breaking the build).
fn include_dirs() -> Vec<String> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(v) = std::env::var(var) {
            dirs.push(format!("{v}/include"));
        }
    }
    dirs.push("/usr/local/cuda/include".to_string());
    dirs.into_iter().filter(|d| std::path::Path::new(d).is_dir()).collect()
}

/// Set to `1` to compile the kernels with source line information (for a profiler).
pub(crate) const LINEINFO_ENV: &str = "LORA_NVRTC_LINEINFO";

/// Compile one family to PTX for `sm_{major}{minor}` with NVRTC (no driver needed).
pub(crate) fn compile_family(family: Family, compute_capability: (i32, i32)) -> Result<String, KernelError> {
    compile_source(family.module_name(), &family.source(), compute_capability)
}

/// Compile a translation unit named `file` to PTX; a rejection carries NVRTC's log.
pub(crate) fn compile_source(
    file: &'static str,
    source: &str,
    compute_capability: (i32, i32),
) -> Result<String, KernelError> {
    // SAFETY: see `libraries_present`; compiling needs NVRTC only, not the driver.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(KernelError::NvrtcMissing);
    }
    let (major, minor) = compute_capability;
    // sm_90a's arch-specific instructions (wgmma) run on that capability
    // only: the code is built for the device it loads on.
    let suffix = if arch_specific(compute_capability) { "a" } else { "" };
    let mut options = vec![
        format!("--gpu-architecture=sm_{major}{minor}{suffix}"),
        "-std=c++17".to_string(),
    ];
    options.extend(include_dirs().into_iter().map(|d| format!("--include-path={d}")));
    // Source lines for a profiler's per-line view; the machine code is the same.
    if std::env::var(LINEINFO_ENV).is_ok_and(|v| v == "1") {
        options.push("--generate-line-info".to_string());
    }
    let opts = CompileOptions {
        options,
        name: Some(file.to_string()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| match e {
        CompileError::CompileError { log, .. } => KernelError::Compile {
            module: file,
            log: log.to_string_lossy().into_owned(),
        },
        other => KernelError::Compile {
            module: file,
            log: format!("{other:?}"),
        },
    })?;
    Ok(ptx.to_src())
}

impl CudaBackend {
    /// The module of `family`, compiled and loaded at first use.
    fn module(&self, family: Family) -> Result<Arc<CudaModule>, KernelError> {
        let mut modules = self.modules.modules.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = modules.get(&family) {
            return Ok(m.clone());
        }
        let ptx = compile_family(family, self.compute_capability)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(driver_err("cuModuleLoadData"))?;
        modules.insert(family, module.clone());
        Ok(module)
    }

    fn function(&self, kernel: Kernel) -> Result<CudaFunction, KernelError> {
        {
            let functions = self.modules.functions.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(f) = functions.get(kernel.name) {
                return Ok(f.clone());
            }
        }
        let module = self.module(kernel.family)?;
        let f = module
            .load_function(kernel.name)
            .map_err(driver_err("cuModuleGetFunction"))?;
        // Let every kernel take all the dynamic shared memory a block may opt in to.
        let static_smem = f.shared_size_bytes().map_err(driver_err("cuFuncGetAttribute"))?;
        let dynamic = i32::try_from(self.smem_optin).unwrap_or(i32::MAX) - static_smem;
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            dynamic.max(0),
        )
        .map_err(driver_err("cuFuncSetAttribute"))?;
        let mut functions = self.modules.functions.lock().unwrap_or_else(|p| p.into_inner());
        functions.insert(kernel.name, f.clone());
        Ok(f)
    }

    /// Most clusters of 8 blocks of 256 threads resident at once when the
    /// dynamic shared memory lets 1, 2, 3 or 4 blocks share a
    /// multiprocessor (`cuOccupancyMaxActiveClusters`; sm_90 and newer).
    fn query_clusters_of_8(&self) -> Result<[usize; 4], KernelError> {
        use cudarc::driver::sys;
        let f = self.function(Kernel {
            family: Family::Occupancy,
            name: "occupancy_probe",
        })?;
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        let mut answers = [0usize; 4];
        for (i, answer) in answers.iter_mut().enumerate() {
            let blocks = i + 1;
            let smem = (self.smem_per_sm / blocks)
                .saturating_sub(RESERVED_SMEM_PER_BLOCK)
                .min(self.smem_optin);
            // SAFETY: a zeroed attribute is a valid bit pattern (an id and a plain-data union).
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attr.value.clusterDim.x = 8;
            attr.value.clusterDim.y = 1;
            attr.value.clusterDim.z = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: 8,
                gridDimY: 1,
                gridDimZ: 1,
                blockDimX: 256,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: u32::try_from(smem).unwrap_or(u32::MAX),
                hStream: self.stream.cu_stream(),
                attrs: &mut attr,
                numAttrs: 1,
            };
            let mut clusters: std::ffi::c_int = 0;
            // SAFETY: `f` is a loaded function of this context (bound above);
            // `config` and `attr` outlive the call, which only reads them and
            // writes one int through a valid pointer. Nothing is launched.
            unsafe { sys::cuOccupancyMaxActiveClusters(&mut clusters, f.cu_function(), &config) }
                .result()
                .map_err(driver_err("cuOccupancyMaxActiveClusters"))?;
            *answer = usize::try_from(clusters).unwrap_or(0);
        }
        Ok(answers)
    }

    /// Compile and load every family now, so no compilation happens later
    /// (e.g. inside a graph capture).
    pub(crate) fn preload(&self) -> Result<(), KernelError> {
        for family in Family::ALL {
            self.module(family)?;
        }
        Ok(())
    }

    /// Launch `kernel` with one by-value parameter struct.
    ///
    /// # Safety
    /// `P` must be the exact `#[repr(C)]` mirror of the kernel's parameter
    /// struct, and every device address in it must be valid for what the
    /// kernel reads and writes for this launch shape.
    pub(crate) unsafe fn launch<P>(&self, kernel: Kernel, launch: Launch, params: &P) -> Result<(), KernelError> {
        // SAFETY: the caller's guarantees, forwarded.
        unsafe { self.launch_on(crate::Lane::Compute, kernel, launch, params) }
    }

    /// The stream `lane` names.
    pub(crate) fn lane_stream(&self, lane: crate::Lane) -> &Arc<CudaStream> {
        match lane {
            crate::Lane::Compute => &self.stream,
            crate::Lane::Copy => &self.copy_stream,
        }
    }

    /// [`Self::launch`] on `lane`'s stream.
    ///
    /// # Safety
    /// As [`Self::launch`]; on [`crate::Lane::Copy`] the caller also orders
    /// the kernel against compute-stream work on the same buffers.
    pub(crate) unsafe fn launch_on<P>(
        &self,
        lane: crate::Lane,
        kernel: Kernel,
        launch: Launch,
        params: &P,
    ) -> Result<(), KernelError> {
        let f = self.function(kernel)?;
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        let mut args = [params as *const P as *mut c_void];
        // SAFETY: the caller guarantees the parameter layout and addresses;
        // `args` outlives the call, and cuLaunchKernel copies the parameters.
        unsafe {
            cudarc::driver::result::launch_kernel(
                f.cu_function(),
                launch.grid,
                (launch.block, 1, 1),
                launch.smem,
                self.lane_stream(lane).cu_stream(),
                &mut args,
            )
        }
        .map_err(driver_err("cuLaunchKernel"))
    }

    /// [`Self::launch`], as a programmatic dependent launch when `dependent`
    /// and the device has them (sm_90 and newer; a plain launch otherwise):
    /// the kernel's blocks may then start while the stream's previous kernel
    /// still runs (once all of that kernel's blocks ran
    /// `griddepcontrol.launch_dependents` or exited), so they get resident early.
    ///
    /// # Safety
    /// As [`Self::launch`]; in addition the kernel must execute
    /// `griddepcontrol.wait` (which waits for the previous kernel to complete
    /// and its writes to be visible) before it touches memory that kernel writes.
    pub(crate) unsafe fn launch_chained<P>(
        &self,
        kernel: Kernel,
        launch: Launch,
        params: &P,
        dependent: bool,
    ) -> Result<(), KernelError> {
        if !dependent || self.compute_capability.0 < 9 {
            // SAFETY: the caller's guarantees are those of `launch`.
            return unsafe { self.launch(kernel, launch, params) };
        }
        // SAFETY: the caller's guarantees are those of this function.
        unsafe { self.launch_with_attributes(kernel, launch, params, dependent, false) }
    }

    /// A programmatic dependent launch where `dependent` (sm_90 and newer),
    /// else a cooperative one: every block of the grid resident at once, or
    /// the launch fails (kernels whose blocks wait for one another; a
    /// dependent one must keep its grid within what is resident at once).
    ///
    /// # Safety
    /// As [`Self::launch_chained`].
    pub(crate) unsafe fn launch_resident<P>(
        &self,
        kernel: Kernel,
        launch: Launch,
        params: &P,
        dependent: bool,
    ) -> Result<(), KernelError> {
        let dependent = dependent && self.compute_capability.0 >= 9;
        // SAFETY: the caller's guarantees are those of this function.
        unsafe { self.launch_with_attributes(kernel, launch, params, dependent, !dependent) }
    }

    /// `cuLaunchKernelEx` with the programmatic-dependent or cooperative attribute.
    ///
    /// # Safety
    /// As [`Self::launch_chained`].
    unsafe fn launch_with_attributes<P>(
        &self,
        kernel: Kernel,
        launch: Launch,
        params: &P,
        dependent: bool,
        cooperative: bool,
    ) -> Result<(), KernelError> {
        use cudarc::driver::sys;
        let f = self.function(kernel)?;
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        let mut args = [params as *const P as *mut c_void];
        // SAFETY: a zeroed attribute is a valid bit pattern (an id and a plain-data union).
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        if dependent {
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
        } else if cooperative {
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
            attr.value.cooperative = 1;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: launch.grid.0,
            gridDimY: launch.grid.1,
            gridDimZ: launch.grid.2,
            blockDimX: launch.block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: launch.smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(dependent || cooperative),
        };
        // SAFETY: the caller guarantees the parameter layout, addresses and the
        // kernel's wait; `config`, `attr` and `args` outlive the call, which copies them.
        unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(driver_err("cuLaunchKernelEx"))
    }

    /// What a launch issued now would follow ([`Predecessor`]). A snapshot:
    /// another thread capturing on this stream meanwhile may change it, so it
    /// may steer only choices that are correct either way (how a launch is
    /// chained, never what it computes).
    pub(crate) fn predecessor(&self) -> Predecessor {
        use cudarc::driver::sys;
        if self.driver_version < CAPTURE_INFO_V3_DRIVER {
            return Predecessor::Unknown;
        }
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut deps: *const sys::CUgraphNode = std::ptr::null();
        // Non-default edges (a programmatic one) make a query without edge data fail.
        let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
        let mut n_deps = 0usize;
        if self.ctx.bind_to_thread().is_err() {
            return Predecessor::Unknown;
        }
        // SAFETY: the stream is this backend's and alive; the id and graph
        // outputs are optional (null); the rest are valid locals.
        let got = unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                self.stream.cu_stream(),
                &mut status,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut deps,
                &mut edges,
                &mut n_deps,
            )
        };
        if got != sys::CUresult::CUDA_SUCCESS || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
            return Predecessor::Unknown;
        }
        if n_deps == 0 || deps.is_null() {
            return Predecessor::NoKernel;
        }
        // SAFETY: the driver returned `n_deps` nodes at `deps`, valid until
        // the stream's next capture call (none is made while this borrows them).
        let nodes = unsafe { std::slice::from_raw_parts(deps, n_deps) };
        let all_kernels = nodes.iter().all(|&node| {
            let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: `node` is a node of the graph being captured; `kind` a valid local.
            let got = unsafe { sys::cuGraphNodeGetType(node, &mut kind) };
            got == sys::CUresult::CUDA_SUCCESS && kind == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL
        });
        if all_kernels {
            Predecessor::Kernels
        } else {
            Predecessor::NoKernel
        }
    }

    /// Device address of the fault word.
    pub(crate) fn fault_addr(&self) -> u64 {
        use cudarc::driver::DevicePtr;
        let fault = self.fault.lock().unwrap_or_else(|p| p.into_inner());
        let (ptr, _sync) = fault.device_ptr(&self.stream);
        ptr
    }

    /// Run `f` with the device address of the launch scratch
    /// ([`SCRATCH_BYTES`]), holding it so that launches of another thread
    /// cannot land between the launches `f` issues (one stream orders them).
    pub(crate) fn with_scratch<R>(&self, f: impl FnOnce(u64) -> R) -> R {
        use cudarc::driver::DevicePtr;
        let scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let (ptr, _sync) = scratch.device_ptr(&self.stream);
        f(ptr)
    }

    /// Run `f` with the device address of the spread form's inboxes
    /// (`sm_count` blocks of [`SPREAD_INBOX_WORDS`]), held across the launch.
    pub(crate) fn with_spread_inbox<R>(&self, f: impl FnOnce(u64) -> R) -> R {
        use cudarc::driver::DevicePtr;
        let inbox = self.spread_inbox.lock().unwrap_or_else(|p| p.into_inner());
        let (ptr, _sync) = inbox.device_ptr(&self.stream);
        f(ptr)
    }

    /// `y[n, m] = x[n, k] · w[m, k]^T`, row-major f32, by one cuBLAS SGEMM
    /// on the backend's stream (asynchronous, no synchronisation). The first
    /// call creates the device's cuBLAS handle, bound to that stream; a
    /// missing `libcublas` is [`KernelError::CublasMissing`].
    ///
    /// Row-major `y` is column-major `y^T [m, n]`, so the call computes
    /// `y^T = w · x^T` in cuBLAS's terms: `w`'s row-major `[m, k]` read as
    /// column-major `[k, m]` and transposed (`lda = k`), `x`'s row-major
    /// `[n, k]` as column-major `[k, n]` (`ldb = k`), `ldc = m`.
    ///
    /// # Safety
    /// `x`, `w` and `y` must be addresses of live allocations of this
    /// device holding at least `n * k`, `m * k` and `n * m` f32s, `y` must
    /// overlap neither `x` nor `w`, and `n`, `k`, `m` must be positive.
    pub(crate) unsafe fn sgemm_nt(&self, x: u64, w: u64, y: u64, n: i32, k: i32, m: i32) -> Result<(), KernelError> {
        use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let mut blas = self.blas.lock().unwrap_or_else(|p| p.into_inner());
        let handle = match &*blas {
            Some(b) => *b.handle(),
            None => {
                // SAFETY: as in `libraries_present`: a `dlopen` attempt on the
                // library's candidate names, nothing else.
                if !unsafe { cudarc::cublas::sys::is_culib_present() } {
                    return Err(KernelError::CublasMissing);
                }
                let created = CudaBlas::new(self.stream.clone()).map_err(cublas_err("cublasCreate"))?;
                let handle = *created.handle();
                *blas = Some(created);
                handle
            }
        };
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the handle is this backend's (held locked for the call) and
        // issues on its stream; `alpha` and `beta` are host scalars alive for
        // the call (the handle's default host pointer mode); the caller
        // guarantees the three allocations, their sizes for these leading
        // dimensions (k >= 1 for `w` and `x`, m >= 1 for `y`) and that `y`
        // aliases neither input.
        unsafe {
            cudarc::cublas::result::sgemm(
                handle,
                CUBLAS_OP_T,
                CUBLAS_OP_N,
                m,
                n,
                k,
                &alpha,
                w as *const f32,
                k,
                x as *const f32,
                k,
                &beta,
                y as *mut f32,
                m,
            )
        }
        .map_err(cublas_err("cublasSgemm"))
    }

    /// Read and clear the fault word (synchronises the stream).
    pub(crate) fn take_faults(&self) -> Result<u32, KernelError> {
        let mut fault = self.fault.lock().unwrap_or_else(|p| p.into_inner());
        let v = self.stream.clone_dtoh(&*fault).map_err(driver_err("cuMemcpyDtoH"))?;
        self.stream
            .memset_zeros(&mut *fault)
            .map_err(driver_err("cuMemsetD8"))?;
        self.synchronize()?;
        Ok(v.first().copied().unwrap_or(0))
    }

    pub(crate) fn synchronize(&self) -> Result<(), KernelError> {
        self.copy_stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))?;
        self.stream.synchronize().map_err(driver_err("cuStreamSynchronize"))
    }

    pub(crate) fn mem_info(&self) -> Result<(usize, usize), KernelError> {
        self.ctx.mem_get_info().map_err(driver_err("cuMemGetInfo"))
    }

    /// Make the copy lane wait, on the device, for everything queued on the
    /// compute lane so far: a buffer allocated and zeroed there is then
    /// usable on either lane (the allocation and its zeroing are stream
    /// ordered on the compute lane only).
    pub(crate) fn copy_lane_after_compute(&self) -> Result<(), KernelError> {
        let allocated = self.record_event_on(crate::Lane::Compute)?;
        self.wait_event(crate::Lane::Copy, &allocated)
    }

    /// An event recorded at the current end of `lane`'s stream.
    pub(crate) fn record_event_on(&self, lane: crate::Lane) -> Result<CudaEvent, KernelError> {
        self.lane_stream(lane)
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver_err("cuEventRecord"))
    }

    /// Make `lane`'s stream wait (on the device) for `event`.
    pub(crate) fn wait_event(&self, lane: crate::Lane, event: &CudaEvent) -> Result<(), KernelError> {
        self.lane_stream(lane)
            .wait(event)
            .map_err(driver_err("cuStreamWaitEvent"))
    }

    /// Capture what `f` issues on the stream into an instantiated graph.
    pub(crate) fn capture<F>(&self, f: F) -> Result<CudaGraph, KernelError>
    where
        F: FnOnce() -> Result<(), KernelError>,
    {
        // Relaxed mode: a first-use module load inside the closure is allowed.
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(driver_err("cuStreamBeginCapture"))?;
        let body = f();
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        body?;
        graph
            .map_err(driver_err("cuStreamEndCapture"))?
            .ok_or_else(|| KernelError::InvalidArgument {
                arg: "graph",
                reason: "captured an empty graph".into(),
            })
    }
}

/// Time between two recorded events, in milliseconds.
pub(crate) fn elapsed_ms(start: &CudaEvent, end: &CudaEvent) -> Result<f32, KernelError> {
    start.elapsed_ms(end).map_err(driver_err("cuEventElapsedTime"))
}

pub(crate) fn replay(graph: &CudaGraph) -> Result<(), KernelError> {
    graph.launch().map_err(driver_err("cuGraphLaunch"))
}

#[cfg(test)]
mod tests {
    use super::arch_specific_with;

    #[test]
    fn sm_90a_needs_capability_9_0_and_a_cuda_12_nvrtc() {
        assert!(arch_specific_with((9, 0), Some((12, 0))));
        assert!(arch_specific_with((9, 0), Some((13, 0))));
        // CUDA 11.8's NVRTC knows sm_90 but not sm_90a; without NVRTC nothing compiles.
        assert!(!arch_specific_with((9, 0), Some((11, 8))));
        assert!(!arch_specific_with((9, 0), None));
        // Other capabilities compile for their plain target.
        assert!(!arch_specific_with((8, 0), Some((13, 0))));
        assert!(!arch_specific_with((10, 0), Some((13, 0))));
    }
}
