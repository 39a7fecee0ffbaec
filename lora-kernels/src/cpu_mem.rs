//! The CPU backend's memory: allocations with addresses, and the registry
//! that resolves an address read from a table back to (allocation, offset).
//!
//! Kernels find adapter weights through device addresses stored in tables
//! (`PairEntry::a`, overlay entries). On the CPU every allocation gets a
//! synthetic address from a per-device bump counter (never reused, with a
//! gap between allocations), and the reference kernels resolve each address
//! through the registry with bounds and alignment checks: a wrong pointer is
//! an error, never undefined behaviour. Storage sits behind a `Mutex`, so all
//! of this is safe code.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use bytemuck::Pod;

use crate::error::KernelError;

/// First synthetic address; non-zero so that 0 stays "null".
const FIRST_ADDR: u64 = 0x0000_1000_0000_0000;
/// Alignment of every allocation's base address.
const BASE_ALIGN: u64 = 256;
/// Unmapped bytes left after each allocation, so running off its end lands nowhere.
const GUARD_GAP: u64 = 4096;

/// One device's CPU allocations.
#[derive(Debug)]
pub(crate) struct CpuMemory {
    registry: Mutex<Registry>,
    faults: WriteFaults,
}

/// The test-and-debug fault injector of device writes (see
/// [`crate::Device::inject_write_fault_after`]).
#[derive(Debug, Default)]
struct WriteFaults {
    /// Device writes issued so far (faulted ones included).
    writes: AtomicU64,
    /// Whether a fault is armed: the only thing a write reads when none is.
    armed: AtomicBool,
    /// Writes that still succeed before the armed fault fires.
    left: Mutex<Option<usize>>,
}

#[derive(Debug)]
struct Registry {
    next_addr: u64,
    allocs: BTreeMap<u64, Weak<CpuAlloc>>,
    /// Bytes held by live allocations.
    in_use: usize,
    /// Most bytes live at once, when the device was made with a limit.
    limit: Option<usize>,
}

impl Registry {
    fn limit_info(&self) -> Option<(usize, usize)> {
        self.limit.map(|limit| (limit.saturating_sub(self.in_use), limit))
    }

    /// `OutOfMemory` when `bytes` more would pass the limit.
    fn check_limit(&self, bytes: usize) -> Result<(), KernelError> {
        match self.limit_info() {
            Some((free, _)) if bytes > free => Err(KernelError::OutOfMemory { requested: bytes, free }),
            _ => Ok(()),
        }
    }
}

/// Allocations from this size on are checked against the host's available
/// memory (a `/proc/meminfo` read; smaller ones are not worth it).
const LARGE_ALLOC: usize = 64 << 20;

