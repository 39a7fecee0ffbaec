//! The answer file of a served batch, and how two answers compare.
//!
//! One format for both sides: `cargo xtask serve` writes it from the
//! engine's outputs, and PEFT's answers (`peft.safetensors` of the engine
//! fixtures) are in it. For request `i`: `logits_prompt::i` F32
//! `[prompt_len, vocab]`, `tokens::i` I64 `[K]`, `logits_step::i` F32
//! `[K, vocab]`. [`compare`] is the oracle rule: relative errors of the
//! prompt and step logits, and greedy tokens equal up to the first step
//! where the reference's top two logits are within [`NEAR_TIE`] (past a
//! near tie the continuations may legitimately part).

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors, View};

use crate::error::EngineError;
use crate::request::RequestOutput;

/// The relative error bound of the oracle checks, `‖ours − ref‖ / ‖ref‖`.
pub const ANSWER_TOLERANCE: f64 = 2e-2;

/// Top-two logits closer than this make a near tie.
pub const NEAR_TIE: f32 = 1e-3;

/// The largest answer file read: 4 GiB.
const MAX_ANSWER_BYTES: u64 = 4 << 30;

/// The tensors of an answer file, as f32 (tokens converted).
#[derive(Debug, Clone, Default)]
pub struct Answers {
    tensors: BTreeMap<String, Vec<f32>>,
}

/// Request `i`'s answer.
#[derive(Debug, Clone, Copy)]
pub struct Answer<'a> {
    /// `[prompt_len, vocab]`.
    pub logits_prompt: &'a [f32],
    /// The greedy tokens, as f32.
    pub tokens: &'a [f32],
    /// `[K, vocab]`.
    pub logits_step: &'a [f32],
}

impl Answers {
    /// Read an answer file.
    pub fn read(path: &Path) -> Result<Answers, EngineError> {
        let io = |source| EngineError::Io {
            path: path.to_path_buf(),
            source,
        };
        let len = std::fs::metadata(path).map_err(io)?.len();
        if len > MAX_ANSWER_BYTES {
            return Err(EngineError::Answers {
                path: path.to_path_buf(),
                reason: format!("{len} bytes, over the limit of {MAX_ANSWER_BYTES}"),
            });
        }
        let bytes = std::fs::read(path).map_err(io)?;
        let st = SafeTensors::deserialize(&bytes).map_err(|source| EngineError::Safetensors {
            file: path.to_path_buf(),
            source,
        })?;
        let mut tensors = BTreeMap::new();
        for (name, t) in st.tensors() {
            let data = match t.dtype() {
                Dtype::F32 => t
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
                Dtype::I64 => t
                    .data()
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
                    .collect(),
                other => {
                    return Err(EngineError::Answers {
                        path: path.to_path_buf(),
                        reason: format!("tensor `{name}` has dtype {other:?}; answers are F32 or I64"),
                    });
                }
            };
            tensors.insert(name, data);
        }
        Ok(Answers { tensors })
    }

    /// Request `i`'s answer, when the file has all three of its tensors.
    pub fn request(&self, i: usize) -> Option<Answer<'_>> {
        let get = |kind: &str| self.tensors.get(&format!("{kind}::{i}")).map(Vec::as_slice);
        Some(Answer {
            logits_prompt: get("logits_prompt")?,
            tokens: get("tokens")?,
            logits_step: get("logits_step")?,
        })
    }

    /// Any tensor by name (e.g. the fixtures' `logits_prompt_base::i`).
    pub fn tensor(&self, name: &str) -> Option<&[f32]> {
        self.tensors.get(name).map(Vec::as_slice)
    }
}

/// How greedy tokens compare with the reference's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenMatch {
    /// Every token equal.
    Equal,
    /// Equal up to a reference near tie at this step, then parted.
    PastTie(usize),
    /// Different at this step, before any near tie (or a different count).
    Differ(usize),
}

/// One request's output against the reference answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Comparison {
    /// Relative error of the prompt logits.
    pub prompt_err: f64,
    /// The largest relative error of a step's logits before the first near tie.
    pub step_err: f64,
    /// The tokens.
    pub tokens: TokenMatch,
}

impl Comparison {
    /// Within `tol` on both logit errors, and no token differing before a near tie.
    pub fn within(&self, tol: f64) -> bool {
        self.prompt_err <= tol && self.step_err <= tol && !matches!(self.tokens, TokenMatch::Differ(_))
    }
}

/// `‖ours − reference‖ / ‖reference‖` in f64; infinite when the lengths differ.
pub fn rel_error(ours: &[f32], reference: &[f32]) -> f64 {
    if ours.len() != reference.len() {
        return f64::INFINITY;
    }
    let num: f64 = ours
        .iter()
        .zip(reference)
        .map(|(a, b)| (f64::from(*a) - f64::from(*b)).powi(2))
        .sum();
    let den: f64 = reference.iter().map(|b| f64::from(*b).powi(2)).sum();
    if den == 0.0 {
        return if num == 0.0 { 0.0 } else { f64::INFINITY };
    }
    (num / den).sqrt()
}

