//! [`Engine`]: continuous batching of mixed-adapter requests over a
//! [`LoraPool`], as an engine author would write it with the public API.
//!
//! Each [`Engine::step`] admits waiting requests (FIFO, up to
//! [`EngineOptions::admit_per_step`], while the running batch and the token
//! budget have room), leasing each request's adapter for its whole life —
//! promoting it into a slot, evicting the least recently used idle adapter,
//! when it is not resident; then runs one prefill forward over the admitted
//! prompts (a pool prefill step) and one decode forward over every running
//! request (a pool decode step); then retires the finished requests, which
//! drops their leases. A request whose adapter cannot be placed because
//! every slot is held waits at the head of the queue. Between steps the
//! pool is the caller's ([`Engine::pool_mut`]): swaps and evictions there
//! are refused for slots that running requests hold.
//!
//! This module must never touch a slot number it did not get from a
//! lease, nor build kernel rows itself: every row of every forward comes
//! from a pool step built from the requests' leases.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use lora_audit::{AuditError, LoraOptions, audit_adapter, read_base_tables};
use lora_kernels::Device;
use lora_layout::ModelConfig;
use lora_moe::{MoeCapacity, MoeLora};
use lora_overlay::{ServedTables, TokenOverlays};
use lora_pool::{AdapterSource, BaseWeights, BatchCapacity, LoraPool, PoolError, PrefillSeq, SlotLease, Step, StepRow};

use crate::adapted::{DenseTargets, StepHooks, StepRef};
use crate::base_weights::ModelBase;
use crate::collective::Collective;
use crate::error::EngineError;
use crate::expert_parallel::group_of;
use crate::forward::SeqChunk;
use crate::kv_cache::KvCache;
use crate::model::Model;
use crate::prefix::{CachedPrompt, PrefixCache};
use crate::request::{EngineEvent, Request, RequestOutput, check_request};

/// How the scheduler batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOptions {
    /// Most requests running at once (decode rows per step).
    pub max_running: usize,
    /// Most requests admitted per step (their prompts form one prefill).
    pub admit_per_step: usize,
    /// Most prompt tokens in one prefill step; a longer prompt is refused
    /// when submitted.
    pub max_batch_tokens: usize,
    /// Prompts kept in the prefix cache.
    pub prefix_entries: usize,
}

impl Default for EngineOptions {
    fn default() -> EngineOptions {
        EngineOptions {
            max_running: 4,
            admit_per_step: 2,
            max_batch_tokens: 4096,
            prefix_entries: 8,
        }
    }
}

/// An adapter the engine may serve: its name and folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterDir {
    /// The name requests use.
    pub name: String,
    /// The PEFT folder.
    pub dir: PathBuf,
}

/// A running request.
#[derive(Debug)]
struct Running {
    request: usize,
    lease: Option<SlotLease>,
    out: RequestOutput,
}

/// The reference engine: a base model, a slot pool with token overlays and
/// MoE folds, and a scheduler.
pub struct Engine {
    /// Shared with the pool's base weights (DoRA) when the pool serves DoRA.
    model: Arc<Model>,
    pool: LoraPool<TokenOverlays>,
    moe: Option<MoeLora>,
    targets: DenseTargets,
    library: BTreeMap<String, PathBuf>,
    opts: EngineOptions,
    requests: Vec<Request>,
    waiting: VecDeque<usize>,
    running: Vec<Running>,
    /// `caches[i]` is `running[i]`'s KV cache.
    caches: Vec<KvCache>,
    outputs: Vec<Option<RequestOutput>>,
    prefix: PrefixCache,
    events: Vec<EngineEvent>,
    steps: usize,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("steps", &self.steps)
            .field("waiting", &self.waiting.len())
            .field("running", &self.running.len())
            .finish_non_exhaustive()
    }
}

/// The vocabulary index of the largest logit (the first of equals, as
/// `torch.argmax`).
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

