//! How to pick each token (samplers, run host-side) and when to stop generating.

use crate::Sampler;

impl Sampler {
    /// The most likely token.
    pub fn greedy() -> Sampler {
        Sampler { temperature: 0.0, top_k: 0, top_p: 1.0, seed: None }
    }

    /// Sampling from the whole distribution at `temperature`.
    pub fn temperature(temperature: f32) -> Sampler {
        Sampler { temperature, ..Sampler::greedy() }
    }

    /// Sampling at `temperature` among the `k` most likely tokens.
    pub fn top_k(temperature: f32, k: u32) -> Sampler {
        Sampler { temperature, top_k: k, ..Sampler::greedy() }
    }

    /// Nucleus sampling at `temperature`: among the most likely tokens that reach
    /// probability `p` together.
    pub fn top_p(temperature: f32, p: f32) -> Sampler {
        Sampler { temperature, top_p: p, ..Sampler::greedy() }
    }

    /// Reproducible draws: `Context::generate` uses `seed`, `seed + 1`, ... per step.
    pub fn with_seed(self, seed: u64) -> Sampler {
        Sampler { seed: Some(seed), ..self }
    }
}

/// When `Context::generate` stops: after `max_tokens`, at an EOS token (not included in
/// the output), or once the output contains a stop string (cut before it).
#[derive(Clone, Debug)]
pub struct Stop {
    pub max_tokens: usize,
    pub eos_tokens: Vec<u32>,
    pub strings: Vec<String>,
}

impl Stop {
    /// Stop after `max_tokens` tokens only.
    pub fn new(max_tokens: usize) -> Stop {
        Stop { max_tokens, eos_tokens: Vec::new(), strings: Vec::new() }
    }

    /// Also stop at any of these tokens (e.g. `Queue::eos_tokens`).
    pub fn eos(mut self, tokens: Vec<u32>) -> Stop {
        self.eos_tokens.extend(tokens);
        self
    }

    /// Also stop once the output contains `text`.
    pub fn string(mut self, text: &str) -> Stop {
        self.strings.push(text.to_string());
        self
    }

    /// The output cut before the first stop string, if it contains one.
    pub(crate) fn cut<'a>(&self, text: &'a str) -> Option<&'a str> {
        self.strings.iter().filter_map(|s| text.find(s.as_str())).min().map(|i| &text[..i])
    }
}
