// The device's cluster occupancy, asked of the driver once per backend
// (`cuOccupancyMaxActiveClusters`, lora_kernels::ops::limits): a kernel that
// is never launched. The query gives it clusters of 8, 256 threads a block
// and the dynamic shared memory that lets k blocks share a multiprocessor.
extern "C" __global__ void __launch_bounds__(256) occupancy_probe() {}