/// One CPU allocation: `bytes` bytes at synthetic address `base`.
#[derive(Debug)]
pub(crate) struct CpuAlloc {
    base: u64,
    bytes: usize,
    // u128 storage keeps every element type (at most 16-byte aligned) aligned.
    data: Mutex<Vec<u128>>,
    memory: Weak<CpuMemory>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain bytes behind; they stay usable.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl CpuMemory {
    pub(crate) fn new() -> Arc<CpuMemory> {
        CpuMemory::with_limit(None)
    }

    /// A memory whose live allocations may total at most `limit` bytes
    /// (`None`: no limit), so that tests can run out of device memory.
    pub(crate) fn with_limit(limit: Option<usize>) -> Arc<CpuMemory> {
        Arc::new(CpuMemory {
            registry: Mutex::new(Registry {
                next_addr: FIRST_ADDR,
                allocs: BTreeMap::new(),
                in_use: 0,
                limit,
            }),
            faults: WriteFaults::default(),
        })
    }

    /// Arm a one-shot fault: the next `n` device writes succeed, the one
    /// after fails. Replaces a fault still armed.
    pub(crate) fn inject_write_fault_after(&self, n: usize) {
        let mut left = lock(&self.faults.left);
        *left = Some(n);
        self.faults.armed.store(true, Ordering::Release);
    }

    /// Disarm the fault; whether one was still armed (had not fired).
    pub(crate) fn clear_write_fault(&self) -> bool {
        let mut left = lock(&self.faults.left);
        self.faults.armed.store(false, Ordering::Release);
        left.take().is_some()
    }

    /// Device writes issued so far, faulted ones included.
    pub(crate) fn write_count(&self) -> u64 {
        self.faults.writes.load(Ordering::Relaxed)
    }

    /// Count one device write (`op` names it) and fail it when it is the
    /// armed one. Called once per write, after its arguments were checked
    /// and before any byte is written.
    pub(crate) fn before_write(&self, op: &'static str) -> Result<(), KernelError> {
        let write = self.faults.writes.fetch_add(1, Ordering::Relaxed);
        if !self.faults.armed.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut left = lock(&self.faults.left);
        match *left {
            Some(0) => {
                *left = None;
                self.faults.armed.store(false, Ordering::Release);
                Err(KernelError::InjectedFault { op, write })
            }
            Some(n) => {
                *left = Some(n - 1);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// `(free, limit)` bytes under the limit, or `None` without one.
    pub(crate) fn limit_info(&self) -> Option<(usize, usize)> {
        lock(&self.registry).limit_info()
    }

    /// A zeroed allocation of `bytes` bytes.
    pub(crate) fn alloc(self: &Arc<Self>, bytes: usize) -> Result<Arc<CpuAlloc>, KernelError> {
        // Checked before the host memory is taken, and again under the lock below.
        lock(&self.registry).check_limit(bytes)?;
        // Without a limit, a large allocation must fit the host's available
        // memory: zeroing more would get the process killed, not refused.
        if bytes >= LARGE_ALLOC
            && let Some((free, _)) = crate::device::host_memory_info()
            && bytes > free
        {
            return Err(KernelError::OutOfMemory { requested: bytes, free });
        }
        let words = bytes.div_ceil(16);
        let mut data = Vec::new();
        data.try_reserve_exact(words)
            .map_err(|_| KernelError::InvalidArgument {
                arg: "len",
                reason: format!("cannot allocate {bytes} bytes of host memory"),
            })?;
        data.resize(words, 0u128);
        let mut reg = lock(&self.registry);
        reg.check_limit(bytes)?;
        let base = reg.next_addr;
        let span = (bytes as u64).div_ceil(BASE_ALIGN) * BASE_ALIGN + GUARD_GAP;
        reg.next_addr = base.checked_add(span).ok_or(KernelError::InvalidArgument {
            arg: "len",
            reason: "synthetic address space exhausted".into(),
        })?;
        let alloc = Arc::new(CpuAlloc {
            base,
            bytes,
            data: Mutex::new(data),
            memory: Arc::downgrade(self),
        });
        reg.allocs.insert(base, Arc::downgrade(&alloc));
        reg.in_use = reg.in_use.saturating_add(bytes);
        Ok(alloc)
    }

    /// Resolve `addr` to the allocation holding `[addr, addr + bytes)` and the byte offset.
    fn resolve(
        &self,
        what: &dyn Fn() -> String,
        addr: u64,
        bytes: usize,
    ) -> Result<(Arc<CpuAlloc>, usize), KernelError> {
        let bad = |reason: &'static str| KernelError::BadAddress {
            what: what(),
            addr,
            bytes,
            reason,
        };
        if addr == 0 {
            return Err(bad("is null"));
        }
        let found = {
            let reg = lock(&self.registry);
            reg.allocs.range(..=addr).next_back().map(|(_, w)| w.clone())
        };
        let alloc = found
            .and_then(|w| w.upgrade())
            .ok_or_else(|| bad("is not inside any live allocation"))?;
        let offset = addr - alloc.base;
        let end = offset.checked_add(bytes as u64).ok_or_else(|| bad("range overflows"))?;
        if end > alloc.bytes as u64 {
            return Err(bad("runs past the end of its allocation"));
        }
        Ok((alloc, offset as usize))
    }

    /// Copy `count` elements of `T` starting at device address `addr`.
    /// `what` names the address for the error message.
    pub(crate) fn read<T: Pod>(
        &self,
        what: &dyn Fn() -> String,
        addr: u64,
        count: usize,
    ) -> Result<Vec<T>, KernelError> {
        let size = std::mem::size_of::<T>();
        let bytes = count.checked_mul(size).ok_or_else(|| KernelError::BadAddress {
            what: what(),
            addr,
            bytes: usize::MAX,
            reason: "range overflows",
        })?;
        if !addr.is_multiple_of(std::mem::align_of::<T>() as u64) {
            return Err(KernelError::BadAddress {
                what: what(),
                addr,
                bytes,
                reason: "is misaligned for its type",
            });
        }
        let (alloc, offset) = self.resolve(what, addr, bytes)?;
        Ok(alloc.with_bytes(|b| {
            let src = &b[offset..offset + bytes];
            let mut out = vec![T::zeroed(); count];
            bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(src);
            out
        }))
    }

    fn forget(&self, base: u64, bytes: usize) {
        let mut reg = lock(&self.registry);
        if reg.allocs.remove(&base).is_some() {
            reg.in_use = reg.in_use.saturating_sub(bytes);
        }
    }
}

impl CpuAlloc {
    /// The allocation's synthetic device address.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Run `f` on the allocation's bytes.
    pub(crate) fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        let data = lock(&self.data);
        let bytes: &[u8] = bytemuck::cast_slice(&data);
        f(&bytes[..self.bytes])
    }

    /// Run `f` on the allocation's bytes, mutably.
    pub(crate) fn with_bytes_mut<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let mut data = lock(&self.data);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut data);
        f(&mut bytes[..self.bytes])
    }
}

impl Drop for CpuAlloc {
    fn drop(&mut self) {
        if let Some(memory) = self.memory.upgrade() {
            memory.forget(self.base, self.bytes);
        }
    }
}

#[cfg(test)]
mod tests;
