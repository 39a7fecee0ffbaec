use super::*;
use crate::testing::Rng;

#[test]
fn upload_download_write_copy_zero() {
    let d = Device::cpu();
    let mut rng = Rng::new(1);
    let data: Vec<u64> = (0..100).map(|_| rng.next_u64()).collect();
    let mut a = d.upload(&data).unwrap();
    assert_eq!(a.len(), 100);
    assert_eq!(a.download().unwrap(), data);
    a.write(90, &data[..10]).unwrap();
    assert_eq!(a.download_range(90, 10).unwrap(), &data[..10]);
    let mut b = d.alloc_zeros::<u64>(300).unwrap();
    assert!(b.download().unwrap().iter().all(|&v| v == 0));
    b.copy_from(50, &a, 0, 100).unwrap();
    assert_eq!(b.download_range(50, 100).unwrap(), a.download().unwrap());
    b.zero_range(60, 5).unwrap();
    assert!(b.download_range(60, 5).unwrap().iter().all(|&v| v == 0));
    assert_eq!(b.addr_at(3).unwrap(), b.device_addr() + 24);
}

#[test]
fn out_of_range_accesses_are_errors() {
    let d = Device::cpu();
    let mut a = d.alloc_zeros::<f32>(10).unwrap();
    let b = d.alloc_zeros::<f32>(10).unwrap();
    assert!(matches!(a.write(8, &[1.0; 3]), Err(KernelError::OutOfBounds { .. })));
    assert!(matches!(a.download_range(5, 6), Err(KernelError::OutOfBounds { .. })));
    assert!(matches!(
        a.zero_range(usize::MAX, 2),
        Err(KernelError::OutOfBounds { .. })
    ));
    assert!(matches!(a.copy_from(0, &b, 5, 6), Err(KernelError::OutOfBounds { .. })));
    assert!(matches!(a.addr_at(11), Err(KernelError::OutOfBounds { .. })));
    assert!(a.addr_at(10).is_ok());
}

#[test]
fn buffers_of_another_device_are_refused() {
    let (d1, d2) = (Device::cpu(), Device::cpu());
    let mut a = d1.alloc_zeros::<i32>(4).unwrap();
    let b = d2.alloc_zeros::<i32>(4).unwrap();
    assert!(matches!(
        a.copy_from(0, &b, 0, 4),
        Err(KernelError::DeviceMismatch { .. })
    ));
}

#[test]
fn empty_buffers_work() {
    let d = Device::cpu();
    let mut a = d.upload::<u8>(&[]).unwrap();
    assert!(a.is_empty());
    assert!(a.download().unwrap().is_empty());
    a.write(0, &[]).unwrap();
}

#[test]
fn pinned_buffers_upload() {
    let d = Device::cpu();
    let mut p = d.alloc_pinned::<u32>(5).unwrap();
    assert!(p.as_slice().unwrap().iter().all(|&v| v == 0));
    p.as_mut_slice().unwrap().copy_from_slice(&[1, 2, 3, 4, 5]);
    let mut a = d.alloc_zeros::<u32>(8).unwrap();
    a.upload_pinned(3, &p).unwrap();
    assert_eq!(a.download().unwrap(), [0, 0, 0, 1, 2, 3, 4, 5]);
    assert!(a.upload_pinned(4, &p).is_err());
}

#[test]
fn table_entries_round_trip() {
    let d = Device::cpu();
    let e = PairEntry {
        a: 0x1000,
        b: 0x2000,
        scale: 0.5,
        rank: 8,
    };
    let t = d.upload(&[e, PairEntry::default()]).unwrap();
    assert_eq!(t.download().unwrap(), [e, PairEntry::default()]);
}

/// The op an injected fault names, or a panic naming what came instead.
fn injected_op<T: std::fmt::Debug>(r: Result<T, KernelError>) -> &'static str {
    match r {
        Err(KernelError::InjectedFault { op, .. }) => op,
        other => panic!("expected an injected fault, got {other:?}"),
    }
}

