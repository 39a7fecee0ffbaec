//! Expert parallelism: an MoE layer of a model cut for an expert-parallel
//! rank ([`crate::Model::shard`] with `ep_world > 1`), whose rank holds a
//! contiguous block of the routed experts (`Placement::expert_range`) and
//! the whole router.
//!
//! Every rank holds every token's normed input (the attention and dense
//! layers before it are replicated, or tensor-parallel and all-reduced)
//! and routes every token alike (the router and its delta are
//! replicated). The batch's tokens are then split into contiguous blocks,
//! one per rank (rank `s` *sources* tokens `s·n/W .. (s+1)·n/W`), and per
//! layer:
//!
//! 1. *Dispatch.* Each rank sends each of its tokens' (token, chosen
//!    expert) rows to the rank holding that expert, with the token's tag
//!    ([`DeltaHooks::dispatch_tags`]: the engine's per-token adapter map,
//!    `lora_moe::MoeLora::dispatch_map`), in one
//!    [`Collective::all_to_all_v`]. A row is `[tag, expert, x[hidden]]`
//!    (tag and expert are small integers, exact in f32).
//! 2. *Experts.* Each rank runs its experts over the rows it received, in
//!    source-rank order (base gate|up, [`DeltaHooks::dispatched_gate_up`]
//!    with the received tags, `silu(gate) * up`, base down,
//!    [`DeltaHooks::dispatched_down`]), and sends each row's output back
//!    to its source, in the order it came (a second all-to-all).
//! 3. *Combine.* Each source rank sums its tokens' expert outputs times
//!    their routing weights in ascending expert order (transformers'
//!    loop, and the one-rank forward's), and one all-gather gives every
//!    rank the whole layer output, which is therefore the same on every
//!    rank bit for bit: the forward adds no all-reduce after it.
//!
//! Which collective group a placement runs with is [`group_of`]: the
//! tensor-parallel group when `tp_world > 1` (expert parallelism then
//! runs over the same ranks), the expert-parallel one otherwise.
//!
//! This module must never compute a delta (the hooks add them), never
//! read a tag (it only carries them), and never decide routing (the
//! forward routes before dispatch).

use std::ops::Range;

use lora_layout::Placement;

use crate::collective::Collective;
use crate::config::MoeConfig;
use crate::error::EngineError;
use crate::hooks::DeltaHooks;
use crate::math::silu_mul;
use crate::model::Model;
use crate::projection::{Projection, Site};

/// The `(rank, world)` of the collective group a model cut for
/// `placement` runs with (`moe`: the model has routed-expert layers).
///
/// Errors ([`EngineError::NotTensorParallel`], naming the worlds):
/// routed experts under `tp_world > 1` without expert parallelism over
/// the same ranks (experts cut by their width are not built), and
/// expert-parallel ranks other than the tensor-parallel ones (two groups
/// are not built).
pub(crate) fn group_of(placement: Placement, moe: bool) -> Result<(usize, usize), EngineError> {
    let (tp, ep) = (placement.tp_world(), placement.ep_world());
    if tp > 1 && moe && ep == 1 {
        return Err(EngineError::NotTensorParallel {
            what: format!(
                "routed experts under tp_world {tp} with ep_world 1: experts are not cut; \
                 serve them expert-parallel (ep_world = tp_world, or tp_world 1)"
            ),
        });
    }
    if tp > 1 && ep > 1 && (tp, placement.tp_rank()) != (ep, placement.ep_rank()) {
        return Err(EngineError::NotTensorParallel {
            what: format!(
                "expert-parallel rank {} of {ep} beside tensor-parallel rank {} of {tp}: \
                 expert parallelism runs over the tensor-parallel ranks or alone",
                placement.ep_rank(),
                placement.tp_rank()
            ),
        });
    }
    Ok(if tp > 1 {
        (placement.tp_rank(), tp)
    } else {
        (placement.ep_rank(), ep)
    })
}

/// Token block `rank` of `n` tokens over `world` ranks.
fn block(rank: usize, n: usize, world: usize) -> Range<usize> {
    rank * n / world..(rank + 1) * n / world
}

impl Model {
    /// The collective to all-reduce a layer's attention output
    /// (`moe_layer` false) or MLP output through: the group's, when this
    /// model's dense projections are cut over it (a one-rank group
    /// included), except after an expert-parallel MoE layer, whose output
    /// is already whole on every rank.
    pub(crate) fn partial_sums(&self, moe_layer: bool) -> Option<&dyn Collective> {
        let c = self.collective.as_deref()?;
        let cut_over_group = self.placement.tp_world() == c.world();
        let whole = moe_layer && self.placement.ep_world() > 1;
        (cut_over_group && !whole).then_some(c)
    }

