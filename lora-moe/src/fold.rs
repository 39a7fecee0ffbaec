//! The folds: the router delta onto the gate logits before top-k, and the
//! routed-expert deltas onto the grouped-GEMM outputs, for expanded decode
//! rows and for expert-sorted prefill rows.
//!
//! Every expert row reads one entry `expert * max_loras + slot` of the
//! expert pool's `[num_experts * max_loras]` table for (layer, projection),
//! or -1 (no adapter): [`MoeLora::index_decode_rows`] builds that index with
//! `moe_decode_index` from the router's `topk_ids` and the per-token adapter
//! map (`row_adapter[row / top_k]`), [`MoeLora::index_sorted_rows`] with
//! `moe_sorted_index` from the sort's `sorted_token` and `expert_offsets`.
//! The folds are one `bgmv` launch each over all rows: rows of any mix of
//! adapters and experts, an entry of rank 0 (an expert the adapter leaves
//! alone) adding nothing. The router entry is the token's slot itself in
//! the layer's `[max_loras]` router table. Nothing here allocates device
//! memory, copies from the host or synchronises.

use half::bf16;
use lora_kernels::{
    DeviceBuffer, LoraTarget, MoeRouting, OutputElem, Rows, RowsMut, bgmv, moe_decode_index, moe_sorted_index,
};
use lora_pool::{DecodeStep, LoraPool, PoolError, SlotCompanion, Step};

use crate::error::MoeError;
use crate::layer::{ExpertRows, MoeLora};
use crate::target::{ExpertTarget, check_targets, kernel_targets};

/// The expert-sorted rows of one MoE layer's grouped GEMM, on the device.
#[derive(Debug, Clone, Copy)]
pub struct SortedRows<'a> {
    /// `i32[n_sorted]`: the expanded row (`token * top_k + k`) each sorted
    /// row holds; a value outside `0 .. n_tokens * top_k` marks a padding
    /// row, which is left alone.
    pub sorted_token: &'a DeviceBuffer<i32>,
    /// Sorted rows, padding included.
    pub n_sorted: usize,
    /// `i32[num_experts + 1]` prefix sum: expert `e`'s rows are
    /// `expert_offsets[e] .. expert_offsets[e + 1]`.
    pub expert_offsets: &'a DeviceBuffer<i32>,
}

/// Which expert rows a fold expects the index to describe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IndexedRows {
    Expanded,
    Sorted,
}

impl MoeLora {
    fn routing(&self) -> MoeRouting {
        MoeRouting {
            top_k: self.geometry.top_k,
            max_loras: self.geometry.max_loras,
            n_experts: self.geometry.num_experts,
        }
    }

    /// Tokens of the batch set from `step`, after checking that `step` is
    /// both the pool's current step and the one this scratch was set from.
    fn batch_tokens<C: SlotCompanion, S: Step>(
        &self,
        pool: &LoraPool<C>,
        step: &S,
        call: &'static str,
    ) -> Result<usize, MoeError> {
        self.check_pool(pool)?;
        pool.check_step(step)?;
        if self.step.is_some() && self.step != Some(step.id()) {
            return Err(PoolError::StaleStep { kind: step.kind() }.into());
        }
        self.n_tokens.ok_or_else(|| MoeError::NotRouted {
            call,
            reason: "no batch is set (set_decode_step / set_prefill_step)".into(),
        })
    }

    /// Index the current batch's expanded rows from the router's
    /// `topk_ids` (`i32[n_tokens * top_k]`, token major): expanded row `r`
    /// gets `topk_ids[r] * max_loras + row_adapter[r / top_k]`, or -1 when
    /// its token folds nothing. Graph-capturable.
    pub fn index_decode_rows<C: SlotCompanion>(
        &mut self,
        pool: &LoraPool<C>,
        step: &DecodeStep,
        topk_ids: &DeviceBuffer<i32>,
    ) -> Result<(), MoeError> {
        let n_tokens = self.batch_tokens(pool, step, "index_decode_rows")?;
        let routing = self.routing();
        moe_decode_index(
            &self.device,
            &self.row_adapter,
            topk_ids,
            n_tokens,
            routing,
            &mut self.expert_idx,
        )?;
        self.expert_rows = ExpertRows::Expanded(n_tokens * routing.top_k);
        Ok(())
    }

    /// Index `rows`, the expert-sorted rows of the current batch: sorted row
    /// `i` gets `expert(i) * max_loras + row_adapter[sorted_token[i] /
    /// top_k]`, with `expert(i)` from `expert_offsets`; -1 for padding rows
    /// and tokens that fold nothing. Graph-capturable.
    pub fn index_sorted_rows<C: SlotCompanion, S: Step>(
        &mut self,
        pool: &LoraPool<C>,
        step: &S,
        rows: SortedRows<'_>,
    ) -> Result<(), MoeError> {
        let n_tokens = self.batch_tokens(pool, step, "index_sorted_rows")?;
        if rows.n_sorted > self.capacity.max_sorted_rows {
            return Err(MoeError::BatchTooLarge {
                what: "sorted rows",
                got: rows.n_sorted,
                capacity: self.capacity.max_sorted_rows,
            });
        }
        moe_sorted_index(
            &self.device,
            rows.sorted_token,
            rows.n_sorted,
            rows.expert_offsets,
            &self.row_adapter,
            n_tokens,
            self.routing(),
            &mut self.expert_idx,
        )?;
        self.expert_rows = ExpertRows::Sorted(rows.n_sorted);
        Ok(())
    }

