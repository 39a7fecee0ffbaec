//! Device memory: [`DeviceBuffer`] (typed, on one [`Device`]) and
//! [`PinnedHostBuffer`] (page-locked host memory for fast uploads).
//!
//! Every element range is checked against the buffer before any copy; a bad
//! range is [`KernelError::OutOfBounds`].

use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, PinnedHostSlice};

use crate::cpu_mem::CpuAlloc;
use crate::cuda_rt::driver_err;
use crate::device::{Backend, Device, Lane};
use crate::error::KernelError;
use crate::table::{EmbedOverlayEntry, LmHeadOverlayEntry, PairEntry};

mod sealed {
    /// The cudarc side of an element type; private, so [`super::DeviceElem`] is sealed.
    pub trait Sealed: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {}
}

/// An element type a [`DeviceBuffer`] can hold: plain old data that the
/// device copies byte for byte. Sealed: bf16, f32, i32, u32, u64, u8, the
/// table entry structs and `RepackRegion`.
pub trait DeviceElem: bytemuck::Pod + Default + fmt::Debug + Send + Sync + 'static + sealed::Sealed {
    /// Short type name, as used in kernel names (`bf16`, `f32`, ...).
    const NAME: &'static str;
}

macro_rules! device_elem {
    ($($t:ty => $name:literal),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl DeviceElem for $t {
            const NAME: &'static str = $name;
        }
    )*};
}

device_elem! {
    half::bf16 => "bf16",
    f32 => "f32",
    i32 => "i32",
    u32 => "u32",
    u64 => "u64",
    u8 => "u8",
    PairEntry => "pair_entry",
    EmbedOverlayEntry => "embed_overlay_entry",
    LmHeadOverlayEntry => "lm_head_overlay_entry",
    crate::ops::repack::RepackRegion => "repack_region",
}

/// A typed allocation of `len` elements on one device, zeroed at creation.
/// Its address never changes for its life (table entries may point into it).
pub struct DeviceBuffer<T: DeviceElem> {
    device: Device,
    len: usize,
    storage: Storage<T>,
}

enum Storage<T: DeviceElem> {
    Cpu(Arc<CpuAlloc>),
    // cudarc refuses zero-byte allocations on some drivers; at least one element is allocated.
    Cuda(CudaSlice<T>),
}

impl<T: DeviceElem> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("type", &T::NAME)
            .field("len", &self.len)
            .field("addr", &format_args!("{:#x}", self.device_addr()))
            .field("device", &self.device.name())
            .finish()
    }
}

pub(crate) fn check_range(arg: &'static str, offset: usize, len: usize, total: usize) -> Result<(), KernelError> {
    match offset.checked_add(len) {
        Some(end) if end <= total => Ok(()),
        _ => Err(KernelError::OutOfBounds {
            arg,
            start: offset,
            end: offset.saturating_add(len),
            len: total,
        }),
    }
}

impl Device {
    /// A zeroed buffer of `len` elements, usable on either lane at once: on
    /// CUDA it is allocated and zeroed on the compute lane, and the copy lane
    /// waits for that on the device (without the wait, a copy-lane write
    /// queued next could land before the zeroing and be wiped by it).
    pub fn alloc_zeros<T: DeviceElem>(&self, len: usize) -> Result<DeviceBuffer<T>, KernelError> {
        let storage = match self.backend() {
            Backend::Cpu(cpu) => {
                let bytes = len
                    .checked_mul(std::mem::size_of::<T>())
                    .ok_or(KernelError::InvalidArgument {
                        arg: "len",
                        reason: format!("{len} elements overflow"),
                    })?;
                Storage::Cpu(cpu.memory.alloc(bytes)?)
            }
            Backend::Cuda(c) => {
                let slice = c
                    .stream
                    .alloc_zeros::<T>(len.max(1))
                    .map_err(driver_err("cuMemAlloc"))?;
                c.copy_lane_after_compute()?;
                Storage::Cuda(slice)
            }
        };
        Ok(DeviceBuffer {
            device: self.clone(),
            len,
            storage,
        })
    }

    /// A buffer holding a copy of `data`.
    pub fn upload<T: DeviceElem>(&self, data: &[T]) -> Result<DeviceBuffer<T>, KernelError> {
        let mut buf = self.alloc_zeros(data.len())?;
        buf.write(0, data)?;
        Ok(buf)
    }

