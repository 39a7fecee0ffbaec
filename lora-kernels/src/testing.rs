//! Helpers for the GPU tests and benchmarks of this and other crates: the
//! skip-or-fail gate for GPU tests, a small seeded RNG, random pools of LoRA
//! pairs laid out like the real pool, and the relative error norm.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use half::bf16;

use crate::buffer::DeviceBuffer;
use crate::device::Device;
use crate::error::KernelError;
use crate::table::PairEntry;

/// The switch that turns a skipped GPU test into a failed one.
pub const REQUIRE_GPU_ENV: &str = "LORA_REQUIRE_GPU";

/// Whether `LORA_REQUIRE_GPU` is `1` or `true`.
pub fn gpu_required() -> bool {
    std::env::var(REQUIRE_GPU_ENV).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// CUDA device 0 for GPU test `test`, or `None` after printing why it is
/// skipped. Under `LORA_REQUIRE_GPU=1` a missing GPU fails the test instead.
pub fn cuda_or_skip(test: &str) -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => Some(d),
        Err(e) if gpu_required() => panic!("{test}: {REQUIRE_GPU_ENV}=1 but CUDA is not usable: {e}"),
        Err(e) => {
            eprintln!("skipping {test}: CUDA is not usable here ({e})");
            None
        }
    }
}

/// A SplitMix64 generator: small, seeded, reproducible.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// A generator with a fresh seed (time and a counter), printed with
    /// `label` so a failing run can be replayed with [`Rng::new`].
    pub fn fresh(label: &str) -> Rng {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let seed = nanos
            ^ COUNTER
                .fetch_add(1, Ordering::Relaxed)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15);
        eprintln!("{label}: seed {seed:#x}");
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// Uniform in `[-1, 1)`.
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// `len` BF16 values uniform in `[-amp, amp)`.
    pub fn bf16_vec(&mut self, len: usize, amp: f32) -> Vec<bf16> {
        (0..len).map(|_| bf16::from_f32(self.uniform() * amp)).collect()
    }
}

/// Random LoRA pairs laid out like pool slots: slot `s` holds A
/// `[stride, in]` then B `[out, stride]` (BF16), with A rows and B columns
/// past the slot's rank zero (or NaN, to prove a kernel never reads them).
#[derive(Debug, Clone)]
pub struct RandomPairs {
    /// Input width.
    pub in_dim: usize,
    /// Output width.
    pub out_dim: usize,
    /// Rank stride (the pool's `max_rank`).
    pub stride: usize,
    /// Rank of each slot (0: no pair).
    pub ranks: Vec<u32>,
    /// Scale of each slot.
    pub scales: Vec<f32>,
    /// All slots' weights, slot after slot.
    pub data: Vec<bf16>,
}

impl RandomPairs {
    /// Slots of the given ranks with random weights and scales. Entries of A
    /// are uniform in `±1/sqrt(in)`, of B in `±1/sqrt(rank)`, so deltas stay
    /// of order one; padding is zero.
    pub fn new(rng: &mut Rng, in_dim: usize, out_dim: usize, stride: usize, ranks: &[u32]) -> RandomPairs {
        let slot = stride * in_dim + out_dim * stride;
        let mut data = vec![bf16::ZERO; slot * ranks.len()];
        let mut scales = Vec::with_capacity(ranks.len());
        for (s, &r) in ranks.iter().enumerate() {
            let r = (r as usize).min(stride);
            let base = s * slot;
            let a_amp = 1.0 / (in_dim.max(1) as f32).sqrt();
            let b_amp = 1.0 / (r.max(1) as f32).sqrt();
            for v in &mut data[base..base + r * in_dim] {
                *v = bf16::from_f32(rng.uniform() * a_amp);
            }
            for o in 0..out_dim {
                let row = base + stride * in_dim + o * stride;
                for v in &mut data[row..row + r] {
                    *v = bf16::from_f32(rng.uniform() * b_amp);
                }
            }
            scales.push(0.5 + rng.uniform().abs());
        }
        RandomPairs {
            in_dim,
            out_dim,
            stride,
            ranks: ranks.to_vec(),
            scales,
            data,
        }
    }

    /// Elements of one slot.
    pub fn slot_elems(&self) -> usize {
        self.stride * self.in_dim + self.out_dim * self.stride
    }

    /// Fill every A row and B column past each slot's rank with NaN.
    pub fn poison_padding(&mut self) {
        let slot = self.slot_elems();
        for (s, &r) in self.ranks.iter().enumerate() {
            let r = (r as usize).min(self.stride);
            let base = s * slot;
            for v in &mut self.data[base + r * self.in_dim..base + self.stride * self.in_dim] {
                *v = bf16::NAN;
            }
            for o in 0..self.out_dim {
                let row = base + self.stride * self.in_dim + o * self.stride;
                for v in &mut self.data[row + r..row + self.stride] {
                    *v = bf16::NAN;
                }
            }
        }
    }