impl Engine {
    /// Load the model in `model_dir`, audit every adapter of `adapters`
    /// (a refused one is [`EngineError::AdapterRefused`], naming it), and
    /// pack a pool of `lora.max_loras` slots on `device` holding the first
    /// adapters; the others are promoted when a request needs them. On a
    /// CUDA `device` the base projections run there too (cuBLAS).
    ///
    /// A tensor-parallel placement (`lora.placement` with `tp_world > 1`)
    /// needs the rank's collective: [`Engine::load_rank`].
    pub fn load(
        model_dir: &Path,
        adapters: &[AdapterDir],
        device: &Device,
        lora: LoraOptions,
        opts: EngineOptions,
    ) -> Result<Engine, EngineError> {
        let p = lora.placement;
        if p.tp_world() > 1 || p.ep_world() > 1 {
            return Err(EngineError::NotTensorParallel {
                what: format!(
                    "tp_world {} / ep_world {} without the rank's collective (Engine::load_rank)",
                    p.tp_world(),
                    p.ep_world()
                ),
            });
        }
        let model = Model::load_on(model_dir, device)?;
        let cfg = lora_config(model_dir)?;
        Engine::assemble(model, cfg, model_dir, adapters, device, lora, opts)
    }

    /// [`Engine::load`] as tensor- and expert-parallel rank
    /// `lora.placement` of the group `collective` connects (its rank and
    /// world size must be the placement's: the tensor-parallel ones, or
    /// the expert-parallel ones when `tp_world` is 1): the base model is
    /// cut for the rank ([`Model::shard`]) and its forward all-reduces the
    /// row-parallel outputs through `collective`, and an MoE model's
    /// layers dispatch their tokens to the ranks holding their experts,
    /// with the per-token adapter map (`lora_moe::MoeLora::dispatch_map`);
    /// the pool holds the rank's shard of every adapter (its experts, the
    /// router whole).
    /// Every rank of the group must be given the same requests in the
    /// same order: each steps the same schedule, and every rank's outputs
    /// equal (the reduced logits are the same on every rank).
    ///
    /// Errors: a collective of another rank or world
    /// ([`EngineError::Collective`]), a placement that does not divide the
    /// model ([`EngineError::Placement`], `num_experts` for an `ep_world`
    /// that does not divide it), a pool built for DoRA (`lora.dora`), an
    /// MoE model under `tp_world > 1` without expert parallelism over the
    /// same ranks ([`EngineError::NotTensorParallel`]), and
    /// [`Engine::load`]'s.
    pub fn load_rank(
        model_dir: &Path,
        adapters: &[AdapterDir],
        device: &Device,
        lora: LoraOptions,
        opts: EngineOptions,
        collective: Arc<dyn Collective>,
    ) -> Result<Engine, EngineError> {
        let p = lora.placement;
        // DoRA's rescale divides by the norm of each whole weight row,
        // which a row-parallel rank's shard does not hold.
        if lora.dora {
            return Err(EngineError::NotTensorParallel {
                what: "DoRA adapters (LoraOptions::dora, LORA_DORA): the rescale needs each whole weight row's norm"
                    .into(),
            });
        }
        let whole = Model::load(model_dir)?;
        let cfg = lora_config(model_dir)?;
        let group = group_of(p, !whole.config().moe_layers().is_empty())?;
        if (collective.rank(), collective.world()) != group {
            return Err(EngineError::Collective(format!(
                "a collective of rank {} of {} for rank {} of {} (tp_world {}, ep_world {})",
                collective.rank(),
                collective.world(),
                group.0,
                group.1,
                p.tp_world(),
                p.ep_world()
            )));
        }
        let model = whole.shard(&cfg, p)?.with_collective(collective).on_device(device)?;
        Engine::assemble(model, cfg, model_dir, adapters, device, lora, opts)
    }