    /// A zeroed page-locked host buffer for fast uploads to this device (a
    /// plain host vector on the CPU backend).
    ///
    /// The host's available memory is checked first: an allocation past it
    /// is [`KernelError::OutOfHostMemory`], naming both numbers (page-locked
    /// memory cannot be swapped out, so taking it would starve the host).
    pub fn alloc_pinned<T: DeviceElem>(&self, len: usize) -> Result<PinnedHostBuffer<T>, KernelError> {
        let requested = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or(KernelError::InvalidArgument {
                arg: "len",
                reason: format!("{len} elements overflow"),
            })?;
        if let Some((free, _)) = crate::device::host_memory_info()
            && requested > free
        {
            return Err(KernelError::OutOfHostMemory { requested, free });
        }
        let inner = match self.backend() {
            Backend::Cpu(_) => Pinned::Host(vec![T::zeroed(); len]),
            Backend::Cuda(c) => {
                // SAFETY: the memory is uninitialised after the call; it is zeroed
                // through a raw pointer below before any slice of it is formed.
                let mut slice = unsafe { c.ctx.alloc_pinned_with_flags::<T>(len.max(1), 0) }
                    .map_err(driver_err("cuMemHostAlloc"))?;
                let ptr = slice.as_mut_ptr().map_err(driver_err("cuEventSynchronize"))?;
                // SAFETY: `ptr` points to `len.max(1)` elements just allocated for
                // `slice`, nothing else aliases them, and all-zero bytes are a valid `T` (Pod).
                unsafe { std::ptr::write_bytes(ptr, 0, len.max(1)) };
                Pinned::Cuda(slice)
            }
        };
        Ok(PinnedHostBuffer {
            device: self.clone(),
            len,
            inner,
            last_copy: Mutex::new([None, None]),
        })
    }
}