    /// Fold the router delta of each token's adapter onto `gate_logits`
    /// (`[n_tokens, num_experts]`, f32 or bf16, in place) from `router_in`
    /// (`[n_tokens, hidden]`), before top-k. One launch; the kernel walks the
    /// rows in blocks, grouping each block's rows by adapter so every
    /// adapter's router pair is read once per block. Graph-capturable.
    pub fn apply_router_lora<C: SlotCompanion, S: Step, Y: OutputElem>(
        &self,
        pool: &LoraPool<C>,
        step: &S,
        layer: usize,
        router_in: Rows<'_, bf16>,
        gate_logits: RowsMut<'_, Y>,
    ) -> Result<(), MoeError> {
        let n_tokens = self.batch_tokens(pool, step, "apply_router_lora")?;
        self.check_moe_layer(pool, layer)?;
        let cfg = pool.config();
        let num_experts = self.geometry.num_experts;
        if router_in.n_rows != n_tokens {
            return Err(MoeError::shape(
                "router_in",
                format!("{} rows; the batch has {n_tokens} tokens", router_in.n_rows),
            ));
        }
        if router_in.width != cfg.hidden_size {
            return Err(MoeError::shape(
                "router_in",
                format!(
                    "rows are {} wide; the router takes {}",
                    router_in.width, cfg.hidden_size
                ),
            ));
        }
        if gate_logits.width != num_experts {
            return Err(MoeError::shape(
                "gate_logits",
                format!(
                    "rows are {} wide; the layer has {num_experts} experts",
                    gate_logits.width
                ),
            ));
        }
        let Some(experts) = pool.experts() else {
            // No expert pool: every route is Skip or was refused.
            return Ok(());
        };
        let table_offset = experts
            .router_table_offset(layer)
            .ok_or(MoeError::NotMoeLayer { layer })?;
        let target = LoraTarget {
            table: experts.table(),
            table_offset,
            n_entries: self.geometry.max_loras,
            out_dim: num_experts,
            y_col_offset: 0,
            dora: None,
        };
        bgmv(
            &self.device,
            router_in,
            &self.row_adapter,
            &[target],
            experts.stride(),
            gate_logits,
        )?;
        Ok(())
    }

    /// Fold the expert deltas of `targets` onto the expanded decode rows
    /// indexed by [`MoeLora::index_decode_rows`]: `x` is `[n_tokens * top_k,
    /// in]` (row `token * top_k + k` holds the input of the token's `k`-th
    /// expert), `y` the projection's output rows, updated in place.
    /// Graph-capturable.
    pub fn apply_expert_lora_decode<C: SlotCompanion, S: Step, Y: OutputElem>(
        &self,
        pool: &LoraPool<C>,
        step: &S,
        layer: usize,
        targets: &[ExpertTarget],
        x: Rows<'_, bf16>,
        y: RowsMut<'_, Y>,
    ) -> Result<(), MoeError> {
        self.fold_experts(pool, step, layer, targets, IndexedRows::Expanded, x, y)
    }

    /// Fold the expert deltas of `targets` onto the expert-sorted
    /// grouped-GEMM output indexed by [`MoeLora::index_sorted_rows`]: `x` is
    /// the sorted input `[n_sorted, in]`, `y` the sorted output
    /// `[n_sorted, out]`, updated in place; each expert's row block takes its
    /// own delta, each row from its own adapter. Graph-capturable.
    pub fn apply_expert_lora_sorted<C: SlotCompanion, S: Step, Y: OutputElem>(
        &self,
        pool: &LoraPool<C>,
        step: &S,
        layer: usize,
        targets: &[ExpertTarget],
        x: Rows<'_, bf16>,
        y: RowsMut<'_, Y>,
    ) -> Result<(), MoeError> {
        self.fold_experts(pool, step, layer, targets, IndexedRows::Sorted, x, y)
    }

    // The two public folds' arguments plus which index they expect.
    #[allow(clippy::too_many_arguments)]
    fn fold_experts<C: SlotCompanion, S: Step, Y: OutputElem>(
        &self,
        pool: &LoraPool<C>,
        step: &S,
        layer: usize,
        targets: &[ExpertTarget],
        kind: IndexedRows,
        x: Rows<'_, bf16>,
        y: RowsMut<'_, Y>,
    ) -> Result<(), MoeError> {
        let rows = match (kind, self.expert_rows) {
            (IndexedRows::Expanded, ExpertRows::Expanded(n)) | (IndexedRows::Sorted, ExpertRows::Sorted(n)) => n,
            _ => {
                let (call, reason) = match kind {
                    IndexedRows::Expanded => ("apply_expert_lora_decode", "expanded rows (index_decode_rows)"),
                    IndexedRows::Sorted => ("apply_expert_lora_sorted", "sorted rows (index_sorted_rows)"),
                };
                return Err(MoeError::NotRouted {
                    call,
                    reason: format!("the {reason} are not indexed"),
                });
            }
        };
        self.batch_tokens(pool, step, "fold_experts")?;
        self.check_moe_layer(pool, layer)?;
        if x.n_rows != rows {
            return Err(MoeError::shape(
                "x",
                format!("{} rows; the expert index covers {rows}", x.n_rows),
            ));
        }
        let Some(experts) = pool.experts() else {
            // No expert pool: every route is Skip or was refused.
            return check_targets(pool.config(), targets, x.width).map(|_| ());
        };
        let kernel_targets = kernel_targets(pool.config(), experts, self.geometry.max_loras, layer, targets, x.width)?;
        bgmv(&self.device, x, &self.expert_idx, &kernel_targets, experts.stride(), y)?;
        Ok(())
    }

    fn check_moe_layer<C: SlotCompanion>(&self, pool: &LoraPool<C>, layer: usize) -> Result<(), MoeError> {
        if pool.config().is_moe_layer(layer) {
            Ok(())
        } else {
            Err(MoeError::NotMoeLayer { layer })
        }
    }
}