    /// The expert-parallel group, when this model's MoE layers dispatch.
    pub(crate) fn expert_group(&self) -> Option<&dyn Collective> {
        self.collective.as_deref().filter(|_| self.placement.ep_world() > 1)
    }

    /// One MoE layer's routed experts under expert parallelism (see the
    /// module docs), after routing: `topk` / `weights` `[n * k]` are every
    /// token's chosen experts and routing weights (the same on every
    /// rank); `gate_up` / `down` this rank's experts. Returns the layer
    /// output `[n, hidden]`, whole.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dispatch_experts(
        &self,
        c: &dyn Collective,
        l: usize,
        moe: &MoeConfig,
        gate_up: &[Projection],
        down: &[Projection],
        xn: &[f32],
        topk: &[u32],
        weights: &[f32],
        hooks: &mut dyn DeltaHooks,
    ) -> Result<Vec<f32>, EngineError> {
        let (rank, world) = (c.rank(), c.world());
        if (rank, world) != (self.placement.ep_rank(), self.placement.ep_world()) {
            return Err(EngineError::Collective(format!(
                "a collective of rank {rank} of {world} for expert-parallel rank {} of {}",
                self.placement.ep_rank(),
                self.placement.ep_world()
            )));
        }
        let h = self.cfg.hidden;
        let n = xn.len() / h;
        let (k, mi) = (moe.top_k, moe.moe_inter);
        let experts = self.placement.expert_range(moe.num_experts)?;
        let per = experts.len();
        if per == 0 || (gate_up.len(), down.len()) != (per, per) {
            return Err(EngineError::Collective(format!(
                "layer {l} holds {} / {} experts for the block {experts:?}",
                gate_up.len(),
                down.len()
            )));
        }
        let tags = hooks.dispatch_tags(l, n)?;
        // A tag travels as an f32: exact below 2^24 in magnitude.
        if tags.len() != n || tags.iter().any(|t| t.unsigned_abs() >= 1 << 24) {
            return Err(EngineError::Hook {
                hook: "dispatch_tags",
                source: format!("{} tags for {n} tokens, each below 2^24 in magnitude", tags.len()).into(),
            });
        }

        // 1. dispatch: this rank's tokens' rows to their experts' ranks
        let mine = block(rank, n, world);
        let mut send: Vec<Vec<f32>> = vec![Vec::new(); world];
        let mut sent: Vec<Vec<usize>> = vec![Vec::new(); world];
        for t in mine.clone() {
            for (j, &e) in topk[t * k..(t + 1) * k].iter().enumerate() {
                let (r, dest) = (t * k + j, e as usize / per);
                send[dest].extend([tags[t] as f32, e as f32]);
                send[dest].extend_from_slice(&xn[t * h..(t + 1) * h]);
                sent[dest].push(r);
            }
        }
        let recv = c.all_to_all_v(&send)?;

        // 2. this rank's experts over the rows it received
        let mut from = Vec::with_capacity(world);
        let (mut x, mut row_tags, mut row_experts) = (Vec::new(), Vec::new(), Vec::new());
        for (s, buf) in recv.iter().enumerate() {
            from.push(buf.len() / (h + 2));
            for row in buf.chunks_exact(h + 2) {
                let e = row[1] as u32;
                if !experts.contains(&(e as usize)) {
                    return Err(EngineError::Collective(format!(
                        "rank {s} dispatched a row of expert {e} to rank {rank}, which holds experts {experts:?}"
                    )));
                }
                row_tags.push(row[0] as i32);
                row_experts.push(e);
                x.extend_from_slice(&row[2..]);
            }
        }
        let m = row_experts.len();
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); per];
        for (r, &e) in row_experts.iter().enumerate() {
            by_expert[e as usize - experts.start].push(r);
        }
        let mut gu = vec![0.0f32; m * 2 * mi];
        run_experts(&by_expert, gate_up, "gate_up", l, experts.start, &x, h, &mut gu, 2 * mi)?;
        hooks.dispatched_gate_up(l, &x, &row_experts, &row_tags, &mut gu)?;
        let mut act = vec![0.0f32; m * mi];
        silu_mul(&gu, mi, &mut act);
        let mut dn = vec![0.0f32; m * h];
        run_experts(&by_expert, down, "down", l, experts.start, &act, mi, &mut dn, h)?;
        hooks.dispatched_down(l, &act, &row_experts, &row_tags, &mut dn)?;
        let mut back = Vec::with_capacity(world);
        let mut at = 0;
        for rows in from {
            back.push(dn[at * h..(at + rows) * h].to_vec());
            at += rows;
        }
        let returned = c.all_to_all_v(&back)?;

        // 3. combine this rank's tokens, then gather every rank's
        let mut expanded = vec![0.0f32; n * k * h];
        for (d, (buf, rows)) in returned.iter().zip(&sent).enumerate() {
            if buf.len() != rows.len() * h {
                return Err(EngineError::Collective(format!(
                    "rank {d} returned {} values for {} rows",
                    buf.len(),
                    rows.len()
                )));
            }
            for (&r, y) in rows.iter().zip(buf.chunks_exact(h)) {
                expanded[r * h..(r + 1) * h].copy_from_slice(y);
            }
        }
        let longest = (0..world).map(|s| block(s, n, world).len()).max().unwrap_or(0);
        let mut part = vec![0.0f32; longest * h];
        let mut slots: Vec<usize> = Vec::with_capacity(k);
        for (t, o) in mine.clone().zip(part.chunks_exact_mut(h)) {
            slots.clear();
            slots.extend(0..k);
            slots.sort_by_key(|&j| topk[t * k + j]);
            for &j in &slots {
                let r = t * k + j;
                for (a, &b) in o.iter_mut().zip(&expanded[r * h..(r + 1) * h]) {
                    *a += b * weights[r];
                }
            }
        }
        let mut all = vec![0.0f32; world * longest * h];
        c.all_gather(&part, &mut all)?;
        let mut out = Vec::with_capacity(n * h);
        for s in 0..world {
            let start = s * longest * h;
            out.extend_from_slice(&all[start..start + block(s, n, world).len() * h]);
        }
        Ok(out)
    }
}

