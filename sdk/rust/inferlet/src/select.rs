//! SGLang's `select`: which of several multi-token choices the model finds likeliest.
//!
//! Each choice's tokens are scored after the context's pending tokens in one pass that
//! writes no KV (an output per choice token, with that token's log-probability); every
//! choice's pass is enqueued before any is awaited, so they share a batch, and the context
//! is unchanged. How a choice's token log-probabilities become its score is the known trap
//! of `select` ([`Normalize`]). The twin of the Python SDK's `Context.select`.

use crate::bindings::inference::{self, Output};
use crate::bindings::types::{Error, ErrorKind};
use crate::context::{awaited, output};
use crate::Context;

/// How [`Context::select`] turns a choice's token log-probabilities into its score.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Normalize {
    /// Their sum: the choice's log-probability (favours short choices).
    Sum,
    /// Their mean per token (SGLang's default; favours choices whose later tokens are
    /// predictable once begun).
    Mean,
    /// The mean of log p(token | context) - log p(token | a fresh start): how much the
    /// context raises each token (SGLang's unconditional-likelihood normalisation). A fresh
    /// start is the model's first EOS token alone, the start of a new document for most
    /// models.
    Unconditional,
}

/// What [`Context::select`] chose, and why.
#[derive(Clone, Debug)]
pub struct Selection {
    /// The chosen choice's index and text.
    pub index: usize,
    pub text: String,
    /// Every choice's score, as normalised.
    pub scores: Vec<f32>,
    /// Every choice's per-token log-probabilities after the context.
    pub logprobs: Vec<Vec<f32>>,
}

impl Context {
    /// Which of `choices` the model finds likeliest after the context (see the module).
    /// Needs a pending token (fill the prompt, do not flush it): the first token of each
    /// choice is predicted from it.
    ///
    /// Errors: `invalid-argument` for no choices, a choice without tokens, or no pending
    /// token.
    pub async fn select(&self, choices: &[&str], normalize: Normalize) -> Result<Selection, Error> {
        let invalid = |message: &str| Error { kind: ErrorKind::InvalidArgument, message: message.to_string() };
        if choices.is_empty() {
            return Err(invalid("select needs at least one choice"));
        }
        if self.pending().is_empty() {
            return Err(invalid("select predicts each choice from the pending tokens: fill the prompt and do not flush it"));
        }
        let tokenized: Vec<Vec<u32>> = choices.iter().map(|c| self.queue().tokenize(c)).collect();
        if let Some(i) = tokenized.iter().position(Vec::is_empty) {
            return Err(invalid(&format!("choice {:?} has no tokens", choices[i])));
        }
        let last = self.pending().len() as u32 - 1;
        let scored = tokenized.iter().map(|t| self.peek_outputs(t, outputs(last, t)))
            .collect::<Result<Vec<_>, Error>>()?;
        let mut fresh = Vec::new();
        if normalize == Normalize::Unconditional {
            let start = self.queue().eos_tokens().first().copied().unwrap_or(0);
            for t in &tokenized {
                fresh.push(self.fresh_pass(&[&[start], t.as_slice()].concat(), outputs(0, t))?);
            }
        }
        let mut logprobs = Vec::new();
        for pass in scored {
            logprobs.push(token_logprobs(pass.await?));
        }
        let mut scores: Vec<f32> = logprobs.iter().map(|lp| match normalize {
            Normalize::Sum => lp.iter().sum(),
            _ => lp.iter().sum::<f32>() / lp.len() as f32,
        }).collect();
        for (i, pass) in fresh.into_iter().enumerate() {
            let alone = token_logprobs(pass.await?);
            let lp = &logprobs[i];
            scores[i] = lp.iter().zip(&alone).map(|(a, b)| a - b).sum::<f32>() / lp.len() as f32;
        }
        let index = (0..scores.len()).fold(0, |best, i| if scores[i] > scores[best] { i } else { best });
        Ok(Selection { index, text: choices[index].to_string(), scores, logprobs })
    }

    /// Enqueues a pass over `tokens` alone (no context, no KV written) on this context's
    /// queue; its result, awaited.
    fn fresh_pass(&self, tokens: &[u32], outs: Vec<Output>)
                  -> Result<impl std::future::Future<Output = Result<inference::PassResult, Error>>, Error> {
        let id = inference::execute(self.queue().raw(), inference::ForwardPass {
            input_embeds: Vec::new(),
            positions: (0..tokens.len() as u32).collect(),
            input_kv_pages: Vec::new(),
            input_kv_last_page_len: 0,
            output_kv_pages: Vec::new(),
            output_kv_offset: 0,
            attention_mask: None,
            outputs: outs,
            stop_tokens: Vec::new(),
            input_tokens: tokens.to_vec(),
        })?;
        Ok(awaited(self.queue().clone(), id))
    }
}

/// One output per token of `tokens`, at `first`, `first + 1`, ..., each asking for the
/// log-probability of the token it predicts.
fn outputs(first: u32, tokens: &[u32]) -> Vec<Output> {
    tokens.iter().enumerate()
        .map(|(i, &t)| Output { index: first + i as u32, logprobs_of: vec![t], ..output(0) })
        .collect()
}

/// The log-probability each output asked for, in output order.
fn token_logprobs(result: inference::PassResult) -> Vec<f32> {
    let mut details = result.details;
    details.sort_by_key(|d| d.index);
    details.into_iter().map(|d| d.logprobs[0]).collect()
}
