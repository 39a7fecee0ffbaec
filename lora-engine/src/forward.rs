//! The batched base forward over packed sequence chunks.
//!
//! [`Model::forward`] runs any mix of prefill and decode chunks in one pass:
//! the tokens of all chunks are packed into `n` rows (chunk by chunk, in
//! order), every projection runs once over all rows, and attention is causal
//! per chunk over that chunk's [`KvCache`] plus its own earlier tokens, with
//! the layer's sliding window if it has one. Each projection's base output is
//! handed to the [`DeltaHooks`] before it is used. The projections run where
//! the model's weights are ([`crate::projection`]: host f32, or cuBLAS SGEMM
//! on a CUDA device); everything else runs on the host. The math follows the
//! transformers 5 modeling files of the six families line by line (see each
//! step's comment).
//!
//! This module must never keep state between calls (the caches are the only
//! state, and they are the caller's), never leave a cache half-updated (any
//! error restores every cache's length), and never read weights by name.

use rayon::prelude::*;

use crate::config::{BaseConfig, MoeConfig};
use crate::error::EngineError;
use crate::hooks::DeltaHooks;
use crate::kv_cache::KvCache;
use crate::math::{Rope, dot, rms_norm, rms_norm_in_place, silu_mul, softmax_in_place};
use crate::model::{Layer, Mlp, Model};
use crate::projection::{Projection, Site};

/// One sequence's new tokens in a batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// Index into the `caches` slice passed to [`Model::forward`]; the tokens'
    /// positions continue from that cache's [`KvCache::len`].
    pub cache: usize,
    /// The new token ids (may be empty).
    pub tokens: &'a [u32],
}

/// Where a packed row comes from.
#[derive(Debug, Clone, Copy)]
struct Row {
    cache: usize,
    /// Absolute position in its sequence.
    pos: usize,
}

