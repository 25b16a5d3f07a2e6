//! A token sequence and the KV pages that hold it.
//!
//! Bookkeeping: the context's tokens are `committed` (their K/V written into `pages`)
//! followed by `pending` (filled, not yet run through the model). The pages hold the
//! committed tokens in order: every page is full except the last, which holds `last_len`
//! of `page_size` slots. A forward pass reads the pages as context and writes the new
//! tokens from slot `last_len` of the last page on, into newly allocated pages after it.
//! Only that partial last page is ever written, so full pages can be shared by forks.

use std::rc::Rc;

use crate::bindings::forward::{self, ForwardPass};
use crate::bindings::types::{Embed, Error, ErrorKind, KvPage};
use crate::bindings::{allocate, input_text, output_text};
use crate::{ChatMessage, Queue, Sampler, Stop};

/// A KV page, freed when the last context holding it drops it.
struct Page {
    id: KvPage,
    queue: Rc<Queue>,
}

impl Drop for Page {
    fn drop(&mut self) {
        // Fails only if the id is already invalid, which this type rules out.
        let _ = allocate::dealloc_kvpage(self.queue.raw(), &[self.id]);
    }
}

/// A sequence being generated: fill it with text or tokens, then decode.
pub struct Context {
    queue: Rc<Queue>,
    pages: Vec<Rc<Page>>,
    last_len: u32,
    committed: Vec<u32>,
    pending: Vec<u32>,
    /// Input embeds, reused by every forward (the queue orders their reuse).
    embeds: Vec<Embed>,
    /// The output embed of the last token, allocated on the first decode step.
    output: Option<Embed>,
}

impl Context {
    /// An empty context whose calls go to `queue`.
    pub fn new(queue: Rc<Queue>) -> Context {
        Context { queue, pages: Vec::new(), last_len: 0, committed: Vec::new(), pending: Vec::new(),
                  embeds: Vec::new(), output: None }
    }

    pub fn queue(&self) -> &Rc<Queue> {
        &self.queue
    }

    /// Every token of the sequence: committed, then pending.
    pub fn tokens(&self) -> Vec<u32> {
        [self.committed.as_slice(), self.pending.as_slice()].concat()
    }

    /// Appends text (tokenized, no special tokens added).
    pub fn fill(&mut self, text: &str) {
        let tokens = self.queue.tokenize(text);
        self.pending.extend(tokens);
    }

    pub fn fill_tokens(&mut self, tokens: &[u32]) {
        self.pending.extend_from_slice(tokens);
    }

