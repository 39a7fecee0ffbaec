//! The path from host to a slot: pinned chunks filled by the pool's workers
//! and copied to a device staging slot as each one completes.
//!
//! The slot's places are cut into chunks of whole places, each with its own
//! pinned host buffer. A few chunk workers (the rest of the rayon pool helps
//! inside each chunk) take chunks in order from one queue; a finished chunk
//! is handed, with its exclusive borrow, to the calling thread, which issues
//! its asynchronous copy at once. So the copies run while later chunks are
//! still being filled, and the transfer costs about the slower of the two
//! streams rather than their sum.
//!
//! Two fills: the packed slot image (each tensor read or converted into its
//! padded place), or the raw data section of an adapter file (placed later
//! on the device by [`lora_kernels::repack`], so the read need not wait for
//! the audit). Nothing here is live: a failure at any point leaves only this
//! staging area dirty.
//!
//! What it must never do: issue a chunk's copy before the chunk is filled,
//! or return before every worker has stopped touching the chunks.

use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use half::bf16;
use lora_audit::{AuditError, UnparsedSafetensors};
use lora_kernels::{Device, DeviceBuffer, PinnedHostBuffer, RepackRegion};
use lora_layout::{PairLayout, SlotLayout};
use rayon::prelude::*;

use crate::error::PoolError;
use crate::image::{ImageError, PackPlan, range_elems};

/// Default size of one pinned chunk: small enough that the first copy
/// starts early and the last one ends soon after the last read, large
/// enough that each copy runs at the link's full rate.
pub(crate) const DEFAULT_CHUNK_BYTES: usize = 4 << 20;

/// Default number of chunks filled at once.
pub(crate) const DEFAULT_IN_FLIGHT: usize = 2;

/// Bytes one worker reads at a time from a file: small enough that a
/// chunk is read by the whole pool (a whole chunk per thread left most of
/// the copy engine idle on the H200 host, 1 MiB pieces of 4 MiB chunks
/// ran 1.6x slower than 8 MiB chunks).
const READ_PIECE: usize = 128 << 10;

/// Host chunks, the device staging slot, and the repack region table of one pool.
pub(crate) struct Staging {
    chunks: Vec<StagingChunk>,
    in_flight: usize,
    pub(crate) device: DeviceBuffer<bf16>,
    pub(crate) regions: DeviceBuffer<RepackRegion>,
}

struct StagingChunk {
    places: Range<usize>,
    elem_offset: usize,
    host: PinnedHostBuffer<bf16>,
}

impl Staging {
    /// Chunks of whole places of about `chunk_bytes` (a place larger than
    /// that is a chunk alone), a device slot of `layout`'s size, and a
    /// region table of two entries per place.
    pub(crate) fn new(device: &Device, layout: &SlotLayout, chunk_bytes: usize) -> Result<Staging, PoolError> {
        Ok(Staging {
            chunks: chunks(device, layout, chunk_bytes)?,
            in_flight: DEFAULT_IN_FLIGHT,
            device: device.alloc_zeros(layout.slot_bytes() / 2)?,
            regions: device.alloc_zeros(Self::region_capacity(layout))?,
        })
    }

    /// Entries of the region table: two per place.
    pub(crate) fn region_capacity(layout: &SlotLayout) -> usize {
        2 * PairLayout::len(layout).max(1)
    }

    /// Re-cut the host chunks and set how many are filled at once (the
    /// device slot stays).
    pub(crate) fn retune(
        &mut self,
        device: &Device,
        layout: &SlotLayout,
        chunk_bytes: usize,
        in_flight: usize,
    ) -> Result<(), PoolError> {
        self.chunks = chunks(device, layout, chunk_bytes)?;
        self.in_flight = in_flight.max(1);
        Ok(())
    }

    /// Number of host chunks.
    pub(crate) fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// Bytes the device staging slot holds.
    pub(crate) fn capacity_bytes(&self) -> usize {
        2 * self.device.len()
    }

    /// Pack `plan` into the chunks and copy each to the device staging slot
    /// as soon as it is packed. The first failure stops the workers and is
    /// returned; the staging slot is then partly written, which nothing reads.
    pub(crate) fn pack_and_upload(
        &mut self,
        layout: &SlotLayout,
        plan: &PackPlan<'_>,
        image_err: impl Fn(ImageError) -> PoolError + Sync,
    ) -> Result<(), PoolError> {
        let never = AtomicBool::new(false);
        let count = self.chunks.len();
        self.pipeline(count, &never, |chunk| {
            let host = chunk.host.as_mut_slice()?;
            plan.fill(layout, chunk.places.clone(), host).map_err(&image_err)
        })
    }

