//! One sequence's attention keys and values, per layer, on the host.
//!
//! A [`KvCache`] holds, for every layer, the post-RoPE keys and the values of
//! the tokens the sequence has been fed so far, `[len, kv_heads * head_dim]`
//! each, f32. Positions of new tokens continue from [`KvCache::len`]. It must
//! never be shared between sequences in one batch (the forward refuses), and
//! never hold a partial forward: a failed forward restores the length.

use crate::model::Model;

/// Per-layer keys and values of one sequence.
#[derive(Debug, Clone)]
pub struct KvCache {
    len: usize,
    kv_dim: usize,
    layers: Vec<LayerKv>,
}

/// One layer's rows, `[len, kv_dim]` each.
#[derive(Debug, Clone, Default)]
pub(crate) struct LayerKv {
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

impl KvCache {
    /// An empty cache shaped for `model`.
    pub fn new(model: &Model) -> Self {
        let cfg = model.config();
        Self {
            len: 0,
            kv_dim: cfg.kv_dim(),
            layers: vec![LayerKv::default(); cfg.n_layers],
        }
    }

    /// Tokens cached (the position the next token takes).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps the first `n` tokens (no-op when `n >= len`), e.g. to roll back
    /// rejected draft tokens or reuse a shared prefix.
    pub fn truncate(&mut self, n: usize) {
        if n < self.len {
            self.restore(n);
        }
    }

    /// Cuts every layer to `n` rows, whatever state a forward left them in.
    pub(crate) fn restore(&mut self, n: usize) {
        let keep = n * self.kv_dim;
        for layer in &mut self.layers {
            layer.k.truncate(keep);
            layer.v.truncate(keep);
        }
        self.len = n;
    }

    pub(crate) fn set_len(&mut self, n: usize) {
        self.len = n;
    }

    pub(crate) fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    pub(crate) fn n_layers(&self) -> usize {
        self.layers.len()
    }

    pub(crate) fn layer(&self, l: usize) -> Option<&LayerKv> {
        self.layers.get(l)
    }

    pub(crate) fn layer_mut(&mut self, l: usize) -> Option<&mut LayerKv> {
        self.layers.get_mut(l)
    }
}
