//! The path from host to a slot: pinned chunks filled by the pool's workers
//! and copied to a device staging slot as each one completes.
//!
//! The slot's places are cut into chunks of whole places, each with its own
//! pinned host buffer, and each chunk into parts (a place, or a piece of the
//! file). Every reader thread takes the next part in slot order from one
//! counter, and the thread that fills a chunk's last part issues the chunk's
//! asynchronous copy on the device's copy lane. So the chunks complete one
//! after another without a pause, the copies run while later chunks are
//! still being filled, and the transfer costs about the slower of the two
//! streams rather than their sum. (Chunk workers that each filled a whole
//! chunk completed their chunks together, in waves, with the readers idle
//! between waves: BENCHMARKS.md, "Swap and peer landing".)
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
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use half::bf16;
use lora_audit::{AuditError, UnparsedSafetensors};
use lora_kernels::{Device, DeviceBuffer, Lane, PinnedHostBuffer, RepackRegion};
use lora_layout::{PairLayout, SlotLayout};

use crate::error::PoolError;
use crate::image::{ImageError, PackPlan, range_elems};
use crate::streaming::read_streaming;

/// Default size of one pinned chunk: small enough that the first copy
/// starts early and the last one ends soon after the last read, large
/// enough that each copy runs at the link's full rate.
const DEFAULT_CHUNK_BYTES: usize = 4 << 20;

/// Default reader threads: one per core (on the 16-core H200 host, with
/// streaming stores, 16 readers swapped in 2.15 ms and 12 in 2.21; 10 or
/// fewer starve the copy). Between hosts of one kind the best count moved
/// by a few threads; `StagingTuning` overrides it.
fn default_read_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get())
}

/// Bytes one worker reads at a time from a file: small enough that a
/// chunk is read by the whole pool (a whole chunk per thread left most of
/// the copy engine idle on the H200 host, 1 MiB pieces of 4 MiB chunks
/// ran 1.6x slower than 8 MiB chunks).
const READ_PIECE: usize = 128 << 10;

/// How the swap path moves adapters to the device; see
/// [`crate::LoraPool::tune_staging`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingTuning {
    /// Bytes of one pinned chunk (default 4 MiB).
    pub chunk_bytes: usize,
    /// Take the device-repack route when the file's data section fits the
    /// device staging slot (default true).
    pub device_repack: bool,
    /// The swap path's own reader threads (default: one per core).
    pub read_threads: usize,
    /// On the device-repack route, read through a small per-thread buffer
    /// and move the bytes on with non-temporal stores, so the copy engine
    /// reads memory rather than dirty cache lines (default true: measured
    /// faster on the H200 host).
    pub streaming_stores: bool,
}

impl Default for StagingTuning {
    fn default() -> StagingTuning {
        StagingTuning {
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            device_repack: true,
            read_threads: default_read_threads(),
            streaming_stores: true,
        }
    }
}

/// Host chunks, the device staging slot, and the repack region table (and
/// the value scan's answers) of one pool.
pub(crate) struct Staging {
    chunks: Vec<StagingChunk>,
    tuning: StagingTuning,
    /// The swap path's own readers: they never wait on (or hold up) the
    /// engine's rayon work, and their number is a tuning choice.
    threads: rayon::ThreadPool,
    pub(crate) device: DeviceBuffer<bf16>,
    pub(crate) regions: DeviceBuffer<RepackRegion>,
    /// Per region, the first element the device's value scan found not
    /// finite, then the flag word a gated repack reads
    /// ([`lora_kernels::queue_value_scan`]).
    pub(crate) hits: DeviceBuffer<u64>,
}

struct StagingChunk {
    places: Range<usize>,
    elem_offset: usize,
    host: PinnedHostBuffer<bf16>,
}

impl Staging {
    /// Chunks of whole places of about `tuning.chunk_bytes` (a place
    /// larger than that is a chunk alone), a device slot of `layout`'s size,
    /// and a region table of two entries per place.
    pub(crate) fn new(device: &Device, layout: &SlotLayout, tuning: StagingTuning) -> Result<Staging, PoolError> {
        Ok(Staging {
            chunks: chunks(device, layout, tuning.chunk_bytes)?,
            threads: reader_pool(tuning.read_threads)?,
            tuning,
            device: device.alloc_zeros(layout.slot_bytes() / 2)?,
            regions: device.alloc_zeros(2 * PairLayout::len(layout).max(1))?,
            hits: device.alloc_zeros(2 * PairLayout::len(layout) + 1)?,
        })
    }