/// Steps of the reference's generation before its first near tie.
pub fn steps_before_near_tie(logits_step: &[f32], vocab: usize) -> usize {
    if vocab == 0 {
        return 0;
    }
    logits_step
        .chunks_exact(vocab)
        .position(|row| {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &v in row {
                if v > a {
                    (a, b) = (v, a);
                } else if v > b {
                    b = v;
                }
            }
            a - b < NEAR_TIE
        })
        .unwrap_or(logits_step.len() / vocab)
}

/// Compare `ours` with `reference` by the oracle rule.
pub fn compare(ours: &RequestOutput, reference: &Answer<'_>, vocab: usize) -> Comparison {
    let untied = steps_before_near_tie(reference.logits_step, vocab);
    let mut step_err = 0.0f64;
    for s in 0..untied {
        let row = s * vocab..(s + 1) * vocab;
        let e = match (ours.logits_step.get(row.clone()), reference.logits_step.get(row)) {
            (Some(a), Some(b)) => rel_error(a, b),
            _ => f64::INFINITY,
        };
        step_err = step_err.max(e);
    }
    let n = ours.tokens.len().max(reference.tokens.len());
    let differ = (0..n).find(|&s| ours.tokens.get(s).map(|&t| t as f32) != reference.tokens.get(s).copied());
    let tokens = match differ {
        None => TokenMatch::Equal,
        Some(s) if s >= untied && ours.tokens.len() == reference.tokens.len() => TokenMatch::PastTie(s),
        Some(s) => TokenMatch::Differ(s),
    };
    Comparison {
        prompt_err: rel_error(&ours.logits_prompt, reference.logits_prompt),
        step_err,
        tokens,
    }
}

/// One tensor to write.
struct Tensor {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Tensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn f32_tensor(rows: usize, vocab: usize, v: &[f32]) -> Tensor {
    Tensor {
        dtype: Dtype::F32,
        shape: vec![rows, vocab],
        data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// Write `outputs` (request `i` = `outputs[i]`) as an answer file.
pub fn write_answers(path: &Path, outputs: &[&RequestOutput], vocab: usize) -> Result<(), EngineError> {
    let mut tensors = BTreeMap::new();
    let rows = |len: usize| len.checked_div(vocab).unwrap_or(0);
    for (i, o) in outputs.iter().enumerate() {
        tensors.insert(
            format!("logits_prompt::{i}"),
            f32_tensor(rows(o.logits_prompt.len()), vocab, &o.logits_prompt),
        );
        tensors.insert(
            format!("tokens::{i}"),
            Tensor {
                dtype: Dtype::I64,
                shape: vec![o.tokens.len()],
                data: o.tokens.iter().flat_map(|&t| i64::from(t).to_le_bytes()).collect(),
            },
        );
        tensors.insert(
            format!("logits_step::{i}"),
            f32_tensor(o.tokens.len(), vocab, &o.logits_step),
        );
    }
    safetensors::serialize_to_file(tensors.iter().map(|(k, v)| (k.clone(), v)), None, path).map_err(|source| {
        EngineError::Safetensors {
            file: path.to_path_buf(),
            source,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output(prompt: &[f32], tokens: &[u32], steps: &[f32]) -> RequestOutput {
        RequestOutput {
            logits_prompt: prompt.to_vec(),
            tokens: tokens.to_vec(),
            logits_step: steps.to_vec(),
        }
    }

    #[test]
    fn written_answers_read_back() {
        let dir = std::env::temp_dir().join(format!("lora-engine-answers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("a.safetensors");
        let a = output(&[1.0, 2.0, 3.0, 4.0], &[1], &[0.5, 0.75]);
        let b = output(&[5.0, 6.0], &[], &[]);
        write_answers(&path, &[&a, &b], 2).expect("write");
        let answers = Answers::read(&path).expect("read");
        for (i, o) in [&a, &b].into_iter().enumerate() {
            let r = answers.request(i).expect("request");
            let c = compare(o, &r, 2);
            assert_eq!((c.prompt_err, c.step_err, c.tokens), (0.0, 0.0, TokenMatch::Equal));
        }
        assert!(answers.request(2).is_none());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn tokens_may_part_only_past_a_near_tie() {
        // Step 0 is decisive, step 1 a near tie.
        let steps = [0.0, 1.0, 0.5, 0.5 + NEAR_TIE / 2.0];
        let reference = Answer {
            logits_prompt: &[1.0, 1.0],
            tokens: &[1.0, 1.0],
            logits_step: &steps,
        };
        let parted = output(&[1.0, 1.0], &[1, 0], &steps);
        assert_eq!(compare(&parted, &reference, 2).tokens, TokenMatch::PastTie(1));
        let wrong = output(&[1.0, 1.0], &[0, 1], &steps);
        assert_eq!(compare(&wrong, &reference, 2).tokens, TokenMatch::Differ(0));
        let short = output(&[1.0, 1.0], &[1], &steps[..2]);
        assert!(!compare(&short, &reference, 2).within(ANSWER_TOLERANCE));
    }

    #[test]
    fn relative_error_is_scale_free() {
        assert_eq!(rel_error(&[2.0, 0.0], &[1.0, 0.0]), 1.0);
        assert_eq!(rel_error(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rel_error(&[0.0], &[0.0]), 0.0);
    }
}
