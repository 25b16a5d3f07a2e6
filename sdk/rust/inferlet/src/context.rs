//! A token sequence and the KV pages that hold it.
//!
//! Bookkeeping: the context's tokens are `committed` (run through the model) followed by
//! `pending` (filled, not yet run). Token i sits at position i. The held pages store the
//! committed tokens' K/V in order, every page full except the last (`last_len` slots), and
//! each remembers the position of its first slot: pages can be dropped from the middle
//! (attention sink, windowed attention), so positions and slots can diverge.
//!
//! Pages are shared copy-on-write: `fork` shares every page, imported pages are shared with
//! other instances, and a forward pass that would write into a shared partial last page
//! copies it first. Only that partial last page is ever written, so full pages are never
//! copied.
//!
//! A context that `set_discardable` lets the server drop its pages while the inferlet waits
//! on I/O and the KV pool runs short (`control.kv_pressure`); the next pass that names one
//! fails with `discarded`, and the context computes its committed tokens again, in chunks,
//! and retries, so its caller sees only the time it took.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::bindings::forward::{self, ForwardPass};
use crate::bindings::inference::{self, Output, PassResult, PassStatus};
use crate::bindings::types::{Embed, Error, ErrorKind, KvPage};
use crate::bindings::memory::{self, KvClass};
use crate::bindings::{allocate, input_text, kvs};
use crate::executor::{claim, PassWait};
use crate::{ChatMessage, Queue, Sampler, Stop, TextStream};

/// A KV page, freed when the last context holding it drops it.
struct Page {
    id: KvPage,
    queue: Rc<Queue>,
    /// Exported or imported: other instances may read it, so never write it.
    foreign: Cell<bool>,
}

impl Drop for Page {
    fn drop(&mut self) {
        // Fails only if the id is already invalid, which this type rules out.
        let _ = allocate::dealloc_kvpage(self.queue.raw(), &[self.id]);
    }
}

/// A page held by a context: the page, the position of its first slot, and which of its
/// slots this context has masked out of attention.
#[derive(Clone)]
struct Held {
    page: Rc<Page>,
    first: u32,
    masked: Vec<bool>,
}

/// A sequence being generated: fill it with text or tokens, then decode.
pub struct Context {
    queue: Rc<Queue>,
    pages: Vec<Held>,
    last_len: u32,
    committed: Vec<u32>,
    pending: Vec<u32>,
    /// Input embeds, reused by every forward (the queue orders their reuse).
    embeds: Vec<Embed>,
    /// Output embeds, reused likewise: valid until the next forward of this context.
    outputs: Vec<Embed>,
    /// Fused passes enqueued without awaiting their result (prefill chunks): claimed, and
    /// their failure reported, when this context next awaits a pass.
    unclaimed: Vec<u64>,
    /// Its pages may be dropped under memory pressure and computed again (`set_discardable`).
    discardable: bool,
}

impl Context {
    /// An empty context whose calls go to `queue`.
    pub fn new(queue: Rc<Queue>) -> Context {
        Context { queue, pages: Vec::new(), last_len: 0, committed: Vec::new(), pending: Vec::new(),
                  embeds: Vec::new(), outputs: Vec::new(), unclaimed: Vec::new(), discardable: false }
    }

    /// The queue this context's calls go to.
    pub fn queue(&self) -> &Rc<Queue> {
        &self.queue
    }

    /// Every token of the sequence: committed, then pending.
    pub fn tokens(&self) -> Vec<u32> {
        [self.committed.as_slice(), self.pending.as_slice()].concat()
    }

    /// The tokens already run through the model (their K/V are in the pages).
    pub fn committed(&self) -> &[u32] {
        &self.committed
    }

    /// The tokens filled but not yet run through the model.
    pub fn pending(&self) -> &[u32] {
        &self.pending
    }

    /// How many tokens the sequence has, committed and pending.
    pub fn len(&self) -> usize {
        self.committed.len() + self.pending.len()
    }

    /// Whether the context holds no token, committed or pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many KV pages this context holds (shared pages count once per holder).
    pub fn num_pages(&self) -> usize {
        self.pages.len()
    }

    /// The host ids of the held pages, in order.
    pub fn page_ids(&self) -> Vec<KvPage> {
        self.pages.iter().map(|h| h.page.id).collect()
    }

    /// Lets the server drop this context's pages while the inferlet waits on I/O and the KV
    /// pool runs short (`memory.set-kv-class` discardable; off: swappable, the default). A
    /// pass that then names a dropped page makes the context compute its committed tokens
    /// again and retry: worth it where the wait is long and the context short (APIServe's
    /// trade-off, `control.kv_pressure = "min-waste"` weighs it per paused instance). Only
    /// a context whose tokens sit at positions 0.. in its own pages, none masked or
    /// dropped, can be recomputed exactly; for any other the pass fails with `discarded`.
    pub fn set_discardable(&mut self, on: bool) -> Result<(), Error> {
        self.discardable = on;
        let own: Vec<KvPage> = self.pages.iter().filter(|h| !h.page.foreign.get()).map(|h| h.page.id).collect();
        if own.is_empty() {
            return Ok(());
        }
        memory::set_kv_class(&own, if on { KvClass::Discardable } else { KvClass::Swappable })
    }