    /// The engine over a loaded (and, for a rank, cut) `model`.
    fn assemble(
        model: Model,
        cfg: ModelConfig,
        model_dir: &Path,
        adapters: &[AdapterDir],
        device: &Device,
        lora: LoraOptions,
        opts: EngineOptions,
    ) -> Result<Engine, EngineError> {
        let model = Arc::new(model);
        let lora = LoraOptions {
            rotatable: true,
            ..lora
        };
        let mut library = BTreeMap::new();
        for a in adapters {
            if library.insert(a.name.clone(), a.dir.clone()).is_some() {
                return Err(EngineError::DuplicateAdapter { name: a.name.clone() });
            }
            audit_one(a, &cfg, &lora)?;
        }
        let opts = EngineOptions {
            max_running: opts.max_running.max(1),
            admit_per_step: opts.admit_per_step.max(1),
            max_batch_tokens: opts.max_batch_tokens.max(1),
            ..opts
        };
        let weights = model_dir.join("model.safetensors");
        let base = read_base_tables(&weights).map_err(|e| EngineError::BaseTables {
            path: weights.clone(),
            source: Box::new(e),
        })?;
        let tables = ServedTables::upload_at(device, &base, &cfg, lora.placement)?;
        let overlays = TokenOverlays::new(device, tables, lora.max_loras)?;
        let sources: Vec<AdapterSource<'_>> = adapters
            .iter()
            .take(lora.max_loras)
            .map(|a| AdapterSource {
                name: &a.name,
                dir: &a.dir,
            })
            .collect();
        let capacity = BatchCapacity {
            max_rows: opts.max_batch_tokens.max(opts.max_running),
            max_segments: opts.admit_per_step,
        };
        // A pool built for DoRA gets the model's projections as its base
        // weights (read when a DoRA adapter is staged).
        let base: Option<Arc<dyn BaseWeights>> = lora.dora.then(|| {
            Arc::new(ModelBase {
                model: Arc::clone(&model),
                cfg: cfg.clone(),
            }) as Arc<dyn BaseWeights>
        });
        let placement = lora.placement;
        let pool = LoraPool::load_with_base_weights(device, cfg.clone(), lora, capacity, &sources, overlays, base)?;
        let moe = match (&cfg.moe, pool.experts()) {
            // An expert-parallel rank may receive every token's every
            // chosen expert row, each folded as a token of its own.
            (Some(m), Some(_)) => Some(MoeLora::new(
                &pool,
                MoeCapacity::for_tokens(
                    if placement.ep_world() > 1 {
                        capacity.max_rows * m.top_k
                    } else {
                        capacity.max_rows
                    },
                    m.top_k,
                ),
            )?),
            _ => None,
        };
        let targets = DenseTargets::at(&cfg, placement)?;
        Ok(Engine {
            model,
            targets,
            pool,
            moe,
            library,
            prefix: PrefixCache::new(opts.prefix_entries),
            opts,
            requests: Vec::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            caches: Vec::new(),
            outputs: Vec::new(),
            events: Vec::new(),
            steps: 0,
        })
    }

    /// The base model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The pool.
    pub fn pool(&self) -> &LoraPool<TokenOverlays> {
        &self.pool
    }

    /// The pool, between steps: swaps and evictions of slots that running
    /// requests hold are refused with [`PoolError::SlotInUse`].
    pub fn pool_mut(&mut self) -> &mut LoraPool<TokenOverlays> {
        &mut self.pool
    }

    /// Queue `request`; returns its index. Refused, queueing nothing, for an
    /// empty prompt, an id outside the vocabulary, an unknown adapter, or a
    /// prompt over the prefill budget.
    pub fn submit(&mut self, request: Request) -> Result<usize, EngineError> {
        let index = self.requests.len();
        check_request(index, &request)?;
        let bad = |reason: String| Err(EngineError::Request { index, reason });
        let vocab = self.model.config().vocab;
        if let Some(&id) = request.prompt.iter().find(|&&id| id as usize >= vocab) {
            return bad(format!("token id {id} is not below the vocabulary size {vocab}"));
        }
        if let Some(name) = &request.adapter
            && !self.library.contains_key(name)
        {
            return bad(format!("adapter `{name}` was not given to the engine"));
        }
        if request.prompt.len() > self.opts.max_batch_tokens {
            return bad(format!(
                "the prompt's {} tokens exceed the prefill budget of {}",
                request.prompt.len(),
                self.opts.max_batch_tokens
            ));
        }
        self.requests.push(request);
        self.outputs.push(None);
        self.waiting.push_back(index);
        Ok(index)
    }

    /// Nothing waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Steps run so far.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// What the scheduler did, in order.
    pub fn events(&self) -> &[EngineEvent] {
        &self.events
    }

    /// Request `i`'s output, once it finished.
    pub fn output(&self, i: usize) -> Option<&RequestOutput> {
        self.outputs.get(i)?.as_ref()
    }

    /// Run steps until every request finished.
    pub fn run(&mut self) -> Result<(), EngineError> {
        while !self.is_idle() {
            self.step()?;
        }
        Ok(())
    }

    /// One scheduler step: admit, prefill the admitted prompts, decode every
    /// running request one token, retire the finished. A failed forward
    /// leaves every request where it was (admitted ones go back to the head
    /// of the queue) and every KV cache as it was.
    pub fn step(&mut self) -> Result<(), EngineError> {
        if self.is_idle() {
            return Ok(());
        }
        let step = self.steps;
        let admitted = self.admit()?;
        let first_new = self.running.len() - admitted.len();
        if let Err(e) = self.prefill(&admitted, first_new) {
            // Back to the head of the queue, in order; their leases drop.
            for r in self.running.drain(first_new..).rev() {
                self.waiting.push_front(r.request);
            }
            self.caches.truncate(first_new);
            return Err(e);
        }
        self.decode()?;
        self.steps += 1;
        self.retire(step);
        Ok(())
    }

