//! Models and their command queues.

use crate::bindings::futures::Pollable;
use crate::bindings::types::{self, Embed, Error};
use crate::bindings::scheduling::{self, Objective};
use crate::bindings::{allocate, inference, output_text, runtime, tokenize};
use crate::{join_all, ChatMessage, Context, Sampler};
use std::cell::OnceCell;
use std::rc::Rc;

/// A model the server serves, by name.
#[derive(Clone, Debug)]
pub struct Model {
    name: String,
}

impl Model {
    /// The server's first model (the default one).
    pub fn default_model() -> Result<Model, String> {
        let name = runtime::available_models().into_iter().next().ok_or("the server serves no model")?;
        Ok(Model { name })
    }

    /// The model called `name`, if the server serves it.
    pub fn get(name: &str) -> Option<Model> {
        runtime::available_models().into_iter().find(|m| m == name).map(|name| Model { name })
    }

    /// The model's name, as `runtime.available-models` lists it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The traits the model implements ("forward", "input-text", ...).
    pub fn traits(&self) -> Result<Vec<String>, Error> {
        runtime::available_traits(&self.name)
    }

    /// A new command queue: calls on it run in order, other queues' calls independently.
    pub fn create_queue(&self) -> Result<Queue, Error> {
        let raw = runtime::create_queue(&self.name)?;
        let page_size = allocate::kv_page_size(&raw);
        Ok(Queue { raw, page_size, ready: OnceCell::new() })
    }

    /// An empty context on a new queue.
    pub fn create_context(&self) -> Result<Context, Error> {
        Ok(Context::new(Rc::new(self.create_queue()?)))
    }
}

/// A command queue of one model, with the model's tokenizer at hand.
pub struct Queue {
    // Declared first: the pollable is dropped before the queue it reports on.
    ready: OnceCell<Pollable>,
    raw: types::Queue,
    page_size: u32,
}

impl Queue {
    /// The WIT queue resource, for calling `bindings` directly.
    pub fn raw(&self) -> &types::Queue {
        &self.raw
    }

    /// The queue's `results-ready` pollable, made on first use.
    pub(crate) fn results_pollable(&self) -> &Pollable {
        self.ready.get_or_init(|| inference::results_ready(&self.raw))
    }

    /// Token slots per KV page.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// `text` as the model's tokens (no special tokens added).
    pub fn tokenize(&self, text: &str) -> Vec<u32> {
        tokenize::tokenize(&self.raw, text)
    }

    /// The text of `tokens`.
    pub fn detokenize(&self, tokens: &[u32]) -> Result<String, Error> {
        tokenize::detokenize(&self.raw, tokens)
    }

    /// The tokens that end a generation.
    pub fn eos_tokens(&self) -> Vec<u32> {
        tokenize::get_eos_tokens(&self.raw)
    }

    /// The conversation rendered with the model's chat template, ready to tokenize.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, Error> {
        tokenize::apply_chat_template(&self.raw, messages, add_generation_prompt)
    }

    /// Waits until everything enqueued so far has run; reports the first failure.
    pub async fn synchronize(&self) -> Result<(), Error> {
        runtime::synchronize(&self.raw).await
    }

    /// One token drawn from the distribution after output embed `embed` (see
    /// `Context::forward_pending`).
    pub async fn sample(&self, embed: Embed, sampler: &Sampler) -> Result<u32, Error> {
        output_text::sample(&self.raw, embed, sampler.clone())?.await
    }

    /// One token per output embed, all requested at once (they batch together).
    pub async fn sample_all(&self, embeds: &[Embed], sampler: &Sampler) -> Result<Vec<u32>, Error> {
        join_all(embeds.iter().map(|&e| self.sample(e, sampler))).await.into_iter().collect()
    }

    /// The `k` most likely next tokens after output embed `embed`, with their
    /// probabilities, most likely first.
    pub async fn next_dist(&self, embed: Embed, k: u32) -> Result<(Vec<u32>, Vec<f32>), Error> {
        let dist = output_text::get_next_dist(&self.raw, embed, k)?.await?;
        Ok((dist.token_ids, dist.probs))
    }

    /// Higher priorities go first when the scheduler must choose; 0 is the default.
    pub fn set_priority(&self, priority: u32) {
        runtime::set_queue_priority(&self.raw, priority)
    }

    /// What the queue's calls are for (`Objective::Latency` goes first; every queue starts
    /// as `Throughput`), and its task group ("" for none): queues of one group are ordered
    /// as one job. Fails (`out-of-resources`) past the `latency_queues` quota.
    pub fn set_objective(&self, objective: Objective, group: &str) -> Result<(), Error> {
        scheduling::set_queue_objective(&self.raw, objective, group)
    }

    /// How many new tokens the queue's current job still has to run (for the `srjf`
    /// scheduler: least work first); 0 clears the hint.
    pub fn set_job_size(&self, tokens: u32) -> Result<(), Error> {
        scheduling::set_job_size(&self.raw, tokens)
    }
}