    /// Appends a conversation rendered by the model's chat template; with
    /// `add_generation_prompt`, the opening of the assistant's turn too.
    pub fn fill_chat(&mut self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<(), Error> {
        let text = self.queue.apply_chat_template(messages, add_generation_prompt)?;
        self.fill(&text);
        Ok(())
    }

    /// Runs every pending token but the last through the model (the last stays pending:
    /// the next decode step needs an input token to predict from).
    pub fn flush(&mut self) -> Result<(), Error> {
        if self.pending.len() > 1 {
            let last = self.pending.pop().unwrap();
            let tokens = std::mem::replace(&mut self.pending, vec![last]);
            self.forward(&tokens, None)?;
        }
        Ok(())
    }

    /// Runs the pending tokens, samples the next token on the host, and leaves it pending.
    pub async fn decode_step(&mut self, sampler: &Sampler) -> Result<u32, Error> {
        if self.pending.is_empty() {
            return Err(Error { kind: ErrorKind::InvalidArgument,
                               message: "decode_step on a context with no pending token; fill it first".into() });
        }
        let output = match self.output {
            Some(embed) => embed,
            None => *self.output.insert(allocate::alloc_emb(self.queue.raw(), 1)?[0]),
        };
        let tokens = std::mem::take(&mut self.pending);
        self.forward(&tokens, Some(output))?;
        let token = output_text::sample(self.queue.raw(), output, sampler.clone())?.await?;
        self.pending.push(token);
        Ok(token)
    }

    /// Decodes until `stop`, returning the generated text (without the EOS token or the
    /// stop string). With a seeded sampler, step i uses seed + i.
    pub async fn generate(&mut self, sampler: &Sampler, stop: &Stop) -> Result<String, Error> {
        let mut sampler = sampler.clone();
        let mut generated = Vec::new();
        while generated.len() < stop.max_tokens {
            let token = self.decode_step(&sampler).await?;
            sampler.seed = sampler.seed.map(|seed| seed.wrapping_add(1));
            if stop.eos_tokens.contains(&token) {
                break;
            }
            generated.push(token);
            if !stop.strings.is_empty() {
                let text = self.queue.detokenize(&generated)?;
                if let Some(cut) = stop.cut(&text) {
                    return Ok(cut.to_string());
                }
            }
        }
        self.queue.detokenize(&generated)
    }

    /// A copy of this context that can diverge from it: full pages are shared, the partly
    /// filled last page is copied (on the queue, after the writes before it).
    pub fn fork(&self) -> Result<Context, Error> {
        let page_size = self.queue.page_size();
        let mut pages = self.pages.clone();
        if self.last_len < page_size {
            if let Some(last) = pages.pop() {
                let copy = self.alloc_pages(1)?.remove(0);
                allocate::copy_kvpage(self.queue.raw(), last.id, copy.id, 0, 0, self.last_len)?;
                pages.push(copy);
            }
        }
        Ok(Context { queue: self.queue.clone(), pages, last_len: self.last_len,
                     committed: self.committed.clone(), pending: self.pending.clone(),
                     embeds: Vec::new(), output: None })
    }

    /// Enqueues one forward pass over `tokens`, writing the last token's final hidden
    /// state into `output` if given.
    fn forward(&mut self, tokens: &[u32], output: Option<Embed>) -> Result<(), Error> {
        let queue = self.queue.clone();
        let n = tokens.len() as u32;
        if self.embeds.len() < tokens.len() {
            let more = allocate::alloc_emb(queue.raw(), (tokens.len() - self.embeds.len()) as u32)?;
            self.embeds.extend(more);
        }

        let start = self.committed.len() as u32;
        let positions: Vec<u32> = (start..start + n).collect();
        let embeds = &self.embeds[..tokens.len()];
        input_text::embed_text(queue.raw(), tokens, &positions, embeds)?;

        let page_size = queue.page_size();
        let free = if self.pages.is_empty() { 0 } else { page_size - self.last_len };
        let new_pages = self.alloc_pages((n.saturating_sub(free) + page_size - 1) / page_size)?;
        let mut output_pages: Vec<KvPage> = if free > 0 { vec![self.pages.last().unwrap().id] } else { vec![] };
        output_pages.extend(new_pages.iter().map(|p| p.id));
        forward::forward(queue.raw(), ForwardPass {
            input_kv_pages: self.pages.iter().map(|p| p.id).collect(),
            input_kv_last_page_len: self.last_len,
            input_embeds: embeds.to_vec(),
            output_kv_pages: output_pages,
            output_kv_offset: if free > 0 { self.last_len } else { 0 },
            output_embeds: output.into_iter().collect(),
            output_token_indices: if output.is_some() { vec![n - 1] } else { vec![] },
            attention_mask: None,
        })?;

        self.pages.extend(new_pages);
        self.committed.extend_from_slice(tokens);
        self.last_len = self.committed.len() as u32 - (self.pages.len() as u32 - 1) * page_size;
        Ok(())
    }

    fn alloc_pages(&self, count: u32) -> Result<Vec<Rc<Page>>, Error> {
        let ids = allocate::alloc_kvpage(self.queue.raw(), count)?;
        Ok(ids.into_iter().map(|id| Rc::new(Page { id, queue: self.queue.clone() })).collect())
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        let embeds: Vec<Embed> = self.embeds.iter().copied().chain(self.output).collect();
        if !embeds.is_empty() {
            let _ = allocate::dealloc_emb(self.queue.raw(), &embeds);
        }
    }
}