    /// Admit waiting requests; returns the indices into `running` of those
    /// that need a prefill, which are the last ones (prefix hits run
    /// already, pushed before them).
    fn admit(&mut self) -> Result<Vec<usize>, EngineError> {
        let mut hits: Vec<(Running, CachedPrompt)> = Vec::new();
        let mut fresh: Vec<Running> = Vec::new();
        let mut tokens = 0usize;
        loop {
            let n = hits.len() + fresh.len();
            if n >= self.opts.admit_per_step || self.running.len() + n >= self.opts.max_running {
                break;
            }
            let Some(&request) = self.waiting.front() else {
                break;
            };
            let prompt_len = self.requests[request].prompt.len();
            if tokens + prompt_len > self.opts.max_batch_tokens {
                break;
            }
            let lease = match self.requests[request].adapter.clone() {
                None => None,
                Some(name) => match self.lease(&name) {
                    Ok(lease) => Some(lease),
                    // Every slot is held: wait for a request to finish,
                    // unless none runs (then none ever will).
                    Err(PoolError::PoolFull { .. }) if !self.running.is_empty() || n > 0 => break,
                    Err(e) => return Err(e.into()),
                },
            };
            self.waiting.pop_front();
            self.events.push(EngineEvent::Admitted {
                request,
                step: self.steps,
            });
            let adapter_id = lease.as_ref().map_or(0, SlotLease::adapter_id);
            let running = Running {
                request,
                lease,
                out: RequestOutput::default(),
            };
            match self.prefix.get(adapter_id, &self.requests[request].prompt) {
                Some(hit) => {
                    self.events.push(EngineEvent::PrefixHit { request });
                    hits.push((running, hit.clone()));
                }
                None => {
                    tokens += prompt_len;
                    fresh.push(running);
                }
            }
        }
        for (mut running, hit) in hits {
            running.out.logits_prompt = hit.logits;
            self.caches.push(hit.cache);
            self.running.push(running);
            self.take_first_token(self.running.len() - 1);
        }
        let first = self.running.len();
        for running in fresh {
            self.caches.push(KvCache::new(&self.model));
            self.running.push(running);
        }
        Ok((first..self.running.len()).collect())
    }

    /// A lease on `name`, promoting it into a slot when it is not resident.
    fn lease(&mut self, name: &str) -> Result<SlotLease, PoolError> {
        if self.pool.slot_of(name).is_some() {
            return self.pool.acquire(name);
        }
        let victim = self.pool.pick_victim(name)?;
        let replaced = self
            .pool
            .slots()
            .get(victim.index())
            .filter(|s| s.is_filled())
            .map(|s| s.name.clone());
        let dir = self.library.get(name).cloned().unwrap_or_default();
        let lease = self.pool.promote(name, &dir)?;
        self.events.push(EngineEvent::Promoted {
            adapter: name.to_string(),
            slot: lease.slot().index(),
            replaced,
        });
        Ok(lease)
    }

    fn prefill(&mut self, admitted: &[usize], first: usize) -> Result<(), EngineError> {
        if admitted.is_empty() {
            return Ok(());
        }
        let seqs: Vec<PrefillSeq<'_>> = admitted
            .iter()
            .map(|&i| PrefillSeq {
                row: self.running[i].lease.as_ref().map_or(StepRow::Base, StepRow::Adapter),
                len: self.requests[self.running[i].request].prompt.len(),
            })
            .collect();
        let step = self.pool.prefill_step(&seqs)?;
        if let Some(moe) = &mut self.moe {
            moe.set_prefill_step(&self.pool, &step)?;
        }
        let chunks: Vec<SeqChunk<'_>> = admitted
            .iter()
            .map(|&i| SeqChunk {
                cache: i - first,
                tokens: &self.requests[self.running[i].request].prompt,
            })
            .collect();
        let mut hooks = StepHooks {
            pool: &self.pool,
            step: StepRef::Prefill(&step),
            moe: self.moe.as_mut(),
            targets: self.targets,
            model: &self.model,
        };
        let logits = self.model.forward(&chunks, &mut self.caches[first..], &mut hooks)?;
        let vocab = self.model.config().vocab;
        let mut offset = 0;
        for (seq, &i) in admitted.iter().enumerate() {
            let len = self.requests[self.running[i].request].prompt.len();
            let rows = logits[offset * vocab..(offset + len) * vocab].to_vec();
            offset += len;
            let adapter_id = step.adapter_id(seq).unwrap_or(0);
            self.prefix.insert(
                adapter_id,
                &self.requests[self.running[i].request].prompt,
                CachedPrompt {
                    cache: self.caches[i].clone(),
                    logits: rows.clone(),
                },
            );
            self.running[i].out.logits_prompt = rows;
            self.take_first_token(i);
        }
        Ok(())
    }