    /// The table entries of the slots when the weights sit at device address `base`.
    pub fn entries(&self, base: u64) -> Vec<PairEntry> {
        let slot_bytes = (self.slot_elems() * 2) as u64;
        self.ranks
            .iter()
            .zip(&self.scales)
            .enumerate()
            .map(|(s, (&rank, &scale))| {
                let a = base + s as u64 * slot_bytes;
                let b = a + (self.stride * self.in_dim * 2) as u64;
                if rank == 0 {
                    PairEntry::default()
                } else {
                    PairEntry { a, b, scale, rank }
                }
            })
            .collect()
    }

    /// The delta `scale * B (A x)` of slot `slot` for input row `x`, in f64
    /// straight from the weights: an oracle independent of tables and kernels.
    pub fn delta_f64(&self, slot: usize, x: &[f32]) -> Vec<f64> {
        let r = (self.ranks[slot] as usize).min(self.stride);
        let base = slot * self.slot_elems();
        let t: Vec<f64> = (0..r)
            .map(|k| {
                let row = &self.data[base + k * self.in_dim..base + (k + 1) * self.in_dim];
                row.iter()
                    .zip(x)
                    .map(|(a, x)| f64::from(a.to_f32()) * f64::from(*x))
                    .sum()
            })
            .collect();
        (0..self.out_dim)
            .map(|o| {
                let row = base + self.stride * self.in_dim + o * self.stride;
                let dot: f64 = (0..r).map(|k| f64::from(self.data[row + k].to_f32()) * t[k]).sum();
                f64::from(self.scales[slot]) * dot
            })
            .collect()
    }

    /// Upload the weights and their table to `device`.
    pub fn upload(&self, device: &Device) -> Result<PairPool, KernelError> {
        let weights = device.upload(&self.data)?;
        let table = device.upload(&self.entries(weights.device_addr()))?;
        Ok(PairPool { weights, table })
    }
}

/// [`RandomPairs`] on a device: the weights and their `[slots]` table.
pub struct PairPool {
    /// All slots' weights.
    pub weights: DeviceBuffer<bf16>,
    /// One entry per slot.
    pub table: DeviceBuffer<PairEntry>,
}

/// `‖out − reference‖ / ‖reference‖` in f64; infinite when either holds a
/// NaN or an infinity, or the lengths differ (NaN never passes). With an
/// all-zero reference, `‖out‖`.
pub fn rel_error(out: &[f32], reference: &[f32]) -> f64 {
    if out.len() != reference.len() || out.iter().chain(reference).any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (o, r) in out.iter().zip(reference) {
        num += (f64::from(*o) - f64::from(*r)).powi(2);
        den += f64::from(*r).powi(2);
    }
    if den == 0.0 { num.sqrt() } else { (num / den).sqrt() }
}

/// BF16 values widened to f32.
pub fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// Raw little-endian bytes (an even count) as the bf16 elements of a
/// carrier buffer, element by element: a byte vector's address need not be
/// 2-aligned (an empty one's is 1), which a cast would refuse.
pub fn bf16_carrier(bytes: &[u8]) -> Vec<bf16> {
    bytes
        .chunks_exact(2)
        .map(|b| bf16::from_le_bytes([b[0], b[1]]))
        .collect()
}

/// A random repack case: raw source bytes (random BF16 / F16 / F32 values,
/// tensors at any byte offset) and non-overlapping regions over a
/// destination of `dst_len` elements, some of them zeros only.
#[derive(Debug, Clone)]
pub struct RepackCase {
    /// The raw source bytes.
    pub src: Vec<u8>,
    /// The regions, in destination order.
    pub regions: Vec<crate::ops::repack::RepackRegion>,
    /// Destination elements the regions span (and some gaps they leave).
    pub dst_len: usize,
}

impl RepackCase {
    /// A case of `n_regions` regions with sides up to `max_side`.
    pub fn random(rng: &mut Rng, n_regions: usize, max_side: usize) -> RepackCase {
        use crate::ops::repack::{RepackDtype, RepackRegion};
        let mut src = Vec::new();
        let mut regions = Vec::with_capacity(n_regions);
        let mut dst_at = 0usize;
        for _ in 0..n_regions {
            let dtype = [RepackDtype::Bf16, RepackDtype::F16, RepackDtype::F32][rng.below(3)];
            let dst_rows = 1 + rng.below(max_side);
            let dst_cols = 1 + rng.below(max_side);
            let zeros_only = rng.below(8) == 0;
            let rows = if zeros_only { 0 } else { 1 + rng.below(dst_rows) };
            let src_cols = 1 + rng.below(dst_cols);
            // Odd gaps in the source and the destination: any alignment.
            src.resize(src.len() + rng.below(3), 0xa5);
            dst_at += rng.below(3) * 8 + rng.below(2);
            let src_byte = src.len();
            for _ in 0..rows * src_cols {
                let v = (rng.uniform() - 0.5) * 8.0;
                match dtype {
                    RepackDtype::Bf16 => src.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
                    RepackDtype::F16 => src.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
                    RepackDtype::F32 => src.extend_from_slice(&v.to_le_bytes()),
                }
            }
            regions.push(RepackRegion {
                src_byte: src_byte as u64,
                dst_elem: dst_at as u64,
                rows: rows as u32,
                src_cols: src_cols as u32,
                dst_rows: dst_rows as u32,
                dst_cols: dst_cols as u32,
                dtype: dtype as u32,
                pad: 0,
            });
            dst_at += dst_rows * dst_cols;
        }
        // An even source length, as the BF16 carrier buffer needs.
        src.resize(src.len().next_multiple_of(2), 0);
        RepackCase {
            src,
            regions,
            dst_len: dst_at + 5,
        }
    }

