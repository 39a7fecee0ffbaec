use half::bf16;

use super::*;
use crate::table::PairEntry;
use crate::testing::{Rng, cuda_or_skip};

/// A mixed batch: 3 slots (0 DoRA at both targets, 1 plain LoRA, 2 DoRA at
/// the second target only), base rows, two targets side by side in a
/// padded y row.
struct Case {
    out: [usize; 2],
    width: usize,
    stride: usize,
    n_rows: usize,
    slots: Vec<i32>,
    /// Per target, per slot: g, or none.
    g: Vec<Vec<Option<Vec<f32>>>>,
    bias: Vec<Vec<f32>>,
    y0: Vec<f32>,
}

const N_SLOTS: usize = 3;

impl Case {
    fn random(rng: &mut Rng) -> Case {
        let out = [8 + rng.below(40), 8 + rng.below(40)];
        let width = out[0] + out[1];
        let stride = width + rng.below(5);
        let n_rows = 1 + rng.below(20);
        let slots = (0..n_rows).map(|_| rng.below(N_SLOTS + 1) as i32 - 1).collect();
        let g = (0..2)
            .map(|t| {
                (0..N_SLOTS)
                    .map(|s| {
                        let dora = s == 0 || (s == 2 && t == 1);
                        dora.then(|| (0..out[t]).map(|_| 1.0 + 0.5 * rng.uniform()).collect())
                    })
                    .collect()
            })
            .collect();
        // Target 0 has a bias, target 1 none (zeros).
        let bias = vec![(0..out[0]).map(|_| rng.uniform()).collect(), vec![0.0; out[1]]];
        let y0 = (0..n_rows * stride).map(|_| 4.0 * rng.uniform()).collect();
        Case {
            out,
            width,
            stride,
            n_rows,
            slots,
            g,
            bias,
            y0,
        }
    }

    /// The expected y, computed here on the host.
    fn expected<Y: OutputElem>(&self) -> Vec<Y> {
        let mut y: Vec<Y> = self.y0.iter().map(|v| Y::from_f32(*v)).collect();
        for (r, &s) in self.slots.iter().enumerate() {
            if s < 0 {
                continue;
            }
            let mut col = 0;
            for t in 0..2 {
                if let Some(g) = &self.g[t][s as usize] {
                    for c in 0..self.out[t] {
                        let v = &mut y[r * self.stride + col + c];
                        let b = self.bias[t][c];
                        *v = Y::from_f32(g[c] * (v.to_f32() - b) + b);
                    }
                }
                col += self.out[t];
            }
        }
        y
    }

    fn run<Y: OutputElem>(&self, device: &Device) -> Result<Vec<Y>, KernelError> {
        let mut g_bufs = Vec::new();
        let mut table = vec![0u64; 2 * N_SLOTS];
        for t in 0..2 {
            for s in 0..N_SLOTS {
                if let Some(g) = &self.g[t][s] {
                    let buf = device.upload(g)?;
                    table[t * N_SLOTS + s] = buf.device_addr();
                    g_bufs.push(buf);
                }
            }
        }
        let table = device.upload(&table)?;
        let bias: Vec<f32> = self.bias.concat();
        let bias = device.upload(&bias)?;
        let row_slot = device.upload(&self.slots)?;
        let mut y = device.upload(&self.y0.iter().map(|v| Y::from_f32(*v)).collect::<Vec<Y>>())?;
        let targets = [
            DoraTarget {
                table: &table,
                table_offset: 0,
                n_entries: N_SLOTS,
                bias: &bias,
                bias_offset: 0,
                out_dim: self.out[0],
                y_col_offset: 0,
            },
            DoraTarget {
                table: &table,
                table_offset: N_SLOTS,
                n_entries: N_SLOTS,
                bias: &bias,
                bias_offset: self.out[0],
                out_dim: self.out[1],
                y_col_offset: self.out[0],
            },
        ];
        let rows = RowsMut {
            buf: &mut y,
            offset: 0,
            n_rows: self.n_rows,
            width: self.width,
            stride: self.stride,
        };
        dora_rescale(device, &row_slot, &targets, rows)?;
        device.synchronize()?;
        device.check_faults()?;
        y.download()
    }
}

fn bits<Y: OutputElem>(v: &[Y]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

#[test]
fn the_cpu_rescale_touches_dora_rows_only_and_keeps_the_bias_outside() {
    let mut rng = Rng::fresh("dora cpu");
    let device = Device::cpu();
    for _ in 0..20 {
        let case = Case::random(&mut rng);
        assert_eq!(bits(&case.run::<f32>(&device).unwrap()), bits(&case.expected::<f32>()));
        assert_eq!(
            bits(&case.run::<bf16>(&device).unwrap()),
            bits(&case.expected::<bf16>())
        );
    }
}

#[test]
fn a_slot_past_the_table_is_an_error() {
    let mut rng = Rng::new(7);
    let device = Device::cpu();
    let mut case = Case::random(&mut rng);
    case.slots[0] = N_SLOTS as i32;
    let err = case.run::<f32>(&device).unwrap_err();
    assert!(matches!(err, KernelError::BadIndex { arg: "row_slot", .. }), "{err}");
}

/// CUDA against the host expectation (which the CPU reference equals bit
/// for bit), on fresh random cases: equal bit for bit, since both round
/// `g · (y − b) + b` the same way without a fused multiply-add.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_dora_rescale_equals_the_cpu_reference() {
    let Some(gpu) = cuda_or_skip("gpu_dora_rescale_equals_the_cpu_reference") else {
        return;
    };
    let mut rng = Rng::fresh("dora gpu");
    for _ in 0..50 {
        let case = Case::random(&mut rng);
        assert_eq!(bits(&case.run::<f32>(&gpu).unwrap()), bits(&case.expected::<f32>()));
        assert_eq!(bits(&case.run::<bf16>(&gpu).unwrap()), bits(&case.expected::<bf16>()));
    }
}

