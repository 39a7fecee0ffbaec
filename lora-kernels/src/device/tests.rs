use super::*;
use crate::testing::gpu_required;

#[test]
fn cpu_device_reports_itself() {
    let d = Device::cpu();
    assert_eq!(d.kind(), DeviceKind::Cpu);
    assert!(!d.is_cuda());
    assert_eq!(d.name(), "cpu");
    assert!(d.compute_capability().is_none());
    assert!(d.same_as(&d.clone()));
    assert!(!d.same_as(&Device::cpu()));
    d.synchronize().unwrap();
    d.preload_kernels().unwrap();
    assert!(d.take_faults().unwrap().is_empty());
    if let Ok((free, total)) = d.memory_info() {
        assert!(free <= total && total > 0);
    }
}

#[test]
fn best_falls_back_to_cpu_with_a_reason() {
    let (d, reason) = Device::best();
    assert_eq!(d.is_cuda(), reason.is_none());
}

#[test]
fn graphs_are_refused_on_cpu() {
    let d = Device::cpu();
    let err = d.capture_graph(|| Ok(())).err().map(|e| e.to_string());
    assert!(err.is_some_and(|e| e.contains("not supported on cpu")));
}

#[test]
fn cpu_events_measure_host_time() {
    let d = Device::cpu();
    let a = d.record_event().unwrap();
    let b = d.record_event().unwrap();
    assert!(a.elapsed_ms(&b).unwrap() >= 0.0);
}

/// The CUDA sources compile with NVRTC for Hopper and Ampere. Needs only
/// libnvrtc (no GPU); skipped without it unless LORA_REQUIRE_GPU=1.
#[test]
#[ignore = "needs libnvrtc: run with --include-ignored where CUDA is installed"]
fn kernels_compile_with_nvrtc() {
    for cc in [(9, 0), (8, 0)] {
        match compile_all_kernels(cc) {
            Ok(()) => {}
            Err(KernelError::NvrtcMissing) if !gpu_required() => {
                eprintln!("skipping kernels_compile_with_nvrtc: libnvrtc not found");
                return;
            }
            Err(e) => panic!("sm_{}{}: {e}", cc.0, cc.1),
        }
    }
}

#[test]
#[ignore = "needs libnvrtc: run with --include-ignored where CUDA is installed"]
fn a_compile_error_carries_the_nvrtc_log() {
    match cuda_rt::compile_source(
        "broken.cu",
        "extern \"C\" __global__ void k() { undefined_symbol(); }",
        (9, 0),
    ) {
        Err(KernelError::Compile { module, log }) => {
            assert_eq!(module, "broken.cu");
            assert!(log.contains("undefined_symbol"), "log: {log}");
        }
        Err(KernelError::NvrtcMissing) if !gpu_required() => eprintln!("skipping: libnvrtc not found"),
        other => panic!("expected a compile error, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_cpu_memory_limit_refuses_allocations_past_it_and_frees_on_drop() {
    let d = Device::cpu_with_memory_limit(1000);
    assert_eq!(d.memory_info().unwrap(), (1000, 1000));
    let a = d.alloc_zeros::<f32>(200).unwrap();
    assert_eq!(d.memory_info().unwrap(), (200, 1000));
    let r = d.alloc_zeros::<f32>(51);
    assert!(
        matches!(
            r,
            Err(KernelError::OutOfMemory {
                requested: 204,
                free: 200
            })
        ),
        "{r:?}"
    );
    let b = d.alloc_zeros::<u8>(200).unwrap();
    assert_eq!(d.memory_info().unwrap(), (0, 1000));
    drop(a);
    assert_eq!(d.memory_info().unwrap(), (800, 1000));
    drop(b);
    d.alloc_zeros::<u8>(1000).unwrap();
}

/// What a launch would follow, from the driver's capture state: unknown
/// outside a capture; no kernel at a graph's root and after a memset;
/// kernels after a plain launch and after a programmatic dependent one
/// (whose edge is not a default one).
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_the_predecessor_follows_the_capture() {
    use crate::cuda_rt::Predecessor;
    use crate::ops::launch_floor::{empty_launch, empty_launch_on};
    let Some(gpu) = crate::testing::cuda_or_skip("gpu_the_predecessor_follows_the_capture") else {
        return;
    };
    let Backend::Cuda(c) = gpu.backend() else {
        panic!("cuda_or_skip returned a CPU device");
    };
    gpu.preload_kernels().unwrap();
    assert_eq!(c.predecessor(), Predecessor::Unknown);
    let mut buf = gpu.alloc_zeros::<u32>(64).unwrap();
    let mut seen = Vec::new();
    let graph = gpu
        .capture_graph(|| {
            seen.push(c.predecessor());
            empty_launch(&gpu)?;
            seen.push(c.predecessor());
            buf.zero_range(0, 64)?;
            seen.push(c.predecessor());
            empty_launch(&gpu)?;
            empty_launch_on(c, true)?;
            seen.push(c.predecessor());
            Ok(())
        })
        .unwrap();
    graph.replay().unwrap();
    gpu.synchronize().unwrap();
    assert_eq!(c.predecessor(), Predecessor::Unknown);
    let expected = if c.driver_version >= crate::cuda_rt::CAPTURE_INFO_V3_DRIVER {
        [
            Predecessor::NoKernel,
            Predecessor::Kernels,
            Predecessor::NoKernel,
            Predecessor::Kernels,
        ]
    } else {
        [Predecessor::Unknown; 4]
    };
    assert_eq!(seen, expected, "driver {}", c.driver_version);
}