    /// The first greedy token of `running[i]`, from its prompt's last logits.
    fn take_first_token(&mut self, i: usize) {
        let vocab = self.model.config().vocab;
        let r = &mut self.running[i];
        if self.requests[r.request].max_new_tokens == 0 {
            return;
        }
        let n = r.out.logits_prompt.len();
        let last = r.out.logits_prompt[n - vocab..].to_vec();
        r.out.tokens.push(argmax(&last));
        r.out.logits_step.extend_from_slice(&last);
    }

    fn decode(&mut self) -> Result<(), EngineError> {
        let active: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                let r = &self.running[i];
                let want = self.requests[r.request].max_new_tokens;
                !r.out.tokens.is_empty() && r.out.tokens.len() < want
            })
            .collect();
        if active.is_empty() {
            return Ok(());
        }
        let rows: Vec<StepRow<'_>> = active
            .iter()
            .map(|&i| self.running[i].lease.as_ref().map_or(StepRow::Base, StepRow::Adapter))
            .collect();
        let step = self.pool.decode_step(&rows, rows.len())?;
        if let Some(moe) = &mut self.moe {
            moe.set_decode_step(&self.pool, &step)?;
        }
        let last: Vec<[u32; 1]> = active
            .iter()
            .map(|&i| [self.running[i].out.tokens.last().copied().unwrap_or(0)])
            .collect();
        let chunks: Vec<SeqChunk<'_>> = active
            .iter()
            .zip(&last)
            .map(|(&i, t)| SeqChunk { cache: i, tokens: t })
            .collect();
        let mut hooks = StepHooks {
            pool: &self.pool,
            step: StepRef::Decode(&step),
            moe: self.moe.as_mut(),
            targets: self.targets,
            model: &self.model,
        };
        let logits = self.model.forward(&chunks, &mut self.caches, &mut hooks)?;
        let vocab = self.model.config().vocab;
        for (row, &i) in active.iter().enumerate() {
            let l = &logits[row * vocab..(row + 1) * vocab];
            let out = &mut self.running[i].out;
            out.tokens.push(argmax(l));
            out.logits_step.extend_from_slice(l);
        }
        Ok(())
    }

    fn retire(&mut self, step: usize) {
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if r.out.tokens.len() >= self.requests[r.request].max_new_tokens {
                let done = self.running.remove(i);
                self.caches.remove(i);
                self.events.push(EngineEvent::Finished {
                    request: done.request,
                    step,
                });
                self.outputs[done.request] = Some(done.out);
            } else {
                i += 1;
            }
        }
    }
}

/// Audit one adapter: refused (its report's reasons, or a refused config)
/// or unreadable are distinct errors naming it.
/// The adapter geometry of the model in `model_dir`.
fn lora_config(model_dir: &Path) -> Result<ModelConfig, EngineError> {
    let config_path = model_dir.join("config.json");
    ModelConfig::from_file(&config_path).map_err(|source| EngineError::LoraConfig {
        path: config_path.clone(),
        source,
    })
}

fn audit_one(a: &AdapterDir, cfg: &ModelConfig, opts: &LoraOptions) -> Result<(), EngineError> {
    match audit_adapter(&a.dir, cfg, opts) {
        Ok(report) if report.is_servable() => Ok(()),
        Ok(report) => Err(EngineError::AdapterRefused {
            name: a.name.clone(),
            report: report.to_text(cfg),
        }),
        Err(AuditError::ConfigRefused(refusals)) => Err(EngineError::AdapterRefused {
            name: a.name.clone(),
            report: refusals.iter().map(|r| format!("  {r}\n")).collect(),
        }),
        Err(source) => Err(EngineError::Adapter {
            name: a.name.clone(),
            source: Box::new(source),
        }),
    }
}