impl Model {
    /// Runs the base model with deltas over the packed `chunks`, appending
    /// their keys and values to `caches`.
    ///
    /// Returns logits `[total_tokens, vocab]`, row-major, rows packed chunk by
    /// chunk in order. Errors (no cache is changed): a chunk naming a cache
    /// index past `caches`, two chunks naming one cache, a cache of another
    /// model's geometry, a token id `>= vocab` (naming chunk and position), or
    /// a hook's error. With no tokens at all, no hook is called.
    pub fn forward(
        &self,
        chunks: &[SeqChunk<'_>],
        caches: &mut [KvCache],
        hooks: &mut dyn DeltaHooks,
    ) -> Result<Vec<f32>, EngineError> {
        let rows = self.plan(chunks, caches)?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let before: Vec<(usize, usize)> = chunks.iter().map(|c| (c.cache, caches[c.cache].len())).collect();
        let ids: Vec<u32> = chunks.iter().flat_map(|c| c.tokens.iter().copied()).collect();
        match self.run(&ids, &rows, caches, hooks) {
            Ok(logits) => {
                for (chunk, &(cache, len)) in chunks.iter().zip(&before) {
                    caches[cache].set_len(len + chunk.tokens.len());
                }
                Ok(logits)
            }
            Err(e) => {
                for &(cache, len) in &before {
                    caches[cache].restore(len);
                }
                Err(e)
            }
        }
    }

    /// Checks the batch and gives every packed row its cache and position.
    fn plan(&self, chunks: &[SeqChunk<'_>], caches: &[KvCache]) -> Result<Vec<Row>, EngineError> {
        let cfg = &self.cfg;
        let mut owner: Vec<Option<usize>> = vec![None; caches.len()];
        let mut rows = Vec::new();
        for (ci, chunk) in chunks.iter().enumerate() {
            let Some(cache) = caches.get(chunk.cache) else {
                return Err(EngineError::CacheIndex {
                    chunk: ci,
                    cache: chunk.cache,
                    n_caches: caches.len(),
                });
            };
            if let Some(first) = owner[chunk.cache] {
                return Err(EngineError::DuplicateCache {
                    cache: chunk.cache,
                    first,
                    second: ci,
                });
            }
            owner[chunk.cache] = Some(ci);
            if cache.n_layers() != cfg.n_layers || cache.kv_dim() != cfg.kv_dim() {
                return Err(EngineError::CacheGeometry {
                    cache: chunk.cache,
                    cache_layers: cache.n_layers(),
                    cache_kv_dim: cache.kv_dim(),
                    model_layers: cfg.n_layers,
                    model_kv_dim: cfg.kv_dim(),
                });
            }
            if let Some((position, &token)) = chunk.tokens.iter().enumerate().find(|&(_, &t)| t as usize >= cfg.vocab) {
                return Err(EngineError::TokenOutOfRange {
                    chunk: ci,
                    position,
                    token,
                    vocab: cfg.vocab,
                });
            }
            let end = cache.len() + chunk.tokens.len();
            if end > u32::MAX as usize {
                return Err(EngineError::PositionOverflow {
                    cache: chunk.cache,
                    position: end,
                });
            }
            rows.extend((cache.len()..end).map(|pos| Row {
                cache: chunk.cache,
                pos,
            }));
        }
        Ok(rows)
    }

    fn run(
        &self,
        ids: &[u32],
        rows: &[Row],
        caches: &mut [KvCache],
        hooks: &mut dyn DeltaHooks,
    ) -> Result<Vec<f32>, EngineError> {
        let cfg = &self.cfg;
        let (n, h) = (rows.len(), cfg.hidden);
        let eps = cfg.rms_norm_eps as f32;

        // embed_tokens(input_ids); a vocab-parallel rank looks up its own
        // tokens only (zero rows for the others', deltas and overlays
        // included), and the all-reduce sums the ranks' rows.
        let mut hs = vec![0.0f32; n * h];
        let start = self.vocab_held.as_ref().map_or(0, |r| r.start);
        let held = self.embed.w.len() / h.max(1);
        for (row, &id) in hs.chunks_exact_mut(h).zip(ids) {
            if let Some(t) = (id as usize).checked_sub(start).filter(|&t| t < held) {
                row.copy_from_slice(&self.embed.w[t * h..(t + 1) * h]);
            }
        }
        hooks.embed(ids, &mut hs)?;
        if self.vocab_held.is_some()
            && let Some(c) = &self.collective
        {
            c.all_reduce_sum(&mut hs)?;
        }

        // rotary_emb(position_ids): cos/sin of each row's position
        let half = cfg.head_dim / 2;
        let mut cos = vec![0.0f32; n * half];
        let mut sin = vec![0.0f32; n * half];
        for ((row, c), s) in rows
            .iter()
            .zip(cos.chunks_exact_mut(half))
            .zip(sin.chunks_exact_mut(half))
        {
            // plan() checked every position fits u32
            self.rope.cos_sin(row.pos as u32, c, s);
        }

        let mut xn = vec![0.0f32; n * h];
        for (l, layer) in self.layers.iter().enumerate() {
            // residual + self_attn(input_layernorm(x))
            rms_norm(&hs, &layer.input_norm, eps, &mut xn);
            let mut attn_out = self.attention(l, layer, &xn, rows, &cos, &sin, caches, hooks)?;
            // A tensor-parallel rank's o_proj output (and delta) is a
            // partial sum over its heads.
            if let Some(c) = self.partial_sums(false) {
                c.all_reduce_sum(&mut attn_out)?;
            }
            add_in_place(&mut hs, &attn_out);
            // residual + mlp(post_attention_layernorm(x))
            rms_norm(&hs, &layer.post_norm, eps, &mut xn);
            let mut mlp_out = match &layer.mlp {
                Mlp::Dense { gate_up, down } => {
                    let i = cfg.inter;
                    let mut gu = vec![0.0f32; n * 2 * i];
                    gate_up.apply(Site::layer("gate_up", l), &xn, &mut gu)?;
                    hooks.gate_up(l, &xn, &mut gu)?;
                    let mut act = vec![0.0f32; n * i];
                    silu_mul(&gu, i, &mut act);
                    let mut dn = vec![0.0f32; n * h];
                    down.apply(Site::layer("down", l), &act, &mut dn)?;
                    hooks.down(l, &act, &mut dn)?;
                    dn
                }
                Mlp::Moe {
                    moe,
                    router,
                    gate_up,
                    down,
                } => self.moe_block(l, moe, router, gate_up, down, &xn, hooks)?,
            };
            // ... and its down_proj output over its intermediate columns
            // (an expert-parallel MoE layer's output is whole already).
            if let Some(c) = self.partial_sums(matches!(layer.mlp, Mlp::Moe { .. })) {
                c.all_reduce_sum(&mut mlp_out)?;
            }
            add_in_place(&mut hs, &mlp_out);
        }

        // lm_head(norm(x))
        rms_norm(&hs, &self.norm, eps, &mut xn);
        let lm = self.lm_head.as_ref().unwrap_or(&self.embed);
        let (Some(c), Some(held)) = (&self.collective, &self.vocab_held) else {
            let mut logits = vec![0.0f32; n * cfg.vocab];
            lm.apply(Site::model("lm_head"), &xn, &mut logits)?;
            hooks.lm_head(&xn, &mut logits)?;
            return Ok(logits);
        };
        // A vocab-parallel rank's logit columns, then every rank's,
        // gathered rank-major and laid out token-major.
        let part = held.len();
        let mut local = vec![0.0f32; n * part];
        lm.apply(Site::model("lm_head"), &xn, &mut local)?;
        hooks.lm_head(&xn, &mut local)?;
        let world = c.world();
        let mut gathered = vec![0.0f32; world * n * part];
        c.all_gather(&local, &mut gathered)?;
        let mut logits = vec![0.0f32; n * part * world];
        if n * part > 0 {
            for (r, rank) in gathered.chunks_exact(n * part).enumerate() {
                for (t, cols) in rank.chunks_exact(part).enumerate() {
                    let at = t * part * world + r * part;
                    logits[at..at + part].copy_from_slice(cols);
                }
            }
        }
        Ok(logits)
    }

    /// One layer's attention block up to (and including) `o_proj`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        l: usize,
        layer: &Layer,
        xn: &[f32],
        rows: &[Row],
        cos: &[f32],
        sin: &[f32],
        caches: &mut [KvCache],
        hooks: &mut dyn DeltaHooks,
    ) -> Result<Vec<f32>, EngineError> {
        let cfg = &self.cfg;
        let (n, h, hd) = (rows.len(), cfg.hidden, cfg.head_dim);
        let (q_dim, kv_dim, qkv_dim) = (cfg.q_dim(), cfg.kv_dim(), cfg.qkv_dim());
        let half = hd / 2;
        let eps = cfg.rms_norm_eps as f32;

        // q_proj | k_proj | v_proj
        let mut qkv = vec![0.0f32; n * qkv_dim];
        layer.qkv.apply(Site::layer("qkv", l), xn, &mut qkv)?;
        hooks.qkv(l, xn, &mut qkv)?;

        // q_norm / k_norm over each head (Qwen3), then apply_rotary_pos_emb
        for (r, row) in qkv.chunks_exact_mut(qkv_dim).enumerate() {
            let (q, rest) = row.split_at_mut(q_dim);
            let k = &mut rest[..kv_dim];
            if let (Some(qw), Some(kw)) = (&layer.q_norm, &layer.k_norm) {
                rms_norm_in_place(q, qw, eps);
                rms_norm_in_place(k, kw, eps);
            }
            let (c, s) = (&cos[r * half..(r + 1) * half], &sin[r * half..(r + 1) * half]);
            Rope::apply(q, c, s);
            Rope::apply(k, c, s);
        }

        // cache.update(key_states, value_states): rows are packed chunk by
        // chunk, so appending in row order keeps each cache in position order.
        for (row, qkv_row) in rows.iter().zip(qkv.chunks_exact(qkv_dim)) {
            let Some(kv) = caches[row.cache].layer_mut(l) else {
                return Err(cache_geometry(row.cache, &caches[row.cache], cfg));
            };
            kv.k.extend_from_slice(&qkv_row[q_dim..q_dim + kv_dim]);
            kv.v.extend_from_slice(&qkv_row[q_dim + kv_dim..]);
        }

        // eager_attention_forward: softmax(q k^T * scaling + causal/sliding mask) v,
        // with kv head `head / (n_heads / n_kv_heads)` (repeat_kv).
        let scale = (hd as f64).powf(-0.5) as f32;
        let group = cfg.n_heads / cfg.n_kv_heads;
        let window = cfg.layers[l].sliding_window;
        let caches_ro: &[KvCache] = caches;
        let mut attn = vec![0.0f32; n * q_dim];
        attn.par_chunks_mut(q_dim)
            .zip(qkv.par_chunks(qkv_dim))
            .zip(rows.par_iter())
            .for_each(|((out, qkv_row), row)| {
                let Some(kv) = caches_ro[row.cache].layer(l) else {
                    return; // unreachable: checked while appending
                };
                let lo = window.map_or(0, |w| (row.pos + 1).saturating_sub(w));
                let mut scores = vec![0.0f32; row.pos + 1 - lo];
                for head in 0..cfg.n_heads {
                    let q = &qkv_row[head * hd..(head + 1) * hd];
                    let off = (head / group) * hd;
                    for (j, s) in (lo..=row.pos).zip(scores.iter_mut()) {
                        let key = &kv.k[j * kv_dim + off..j * kv_dim + off + hd];
                        *s = dot(q, key) * scale;
                    }
                    softmax_in_place(&mut scores);
                    let o = &mut out[head * hd..(head + 1) * hd];
                    o.fill(0.0);
                    for (j, &p) in (lo..=row.pos).zip(scores.iter()) {
                        let val = &kv.v[j * kv_dim + off..j * kv_dim + off + hd];
                        for (a, &b) in o.iter_mut().zip(val) {
                            *a += p * b;
                        }
                    }
                }
            });

        // o_proj
        let mut o = vec![0.0f32; n * h];
        layer.o.apply(Site::layer("o", l), &attn, &mut o)?;
        hooks.o(l, &attn, &mut o)?;
        Ok(o)
    }

    /// A sparse MoE block (`Qwen3MoeSparseMoeBlock` / `MixtralSparseMoeBlock`).
    #[allow(clippy::too_many_arguments)]
    fn moe_block(
        &self,
        l: usize,
        moe: &MoeConfig,
        router: &Projection,
        gate_up: &[Projection],
        down: &[Projection],
        xn: &[f32],
        hooks: &mut dyn DeltaHooks,
    ) -> Result<Vec<f32>, EngineError> {
        let cfg = &self.cfg;
        let h = cfg.hidden;
        let n = xn.len() / h;
        let (ne, k, mi) = (moe.num_experts, moe.top_k, moe.moe_inter);

        // router: F.linear(x, gate.weight)
        let mut logits = vec![0.0f32; n * ne];
        router.apply(Site::layer("router", l), xn, &mut logits)?;
        hooks.router(l, xn, &mut logits)?;

        // softmax over all experts in f32, topk, optional renormalization
        let mut topk = vec![0u32; n * k];
        let mut weights = vec![0.0f32; n * k];
        let mut order: Vec<usize> = Vec::with_capacity(ne);
        for t in 0..n {
            let probs = &mut logits[t * ne..(t + 1) * ne];
            softmax_in_place(probs);
            order.clear();
            order.extend(0..ne);
            order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
            let w = &mut weights[t * k..(t + 1) * k];
            for (j, &e) in order[..k].iter().enumerate() {
                topk[t * k + j] = e as u32;
                w[j] = probs[e];
            }
            if moe.norm_topk_prob {
                let sum: f32 = w.iter().sum();
                for v in w.iter_mut() {
                    *v /= sum;
                }
            }
        }

        // expert parallelism: the experts run where they are held
        if let Some(c) = self.expert_group() {
            return self.dispatch_experts(c, l, moe, gate_up, down, xn, &topk, &weights, hooks);
        }

        // experts: per expert, gather its rows, one linear, scatter back
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); ne];
        for (r, &e) in topk.iter().enumerate() {
            by_expert[e as usize].push(r);
        }
        let mut gu = vec![0.0f32; n * k * 2 * mi];
        for (e, expanded) in by_expert.iter().enumerate().filter(|(_, rs)| !rs.is_empty()) {
            let x: Vec<f32> = expanded
                .iter()
                .flat_map(|&r| xn[(r / k) * h..(r / k + 1) * h].iter().copied())
                .collect();
            let mut y = vec![0.0f32; expanded.len() * 2 * mi];
            gate_up[e].apply(Site::expert("gate_up", l, e), &x, &mut y)?;
            for (&r, yr) in expanded.iter().zip(y.chunks_exact(2 * mi)) {
                gu[r * 2 * mi..(r + 1) * 2 * mi].copy_from_slice(yr);
            }
        }
        hooks.expert_gate_up(l, xn, &topk, &mut gu)?;
        let mut act = vec![0.0f32; n * k * mi];
        silu_mul(&gu, mi, &mut act);
        let mut dn = vec![0.0f32; n * k * h];
        for (e, expanded) in by_expert.iter().enumerate().filter(|(_, rs)| !rs.is_empty()) {
            let x: Vec<f32> = expanded
                .iter()
                .flat_map(|&r| act[r * mi..(r + 1) * mi].iter().copied())
                .collect();
            let mut y = vec![0.0f32; expanded.len() * h];
            down[e].apply(Site::expert("down", l, e), &x, &mut y)?;
            for (&r, yr) in expanded.iter().zip(y.chunks_exact(h)) {
                dn[r * h..(r + 1) * h].copy_from_slice(yr);
            }
        }
        hooks.expert_down(l, &act, &topk, &mut dn)?;