impl<T: DeviceElem> DeviceBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the buffer lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The device address of element 0, as kernels read it from tables.
    pub fn device_addr(&self) -> u64 {
        match &self.storage {
            Storage::Cpu(a) => a.base(),
            Storage::Cuda(s) => match self.device.backend() {
                Backend::Cuda(c) => {
                    let (ptr, _sync) = s.device_ptr(&c.stream);
                    ptr
                }
                Backend::Cpu(_) => 0,
            },
        }
    }

    /// The device address of element `offset` (`offset <= len`).
    pub fn addr_at(&self, offset: usize) -> Result<u64, KernelError> {
        check_range("offset", offset, 0, self.len)?;
        Ok(self.device_addr() + (offset * std::mem::size_of::<T>()) as u64)
    }

    /// Copy the whole buffer to the host.
    pub fn download(&self) -> Result<Vec<T>, KernelError> {
        self.download_range(0, self.len)
    }

    /// Copy elements `offset..offset + len` to the host.
    pub fn download_range(&self, offset: usize, len: usize) -> Result<Vec<T>, KernelError> {
        self.download_range_on(Lane::Compute, offset, len)
    }

    /// [`Self::download_range`] queued on `lane` (it waits for the work
    /// queued there before it).
    pub fn download_range_on(&self, lane: Lane, offset: usize, len: usize) -> Result<Vec<T>, KernelError> {
        check_range("download range", offset, len, self.len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        match (&self.storage, self.device.backend()) {
            (Storage::Cpu(a), _) => Ok(a.with_bytes(|b| {
                let size = std::mem::size_of::<T>();
                let mut out = vec![T::zeroed(); len];
                bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(&b[offset * size..(offset + len) * size]);
                out
            })),
            (Storage::Cuda(s), Backend::Cuda(c)) => c
                .lane_stream(lane)
                .clone_dtoh(&s.slice(offset..offset + len))
                .map_err(driver_err("cuMemcpyDtoH")),
            (Storage::Cuda(_), Backend::Cpu(_)) => Err(backend_mismatch()),
        }
    }

    /// Copy `data` into elements `offset..offset + data.len()`.
    pub fn write(&mut self, offset: usize, data: &[T]) -> Result<(), KernelError> {
        self.write_on(Lane::Compute, offset, data)
    }

    /// [`Self::write`] queued on `lane`.
    pub fn write_on(&mut self, lane: Lane, offset: usize, data: &[T]) -> Result<(), KernelError> {
        check_range("write range", offset, data.len(), self.len)?;
        if data.is_empty() {
            return Ok(());
        }
        match (&mut self.storage, self.device.backend()) {
            (Storage::Cpu(a), _) => {
                self.device.before_write("write")?;
                a.with_bytes_mut(|b| {
                    let size = std::mem::size_of::<T>();
                    b[offset * size..(offset + data.len()) * size].copy_from_slice(bytemuck::cast_slice(data));
                });
                Ok(())
            }
            (Storage::Cuda(s), Backend::Cuda(c)) => {
                let mut view = s.slice_mut(offset..offset + data.len());
                c.lane_stream(lane)
                    .memcpy_htod(data, &mut view)
                    .map_err(driver_err("cuMemcpyHtoD"))
            }
            (Storage::Cuda(_), Backend::Cpu(_)) => Err(backend_mismatch()),
        }
    }

    /// Device-to-device copy of `len` elements from `src[src_offset..]` into `self[dst_offset..]`.
    pub fn copy_from(
        &mut self,
        dst_offset: usize,
        src: &DeviceBuffer<T>,
        src_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        self.copy_from_on(Lane::Compute, dst_offset, src, src_offset, len)
    }

    /// [`Self::copy_from`] queued on `lane`.
    pub fn copy_from_on(
        &mut self,
        lane: Lane,
        dst_offset: usize,
        src: &DeviceBuffer<T>,
        src_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        self.device.expect_same("src", &src.device)?;
        check_range("copy destination", dst_offset, len, self.len)?;
        check_range("copy source", src_offset, len, src.len)?;
        if len == 0 {
            return Ok(());
        }
        match (&mut self.storage, &src.storage, self.device.backend()) {
            (Storage::Cpu(dst), Storage::Cpu(s), _) => {
                self.device.before_write("copy")?;
                let size = std::mem::size_of::<T>();
                let bytes = s.with_bytes(|b| b[src_offset * size..(src_offset + len) * size].to_vec());
                dst.with_bytes_mut(|b| b[dst_offset * size..(dst_offset + len) * size].copy_from_slice(&bytes));
                Ok(())
            }
            (Storage::Cuda(dst), Storage::Cuda(s), Backend::Cuda(c)) => {
                let from = s.slice(src_offset..src_offset + len);
                let mut to = dst.slice_mut(dst_offset..dst_offset + len);
                c.lane_stream(lane)
                    .memcpy_dtod(&from, &mut to)
                    .map_err(driver_err("cuMemcpyDtoD"))
            }
            _ => Err(backend_mismatch()),
        }
    }

    /// Zero elements `offset..offset + len`.
    pub fn zero_range(&mut self, offset: usize, len: usize) -> Result<(), KernelError> {
        check_range("zero range", offset, len, self.len)?;
        if len == 0 {
            return Ok(());
        }
        match (&mut self.storage, self.device.backend()) {
            (Storage::Cpu(a), _) => {
                self.device.before_write("zero")?;
                let size = std::mem::size_of::<T>();
                a.with_bytes_mut(|b| b[offset * size..(offset + len) * size].fill(0));
                Ok(())
            }
            (Storage::Cuda(s), Backend::Cuda(c)) => {
                let mut view = s.slice_mut(offset..offset + len);
                c.stream.memset_zeros(&mut view).map_err(driver_err("cuMemsetD8"))
            }
            (Storage::Cuda(_), Backend::Cpu(_)) => Err(backend_mismatch()),
        }
    }

    /// Copy the whole pinned buffer `src` into `self[dst_offset..]`
    /// (asynchronous on CUDA: an event recorded after the copy makes `src`'s
    /// next [`PinnedHostBuffer::as_mut_slice`] / `as_slice` wait for it, so
    /// `src` is never rewritten while the copy is still queued). Not for
    /// graph capture.
    pub fn upload_pinned(&mut self, dst_offset: usize, src: &PinnedHostBuffer<T>) -> Result<(), KernelError> {
        self.upload_pinned_on(Lane::Compute, dst_offset, src)
    }

    /// [`Self::upload_pinned`] queued on `lane` (`src`'s event is recorded
    /// there, so its reuse waits for this copy whichever lane ran it).
    pub fn upload_pinned_on(
        &mut self,
        lane: Lane,
        dst_offset: usize,
        src: &PinnedHostBuffer<T>,
    ) -> Result<(), KernelError> {
        self.device.expect_same("src", &src.device)?;
        check_range("upload range", dst_offset, src.len, self.len)?;
        if src.len == 0 {
            return Ok(());
        }
        match (&mut self.storage, &src.inner, self.device.backend()) {
            (Storage::Cpu(_), Pinned::Host(v), _) => {
                let data = v.clone();
                self.write(dst_offset, &data)
            }
            (Storage::Cuda(s), Pinned::Cuda(p), Backend::Cuda(c)) => {
                let mut view = s.slice_mut(dst_offset..dst_offset + src.len);
                if p.len() == src.len {
                    c.lane_stream(lane)
                        .memcpy_htod(p, &mut view)
                        .map_err(driver_err("cuMemcpyHtoD"))?;
                    // cudarc's own completion event is off (event tracking is
                    // disabled): record this crate's, replacing the previous
                    // copy's on the same lane (a lane runs in order, so this
                    // one completes after it).
                    let event = c.record_event_on(lane)?;
                    src.last_copy.lock().unwrap_or_else(|p| p.into_inner())[lane as usize] = Some(event);
                    Ok(())
                } else {
                    // Zero-length pinned buffers allocate one element; nothing to copy then.
                    Ok(())
                }
            }
            _ => Err(backend_mismatch()),
        }
    }

    /// The CPU allocation (CPU backend only).
    pub(crate) fn cpu_alloc(&self) -> Option<&Arc<CpuAlloc>> {
        match &self.storage {
            Storage::Cpu(a) => Some(a),
            Storage::Cuda(_) => None,
        }
    }

    /// Apply `f` to the elements `offset..offset + len` in place (CPU backend only).
    pub(crate) fn cpu_modify<R>(
        &mut self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&mut [T]) -> R,
    ) -> Result<R, KernelError> {
        check_range("modify range", offset, len, self.len)?;
        let alloc = self.cpu_alloc().ok_or_else(backend_mismatch)?;
        let size = std::mem::size_of::<T>();
        alloc.with_bytes_mut(|b| {
            let bytes = &mut b[offset * size..(offset + len) * size];
            match bytemuck::try_cast_slice_mut::<u8, T>(bytes) {
                Ok(elems) => Ok(f(elems)),
                Err(e) => Err(KernelError::InvalidArgument {
                    arg: "buffer",
                    reason: format!("cast failed: {e}"),
                }),
            }
        })
    }
}