/// A random DoRA pair laid out as the pool's staging slot holds it (B rows
/// `stride` apart, padding poisoned), its base weight and magnitude.
struct NormCase {
    out: usize,
    inp: usize,
    rank: usize,
    stride: usize,
    scale: f32,
    w: Vec<f32>,
    a: Vec<bf16>,
    b: Vec<bf16>,
    m: Vec<f32>,
}

impl NormCase {
    fn random(rng: &mut Rng) -> NormCase {
        let (out, inp) = (1 + rng.below(300), 1 + rng.below(300));
        let stride = 1 + rng.below(16);
        let rank = 1 + rng.below(stride);
        let mut b = rng.bf16_vec(out * stride, 1.0);
        for o in 0..out {
            for k in rank..stride {
                b[o * stride + k] = bf16::from_f32(f32::NAN);
            }
        }
        NormCase {
            out,
            inp,
            rank,
            stride,
            scale: 0.25 + rng.uniform().abs(),
            w: (0..out * inp).map(|_| rng.uniform()).collect(),
            a: rng.bf16_vec(rank * inp, 1.0),
            b,
            m: (0..out).map(|_| 1.0 + rng.uniform()).collect(),
        }
    }

    /// PEFT's rescale in f64 throughout.
    fn expected(&self) -> Vec<f64> {
        (0..self.out)
            .map(|o| {
                let sum: f64 = (0..self.inp)
                    .map(|i| {
                        let lora: f64 = (0..self.rank)
                            .map(|k| {
                                f64::from(self.b[o * self.stride + k].to_f32())
                                    * f64::from(self.a[k * self.inp + i].to_f32())
                            })
                            .sum();
                        let v = f64::from(self.w[o * self.inp + i]) + f64::from(self.scale) * lora;
                        v * v
                    })
                    .sum();
                f64::from(self.m[o]) / sum.sqrt()
            })
            .collect()
    }

    fn run(&self, device: &Device) -> Result<Vec<f32>, KernelError> {
        let w = device.upload(&self.w)?;
        let a = device.upload(&self.a)?;
        let b = device.upload(&self.b)?;
        let m = device.upload(&self.m)?;
        // Poisoned output around and inside the target range.
        let mut g = device.upload(&vec![f32::NAN; self.out + 2])?;
        let args = DoraNorm {
            weight: &w,
            weight_offset: 0,
            pair: PairEntry {
                a: a.device_addr(),
                b: b.device_addr(),
                scale: self.scale,
                rank: self.rank as u32,
            },
            stride: self.stride,
            magnitude: &m,
            magnitude_offset: 0,
            out_dim: self.out,
            in_dim: self.inp,
        };
        dora_row_scale(device, &args, &mut g, 1)?;
        device.synchronize()?;
        device.check_faults()?;
        let g = g.download()?;
        assert!(g[0].is_nan() && g[self.out + 1].is_nan(), "wrote outside its range");
        Ok(g[1..=self.out].to_vec())
    }
}

fn max_rel(got: &[f32], want: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(g, w)| (f64::from(*g) - w).abs() / w.abs())
        .fold(0.0, f64::max)
}

#[test]
fn the_cpu_row_scale_is_pefts_rescale() {
    let mut rng = Rng::fresh("dora row scale cpu");
    for _ in 0..10 {
        let case = NormCase::random(&mut rng);
        let err = max_rel(&case.run(&Device::cpu()).unwrap(), &case.expected());
        assert!(err < 1e-5, "relative error {err:.3e}");
    }
}

/// CUDA against the CPU reference on fresh random pairs (poisoned B padding
/// and output): equal up to the order of the f64 sum of squares.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn gpu_dora_row_scale_equals_the_cpu_reference() {
    let Some(gpu) = cuda_or_skip("gpu_dora_row_scale_equals_the_cpu_reference") else {
        return;
    };
    let mut rng = Rng::fresh("dora row scale gpu");
    for _ in 0..50 {
        let case = NormCase::random(&mut rng);
        let cpu = case.run(&Device::cpu()).unwrap();
        let cuda = case.run(&gpu).unwrap();
        let want: Vec<f64> = cpu.iter().map(|v| f64::from(*v)).collect();
        let err = max_rel(&cuda, &want);
        assert!(err < 1e-6, "relative error {err:.3e}");
    }
}
