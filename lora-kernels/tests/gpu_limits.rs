//! What the planners read of a CUDA device is what its driver answers:
//! the cluster occupancy among it (`DeviceLimits::clusters_of_8`).

#![allow(clippy::unwrap_used)]

use lora_kernels::DeviceLimits;
use lora_kernels::testing::cuda_or_skip;

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn the_cluster_occupancy_is_the_drivers_answer() {
    let Some(cuda) = cuda_or_skip("the_cluster_occupancy_is_the_drivers_answer") else {
        return;
    };
    let limits = cuda.limits().unwrap();
    eprintln!("{limits:?}");
    if !limits.hopper() {
        assert_eq!(limits.clusters_of_8, [0; 4], "no clusters before sm_90");
        return;
    }
    for (i, &clusters) in limits.clusters_of_8.iter().enumerate() {
        let blocks = i + 1;
        assert!(clusters > 0, "{blocks} a multiprocessor: no cluster of 8 fits");
        assert!(
            clusters * 8 <= limits.multiprocessors * blocks,
            "{blocks} a multiprocessor: {clusters} clusters of 8 exceed the block slots"
        );
        if i > 0 {
            assert!(
                clusters >= limits.clusters_of_8[i - 1],
                "more blocks a multiprocessor hold fewer clusters"
            );
        }
    }
    // The recorded table is what a 132-multiprocessor sm_90 part answers.
    if limits.multiprocessors == DeviceLimits::H200.multiprocessors && limits.capability == (9, 0) {
        assert_eq!(limits.clusters_of_8, DeviceLimits::H200.clusters_of_8);
    }
}