/// Per local expert, its rows of `x` (`in_w` wide) through its projection
/// into the same rows of `y` (`out_w` wide).
#[allow(clippy::too_many_arguments)]
fn run_experts(
    by_expert: &[Vec<usize>],
    projections: &[Projection],
    name: &'static str,
    l: usize,
    first: usize,
    x: &[f32],
    in_w: usize,
    y: &mut [f32],
    out_w: usize,
) -> Result<(), EngineError> {
    for ((e, rows), p) in by_expert.iter().enumerate().zip(projections) {
        if rows.is_empty() {
            continue;
        }
        let xe: Vec<f32> = rows
            .iter()
            .flat_map(|&r| x[r * in_w..(r + 1) * in_w].iter().copied())
            .collect();
        let mut ye = vec![0.0f32; rows.len() * out_w];
        p.apply(Site::expert(name, l, first + e), &xe, &mut ye)?;
        for (&r, yr) in rows.iter().zip(ye.chunks_exact(out_w)) {
            y[r * out_w..(r + 1) * out_w].copy_from_slice(yr);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The ranks' token blocks cover the batch once, in order, and
        /// differ in length by at most one.
        #[test]
        fn token_blocks_cover_the_batch_once(n in 0usize..200, world in 1usize..9) {
            let blocks: Vec<Range<usize>> = (0..world).map(|r| block(r, n, world)).collect();
            let mut next = 0;
            for b in &blocks {
                prop_assert_eq!(b.start, next);
                next = b.end;
            }
            prop_assert_eq!(next, n);
            let lens: Vec<usize> = blocks.iter().map(|b| b.len()).collect();
            let (lo, hi) = (lens.iter().min().copied().unwrap_or(0), lens.iter().max().copied().unwrap_or(0));
            prop_assert!(hi - lo <= 1);
        }
    }

    #[test]
    fn the_group_is_the_tensor_parallel_one_or_the_expert_parallel_one() {
        let ep = |r, w| Placement::SINGLE.with_experts(r, w).expect("placement");
        let tp = |r, w| Placement::new(r, w).expect("placement");
        assert_eq!(group_of(Placement::SINGLE, true).ok(), Some((0, 1)));
        assert_eq!(group_of(ep(1, 4), true).ok(), Some((1, 4)));
        assert_eq!(group_of(tp(1, 2), false).ok(), Some((1, 2)));
        assert_eq!(
            group_of(tp(1, 2).with_experts(1, 2).expect("p"), true).ok(),
            Some((1, 2))
        );
        assert!(group_of(tp(1, 2), true).is_err());
        assert!(group_of(tp(1, 2).with_experts(0, 2).expect("p"), true).is_err());
        assert!(group_of(tp(1, 2).with_experts(1, 4).expect("p"), true).is_err());
    }
}