        // final_hidden_states.index_add_(token, expert_out * weight), experts
        // visited in ascending index as transformers' loop does
        let mut out = vec![0.0f32; n * h];
        let mut slots: Vec<usize> = Vec::with_capacity(k);
        for (t, o) in out.chunks_exact_mut(h).enumerate() {
            slots.clear();
            slots.extend(0..k);
            slots.sort_by_key(|&j| topk[t * k + j]);
            for &j in &slots {
                let r = t * k + j;
                let w = weights[r];
                for (a, &b) in o.iter_mut().zip(&dn[r * h..(r + 1) * h]) {
                    *a += b * w;
                }
            }
        }
        Ok(out)
    }
}

fn add_in_place(acc: &mut [f32], x: &[f32]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

fn cache_geometry(cache: usize, c: &KvCache, cfg: &BaseConfig) -> EngineError {
    EngineError::CacheGeometry {
        cache,
        cache_layers: c.n_layers(),
        cache_kv_dim: c.kv_dim(),
        model_layers: cfg.n_layers,
        model_kv_dim: cfg.kv_dim(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MlpKind;
    use crate::hooks::NoDeltas;
    use crate::test_support::{TempDir, tiny_model_dir};
    use proptest::prelude::*;

    fn tiny(model_type: &str) -> (TempDir, Model) {
        let (dir, _) = tiny_model_dir(model_type, "", 11);
        let model = Model::load(dir.path());
        assert!(model.is_ok(), "{:?}", model.err());
        match model {
            Ok(m) => (dir, m),
            Err(e) => panic!("{e}"),
        }
    }

    fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    #[test]
    fn bad_token_id_names_chunk_and_position() {
        let (_d, m) = tiny("llama");
        let mut caches = vec![KvCache::new(&m), KvCache::new(&m)];
        let chunks = [
            SeqChunk {
                cache: 0,
                tokens: &[1, 2],
            },
            SeqChunk {
                cache: 1,
                tokens: &[3, 4, 40, 5],
            },
        ];
        let r = m.forward(&chunks, &mut caches, &mut NoDeltas);
        assert!(
            matches!(
                r,
                Err(EngineError::TokenOutOfRange {
                    chunk: 1,
                    position: 2,
                    token: 40,
                    vocab: 40
                })
            ),
            "{r:?}"
        );
        assert!(caches.iter().all(KvCache::is_empty));
    }

    #[test]
    fn batch_shape_errors() {
        let (_d, m) = tiny("qwen3");
        let mut caches = vec![KvCache::new(&m), KvCache::new(&m)];
        let dup = [SeqChunk { cache: 1, tokens: &[1] }, SeqChunk { cache: 1, tokens: &[2] }];
        assert!(matches!(
            m.forward(&dup, &mut caches, &mut NoDeltas),
            Err(EngineError::DuplicateCache {
                cache: 1,
                first: 0,
                second: 1
            })
        ));
        let past = [SeqChunk { cache: 2, tokens: &[1] }];
        assert!(matches!(
            m.forward(&past, &mut caches, &mut NoDeltas),
            Err(EngineError::CacheIndex {
                chunk: 0,
                cache: 2,
                n_caches: 2
            })
        ));
        let (wide_dir, _) = tiny_model_dir("llama", r#""num_key_value_heads": 4"#, 2);
        let wide = Model::load(wide_dir.path());
        assert!(wide.is_ok());
        if let Ok(wide) = wide {
            let mut foreign = vec![KvCache::new(&wide)];
            assert!(matches!(
                m.forward(&[SeqChunk { cache: 0, tokens: &[1] }], &mut foreign, &mut NoDeltas),
                Err(EngineError::CacheGeometry { cache: 0, .. })
            ));
        }
        let none = m.forward(&[], &mut caches, &mut NoDeltas);
        assert!(matches!(none, Ok(v) if v.is_empty()));
    }

    /// Checks every hook call's order and shapes; optionally fails at one site
    /// or adds a constant to the o output of layer 0.
    struct Contract<'m> {
        m: &'m Model,
        n: usize,
        calls: Vec<(&'static str, Option<usize>)>,
        fail_at: Option<&'static str>,
        bump_o: f32,
    }

    impl Contract<'_> {
        fn call(&mut self, site: &'static str, layer: Option<usize>) -> Result<(), EngineError> {
            self.calls.push((site, layer));
            if self.fail_at == Some(site) {
                return Err(EngineError::Hook {
                    hook: site,
                    source: "injected".into(),
                });
            }
            Ok(())
        }
    }

    impl DeltaHooks for Contract<'_> {
        fn embed(&mut self, ids: &[u32], rows: &mut [f32]) -> Result<(), EngineError> {
            let c = self.m.config();
            assert_eq!((ids.len(), rows.len()), (self.n, self.n * c.hidden));
            self.call("embed", None)
        }
        fn qkv(&mut self, layer: usize, x: &[f32], y: &mut [f32]) -> Result<(), EngineError> {
            let c = self.m.config();
            assert_eq!((x.len(), y.len()), (self.n * c.hidden, self.n * c.qkv_dim()));
            self.call("qkv", Some(layer))
        }
        fn o(&mut self, layer: usize, x: &[f32], y: &mut [f32]) -> Result<(), EngineError> {
            let c = self.m.config();
            assert_eq!((x.len(), y.len()), (self.n * c.q_dim(), self.n * c.hidden));
            if layer == 0 {
                y.iter_mut().for_each(|v| *v += self.bump_o);
            }
            self.call("o", Some(layer))
        }
        fn gate_up(&mut self, layer: usize, x: &[f32], y: &mut [f32]) -> Result<(), EngineError> {
            let c = self.m.config();
            assert_eq!(c.mlp_kind(layer), Some(MlpKind::Dense));
            assert_eq!((x.len(), y.len()), (self.n * c.hidden, self.n * 2 * c.inter));
            self.call("gate_up", Some(layer))
        }
        fn down(&mut self, layer: usize, x: &[f32], y: &mut [f32]) -> Result<(), EngineError> {
            let c = self.m.config();
            assert_eq!((x.len(), y.len()), (self.n * c.inter, self.n * c.hidden));
            self.call("down", Some(layer))
        }
        fn router(&mut self, layer: usize, x: &[f32], logits: &mut [f32]) -> Result<(), EngineError> {
            let c = self.m.config();
            assert_eq!(c.mlp_kind(layer), Some(MlpKind::Moe));
            let e = c.moe.as_ref().map_or(0, |m| m.num_experts);
            assert_eq!((x.len(), logits.len()), (self.n * c.hidden, self.n * e));
            self.call("router", Some(layer))
        }
        fn expert_gate_up(&mut self, layer: usize, x: &[f32], topk: &[u32], y: &mut [f32]) -> Result<(), EngineError> {
            let c = self.m.config();
            let (k, mi, e) = c
                .moe
                .as_ref()
                .map_or((0, 0, 0), |m| (m.top_k, m.moe_inter, m.num_experts));
            assert_eq!(
                (x.len(), topk.len(), y.len()),
                (self.n * c.hidden, self.n * k, self.n * k * 2 * mi)
            );
            assert!(topk.iter().all(|&t| (t as usize) < e));
            for tok in topk.chunks(k) {
                let mut s = tok.to_vec();
                s.dedup();
                assert_eq!(s.len(), k, "a token chose one expert twice");
            }
            self.call("expert_gate_up", Some(layer))
        }
        fn expert_down(&mut self, layer: usize, x: &[f32], topk: &[u32], y: &mut [f32]) -> Result<(), EngineError> {
            let c = self.m.config();
            let (k, mi) = c.moe.as_ref().map_or((0, 0), |m| (m.top_k, m.moe_inter));
            assert_eq!(
                (x.len(), topk.len(), y.len()),
                (self.n * k * mi, self.n * k, self.n * k * c.hidden)
            );
            self.call("expert_down", Some(layer))
        }
        fn lm_head(&mut self, hidden: &[f32], logits: &mut [f32]) -> Result<(), EngineError> {
            let c = self.m.config();
            assert_eq!((hidden.len(), logits.len()), (self.n * c.hidden, self.n * c.vocab));
            self.call("lm_head", None)
        }
    }

    fn expected_calls(m: &Model) -> Vec<(&'static str, Option<usize>)> {
        let mut want = vec![("embed", None)];
        for l in 0..m.config().n_layers {
            want.push(("qkv", Some(l)));
            want.push(("o", Some(l)));
            match m.mlp_kind(l) {
                Some(MlpKind::Moe) => want.extend([
                    ("router", Some(l)),
                    ("expert_gate_up", Some(l)),
                    ("expert_down", Some(l)),
                ]),
                _ => want.extend([("gate_up", Some(l)), ("down", Some(l))]),
            }
        }
        want.push(("lm_head", None));
        want
    }

    #[test]
    fn hooks_see_the_documented_shapes_in_order() {
        for family in ["llama", "qwen2", "qwen3_moe", "mixtral"] {
            let (_d, m) = tiny(family);
            let mut caches = vec![KvCache::new(&m), KvCache::new(&m)];
            let chunks = [
                SeqChunk {
                    cache: 0,
                    tokens: &[1, 2, 3],
                },
                SeqChunk { cache: 1, tokens: &[4] },
            ];
            let mut hooks = Contract {
                m: &m,
                n: 4,
                calls: vec![],
                fail_at: None,
                bump_o: 0.0,
            };
            let r = m.forward(&chunks, &mut caches, &mut hooks);
            assert!(r.is_ok(), "{family}: {r:?}");
            assert_eq!(hooks.calls, expected_calls(&m), "{family}");
        }
    }

    #[test]
    fn a_delta_changes_the_logits_and_nodeltas_does_not() {
        let (_d, m) = tiny("qwen3");
        let run = |bump: f32| {
            let mut caches = vec![KvCache::new(&m)];
            let mut hooks = Contract {
                m: &m,
                n: 3,
                calls: vec![],
                fail_at: None,
                bump_o: bump,
            };
            m.forward(
                &[SeqChunk {
                    cache: 0,
                    tokens: &[5, 6, 7],
                }],
                &mut caches,
                &mut hooks,
            )
        };
        let (base, bumped) = (run(0.0), run(0.5));
        let mut caches = vec![KvCache::new(&m)];
        let plain = m.forward(
            &[SeqChunk {
                cache: 0,
                tokens: &[5, 6, 7],
            }],
            &mut caches,
            &mut NoDeltas,
        );
        match (base, bumped, plain) {
            (Ok(b), Ok(x), Ok(p)) => {
                assert_eq!(b, p);
                assert!(max_abs_diff(&b, &x) > 1e-3);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_failing_hook_restores_every_cache() {
        for site in ["embed", "qkv", "o", "down", "expert_down", "lm_head"] {
            let family = if site == "expert_down" { "mixtral" } else { "llama" };
            let (_d, m) = tiny(family);
            let mut caches = vec![KvCache::new(&m), KvCache::new(&m)];
            let warm = m.forward(
                &[SeqChunk {
                    cache: 0,
                    tokens: &[1, 2],
                }],
                &mut caches,
                &mut NoDeltas,
            );
            assert!(warm.is_ok());
            let snapshot = caches.clone();
            let chunks = [
                SeqChunk { cache: 0, tokens: &[3] },
                SeqChunk {
                    cache: 1,
                    tokens: &[4, 5],
                },
            ];
            let mut hooks = Contract {
                m: &m,
                n: 3,
                calls: vec![],
                fail_at: Some(site),
                bump_o: 0.0,
            };
            let r = m.forward(&chunks, &mut caches, &mut hooks);
            assert!(
                matches!(r, Err(EngineError::Hook { hook, .. }) if hook == site),
                "{site}"
            );
            assert_eq!((caches[0].len(), caches[1].len()), (2, 0), "{site}");
            // the restored caches behave exactly like the ones before the failure
            let again = m.forward(&chunks, &mut caches, &mut NoDeltas);
            let mut fresh = snapshot;
            let want = m.forward(&chunks, &mut fresh, &mut NoDeltas);
            match (again, want) {
                (Ok(a), Ok(w)) => assert_eq!(a, w, "{site}"),
                other => panic!("{site}: {other:?}"),
            }
        }
    }

    #[test]
    fn truncate_rolls_back_tokens() {
        let (_d, m) = tiny("mistral");
        let mut c = vec![KvCache::new(&m)];
        let full = m.forward(
            &[SeqChunk {
                cache: 0,
                tokens: &[1, 2, 3, 4],
            }],
            &mut c,
            &mut NoDeltas,
        );
        c[0].truncate(2);
        assert_eq!(c[0].len(), 2);
        c[0].truncate(9);
        assert_eq!(c[0].len(), 2);
        let redo = m.forward(
            &[SeqChunk {
                cache: 0,
                tokens: &[3, 4],
            }],
            &mut c,
            &mut NoDeltas,
        );
        match (full, redo) {
            (Ok(f), Ok(r)) => assert!(max_abs_diff(&f[2 * 40..], &r) < 1e-5),
            other => panic!("{other:?}"),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]
        /// Any split of two sequences into interleaved chunks gives the logits of
        /// one prefill each.
        #[test]
        fn chunking_does_not_change_logits(
            family in prop::sample::select(vec!["llama", "qwen3", "qwen3_moe", "mixtral"]),
            a in prop::collection::vec(0u32..40, 1..9),
            b in prop::collection::vec(0u32..40, 1..9),
            cuts in prop::collection::vec(1usize..4, 1..6),
        ) {
            let (_d, m) = tiny(family);
            let vocab = m.config().vocab;
            let mut whole = Vec::new();
            for seq in [&a, &b] {
                let mut c = vec![KvCache::new(&m)];
                let out = m.forward(&[SeqChunk { cache: 0, tokens: seq }], &mut c, &mut NoDeltas);
                prop_assert!(out.is_ok());
                whole.push(out.unwrap_or_default());
            }
            let mut caches = vec![KvCache::new(&m), KvCache::new(&m)];
            let mut got: [Vec<f32>; 2] = [vec![], vec![]];
            let (mut ia, mut ib, mut step) = (0usize, 0usize, 0usize);
            while ia < a.len() || ib < b.len() {
                let cut = cuts[step % cuts.len()];
                step += 1;
                let ea = (ia + cut).min(a.len());
                let eb = (ib + cut + 1).min(b.len());
                // alternate chunk order between steps
                let mut chunks = vec![SeqChunk { cache: 0, tokens: &a[ia..ea] }, SeqChunk { cache: 1, tokens: &b[ib..eb] }];
                if step % 2 == 0 {
                    chunks.reverse();
                }
                let out = m.forward(&chunks, &mut caches, &mut NoDeltas);
                prop_assert!(out.is_ok());
                let out = out.unwrap_or_default();
                let mut off = 0;
                for ch in &chunks {
                    let len = ch.tokens.len() * vocab;
                    got[ch.cache].extend_from_slice(&out[off..off + len]);
                    off += len;
                }
                ia = ea;
                ib = eb;
            }
            for s in 0..2 {
                prop_assert!(max_abs_diff(&got[s], &whole[s]) < 1e-4, "{family} seq {s}");
            }
        }
    }
}