    /// Re-cut the host chunks if their size changes and take `tuning`'s other choices (the
    /// device slot stays).
    pub(crate) fn retune(
        &mut self,
        device: &Device,
        layout: &SlotLayout,
        tuning: StagingTuning,
    ) -> Result<(), PoolError> {
        if tuning.read_threads != self.threads.current_num_threads() {
            self.threads = reader_pool(tuning.read_threads)?;
        }
        // The pinned chunks depend on their size only: keep them otherwise.
        if tuning.chunk_bytes != self.tuning.chunk_bytes {
            self.chunks = chunks(device, layout, tuning.chunk_bytes)?;
        }
        self.tuning = tuning;
        Ok(())
    }

    /// Whether a data section of `len` bytes goes the device-repack route.
    pub(crate) fn takes_raw(&self, len: usize) -> bool {
        self.tuning.device_repack && len <= self.capacity_bytes()
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
        // One part per place, in slot order.
        let mut parts = Vec::with_capacity(PairLayout::len(layout));
        for (c, chunk) in self.chunks.iter().enumerate() {
            let mut at = 0usize;
            for place in chunk.places.clone() {
                let bytes = 2 * range_elems(layout, place..place + 1);
                parts.push(Part {
                    chunk: c,
                    bytes: at..at + bytes,
                    source: place,
                });
                at += bytes;
            }
        }
        self.pipeline(count, &never, &parts, |part, dst| {
            let got = dst.len();
            let dst: &mut [bf16] = bytemuck::try_cast_slice_mut(dst).map_err(|_| {
                image_err(ImageError::Destination {
                    got,
                    expected: got & !1,
                })
            })?;
            plan.fill(layout, part.source..part.source + 1, dst).map_err(&image_err)
        })
    }

    /// Copy the first `len` bytes of `file`'s data section into the device
    /// staging slot, as they are (their values are checked on the device
    /// once the audit has placed them: `queue_value_scan`). Stops early (returning
    /// `Ok`) once `stop` is set by someone else; the caller then must not
    /// use the staging slot.
    pub(crate) fn read_raw(
        &mut self,
        file: &UnparsedSafetensors,
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
        // The chunks that cover `len` bytes, in order (they tile the staging
        // slot, so `len <= capacity` is covered).
        let mut count = 0;
        let mut covered = 0usize;
        while covered < len {
            let Some(chunk) = self.chunks.get(count) else {
                return Err(PoolError::Image {
                    adapter: adapter.to_string(),
                    source: ImageError::Destination {
                        got: covered,
                        expected: len,
                    },
                });
            };
            covered += 2 * chunk.host.len();
            count += 1;
        }
        // Pieces of `READ_PIECE` bytes, in file order.
        let mut parts = Vec::with_capacity(len.div_ceil(READ_PIECE));
        for (c, chunk) in self.chunks[..count].iter().enumerate() {
            let at = 2 * chunk.elem_offset;
            let want = len.saturating_sub(at).min(2 * chunk.host.len());
            parts.extend((0..want).step_by(READ_PIECE).map(|start| Part {
                chunk: c,
                bytes: start..(start + READ_PIECE).min(want),
                source: at + start,
            }));
        }
        let streaming = self.tuning.streaming_stores;
        self.pipeline(count, stop, &parts, |part, piece| {
            let offset = part.source as u64;
            let read = if streaming {
                read_streaming(piece, |buf| file.read_data_at(buf, offset))
            } else {
                file.read_data_at(piece, offset)
            };
            read.map_err(|e| PoolError::Audit {
                adapter: adapter.to_string(),
                source: Box::new(AuditError::Io {
                    path: file.path().to_string(),
                    source: e,
                }),
            })
        })
    }