fn backend_mismatch() -> KernelError {
    KernelError::InvalidArgument {
        arg: "buffer",
        reason: "buffer storage does not match its device backend".into(),
    }
}

/// Page-locked host memory of `len` elements, for fast uploads
/// ([`DeviceBuffer::upload_pinned`]). A plain vector on the CPU backend.
pub struct PinnedHostBuffer<T: DeviceElem> {
    device: Device,
    len: usize,
    inner: Pinned<T>,
    /// The completion event of the last queued copy from this buffer on
    /// each lane (CUDA), indexed by `Lane as usize`.
    last_copy: Mutex<[Option<CudaEvent>; 2]>,
}

enum Pinned<T: DeviceElem> {
    Host(Vec<T>),
    Cuda(PinnedHostSlice<T>),
}

impl<T: DeviceElem> Drop for PinnedHostBuffer<T> {
    /// A copy from the buffer may still be queued: its memory is freed only
    /// once that copy ran.
    fn drop(&mut self) {
        // Nothing to report to on drop; a failed wait means the context is
        // gone, and the memory with it.
        let _ = self.wait_last_copy();
    }
}

impl<T: DeviceElem> PinnedHostBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Wait for the last queued copy from this buffer, if any.
    fn wait_last_copy(&self) -> Result<(), KernelError> {
        let pending = std::mem::take(&mut *self.last_copy.lock().unwrap_or_else(|p| p.into_inner()));
        for event in pending.iter().flatten() {
            event.synchronize().map_err(driver_err("cuEventSynchronize"))?;
        }
        Ok(())
    }

    /// The elements (waits for a pending upload from this buffer to finish).
    pub fn as_slice(&self) -> Result<&[T], KernelError> {
        self.wait_last_copy()?;
        match &self.inner {
            Pinned::Host(v) => Ok(v),
            Pinned::Cuda(p) => Ok(&p.as_slice().map_err(driver_err("cuEventSynchronize"))?[..self.len]),
        }
    }

    /// The elements, mutably (waits for a pending upload from this buffer to finish).
    pub fn as_mut_slice(&mut self) -> Result<&mut [T], KernelError> {
        self.wait_last_copy()?;
        let len = self.len;
        match &mut self.inner {
            Pinned::Host(v) => Ok(v),
            Pinned::Cuda(p) => Ok(&mut p.as_mut_slice().map_err(driver_err("cuEventSynchronize"))?[..len]),
        }
    }
}

#[cfg(test)]
mod tests;