    /// Appends text (tokenized, no special tokens added).
    pub fn fill(&mut self, text: &str) {
        let tokens = self.queue.tokenize(text);
        self.pending.extend(tokens);
    }

    /// Appends `tokens` as pending (run by the next pass).
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
            self.execute(&tokens, None)?;
        }
        Ok(())
    }

    /// Runs every pending token through the model, returning an output embed holding the
    /// final hidden state at each of `indices` (indices into the pending tokens). The
    /// embeds stay valid until this context's next forward pass: sample or inspect them
    /// first (`Queue::sample`, `Queue::next_dist`).
    pub fn forward_pending(&mut self, indices: &[u32]) -> Result<Vec<Embed>, Error> {
        let tokens = std::mem::take(&mut self.pending);
        if indices.is_empty() {
            self.execute(&tokens, None)?;
            return Ok(Vec::new());
        }
        self.forward(&tokens, indices)
    }

    /// Runs the pending tokens, samples the next token on the host, and leaves it pending:
    /// one fused pass (`inference.execute`) and one blocking `take` — two host calls.
    pub async fn decode_step(&mut self, sampler: &Sampler) -> Result<u32, Error> {
        let result = self.step(Output { sample: Some(pass_sampler(sampler)), ..output(0) }).await?;
        let token = result.tokens[0];
        self.pending.push(token);
        Ok(token)
    }

    /// Runs the pending tokens and returns the `k` most likely next tokens with their
    /// probabilities, most likely first. Nothing is appended: `fill_tokens` the choice.
    pub async fn next_dist(&mut self, k: u32) -> Result<(Vec<u32>, Vec<f32>), Error> {
        let mut result = self.step(Output { top_k: k, ..output(0) }).await?;
        let detail = result.details.pop().ok_or_else(|| Error {
            kind: ErrorKind::InferenceFailed, message: "the pass returned no distribution".into() })?;
        Ok((detail.top_ids, detail.top_probs))
    }

    /// The log-probabilities of `candidates` as the next token after the context's tokens
    /// (committed and pending) followed by `then`: PrefillOnly's scoring path. One pass
    /// that writes no KV (its new tokens' keys and values live only for the pass), so the
    /// context is unchanged and any number of scores may run at once: enqueued when this
    /// is called, they share batches (`join_all` them). E.g. a profile flushed once, then
    /// `score(post_and_question, &[yes, no])` per post.
    ///
    /// Errors: `invalid-argument` for no candidates, nothing to score after, a candidate
    /// outside the vocabulary, or more new tokens (pending + `then`) than one pass takes.
    pub fn score(&self, then: &[u32], candidates: &[u32]) -> impl std::future::Future<Output = Result<Vec<f32>, Error>> {
        let pass = if candidates.is_empty() {
            Err(Error { kind: ErrorKind::InvalidArgument, message: "no candidate tokens to score".into() })
        } else {
            self.peek(then, Output { logprobs_of: candidates.to_vec(), ..output(0) })
        };
        async move {
            let mut detail = pass?.await?.details;
            detail.pop().map(|d| d.logprobs).ok_or_else(|| Error {
                kind: ErrorKind::InferenceFailed, message: "the pass returned no log-probabilities".into() })
        }
    }

    /// Draws the next token after the pending ones and returns it with the `k` most likely
    /// tokens and their probabilities (most likely first), in one pass that writes no KV:
    /// nothing is appended and the context is unchanged (a one-token completion with
    /// log-probabilities, as `/v1/completions` serves `max_tokens: 1`).
    pub fn peek_next(&self, sampler: &Sampler, k: u32) -> impl std::future::Future<Output = Result<(u32, Vec<u32>, Vec<f32>), Error>> {
        let pass = self.peek(&[], Output { sample: Some(pass_sampler(sampler)), top_k: k, ..output(0) });
        async move {
            let mut result = pass?.await?;
            let detail = result.details.pop().ok_or_else(|| Error {
                kind: ErrorKind::InferenceFailed, message: "the pass returned no distribution".into() })?;
            Ok((result.tokens[0], detail.top_ids, detail.top_probs))
        }
    }

    /// The log-probability of each pending token after the tokens before it, with the `k`
    /// most likely tokens there (most likely first): one pass over the pending tokens that
    /// writes no KV (the context is unchanged), so they must fit one pass. Entry i is for
    /// pending token i + 1; the first pending token gets none (as `echo` with `logprobs`
    /// on OpenAI's completions). Returns (log-probability, top ids, top probabilities).
    pub async fn prompt_logprobs(&self, k: u32) -> Result<Vec<(f32, Vec<u32>, Vec<f32>)>, Error> {
        let n = self.pending.len();
        if n < 2 {
            return Ok(Vec::new());
        }
        let outs = (0..n - 1).map(|i| Output { index: i as u32, top_k: k, logprobs_of: vec![self.pending[i + 1]],
                                              ..output(0) }).collect();
        let mut details = self.peek_outputs(&[], outs)?.await?.details;
        details.sort_by_key(|d| d.index);
        Ok(details.into_iter().map(|d| (d.logprobs[0], d.top_ids, d.top_probs)).collect())
    }

    /// Enqueues one pass over the pending tokens and `then` that writes no KV, with `out` at
    /// the last of them; its result, awaited.
    fn peek(&self, then: &[u32], mut out: Output) -> Result<impl std::future::Future<Output = Result<PassResult, Error>>, Error> {
        out.index = (self.pending.len() + then.len()).max(1) as u32 - 1;
        self.peek_outputs(then, vec![out])
    }

    /// `peek` with `outs` at the indices they name.
    pub(crate) fn peek_outputs(&self, then: &[u32], outs: Vec<Output>) -> Result<impl std::future::Future<Output = Result<PassResult, Error>>, Error> {
        let tokens: Vec<u32> = self.pending.iter().chain(then).copied().collect();
        if tokens.is_empty() {
            return Err(Error { kind: ErrorKind::InvalidArgument,
                               message: "nothing to predict from: fill the context or give tokens".into() });
        }
        let start = self.committed.len() as u32;
        let id = inference::execute(self.queue.raw(), inference::ForwardPass {
            input_embeds: Vec::new(),
            positions: (start..start + tokens.len() as u32).collect(),
            input_kv_pages: self.page_ids(),
            input_kv_last_page_len: self.last_len,
            output_kv_pages: Vec::new(),  // writes no KV
            output_kv_offset: 0,
            attention_mask: None,
            outputs: outs,
            stop_tokens: Vec::new(),
            input_tokens: tokens,
        })?;
        Ok(awaited(self.queue.clone(), id))
    }

    /// Runs every pending token, with `out` computed at the last of them; its result.
    pub(crate) async fn step(&mut self, mut out: Output) -> Result<PassResult, Error> {
        if self.pending.is_empty() {
            return Err(Error { kind: ErrorKind::InvalidArgument,
                               message: "no pending token to predict from; fill the context first".into() });
        }
        let tokens = std::mem::take(&mut self.pending);
        out.index = tokens.len() as u32 - 1;
        let id = self.execute(&tokens, Some(out))?;
        let mut results = PassWait { id, queue: self.queue.clone() }.await;
        self.claim_unclaimed()?;
        let result = results.pop().expect("a pass's results are never empty");
        check(&result)?;
        Ok(result)
    }

    /// Enqueues fused passes over `tokens` (appended to the committed ones): one, or one
    /// per chunk of at most the backend's max_batch_tokens; `out` at the last chunk. Earlier
    /// chunks' results are claimed later (`unclaimed`); the last pass's id is returned.
    fn execute(&mut self, tokens: &[u32], out: Option<Output>) -> Result<u64, Error> {
        let mut start = 0;
        loop {
            let size = (tokens.len() - start).min(chunk_limit() as usize);
            let end = start + size;
            let last = end == tokens.len();
            let outputs = match (&out, last) {
                (Some(o), true) => vec![Output { index: o.index - start as u32, ..o.clone() }],
                _ => Vec::new(),
            };
            match self.execute_chunk(&tokens[start..end], outputs) {
                Ok(id) if last => return Ok(id),
                Ok(id) => {
                    self.unclaimed.push(id);
                    start = end;
                }
                Err(e) if size > 1 && e.kind == ErrorKind::InvalidArgument && e.message.contains(LIMIT_NAME) => {
                    learn_limit(&e, size);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One fused pass over `tokens`, written after the committed tokens.
    fn execute_chunk(&mut self, tokens: &[u32], outputs: Vec<Output>) -> Result<u64, Error> {
        let mut recomputed = false;
        loop {
            let attempt = self.pass_over(tokens, tokens.len() as u32, outputs.clone(), Vec::new())
                .and_then(|(pass, new_pages)| Ok((inference::execute(self.queue.raw(), pass)?, new_pages)));
            match attempt {
                Ok((id, new_pages)) => {
                    self.commit(tokens, new_pages);
                    return Ok(id);
                }
                Err(e) if !recomputed && self.lost(&e) => {
                    self.recompute()?;
                    recomputed = true;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The server dropped pages of this discardable context (`set_discardable`).
    fn lost(&self, e: &Error) -> bool {
        self.discardable && e.kind == ErrorKind::Discarded
    }

    /// Computes the committed tokens again into new pages (their old ones were dropped):
    /// chunked passes, claimed at the next await like a prefill's.
    fn recompute(&mut self) -> Result<(), Error> {
        let page_size = self.queue.page_size();
        let exact = self.pages.iter().enumerate().all(|(i, h)| {
            h.first == i as u32 * page_size && !h.page.foreign.get() && !h.masked.iter().any(|&m| m)
        });
        if !exact {
            return Err(Error { kind: ErrorKind::Discarded, message: "the server dropped this context's \
                pages, and they cannot be computed again exactly (pages were masked, dropped or \
                imported)".into() });
        }
        let tokens = std::mem::take(&mut self.committed);
        self.pages.clear();
        self.last_len = 0;
        if !tokens.is_empty() {
            let id = self.execute(&tokens, None)?;
            self.unclaimed.push(id);
        }
        Ok(())
    }

    /// The pass record writing `tokens` after the committed ones, into pages with room for
    /// `room` tokens (the partial last page, copied first if shared, then new pages).
    fn pass_over(&mut self, tokens: &[u32], room: u32, outputs: Vec<Output>,
                 stop_tokens: Vec<u32>) -> Result<(inference::ForwardPass, Vec<Rc<Page>>), Error> {
        let page_size = self.queue.page_size();
        let free = if self.pages.is_empty() { 0 } else { page_size - self.last_len };
        if free > 0 {
            self.make_exclusive(self.pages.len() - 1)?;
        }
        let needed = room.saturating_sub(free);
        let new_pages = if needed > 0 { self.alloc_pages(needed.div_ceil(page_size))? } else { Vec::new() };
        let mut output_pages: Vec<KvPage> = if free > 0 { vec![self.pages.last().unwrap().page.id] } else { vec![] };
        output_pages.extend(new_pages.iter().map(|p| p.id));
        let start = self.committed.len() as u32;
        Ok((inference::ForwardPass {
            input_embeds: Vec::new(),
            input_tokens: tokens.to_vec(),
            positions: (start..start + tokens.len() as u32).collect(),
            input_kv_pages: self.page_ids(),
            input_kv_last_page_len: self.last_len,
            output_kv_pages: output_pages,
            output_kv_offset: if free > 0 { self.last_len } else { 0 },
            attention_mask: None,
            outputs,
            stop_tokens,
        }, new_pages))
    }

    /// Records `tokens` as written after the committed ones, keeping the new pages they
    /// reached (the rest are released).
    fn commit(&mut self, tokens: &[u32], new_pages: Vec<Rc<Page>>) {
        let page_size = self.queue.page_size();
        let n = tokens.len() as u32;
        let free = if self.pages.is_empty() { 0 } else { page_size - self.last_len };
        let first_new = self.committed.len() as u32 + free.min(n);
        let used = n.saturating_sub(free).div_ceil(page_size) as usize;
        for (i, page) in new_pages.into_iter().take(used).enumerate() {
            self.pages.push(Held { page, first: first_new + i as u32 * page_size,
                                   masked: vec![false; page_size as usize] });
        }
        self.committed.extend_from_slice(tokens);
        if let Some(last) = self.pages.last() {
            self.last_len = self.committed.len() as u32 - last.first;
        }
    }

    /// Claims the results of earlier passes enqueued without awaiting them (they ran before
    /// the pass just awaited: a queue's passes run in order); reports the first failure.
    fn claim_unclaimed(&mut self) -> Result<(), Error> {
        let mut failure = None;
        self.unclaimed.retain(|&id| match claim(id) {
            Some(results) => {
                if failure.is_none() {
                    failure = results.iter().find_map(|r| check(r).err());
                }
                false
            }
            None => true,
        });
        failure.map_or(Ok(()), Err)
    }

    /// Decodes until `stop`, returning the generated text (without the EOS token or the
    /// stop string). With a seeded sampler, step i uses seed + i.
    ///
    /// The decoding runs on the host (`Context::run`): the next step is queued by the
    /// reply to the last one, without waiting for this inferlet, which is woken per token
    /// only when stop strings must be checked. Runs are at most `RUN_STEPS` long, so a
    /// large `max_tokens` does not reserve the whole KV pool at once.
    pub async fn generate(&mut self, sampler: &Sampler, stop: &Stop) -> Result<String, Error> {
        let mut sampler = sampler.clone();
        let mut generated: Vec<u32> = Vec::new();
        let mut text = TextStream::new(&self.queue); // what stop strings are looked for in
        while generated.len() < stop.max_tokens {
            let steps = (stop.max_tokens - generated.len()).min(RUN_STEPS) as u32;
            let mut run = self.run(&sampler, steps, &stop.eos_tokens, !stop.strings.is_empty())?;
            let mut cut = None;
            while run.next().await?.is_some() {
                if cut.is_none() && !stop.strings.is_empty() {
                    let visible: Vec<u32> = generated.iter().chain(run.drawn()).copied()
                        .take_while(|t| !stop.eos_tokens.contains(t)).collect();
                    text.push(&visible[text.tokens().len()..])?;
                    cut = stop.cut(text.text()).map(str::to_string);
                    if cut.is_some() {
                        run.cancel()?;
                    }
                }
            }
            let drawn = run.finish()?;
            sampler.seed = sampler.seed.map(|seed| seed.wrapping_add(drawn.len() as u64));
            if let Some(text) = cut {
                return Ok(text);
            }
            for token in drawn {
                if stop.eos_tokens.contains(&token) {
                    return self.queue.detokenize(&generated);
                }
                generated.push(token);
            }
        }
        self.queue.detokenize(&generated)
    }

    /// Starts a host-side decode run (`inference.run`): the pending tokens, then up to
    /// `steps` tokens drawn with `sampler` (a seeded one uses seed + i at step i), each fed
    /// back by the host, ending early after any of `stop_tokens` (which is returned). With
    /// `streaming`, `Run::next` returns the tokens as each step draws them; without, once,
    /// at the end (the inferlet is not woken per token). Call `Run::finish` at the end.
    pub fn run(&mut self, sampler: &Sampler, steps: u32, stop_tokens: &[u32], streaming: bool) -> Result<Run<'_>, Error> {
        self.start_run(sampler, steps, stop_tokens, streaming, None, None, None)
    }

    /// `run` with every draw masked by a grammar, which the host advances over each drawn
    /// token (`Context::run_constrained` in grammar.rs).
    pub(crate) fn start_run(&mut self, sampler: &Sampler, steps: u32, stop_tokens: &[u32], streaming: bool,
                            grammar: Option<inference::GrammarMask>, rules: Option<inference::LogitRules>,
                            echo: Option<inference::TextEcho>) -> Result<Run<'_>, Error> {
        if self.pending.is_empty() || steps == 0 {
            return Err(Error { kind: ErrorKind::InvalidArgument,
                               message: "a run needs a pending token to predict from and at least one step".into() });
        }
        let mut tokens = std::mem::take(&mut self.pending);
        let mut recomputed = false;
        loop {
            if tokens.len() > chunk_limit() as usize {  // a long prompt: prefill all but the end
                let tail = tokens.split_off(tokens.len() - 1);
                if let Err(e) = self.execute(&tokens, None) {
                    self.pending = [tokens, tail].concat();
                    return Err(e);
                }
                tokens = tail;
            }
            let n = tokens.len() as u32;
            let out = Output { index: n - 1, sample: Some(pass_sampler(sampler)), grammar: grammar.clone(),
                               rules: rules.clone(), ..output(0) };
            let started = self.pass_over(&tokens, n + steps - 1, vec![out], stop_tokens.to_vec())
                .and_then(|(pass, new_pages)| {
                    let id = match &echo {
                        Some(e) => inference::run_text(self.queue.raw(), pass, steps, e.clone())?,
                        None => inference::run(self.queue.raw(), pass, steps, streaming)?,
                    };
                    Ok((id, new_pages))
                });
            match started {
                Ok((id, new_pages)) => {
                    return Ok(Run { ctx: self, id, tokens, new_pages, drawn: Vec::new(), done: false });
                }
                // The host refused the first step as too long: learn its limit, chunk, retry.
                Err(e) if n > 1 && e.kind == ErrorKind::InvalidArgument && e.message.contains(LIMIT_NAME) => {
                    learn_limit(&e, n as usize);
                }
                Err(e) if !recomputed && self.lost(&e) => {
                    recomputed = true;
                    if let Err(e) = self.recompute() {
                        self.pending = tokens;
                        return Err(e);
                    }
                }
                Err(e) => {
                    self.pending = tokens;
                    return Err(e);
                }
            }
        }
    }

    /// A copy of this context that can diverge from it. Every page is shared; whichever
    /// context next writes the shared partial last page copies it first. The fork uses the
    /// same queue, so its calls are ordered with the original's; to decode many
    /// continuations at once (batched), use `branch::generate_branches`.
    pub fn fork(&self) -> Context {
        self.fork_on(self.queue.clone())
    }

    /// A fork whose calls go to `queue` instead (another queue of the same instance), so
    /// that it runs concurrently with this context. Queues do not order each other's
    /// calls: await `self.queue().synchronize()` after this context's last write first.
    pub fn fork_on(&self, queue: Rc<Queue>) -> Context {
        Context { queue, pages: self.pages.clone(), last_len: self.last_len,
                  committed: self.committed.clone(), pending: self.pending.clone(),
                  embeds: Vec::new(), outputs: Vec::new(), unclaimed: Vec::new(),
                  discardable: self.discardable }
    }

    /// `n` forks of this context.
    pub fn fork_n(&self, n: usize) -> Vec<Context> {
        (0..n).map(|_| self.fork()).collect()
    }

    /// Forgets every token from position `len` on (committed or pending), e.g. rejected
    /// draft tokens. Pages left empty are released; the slots past the new end of the last
    /// page are overwritten by the next forward.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len() {
            return;
        }
        if len >= self.committed.len() {
            self.pending.truncate(len - self.committed.len());
            return;
        }
        self.pending.clear();
        self.committed.truncate(len);
        let len = len as u32;
        while let Some(last) = self.pages.last() {
            if last.first < len {
                break;
            }
            self.pages.pop();
        }
        self.last_len = match self.pages.last() {
            Some(last) => len - last.first,
            None => 0,
        };
        // The backend clears a slot's mask bit when the slot is written again.
        let last_len = self.last_len as usize;
        if let Some(last) = self.pages.last_mut() {
            last.masked[last_len..].iter_mut().for_each(|m| *m = false);
        }
    }

    /// Hides the committed tokens at positions `[start, end)` from attention (for every
    /// later forward of this context), or shows them again with `masked = false`.
    /// Positions whose pages were dropped are skipped.
    pub fn mask_range(&mut self, start: u32, end: u32, masked: bool) -> Result<(), Error> {
        let end = end.min(self.committed.len() as u32);
        let page_size = self.queue.page_size();
        for index in 0..self.pages.len() {
            let held = &self.pages[index];
            let (lo, hi) = (start.max(held.first), end.min(held.first + page_size));
            if lo >= hi || held.masked[(lo - held.first) as usize..(hi - held.first) as usize]
                .iter().all(|&m| m == masked) {
                continue;
            }
            self.make_exclusive(index)?;
            let held = &mut self.pages[index];
            for slot in lo - held.first..hi - held.first {
                held.masked[slot as usize] = masked;
            }
            forward::mask_kvpage(self.queue.raw(), held.page.id, &held.masked)?;
        }
        Ok(())
    }

    /// Releases every page but the last whose filled slots are all masked: they can no
    /// longer influence generation. Returns how many pages were dropped.
    pub fn drop_masked_pages(&mut self) -> usize {
        let before = self.pages.len();
        let last = before.saturating_sub(1);
        let mut index = 0;
        self.pages.retain(|held| {
            let keep = index == last || !held.masked.iter().all(|&m| m);
            index += 1;
            keep
        });
        before - self.pages.len()
    }

    /// Keeps only the first `first` and the last `last` tokens (counting pending ones) in
    /// view: masks the rest and releases the pages left fully hidden (attention sinks,
    /// sliding windows). Returns how many pages were released.
    pub fn keep_only(&mut self, first: u32, last: u32) -> Result<usize, Error> {
        let len = self.len() as u32;
        if len > first + last {
            self.mask_range(first, len - last, true)?;
        }
        Ok(self.drop_masked_pages())
    }

    /// Publishes the committed tokens' pages under `name` for other instances (and later
    /// launches with `persistent`), with the tokens themselves in the key-value store, so
    /// that `Context::import` can rebuild the context. Waits for pending writes first. The
    /// exported pages become read-only: appending afterwards copies the partial last page.
    pub async fn export(&self, name: &str, persistent: bool) -> Result<(), Error> {
        if self.pages.is_empty() {
            return Err(Error { kind: ErrorKind::InvalidArgument,
                               message: "nothing to export: no committed tokens (flush first)".into() });
        }
        self.queue.synchronize().await?;
        allocate::export_kvpage(&self.page_ids(), name, persistent)?;
        self.pages.iter().for_each(|h| h.page.foreign.set(true)); // now read-only for us too
        let starts: Vec<String> = self.pages.iter().map(|h| h.first.to_string()).collect();
        let tokens: Vec<String> = self.committed.iter().map(|t| t.to_string()).collect();
        let record = format!("{}|{}|{}", self.last_len, starts.join(","), tokens.join(","));
        if let Err(e) = kvs::store_set(&export_key(name), &record) {
            let _ = allocate::unexport_kvpage(name);
            return Err(e);
        }
        Ok(())
    }

    /// A context holding an export's pages and tokens (see `export`), or `None` if there is
    /// no such export. Its pages are shared read-only: appending copies the last page.
    pub fn import(queue: Rc<Queue>, name: &str) -> Result<Option<Context>, Error> {
        let Some(record) = kvs::store_get(&export_key(name)) else { return Ok(None) };
        let ids = match allocate::import_kvpage(name) {
            Ok(ids) => ids,
            Err(e) if e.kind == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let corrupt = || Error { kind: ErrorKind::InvalidArgument,
                                 message: format!("export {name:?}: malformed token record") };
        let mut parts = record.splitn(3, '|');
        let last_len: u32 = parts.next().and_then(|s| s.parse().ok()).ok_or_else(corrupt)?;
        let numbers = |s: Option<&str>| -> Option<Vec<u32>> {
            s?.split(',').filter(|x| !x.is_empty()).map(|x| x.parse().ok()).collect()
        };
        let starts = numbers(parts.next()).ok_or_else(corrupt)?;
        let committed = numbers(parts.next()).ok_or_else(corrupt)?;
        let page_size = queue.page_size() as usize;
        let pages: Vec<Held> = ids.iter().zip(&starts).map(|(&id, &first)| Held {
            page: Rc::new(Page { id, queue: queue.clone(), foreign: Cell::new(true) }),
            first, masked: vec![false; page_size] }).collect();
        if pages.len() != ids.len() {
            return Err(corrupt());
        }
        Ok(Some(Context { queue, pages, last_len, committed, pending: Vec::new(),
                          embeds: Vec::new(), outputs: Vec::new(), unclaimed: Vec::new(), discardable: false }))
    }

    /// Removes an export made by `export` (pages already imported stay valid).
    pub fn unexport(name: &str) -> Result<(), Error> {
        kvs::store_delete(&export_key(name));
        allocate::unexport_kvpage(name)
    }

    /// Enqueues the forward passes over `tokens` (appended to the committed tokens), with an
    /// output embed at each of `indices`: one pass, or, for a prompt longer than the
    /// backend's max_batch_tokens, one pass per chunk of at most that many tokens (each chunk
    /// attends to the ones before it through the pages, so the result is the same sequence).
    fn forward(&mut self, tokens: &[u32], indices: &[u32]) -> Result<Vec<Embed>, Error> {
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        if self.outputs.len() < indices.len() {
            let more = allocate::alloc_emb(self.queue.raw(), (indices.len() - self.outputs.len()) as u32)?;
            self.outputs.extend(more);
        }
        let outputs = self.outputs[..indices.len()].to_vec();
        let mut start = 0;
        let mut recomputed = false;
        while start < tokens.len() {
            let size = tokens.len().min(start + chunk_limit() as usize) - start;
            let end = start + size;
            let (mut chunk_indices, mut chunk_outputs) = (Vec::new(), Vec::new());
            for (&index, &output) in indices.iter().zip(&outputs) {
                if (start..end).contains(&(index as usize)) {
                    chunk_indices.push(index - start as u32);
                    chunk_outputs.push(output);
                }
            }
            match self.forward_chunk(&tokens[start..end], &chunk_indices, chunk_outputs) {
                Ok(()) => start = end,
                // The host refused the chunk before running anything: learn its limit, retry.
                Err(e) if size > 1 && e.kind == ErrorKind::InvalidArgument && e.message.contains(LIMIT_NAME) => {
                    learn_limit(&e, size);
                }
                Err(e) if !recomputed && self.lost(&e) => {
                    self.recompute()?;
                    recomputed = true;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(outputs)
    }

    /// Enqueues one forward pass over `tokens` (at most the backend's max_batch_tokens).
    /// Fails before changing anything if the host refuses the embedding of `tokens`.
    fn forward_chunk(&mut self, tokens: &[u32], indices: &[u32], outputs: Vec<Embed>) -> Result<(), Error> {
        let queue = self.queue.clone();
        let n = tokens.len() as u32;
        if self.embeds.len() < tokens.len() {
            let more = allocate::alloc_emb(queue.raw(), (tokens.len() - self.embeds.len()) as u32)?;
            self.embeds.extend(more);
        }

        let start = self.committed.len() as u32;
        let positions: Vec<u32> = (start..start + n).collect();
        let embeds = self.embeds[..tokens.len()].to_vec();
        input_text::embed_text(queue.raw(), tokens, &positions, &embeds)?;

        let page_size = queue.page_size();
        let free = if self.pages.is_empty() { 0 } else { page_size - self.last_len };
        if free > 0 {
            self.make_exclusive(self.pages.len() - 1)?;
        }
        let new_pages = self.alloc_pages((n.saturating_sub(free) + page_size - 1) / page_size)?;
        let mut output_pages: Vec<KvPage> = if free > 0 { vec![self.pages.last().unwrap().page.id] } else { vec![] };
        output_pages.extend(new_pages.iter().map(|p| p.id));
        forward::forward(queue.raw(), ForwardPass {
            input_kv_pages: self.page_ids(),
            input_kv_last_page_len: self.last_len,
            input_embeds: embeds,
            output_kv_pages: output_pages,
            output_kv_offset: if free > 0 { self.last_len } else { 0 },
            output_embeds: outputs,
            output_token_indices: indices.to_vec(),
            attention_mask: None,
        })?;

        let first_new = start + free.min(n);
        for (i, page) in new_pages.into_iter().enumerate() {
            self.pages.push(Held { page, first: first_new + i as u32 * page_size,
                                   masked: vec![false; page_size as usize] });
        }
        self.committed.extend_from_slice(tokens);
        self.last_len = self.committed.len() as u32 - self.pages.last().unwrap().first;
        if self.embeds.len() > KEPT_EMBEDS {
            // A prefill's input embeds are not needed for decoding: hand them back (after this
            // forward, the queue orders it), so hundreds of contexts fit in the embed pool.
            let extra = self.embeds.split_off(KEPT_EMBEDS);
            allocate::dealloc_emb(queue.raw(), &extra)?;
        }
        Ok(())
    }

    /// Makes sure the page at `index` is written by no one else, copying it if it is
    /// shared with a fork or imported.
    fn make_exclusive(&mut self, index: usize) -> Result<(), Error> {
        let page = self.pages[index].page.clone();
        if Rc::strong_count(&page) == 2 && !page.foreign.get() {
            return Ok(()); // held by this context (and `page` above) only
        }
        let page_size = self.queue.page_size();
        let len = if index + 1 == self.pages.len() { self.last_len } else { page_size };
        let copy = self.alloc_pages(1)?.remove(0);
        allocate::copy_kvpage(self.queue.raw(), page.id, copy.id, 0, 0, len)?;
        self.pages[index].page = copy;
        Ok(())
    }

    fn alloc_pages(&self, count: u32) -> Result<Vec<Rc<Page>>, Error> {
        if count == 0 {
            return Ok(Vec::new());
        }
        let ids = allocate::alloc_kvpage(self.queue.raw(), count)?;
        let pages = ids.iter().map(|&id| Rc::new(Page { id, queue: self.queue.clone(), foreign: Cell::new(false) })).collect();
        if self.discardable {
            memory::set_kv_class(&ids, KvClass::Discardable)?;  // on error the pages are freed
        }
        Ok(pages)
    }
}

/// A host-side decode run of a context (`Context::run`): its tokens as they are drawn.
pub struct Run<'a> {
    ctx: &'a mut Context,
    id: u64,
    /// The run's input tokens (the context's pending ones when it started).
    tokens: Vec<u32>,
    /// Pages reserved for the run; `finish` keeps those it reached.
    new_pages: Vec<Rc<Page>>,
    drawn: Vec<u32>,
    done: bool,
}

impl Run<'_> {
    /// The tokens drawn since the last call (at least one), or `None` once the run ended.
    pub async fn next(&mut self) -> Result<Option<Vec<u32>>, Error> {
        if self.done {
            return Ok(None);
        }
        let mut fresh = Vec::new();
        let results = PassWait { id: self.id, queue: self.ctx.queue.clone() }.await;
        for result in results {
            fresh.extend_from_slice(&result.tokens);
            self.done |= result.status != PassStatus::Running;
            if result.status == PassStatus::Failed {
                self.drawn.extend_from_slice(&fresh);
                return check(&result).map(|_| None);
            }
        }
        self.drawn.extend_from_slice(&fresh);
        Ok(Some(fresh))
    }

    /// The context's queue (its tokenizer, while the run borrows the context).
    pub fn queue(&self) -> &Rc<Queue> {
        &self.ctx.queue
    }

    /// Every token drawn so far.
    pub fn drawn(&self) -> &[u32] {
        &self.drawn
    }

    /// Stops the run after the step in flight; its tokens still come through `next`.
    pub fn cancel(&mut self) -> Result<(), Error> {
        if self.done { Ok(()) } else { inference::cancel(self.ctx.queue.raw(), self.id) }
    }

    /// Ends the run (after `next` returned `None`): the context now holds its input and
    /// every drawn token but the last, which stays pending. Returns the drawn tokens.
    pub fn finish(self) -> Result<Vec<u32>, Error> {
        assert!(self.done, "Run::finish before the run ended (call next until it returns None)");
        let Run { ctx, mut tokens, new_pages, drawn, .. } = self;
        ctx.claim_unclaimed()?;
        let Some(&last) = drawn.last() else {
            return Err(Error { kind: ErrorKind::InferenceFailed, message: "the run drew no token".into() });
        };
        tokens.extend_from_slice(&drawn[..drawn.len() - 1]);
        ctx.commit(&tokens, new_pages);
        ctx.pending.push(last);
        Ok(drawn)
    }
}

/// Input embeds a context keeps between forwards (decode steps and short drafts need few).
const KEPT_EMBEDS: usize = 16;

/// The most steps of one host-side run (`generate`): its pages are reserved up front.
const RUN_STEPS: usize = 256;

/// An output request at new token `index` that computes nothing yet.
pub(crate) fn output(index: u32) -> Output {
    Output { index, sample: None, top_k: 0, logprobs_of: Vec::new(), entropy: false, allowed: None,
             grammar: None, rules: None, keep: None }
}

pub(crate) fn pass_sampler(s: &Sampler) -> inference::Sampler {
    inference::Sampler { temperature: s.temperature, top_k: s.top_k, top_p: s.top_p, min_p: 0.0, seed: s.seed }
}

/// A failed pass's error.
/// The final result of pass `id` on `queue`, checked (a failed pass is its error).
pub(crate) async fn awaited(queue: Rc<Queue>, id: u64) -> Result<PassResult, Error> {
    let result = PassWait { id, queue }.await.pop().expect("a pass's results are never empty");
    check(&result)?;
    Ok(result)
}

pub(crate) fn check(result: &PassResult) -> Result<(), Error> {
    match (&result.status, &result.failure) {
        (PassStatus::Failed, Some(e)) => Err(e.clone()),
        (PassStatus::Failed, None) => Err(Error { kind: ErrorKind::InferenceFailed,
                                                  message: format!("pass {} failed", result.pass) }),
        _ => Ok(()),
    }
}

/// The host refused a chunk as too long: remember its limit (from its message, or half).
fn learn_limit(e: &Error, size: usize) {
    let told = e.message.split(LIMIT_NAME).nth(1)
        .map(|rest| rest.trim_start_matches([' ', '=']))
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next()?.parse::<u32>().ok());
    CHUNK_LIMIT.store(told.unwrap_or(size as u32 / 2).clamp(1, size as u32 - 1), Ordering::Relaxed);
}

/// The most tokens `Context` runs in one forward pass. The host API does not tell the
/// backend's max_batch_tokens, so this starts at its default (4096: every prompt that fits
/// runs in one pass, exactly as it would unchunked) and drops to the host's limit the first
/// time the host refuses a pass as too long (its error names the limit). One per instance.
static CHUNK_LIMIT: AtomicU32 = AtomicU32::new(4096);

/// The name the host's too-many-tokens error gives the limit.
const LIMIT_NAME: &str = "max_batch_tokens";

fn chunk_limit() -> u32 {
    CHUNK_LIMIT.load(Ordering::Relaxed).max(1)
}

fn export_key(name: &str) -> String {
    format!("pie.context-export.{name}")
}

impl Drop for Context {
    fn drop(&mut self) {
        let embeds: Vec<Embed> = self.embeds.iter().chain(&self.outputs).copied().collect();
        if !embeds.is_empty() {
            let _ = allocate::dealloc_emb(self.queue.raw(), &embeds);
        }
    }
}
