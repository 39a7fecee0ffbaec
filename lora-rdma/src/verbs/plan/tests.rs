use proptest::prelude::*;

use super::*;

fn limits(max_message: usize, staging_bytes: usize, max_outstanding: usize) -> PlanLimits {
    PlanLimits {
        max_message,
        staging_bytes,
        max_outstanding,
    }
}

#[test]
fn a_large_op_is_split_under_the_message_limit() {
    let ops = [RemoteOp {
        addr: 0x1000,
        rkey: 9,
        len: 10,
    }];
    let batches = plan_reads(&ops, limits(4, 100, 16)).unwrap();
    assert_eq!(batches.len(), 1);
    let lens: Vec<usize> = batches[0].reads.iter().map(|r| r.len).collect();
    assert_eq!(lens, [4, 4, 2]);
    let addrs: Vec<u64> = batches[0].reads.iter().map(|r| r.remote_addr).collect();
    assert_eq!(addrs, [0x1000, 0x1004, 0x1008]);
}

#[test]
fn batches_respect_staging_and_queue_depth() {
    let ops = [
        RemoteOp {
            addr: 0,
            rkey: 1,
            len: 6,
        },
        RemoteOp {
            addr: 100,
            rkey: 2,
            len: 6,
        },
    ];
    let batches = plan_reads(&ops, limits(1 << 20, 8, 16)).unwrap();
    assert_eq!(batches.iter().map(|b| b.bytes).collect::<Vec<_>>(), [8, 4]);
    let batches = plan_reads(&ops, limits(2, 1 << 20, 2)).unwrap();
    assert!(batches.iter().all(|b| b.reads.len() <= 2));
    assert_eq!(batches.len(), 3);
}

#[test]
fn bad_limits_and_wrapping_ranges_are_errors() {
    let op = RemoteOp {
        addr: 0,
        rkey: 1,
        len: 1,
    };
    assert!(matches!(
        plan_reads(&[op], limits(0, 1, 1)),
        Err(PlanError::ZeroLimit(_))
    ));
    let wrap = RemoteOp {
        addr: u64::MAX - 1,
        rkey: 1,
        len: 4,
    };
    assert!(matches!(
        plan_reads(&[op, wrap], limits(8, 8, 8)),
        Err(PlanError::AddressOverflow { op: 1, .. })
    ));
    assert_eq!(plan_reads(&[], limits(1, 1, 1)).unwrap(), vec![]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn every_byte_is_read_once_within_every_limit(
        lens in prop::collection::vec(0usize..300, 0..12),
        max_message in 1usize..64,
        staging_bytes in 1usize..256,
        max_outstanding in 1usize..8,
    ) {
        let ops: Vec<RemoteOp> = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| RemoteOp { addr: 1 << 40 | (i as u64) << 20, rkey: i as u32, len })
            .collect();
        let lim = limits(max_message, staging_bytes, max_outstanding);
        let batches = plan_reads(&ops, lim).unwrap();
        let mut covered: Vec<usize> = vec![0; ops.len()];
        for b in &batches {
            prop_assert!(!b.reads.is_empty());
            prop_assert!(b.reads.len() <= max_outstanding);
            prop_assert!(b.bytes <= staging_bytes);
            let mut at = 0;
            for r in &b.reads {
                prop_assert!(r.len > 0 && r.len <= max_message);
                prop_assert_eq!(r.staging_offset, at);
                at += r.len;
                // Pieces of one op come in order and tile it.
                prop_assert_eq!(r.op_offset, covered[r.op]);
                prop_assert_eq!(r.remote_addr, ops[r.op].addr + r.op_offset as u64);
                prop_assert_eq!(r.rkey, ops[r.op].rkey);
                covered[r.op] += r.len;
            }
            prop_assert_eq!(at, b.bytes);
        }
        prop_assert_eq!(covered, lens);
    }
}