    /// Copy the first `len` bytes of `file`'s data section into the device
    /// staging slot, as they are. Stops early (returning `Ok`) once `stop`
    /// is set by someone else; the caller then must not use the staging slot.
    pub(crate) fn read_raw(
        &mut self,
        file: &UnparsedSafetensors,
        path: &std::path::Path,
        len: usize,
        stop: &AtomicBool,
        adapter: &str,
    ) -> Result<(), PoolError> {
        if len > self.capacity_bytes() {
            return Err(PoolError::Image {
                adapter: adapter.to_string(),
                source: ImageError::Destination {
                    got: self.capacity_bytes(),
                    expected: len,
                },
            });
        }
        // The chunks that cover `len` bytes, in order.
        let mut count = 0;
        let mut covered = 0usize;
        while covered < len {
            covered += 2 * self.chunks[count].host.len();
            count += 1;
        }
        self.pipeline(count, stop, |chunk| {
            let at = 2 * chunk.elem_offset;
            let host = chunk.host.as_mut_slice()?;
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(host);
            let want = len.saturating_sub(at).min(bytes.len());
            bytes[..want]
                .par_chunks_mut(READ_PIECE)
                .enumerate()
                .try_for_each(|(i, piece)| file.read_data_at(piece, (at + i * READ_PIECE) as u64))
                .map_err(|e| PoolError::Audit {
                    adapter: adapter.to_string(),
                    source: Box::new(AuditError::Io {
                        path: path.display().to_string(),
                        source: e,
                    }),
                })
        })
    }

    /// Fill the first `count` chunks with `fill` and copy each to the
    /// device staging slot once filled. `stop` (set by the caller's other
    /// thread, or here on a failure) ends the fills early.
    fn pipeline(
        &mut self,
        count: usize,
        stop: &AtomicBool,
        fill: impl Fn(&mut StagingChunk) -> Result<(), PoolError> + Sync,
    ) -> Result<(), PoolError> {
        let Staging {
            chunks,
            device,
            in_flight,
            ..
        } = self;
        let chunks = &mut chunks[..count];
        if rayon::current_thread_index().is_some() {
            // Called from inside the rayon pool: the workers could need this
            // very thread, so fill here, chunk by chunk, each chunk's copy
            // overlapping the next chunk's fill.
            for chunk in chunks {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                fill(chunk)?;
                device.upload_pinned(chunk.elem_offset, &chunk.host)?;
            }
            return Ok(());
        }
        let total = chunks.len();
        let queue = Mutex::new(chunks.iter_mut());
        let failed = AtomicBool::new(false);
        let (done, filled) = mpsc::channel();
        let worker = |done: mpsc::Sender<_>| {
            while !stop.load(Ordering::Relaxed) && !failed.load(Ordering::Relaxed) {
                // A poisoned queue only means another worker panicked; the
                // iterator itself is still sound.
                let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
                let Some(chunk) = next else { break };
                let result = fill(&mut *chunk).map(|()| chunk);
                if result.is_err() {
                    failed.store(true, Ordering::Relaxed);
                }
                if done.send(result).is_err() {
                    break;
                }
            }
        };
        let workers = (*in_flight).clamp(1, rayon::current_num_threads());
        std::thread::scope(|scope| {
            // The chunk workers start from outside the pool so this thread
            // stays free to issue the copies (the device context is current
            // here); the rest of the pool helps inside each fill.
            let handle = scope.spawn(move || {
                (0..workers)
                    .into_par_iter()
                    .for_each_with(done, |done, _| worker(done.clone()));
            });
            let mut result = Ok(());
            for _ in 0..total {
                // Every sender gone first: the workers stopped early.
                let Ok(filled) = filled.recv() else { break };
                let issued = filled.and_then(|chunk| Ok(device.upload_pinned(chunk.elem_offset, &chunk.host)?));
                if let Err(e) = issued {
                    failed.store(true, Ordering::Relaxed);
                    result = Err(e);
                    break;
                }
            }
            // Wait for the workers so no chunk stays borrowed past this call.
            if let Err(panic) = handle.join() {
                std::panic::resume_unwind(panic);
            }
            result
        })
    }
}

fn chunks(device: &Device, layout: &SlotLayout, chunk_bytes: usize) -> Result<Vec<StagingChunk>, PoolError> {
    let chunk_elems = (chunk_bytes / 2).max(1);
    let mut chunks = Vec::new();
    let (mut start, mut offset, mut elems) = (0usize, 0usize, 0usize);
    let places = PairLayout::len(layout);
    for i in 0..places {
        let len = range_elems(layout, i..i + 1);
        if elems > 0 && elems + len > chunk_elems {
            chunks.push(StagingChunk {
                places: start..i,
                elem_offset: offset,
                host: device.alloc_pinned(elems)?,
            });
            (start, offset, elems) = (i, offset + elems, 0);
        }
        elems += len;
    }
    if elems > 0 {
        chunks.push(StagingChunk {
            places: start..places,
            elem_offset: offset,
            host: device.alloc_pinned(elems)?,
        });
    }
    Ok(chunks)
}

#[cfg(test)]
mod tests;
