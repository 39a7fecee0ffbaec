//! CUDA graphs (capture a closure of apply calls, replay it) and device
//! events for timing.

use std::time::Instant;

use cudarc::driver::{CudaEvent, CudaGraph};

use crate::cuda_rt;
use crate::device::{Backend, Device};
use crate::error::KernelError;

/// An instantiated CUDA graph: the apply calls of one capture, replayed with
/// the same buffers and launch shapes; contents of the buffers (tables, idx,
/// x) may change between replays.
pub struct DeviceGraph {
    graph: CudaGraph,
}

impl DeviceGraph {
    /// Launch the graph on its device's stream (asynchronous).
    pub fn replay(&self) -> Result<(), KernelError> {
        cuda_rt::replay(&self.graph)
    }
}

impl Device {
    /// Capture the work `f` issues on this device into a graph. Apply calls
    /// allocate nothing and do not synchronise, so they capture; buffer
    /// uploads and downloads inside `f` do not. CPU: an `Unsupported` error.
    pub fn capture_graph<F>(&self, f: F) -> Result<DeviceGraph, KernelError>
    where
        F: FnOnce() -> Result<(), KernelError>,
    {
        match self.backend() {
            Backend::Cpu(_) => Err(KernelError::Unsupported {
                what: "CUDA graph capture",
                device: self.name(),
            }),
            Backend::Cuda(c) => Ok(DeviceGraph { graph: c.capture(f)? }),
        }
    }

    /// Record a timing event at the current end of the device's stream (on
    /// the CPU, the current host time).
    pub fn record_event(&self) -> Result<DeviceEvent, KernelError> {
        match self.backend() {
            Backend::Cpu(_) => Ok(DeviceEvent {
                inner: EventInner::Host(Instant::now()),
            }),
            Backend::Cuda(c) => Ok(DeviceEvent {
                inner: EventInner::Cuda(c.record_event()?),
            }),
        }
    }
}

/// A point on a device's timeline.
pub struct DeviceEvent {
    inner: EventInner,
}

enum EventInner {
    Host(Instant),
    Cuda(CudaEvent),
}

impl DeviceEvent {
    /// Milliseconds from `self` to `end` (waits for both on CUDA).
    pub fn elapsed_ms(&self, end: &DeviceEvent) -> Result<f32, KernelError> {
        match (&self.inner, &end.inner) {
            (EventInner::Host(a), EventInner::Host(b)) => Ok(b.saturating_duration_since(*a).as_secs_f32() * 1e3),
            (EventInner::Cuda(a), EventInner::Cuda(b)) => cuda_rt::elapsed_ms(a, b),
            _ => Err(KernelError::InvalidArgument {
                arg: "end",
                reason: "events of different backends".into(),
            }),
        }
    }
}