#[test]
fn an_injected_fault_fails_one_write_of_each_kind_and_writes_nothing() {
    use crate::ops::repack::{RepackDtype, RepackRegion, repack};
    let d = Device::cpu();
    let src = d.upload(&[half::bf16::ONE; 8]).unwrap();
    let mut dst = d.upload(&[half::bf16::from_f32(3.0); 8]).unwrap();
    let before = dst.download().unwrap();
    let mut pinned = d.alloc_pinned::<half::bf16>(4).unwrap();
    pinned.as_mut_slice().unwrap().fill(half::bf16::from_f32(2.0));
    let region = RepackRegion {
        src_byte: 0,
        dst_elem: 2,
        rows: 1,
        src_cols: 2,
        dst_rows: 1,
        dst_cols: 4,
        dtype: RepackDtype::Bf16 as u32,
        pad: 0,
    };
    type Op<'a> = Box<dyn Fn(&mut DeviceBuffer<half::bf16>) -> Result<(), KernelError> + 'a>;
    let ops: [(&str, Op<'_>); 5] = [
        ("write", Box::new(|b| b.write(1, &[half::bf16::ZERO; 3]))),
        ("write", Box::new(|b| b.upload_pinned(4, &pinned))),
        ("copy", Box::new(|b| b.copy_from(0, &src, 0, 8))),
        ("zero", Box::new(|b| b.zero_range(2, 5))),
        (
            "repack",
            Box::new(|b| {
                let mut scratch = d.alloc_zeros::<RepackRegion>(1)?;
                repack(&d, &src, 16, &[region], &mut scratch, b)
            }),
        ),
    ];
    for (name, op) in &ops {
        d.inject_write_fault_after(0).unwrap();
        let count = d.write_count().unwrap();
        assert_eq!(injected_op(op(&mut dst)), *name);
        assert_eq!(d.write_count(), Some(count + 1), "{name}: the faulted write is counted");
        assert_eq!(
            dst.download().unwrap(),
            before,
            "{name}: a faulted write writes nothing"
        );
        assert!(!d.clear_write_fault(), "{name}: the fault fired and disarmed itself");
        // One-shot: the same write now goes through.
        op(&mut dst).unwrap();
        assert_ne!(dst.download().unwrap(), before, "{name}: the clean write wrote");
        dst.write(0, &before).unwrap();
    }
}

#[test]
fn an_injected_fault_fires_after_n_writes_and_only_real_writes_count() {
    let d = Device::cpu();
    let mut a = d.alloc_zeros::<u32>(4).unwrap();
    let start = d.write_count().unwrap();
    d.inject_write_fault_after(2).unwrap();
    // Refused and empty calls are no writes: they neither count nor fire.
    assert!(matches!(a.write(3, &[1, 2]), Err(KernelError::OutOfBounds { .. })));
    a.write(0, &[]).unwrap();
    a.zero_range(1, 0).unwrap();
    assert_eq!(d.write_count(), Some(start));
    a.write(0, &[1]).unwrap();
    a.write(1, &[2]).unwrap();
    match a.write(2, &[3]) {
        Err(KernelError::InjectedFault { op, write }) => {
            assert_eq!((op, write), ("write", start + 2));
        }
        other => panic!("expected the third write to fault, got {other:?}"),
    }
    a.write(3, &[4]).unwrap();
    assert_eq!(a.download().unwrap(), [1, 2, 0, 4]);
    assert_eq!(d.write_count(), Some(start + 4));
    a.write(0, &[9]).unwrap(); // one-shot: nothing is armed any more
}

#[test]
fn a_write_fault_can_be_cleared_rearmed_and_is_shared_by_clones_only() {
    let d = Device::cpu();
    let other = Device::cpu();
    let mut a = d.alloc_zeros::<u8>(4).unwrap();
    let mut b = other.alloc_zeros::<u8>(4).unwrap();
    assert!(!d.clear_write_fault(), "nothing armed yet");
    d.inject_write_fault_after(0).unwrap();
    assert!(d.clear_write_fault(), "armed and not fired");
    a.write(0, &[1]).unwrap();
    d.inject_write_fault_after(5).unwrap();
    d.clone().inject_write_fault_after(0).unwrap();
    b.write(0, &[1]).unwrap();
    assert_eq!(
        injected_op(a.write(0, &[2])),
        "write",
        "the clone's arming replaced the first"
    );
    a.write(0, &[3]).unwrap();
    assert_eq!(a.download().unwrap(), [3, 0, 0, 0]);
    assert_eq!(b.download().unwrap(), [1, 0, 0, 0]);
    d.inject_write_fault_after(0).unwrap();
    let text = a.zero_range(0, 4).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(text.contains("injected device fault on zero"), "{text}");
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn write_fault_injection_is_refused_on_cuda() {
    let Some(gpu) = crate::testing::cuda_or_skip("write_fault_injection_is_refused_on_cuda") else {
        return;
    };
    assert!(matches!(
        gpu.inject_write_fault_after(0),
        Err(KernelError::Unsupported { .. })
    ));
    assert!(!gpu.clear_write_fault());
    assert_eq!(gpu.write_count(), None);
    let mut a = gpu.alloc_zeros::<u32>(4).unwrap();
    a.write(0, &[1, 2, 3, 4]).unwrap();
    assert_eq!(a.download().unwrap(), [1, 2, 3, 4]);
}

/// An allocation larger than the host can hold is a typed refusal, not an
/// abort or the OOM killer (the check runs before any byte is zeroed).
#[test]
fn a_cpu_allocation_past_host_memory_is_refused() {
    let device = Device::cpu();
    let huge = 1usize << 50; // 1 PiB of f32
    match device.alloc_zeros::<f32>(huge) {
        Err(KernelError::OutOfMemory { requested, .. }) => assert_eq!(requested, huge * 4),
        Err(e) => panic!("expected OutOfMemory, got {e}"),
        Ok(_) => panic!("a 4 PiB allocation succeeded"),
    }
}

#[test]
fn a_pinned_allocation_past_the_hosts_available_memory_is_refused_naming_both_numbers() {
    let Some((free, _)) = crate::device::host_memory_info() else {
        eprintln!("skipping: no /proc/meminfo to check against");
        return;
    };
    let asked = free + (1 << 30);
    match Device::cpu().alloc_pinned::<u8>(asked) {
        Err(KernelError::OutOfHostMemory { requested, free: had }) => {
            assert_eq!(requested, asked);
            assert!(had < requested);
            let text = KernelError::OutOfHostMemory { requested, free: had }.to_string();
            assert!(
                text.contains(&requested.to_string()) && text.contains(&had.to_string()),
                "{text}"
            );
        }
        Err(other) => panic!("expected OutOfHostMemory, got {other}"),
        Ok(_) => panic!("{asked} bytes of pinned memory were taken past {free} available"),
    }
}

/// A buffer allocated while the compute lane is still busy, then written on
/// the copy lane: the write lands after the allocation's zeroing, never
/// under it (the copy lane waits for the compute lane's allocation work).
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn a_fresh_buffer_keeps_a_copy_lane_write_on_cuda() {
    let Some(device) = crate::testing::cuda_or_skip("a_fresh_buffer_keeps_a_copy_lane_write_on_cuda") else {
        return;
    };
    let n = 64 << 20;
    let src = device.alloc_zeros::<f32>(n).unwrap();
    let mut dst = device.alloc_zeros::<f32>(n).unwrap();
    for round in 0..8u64 {
        // Long work on the compute lane, then the allocation behind it.
        for _ in 0..16 {
            dst.copy_from(0, &src, 0, n).unwrap();
        }
        let mut buf = device.alloc_zeros::<u64>(1 << 20).unwrap();
        let want: Vec<u64> = (0..1u64 << 20).map(|i| i ^ (round << 40) | 1).collect();
        buf.write_on(Lane::Copy, 0, &want).unwrap();
        device.synchronize().unwrap();
        assert!(buf.download().unwrap() == want, "round {round}: the write was zeroed");
    }
}
