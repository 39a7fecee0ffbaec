//! The path from host to a slot: pinned chunks packed by every core and
//! copied to a device staging slot as each one completes.
//!
//! The slot's places are cut into chunks of whole places, each with its own
//! pinned host buffer. Workers (the rayon pool) take chunks in slot order
//! from one queue and pack each alone; a finished chunk is handed, with its
//! exclusive borrow, to the calling thread, which issues its asynchronous
//! copy at once. So the copies run while later chunks are still being read,
//! and the whole transfer costs about the slower of the two streams rather
//! than their sum. Publish then copies the staging slot into the live slot
//! on the device. Nothing here is live: a failure at any point leaves only
//! this staging area dirty.
//!
//! What it must never do: issue a chunk's copy before the chunk is fully
//! packed, or return before every worker has stopped touching the chunks.

use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use half::bf16;
use lora_kernels::{Device, DeviceBuffer, PinnedHostBuffer};
use lora_layout::{PairLayout, SlotLayout};
use rayon::prelude::*;

use crate::error::PoolError;
use crate::image::{ImageError, PackPlan, range_elems};

/// Default size of one pinned chunk: small enough that the first copy
/// starts early and the last one ends soon after the last read, large
/// enough that each copy runs at the link's full rate.
pub(crate) const DEFAULT_CHUNK_BYTES: usize = 4 << 20;

/// Host chunks and the device staging slot of one pool.
pub(crate) struct Staging {
    chunks: Vec<StagingChunk>,
    pub(crate) device: DeviceBuffer<bf16>,
}

struct StagingChunk {
    places: Range<usize>,
    elem_offset: usize,
    host: PinnedHostBuffer<bf16>,
}

impl Staging {
    /// Chunks of whole places of about `chunk_bytes` (a place larger than
    /// that is a chunk alone), and a device slot of `layout`'s size.
    pub(crate) fn new(device: &Device, layout: &SlotLayout, chunk_bytes: usize) -> Result<Staging, PoolError> {
        Ok(Staging {
            chunks: chunks(device, layout, chunk_bytes)?,
            device: device.alloc_zeros(layout.slot_bytes() / 2)?,
        })
    }

    /// Re-cut the host chunks (the device slot stays).
    pub(crate) fn rechunk(
        &mut self,
        device: &Device,
        layout: &SlotLayout,
        chunk_bytes: usize,
    ) -> Result<(), PoolError> {
        self.chunks = chunks(device, layout, chunk_bytes)?;
        Ok(())
    }

    /// Number of host chunks.
    pub(crate) fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// Pack `plan` into the chunks on every core, and copy each chunk to
    /// the device staging slot as soon as it is packed. The first failure
    /// stops the workers and is returned; the staging slot is then partly
    /// written, which nothing reads.
    pub(crate) fn pack_and_upload(
        &mut self,
        layout: &SlotLayout,
        plan: &PackPlan<'_>,
        image_err: impl Fn(ImageError) -> PoolError + Sync,
    ) -> Result<(), PoolError> {
        if rayon::current_thread_index().is_some() {
            // Called from inside the rayon pool: the workers could need this
            // very thread, so pack here, chunk by chunk, each chunk's copy
            // overlapping the next chunk's pack.
            for chunk in &mut self.chunks {
                let host = chunk.host.as_mut_slice()?;
                plan.fill(layout, chunk.places.clone(), host).map_err(&image_err)?;
                self.device.upload_pinned(chunk.elem_offset, &chunk.host)?;
            }
            return Ok(());
        }
        let Staging { chunks, device } = self;
        let total = chunks.len();
        let queue = Mutex::new(chunks.iter_mut());
        let stop = AtomicBool::new(false);
        let (done, packed) = mpsc::channel::<Result<&mut StagingChunk, PoolError>>();
        let worker = |done: mpsc::Sender<_>| {
            while !stop.load(Ordering::Relaxed) {
                // A poisoned queue only means another worker panicked; the
                // iterator itself is still sound.
                let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
                let Some(chunk) = next else { break };
                let packed = chunk
                    .host
                    .as_mut_slice()
                    .map_err(PoolError::from)
                    .and_then(|host| plan.fill(layout, chunk.places.clone(), host).map_err(&image_err))
                    .map(|()| chunk);
                if packed.is_err() {
                    stop.store(true, Ordering::Relaxed);
                }
                if done.send(packed).is_err() {
                    break;
                }
            }
        };
        std::thread::scope(|scope| {
            // One worker loop per pool thread, started from outside the pool
            // so this thread stays free to issue the copies (the device
            // context is current here).
            let workers = scope.spawn(move || {
                (0..rayon::current_num_threads())
                    .into_par_iter()
                    .for_each_with(done, |done, _| worker(done.clone()));
            });
            let mut result = Ok(());
            for _ in 0..total {
                // Every sender gone before `total` chunks: a worker stopped
                // early and its error is already in the channel or returned.
                let Ok(packed) = packed.recv() else { break };
                let issued = packed.and_then(|chunk| Ok(device.upload_pinned(chunk.elem_offset, &chunk.host)?));
                if let Err(e) = issued {
                    stop.store(true, Ordering::Relaxed);
                    result = Err(e);
                    break;
                }
            }
            // Wait for the workers so no chunk stays borrowed past this call.
            if let Err(panic) = workers.join() {
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
