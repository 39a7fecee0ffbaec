//! CUDA graphs (capture a closure of apply calls, replay it) and device
//! events for timing.

use std::time::Instant;

use cudarc::driver::{CudaEvent, CudaGraph};

use crate::cuda_rt;
use crate::device::{Backend, Device, Lane};
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
        self.record_event_on(Lane::Compute)
    }

    /// Record an event at the current end of `lane`'s stream: it completes
    /// once everything queued there before it has (on the CPU, at once).
    pub fn record_event_on(&self, lane: Lane) -> Result<DeviceEvent, KernelError> {
        match self.backend() {
            Backend::Cpu(_) => Ok(DeviceEvent {
                inner: EventInner::Host(Instant::now()),
            }),
            Backend::Cuda(c) => Ok(DeviceEvent {
                inner: EventInner::Cuda(c.record_event_on(lane)?),
            }),
        }
    }

    /// Make everything queued on `lane` from now on wait, on the device, for
    /// `event` (the host does not wait). Capturable: inside a graph capture it
    /// becomes a dependency of the graph. An event of another backend is an
    /// error.
    pub fn wait_event(&self, lane: Lane, event: &DeviceEvent) -> Result<(), KernelError> {
        match (self.backend(), &event.inner) {
            (Backend::Cpu(_), EventInner::Host(_)) => Ok(()),
            (Backend::Cuda(c), EventInner::Cuda(e)) => c.wait_event(lane, e),
            _ => Err(KernelError::InvalidArgument {
                arg: "event",
                reason: "an event of another backend".into(),
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
    /// Whether the work queued before the event has completed (never waits;
    /// always true on the CPU).
    pub fn is_done(&self) -> Result<bool, KernelError> {
        match &self.inner {
            EventInner::Host(_) => Ok(true),
            EventInner::Cuda(e) => e.try_is_complete().map_err(cuda_rt::driver_err("cuEventQuery")),
        }
    }

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
