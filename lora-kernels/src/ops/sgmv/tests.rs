use super::*;
use crate::WorkspaceSpec;
use crate::testing::{RandomPairs, Rng, rel_error};

struct Case {
    d: Device,
    pairs: RandomPairs,
    pool: crate::testing::PairPool,
    x_host: Vec<bf16>,
    x: DeviceBuffer<bf16>,
    n: usize,
    ws: LoraWorkspace,
}

fn case(seed: u64, n: usize, in_dim: usize, out: usize, stride: usize, ranks: &[u32]) -> Case {
    let mut rng = Rng::new(seed);
    let d = Device::cpu();
    let mut pairs = RandomPairs::new(&mut rng, in_dim, out, stride, ranks);
    pairs.poison_padding();
    let pool = pairs.upload(&d).unwrap();
    let x_host = rng.bf16_vec(n * in_dim, 1.0);
    let x = d.upload(&x_host).unwrap();
    let spec = WorkspaceSpec {
        max_rows: n,
        max_rank: stride,
        max_segments: 16,
        max_targets: 1,
    };
    let ws = LoraWorkspace::new(&d, spec).unwrap();
    Case {
        d,
        pairs,
        pool,
        x_host,
        x,
        n,
        ws,
    }
}

impl Case {
    fn run(&mut self, grouping: Option<(&[i32], &[i32])>, entry: usize) -> Result<Vec<f32>, KernelError> {
        let (n, in_dim, out) = (self.n, self.pairs.in_dim, self.pairs.out_dim);
        let mut y = self.d.alloc_zeros::<f32>(n * out)?;
        let slots = self.pairs.ranks.len();
        let t = [LoraTarget {
            table: &self.pool.table,
            table_offset: 0,
            n_entries: slots,
            out_dim: out,
            y_col_offset: 0,
            dora: None,
        }];
        let (x, yv) = (Rows::dense(&self.x, n, in_dim), RowsMut::dense(&mut y, n, out));
        match grouping {
            Some((cu, slot)) => {
                let cu = self.d.upload(cu)?;
                let seg_slot = self.d.upload(slot)?;
                let s = Segments {
                    cu_seqlens: &cu,
                    seg_slot: &seg_slot,
                    n_segments: slot.len(),
                };
                sgmv(&self.d, x, &s, &t, self.pairs.stride, yv, &mut self.ws)?;
            }
            None => one_adapter(&self.d, x, entry, &t, self.pairs.stride, yv, &mut self.ws)?,
        }
        y.download()
    }

    /// The f64 oracle for per-row entries (-1: none).
    fn oracle(&self, row_entry: &[i32]) -> Vec<f32> {
        let (in_dim, out) = (self.pairs.in_dim, self.pairs.out_dim);
        let mut want = vec![0f32; self.n * out];
        for (r, &e) in row_entry.iter().enumerate() {
            if e >= 0 {
                let xr: Vec<f32> = self.x_host[r * in_dim..(r + 1) * in_dim]
                    .iter()
                    .map(|v| v.to_f32())
                    .collect();
                for (o, v) in self.pairs.delta_f64(e as usize, &xr).iter().enumerate() {
                    want[r * out + o] = *v as f32;
                }
            }
        }
        want
    }
}

#[test]
fn segments_match_the_f64_oracle() {
    let mut c = case(31, 40, 37, 19, 8, &[8, 1, 5, 0]);
    // Segments: 0..7 slot 2, 7..7 empty, 7..20 none, 20..33 slot 0, 33..40 slot 3 (rank 0).
    let cu = [0, 7, 7, 20, 33, 40];
    let slot = [2, 1, -1, 0, 3];
    let got = c.run(Some((&cu, &slot)), 0).unwrap();
    let mut rows = vec![-1i32; 40];
    rows[..7].fill(2);
    rows[20..33].fill(0);
    let want = c.oracle(&rows);
    assert!(rel_error(&got, &want) < 1e-5);
    assert!(
        got[7 * 19..20 * 19].iter().all(|v| *v == 0.0),
        "rows of no segment adapter stay untouched"
    );
}

#[test]
fn rows_outside_every_segment_are_untouched() {
    let mut c = case(32, 20, 16, 8, 4, &[4, 2]);
    let got = c.run(Some((&[5, 9], &[1])), 0).unwrap();
    let mut rows = vec![-1i32; 20];
    rows[5..9].fill(1);
    assert!(rel_error(&got, &c.oracle(&rows)) < 1e-5);
}

#[test]
fn one_adapter_is_one_segment_over_every_row() {
    let mut c = case(33, 25, 30, 11, 16, &[3, 16]);
    let a = c.run(None, 1).unwrap();
    let b = c.run(Some((&[0, 25], &[1])), 0).unwrap();
    assert_eq!(a, b);
    assert!(rel_error(&a, &c.oracle(&[1; 25])) < 1e-5);
}

#[test]
fn bad_segments_are_errors() {
    let mut c = case(34, 10, 8, 4, 4, &[4]);
    for (cu, slot) in [
        (vec![0, 11], vec![0]),
        (vec![5, 3], vec![0]),
        (vec![-1, 3], vec![0]),
        (vec![0, 4], vec![1]),
    ] {
        assert!(c.run(Some((&cu, &slot)), 0).is_err(), "cu {cu:?} slot {slot:?}");
    }
    assert!(matches!(c.run(None, 1), Err(KernelError::BadIndex { .. })));
}

#[test]
fn workspace_limits_are_enforced() {
    let mut c = case(35, 10, 8, 4, 4, &[4]);
    let spec = WorkspaceSpec {
        max_rows: 9,
        max_rank: 4,
        max_segments: 1,
        max_targets: 1,
    };
    c.ws = LoraWorkspace::new(&c.d, spec).unwrap();
    assert!(c.run(None, 0).is_err(), "more rows than the workspace serves");
    let spec = WorkspaceSpec {
        max_rows: 10,
        max_rank: 2,
        max_segments: 1,
        max_targets: 1,
    };
    c.ws = LoraWorkspace::new(&c.d, spec).unwrap();
    assert!(c.run(None, 0).is_err(), "stride above the workspace rank");
    let spec = WorkspaceSpec {
        max_rows: 10,
        max_rank: 4,
        max_segments: 1,
        max_targets: 1,
    };
    c.ws = LoraWorkspace::new(&c.d, spec).unwrap();
    assert!(
        c.run(Some((&[0, 5, 10], &[0, 0])), 0).is_err(),
        "more segments than the workspace serves"
    );
    assert!(c.run(None, 0).is_ok());
    assert!(LoraWorkspace::new(&c.d, WorkspaceSpec { max_targets: 5, ..spec }).is_err());
}