    /// Fill `parts` of the first `count` chunks with `fill` and copy each
    /// chunk to the device staging slot once all its parts are filled.
    /// Every reader thread takes the next part in slot order from one
    /// counter, so the chunks fill one after another without a pause
    /// between them, and the thread that fills a chunk's last part issues
    /// its copy. `stop` (set by the caller's other thread, or here on a
    /// failure) ends the fills early. `parts` lie inside their chunks and
    /// never overlap (checked).
    fn pipeline(
        &mut self,
        count: usize,
        stop: &AtomicBool,
        parts: &[Part],
        fill: impl Fn(&Part, &mut [u8]) -> Result<(), PoolError> + Sync,
    ) -> Result<(), PoolError> {
        let Staging {
            chunks,
            device,
            threads,
            ..
        } = self;
        let chunks = &mut chunks[..count];
        // Each chunk's memory, once its previous copies ran; nothing else
        // touches it until this returns (`&mut self`).
        let memory = chunks
            .iter_mut()
            .map(|c| {
                let host: &mut [u8] = bytemuck::cast_slice_mut(c.host.as_mut_slice()?);
                Ok(ChunkMemory {
                    ptr: host.as_mut_ptr(),
                    len: host.len(),
                })
            })
            .collect::<Result<Vec<_>, PoolError>>()?;
        let remaining: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(0)).collect();
        let mut end = vec![0usize; count];
        for part in parts {
            let fits =
                part.chunk < count && part.bytes.start >= end[part.chunk] && part.bytes.end <= memory[part.chunk].len;
            if !fits {
                return Err(PoolError::StagingParts {
                    chunk: part.chunk,
                    start: part.bytes.start,
                    end: part.bytes.end,
                });
            }
            end[part.chunk] = part.bytes.end;
            remaining[part.chunk].fetch_add(1, Ordering::Relaxed);
        }
        let chunks: &[StagingChunk] = chunks;
        let device = Mutex::new(device);
        let upload = |c: usize| -> Result<(), PoolError> {
            let mut device = device.lock().unwrap_or_else(|p| p.into_inner());
            Ok(device.upload_pinned_on(Lane::Copy, chunks[c].elem_offset, &chunks[c].host)?)
        };
        // A chunk with no part to fill goes as it is.
        for (c, left) in remaining.iter().enumerate() {
            if left.load(Ordering::Relaxed) == 0 {
                upload(c)?;
            }
        }
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let first_error = Mutex::new(None);
        threads.broadcast(|_| {
            while !stop.load(Ordering::Relaxed) && !failed.load(Ordering::Relaxed) {
                let Some(part) = parts.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    break;
                };
                let memory = &memory[part.chunk];
                // SAFETY: `memory` is a chunk's pinned buffer, which this call
                // borrows exclusively for its whole run and which no queued copy
                // reads (`as_mut_slice` waited for them); `part.bytes` lies inside
                // it and overlaps no other part (checked above), and the counter
                // hands each part to one thread once, so this is the only
                // reference to these bytes. The chunk's copy is issued only after
                // every part of it was filled and its slice dropped.
                let dst = unsafe { std::slice::from_raw_parts_mut(memory.ptr.add(part.bytes.start), part.bytes.len()) };
                let done = fill(part, dst).and_then(|()| {
                    // The last part of a chunk issues its copy (AcqRel: every
                    // other part's writes happen before it).
                    if remaining[part.chunk].fetch_sub(1, Ordering::AcqRel) == 1 {
                        upload(part.chunk)
                    } else {
                        Ok(())
                    }
                });
                if let Err(e) = done {
                    failed.store(true, Ordering::Relaxed);
                    first_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                }
            }
        });
        match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// A piece of a chunk to fill: bytes `bytes` of chunk `chunk`, from
/// `source` (a layout place, or a byte offset of the file's data section).
struct Part {
    chunk: usize,
    bytes: Range<usize>,
    source: usize,
}

/// A chunk's pinned memory, shared by the reader threads that fill its
/// disjoint parts.
struct ChunkMemory {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is only dereferenced through disjoint part slices,
// each handed to one thread (`Staging::pipeline`), while the buffer is
// borrowed exclusively by that call; pinned host memory may be written
// from any thread.
unsafe impl Send for ChunkMemory {}
// SAFETY: as above: shared access only reads the pointer and length.
unsafe impl Sync for ChunkMemory {}

fn reader_pool(threads: usize) -> Result<rayon::ThreadPool, PoolError> {
    let threads = threads.max(1);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("lora-staging-{i}"))
        .build()
        .map_err(|e| PoolError::StagingThreads {
            threads,
            message: e.to_string(),
        })
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
