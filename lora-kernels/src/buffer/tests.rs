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
