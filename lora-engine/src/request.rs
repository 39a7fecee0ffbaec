//! What is asked of the engine and what it answers: requests, their
//! outputs, the run's events, and the JSON request file of `cargo xtask
//! serve`.

use serde::Deserialize;

use crate::error::EngineError;

/// The largest request file read: 64 MiB.
pub const MAX_REQUESTS_BYTES: usize = 64 << 20;

/// Most requests in one file.
pub const MAX_REQUESTS: usize = 1 << 16;

/// Most tokens one request may reach (prompt plus generated).
pub const MAX_SEQUENCE_TOKENS: usize = 1 << 16;

/// One generation request.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<u32>,
    /// The adapter to serve it with; `None`: the base model.
    pub adapter: Option<String>,
    /// Greedy tokens to generate.
    pub max_new_tokens: usize,
}

/// What a finished request produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestOutput {
    /// `[prompt_len, vocab]`: the logits at every prompt position.
    pub logits_prompt: Vec<f32>,
    /// The greedy tokens, `max_new_tokens` of them.
    pub tokens: Vec<u32>,
    /// `[max_new_tokens, vocab]`: the logits that chose each token.
    pub logits_step: Vec<f32>,
}

/// Something the scheduler did, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEvent {
    /// A request was admitted to the running batch at `step`.
    Admitted {
        /// The request's index.
        request: usize,
        /// The engine step.
        step: usize,
    },
    /// An adapter was made resident in `slot` for a request, replacing
    /// `replaced` (`None`: the slot was empty).
    Promoted {
        /// The adapter loaded.
        adapter: String,
        /// Its slot.
        slot: usize,
        /// The adapter evicted from the slot.
        replaced: Option<String>,
    },
    /// A request's prompt was served from the prefix cache (same prompt,
    /// same adapter identity): no prefill ran for it.
    PrefixHit {
        /// The request's index.
        request: usize,
    },
    /// A request produced its last token at `step`.
    Finished {
        /// The request's index.
        request: usize,
        /// The engine step.
        step: usize,
    },
}

/// Parse a request file: a JSON array of `{"prompt": [ids], "adapter":
/// NAME or null, "max_new_tokens": K}`. Refuses a file over
/// [`MAX_REQUESTS_BYTES`], more than [`MAX_REQUESTS`] requests, an empty
/// prompt, and a request past [`MAX_SEQUENCE_TOKENS`]; ids are checked
/// against the model when submitted.
pub fn parse_requests(text: &str) -> Result<Vec<Request>, EngineError> {
    if text.len() > MAX_REQUESTS_BYTES {
        return Err(EngineError::Requests {
            reason: format!("{} bytes, over the limit of {MAX_REQUESTS_BYTES}", text.len()),
        });
    }
    let requests: Vec<Request> =
        serde_json::from_str(text).map_err(|e| EngineError::Requests { reason: e.to_string() })?;
    if requests.len() > MAX_REQUESTS {
        return Err(EngineError::Requests {
            reason: format!("{} requests, over the limit of {MAX_REQUESTS}", requests.len()),
        });
    }
    for (i, r) in requests.iter().enumerate() {
        check_request(i, r)?;
    }
    Ok(requests)
}

/// The model-independent checks of one request.
pub(crate) fn check_request(index: usize, r: &Request) -> Result<(), EngineError> {
    let bad = |reason: String| Err(EngineError::Request { index, reason });
    if r.prompt.is_empty() {
        return bad("the prompt is empty".into());
    }
    if r.prompt.len().saturating_add(r.max_new_tokens) > MAX_SEQUENCE_TOKENS {
        return bad(format!(
            "prompt {} + max_new_tokens {} exceeds {MAX_SEQUENCE_TOKENS} tokens",
            r.prompt.len(),
            r.max_new_tokens
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_form() {
        let r = parse_requests(
            r#"[{"prompt": [1, 2], "adapter": "a", "max_new_tokens": 3},
                                   {"prompt": [4], "adapter": null, "max_new_tokens": 0}]"#,
        )
        .expect("valid");
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].adapter.as_deref(), Some("a"));
        assert_eq!((r[1].adapter.as_deref(), r[1].max_new_tokens), (None, 0));
    }

    #[test]
    fn refuses_malformed_requests() {
        for text in [
            "{}",
            "[{\"prompt\": [], \"adapter\": null, \"max_new_tokens\": 1}]",
            "[{\"prompt\": [-1], \"adapter\": null, \"max_new_tokens\": 1}]",
            "[{\"prompt\": [1], \"adapter\": null}]",
            "[{\"prompt\": [1], \"adapter\": null, \"max_new_tokens\": 1, \"x\": 1}]",
            "[{\"prompt\": [1], \"adapter\": null, \"max_new_tokens\": 18446744073709551615}]",
            "[",
        ] {
            assert!(parse_requests(text).is_err(), "{text}");
        }
    }

    proptest::proptest! {
        /// Any text is parsed or refused, never a panic; what parses keeps
        /// every request's documented bounds.
        #[test]
        fn any_text_is_parsed_or_refused(text in ".{0,200}") {
            if let Ok(requests) = parse_requests(&text) {
                for r in &requests {
                    proptest::prop_assert!(!r.prompt.is_empty());
                    proptest::prop_assert!(r.prompt.len() + r.max_new_tokens <= MAX_SEQUENCE_TOKENS);
                }
            }
        }

        /// Well-formed request lists round-trip through the parser.
        #[test]
        fn well_formed_lists_parse(reqs in proptest::collection::vec(
            (proptest::collection::vec(0u32..1000, 1..8), proptest::option::of("[a-z]{1,6}"), 0usize..8), 0..6)) {
            let text = serde_json::to_string(&reqs.iter().map(|(p, a, k)| serde_json::json!({
                "prompt": p, "adapter": a, "max_new_tokens": k,
            })).collect::<Vec<_>>()).expect("json");
            let parsed = parse_requests(&text).expect("well formed");
            proptest::prop_assert_eq!(parsed.len(), reqs.len());
            for (r, (p, a, k)) in parsed.iter().zip(&reqs) {
                proptest::prop_assert_eq!(&r.prompt, p);
                proptest::prop_assert_eq!(&r.adapter, a);
                proptest::prop_assert_eq!(r.max_new_tokens, *k);
            }
        }
    }
}
