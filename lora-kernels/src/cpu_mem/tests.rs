use super::*;

fn label() -> String {
    "test".to_string()
}

#[test]
fn addresses_resolve_within_their_allocation() {
    let mem = CpuMemory::new();
    let a = mem.alloc(64).unwrap();
    let b = mem.alloc(1000).unwrap();
    assert_ne!(a.base(), 0);
    assert_eq!(a.base() % BASE_ALIGN, 0);
    assert!(b.base() >= a.base() + 64 + GUARD_GAP);
    a.with_bytes_mut(|bytes| bytes.copy_from_slice(&(0..64u8).collect::<Vec<_>>()));
    let v: Vec<u32> = mem.read(&label, a.base() + 8, 4).unwrap();
    assert_eq!(v[0], u32::from_le_bytes([8, 9, 10, 11]));
    let last: Vec<u8> = mem.read(&label, a.base() + 63, 1).unwrap();
    assert_eq!(last, [63]);
}

#[test]
fn bad_addresses_are_errors() {
    let mem = CpuMemory::new();
    let a = mem.alloc(64).unwrap();
    let reason = |r: Result<Vec<u8>, KernelError>| match r {
        Err(KernelError::BadAddress { reason, .. }) => reason,
        other => panic!("expected BadAddress, got {other:?}"),
    };
    assert_eq!(reason(mem.read(&label, 0, 1)), "is null");
    assert_eq!(
        reason(mem.read(&label, a.base() + 60, 8)),
        "runs past the end of its allocation"
    );
    assert_eq!(
        reason(mem.read(&label, a.base() + 64, 1)),
        "runs past the end of its allocation"
    );
    assert_eq!(
        reason(mem.read(&label, a.base() - 1, 1)),
        "is not inside any live allocation"
    );
    assert_eq!(
        reason(mem.read(&label, u64::MAX - 2, 8)),
        "runs past the end of its allocation"
    );
    match mem.read::<u64>(&label, a.base(), usize::MAX) {
        Err(KernelError::BadAddress { reason, .. }) => assert_eq!(reason, "range overflows"),
        other => panic!("expected an overflow, got {other:?}"),
    }
    match mem.read::<u32>(&label, a.base() + 2, 1) {
        Err(KernelError::BadAddress { reason, .. }) => assert_eq!(reason, "is misaligned for its type"),
        other => panic!("expected misalignment, got {other:?}"),
    }
}

#[test]
fn freed_allocations_stop_resolving_and_addresses_are_never_reused() {
    let mem = CpuMemory::new();
    let a = mem.alloc(128).unwrap();
    let base = a.base();
    drop(a);
    assert!(mem.read::<u8>(&label, base, 1).is_err());
    let b = mem.alloc(128).unwrap();
    assert_ne!(b.base(), base);
}

#[test]
fn another_devices_addresses_do_not_resolve() {
    let (m1, m2) = (CpuMemory::new(), CpuMemory::new());
    let a = m1.alloc(16).unwrap();
    let _b = m2.alloc(4096).unwrap();
    // m2's allocation starts at the same synthetic base; a is not in m2.
    assert!(m1.read::<u8>(&label, a.base(), 16).is_ok());
    assert!(m2.read::<u8>(&label, a.base() + 4096, 1).is_err());
}