    /// Write values that are not finite as served (NaN, ±Inf, and for F32
    /// a finite value past BF16's range) at `count` random elements of
    /// random non-empty regions; returns per region the least element
    /// written, the answer [`crate::first_non_finite`] must give.
    pub fn poison_values(&mut self, rng: &mut Rng, count: usize) -> Vec<Option<u64>> {
        use crate::ops::repack::RepackDtype;
        let mut least: Vec<Option<u64>> = vec![None; self.regions.len()];
        let filled: Vec<usize> = (0..self.regions.len())
            .filter(|&i| self.regions[i].rows > 0 && self.regions[i].src_cols > 0)
            .collect();
        if filled.is_empty() {
            return least;
        }
        for _ in 0..count {
            let i = filled[rng.below(filled.len())];
            let r = self.regions[i];
            let e = rng.below(r.rows as usize * r.src_cols as usize);
            let kind = rng.below(4);
            let (size, bytes): (usize, Vec<u8>) = match r.dtype {
                0 => (2, [0x7fc0u16, 0x7f80, 0xff80, 0x7f81][kind].to_le_bytes().to_vec()),
                1 => (2, [0x7e00u16, 0x7c00, 0xfc00, 0x7c01][kind].to_le_bytes().to_vec()),
                _ => (
                    4,
                    [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3.4e38][kind]
                        .to_le_bytes()
                        .to_vec(),
                ),
            };
            debug_assert_eq!(
                size,
                [RepackDtype::Bf16, RepackDtype::F16, RepackDtype::F32][r.dtype as usize].size()
            );
            let at = r.src_byte as usize + e * size;
            self.src[at..at + size].copy_from_slice(&bytes);
            least[i] = Some(least[i].map_or(e as u64, |l| l.min(e as u64)));
        }
        least
    }

    /// The first element not finite as served of each region, on `device`.
    pub fn first_non_finite(&self, device: &Device) -> Result<Vec<Option<u64>>, KernelError> {
        let src = device.upload(&bf16_carrier(&self.src))?;
        let mut scratch = device.alloc_zeros(self.regions.len().max(1))?;
        let mut hits = device.alloc_zeros(self.regions.len() + 1)?;
        crate::ops::repack::first_non_finite(device, &src, self.src.len(), &self.regions, &mut scratch, &mut hits)
    }

    /// Queue the value scan, then the repack gated on it, over a destination
    /// filled with `poison`, with nothing waited for in between, on the copy
    /// lane (ordered after the compute lane's uploads by an event, as the
    /// pool's swap is); returns the scan's answers and the destination.
    pub fn run_if_finite(&self, device: &Device, poison: bf16) -> Result<(Vec<Option<u64>>, Vec<bf16>), KernelError> {
        use crate::Lane;
        use crate::ops::repack::{queue_value_scan, repack_if_finite};
        let src = device.upload(&bf16_carrier(&self.src))?;
        let mut dst = device.upload(&vec![poison; self.dst_len])?;
        let mut scratch = device.alloc_zeros(self.regions.len().max(1))?;
        let mut hits = device.alloc_zeros(self.regions.len() + 1)?;
        let bytes = self.src.len();
        let uploaded = device.record_event_on(Lane::Compute)?;
        device.wait_event(Lane::Copy, &uploaded)?;
        let scan = queue_value_scan(device, Lane::Copy, &src, bytes, &self.regions, &mut scratch, &mut hits)?;
        repack_if_finite(device, &scan, &hits, &src, bytes, &self.regions, &mut scratch, &mut dst)?;
        // The read waits for the copy lane; the download below is queued after it.
        let answers = scan.read(&hits)?;
        Ok((answers, dst.download()?))
    }

    /// Run the case on `device` over a destination filled with `poison`.
    pub fn run(&self, device: &Device, poison: bf16) -> Result<Vec<bf16>, KernelError> {
        let src = device.upload(&bf16_carrier(&self.src))?;
        let mut dst = device.upload(&vec![poison; self.dst_len])?;
        let mut scratch = device.alloc_zeros(self.regions.len().max(1))?;
        crate::ops::repack::repack(device, &src, self.src.len(), &self.regions, &mut scratch, &mut dst)?;
        dst.download()
    }
}
