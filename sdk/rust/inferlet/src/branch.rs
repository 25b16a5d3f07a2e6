//! Fork/join: many continuations of one context, decoded together so they batch.
//!
//! `Context::fork` shares every page, but forks on one queue run one after another.
//! [`generate_branches`] instead decodes every branch in lockstep on the parent's queue:
//! each step enqueues one fused pass per branch (its input tokens in, its next token
//! drawn) before awaiting any, so the step is one batch (vertical batching: the passes
//! write different pages). Each branch reads the parent's full pages in place and writes
//! only its own: a copy of the parent's partial last page and the pages it grows into.
//!
//! A [`Branch`] holds the generated tokens, not a context; [`Branch::context`] rebuilds a
//! context from the parent (sharing its pages) when a branch is to be continued.

use std::rc::Rc;

use crate::bindings::forward::{self, ForwardPass};
use crate::bindings::inference::{self, Output};
use crate::bindings::types::{Error, ErrorKind, KvPage};
use crate::bindings::{allocate, input_text};
use crate::context::{check, output, pass_sampler};
use crate::executor::PassWait;
use crate::{Context, Queue, Sampler, Stop};

/// One finished continuation of a parent context.
#[derive(Clone, Debug)]
pub struct Branch {
    /// The tokens appended before generating (e.g. a per-branch instruction).
    pub suffix: Vec<u32>,
    /// The generated tokens (without an EOS token or a stop string).
    pub tokens: Vec<u32>,
    /// The generated text.
    pub text: String,
    /// The parent's length in tokens (committed and pending) when the branch was made.
    pub parent_len: usize,
}

impl Branch {
    /// The branch's whole sequence length: parent, suffix and generated tokens.
    pub fn len(&self) -> usize {
        self.parent_len + self.suffix.len() + self.tokens.len()
    }

    /// Whether the branch has no tokens at all (parent, suffix and generated).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A fork of `parent` (which must be the branch's parent, unchanged) continued with the
    /// branch's suffix and tokens, pending: its pages are the parent's, shared.
    pub fn context(&self, parent: &Context) -> Context {
        let mut ctx = parent.fork();
        ctx.fill_tokens(&self.suffix);
        ctx.fill_tokens(&self.tokens);
        ctx
    }
}

/// One branch being decoded: its own pages (after the parent's shared full ones), the
/// tokens to run next, and what it has generated.
struct Lane {
    pages: Vec<KvPage>,
    /// Token slots filled in the pages the lane reads (shared and own).
    slots: u32,
    /// The position of the next input token.
    position: u32,
    input: Vec<u32>,
    sampler: Sampler,
    tokens: Vec<u32>,
    done: bool,
}

/// The parent's pages as branches see them: the full ones (read in place) and the partial
/// last one (copied by each branch before writing); `len` slots in all, and the position
/// of the first new token.
struct Shared {
    full: Vec<KvPage>,
    partial: Option<(KvPage, u32)>,
    len: u32,
    position: u32,
}

fn shared(parent: &Context) -> Result<Shared, Error> {
    let page_size = parent.queue().page_size();
    let ids = parent.page_ids();
    let len = parent.committed().len() as u32;
    if ids.len() as u32 != (len + page_size - 1) / page_size {
        return Err(Error { kind: ErrorKind::InvalidArgument,
                           message: "branches need a parent whose pages hold every committed token (none dropped)".into() });
    }
    let rest = len % page_size;
    let full = if rest == 0 { ids.clone() } else { ids[..ids.len() - 1].to_vec() };
    let partial = if rest == 0 { None } else { Some((*ids.last().unwrap(), rest)) };
    Ok(Shared { full, partial, len, position: len })
}

/// Starts one lane per suffix: a copy of the parent's partial last page.
fn lanes(queue: &Queue, pending: &[u32], shared: &Shared, suffixes: &[Vec<u32>],
         samplers: &[Sampler]) -> Result<Vec<Lane>, Error> {
    let mut lanes = Vec::new();
    for (i, suffix) in suffixes.iter().enumerate() {
        let input = [pending, suffix.as_slice()].concat();
        if input.is_empty() {
            return Err(Error { kind: ErrorKind::InvalidArgument,
                               message: "a branch needs a pending token or a suffix to predict from".into() });
        }
        let mut pages = Vec::new();
        if let Some((page, used)) = shared.partial {
            let copy = allocate::alloc_kvpage(queue.raw(), 1)?[0];
            allocate::copy_kvpage(queue.raw(), page, copy, 0, 0, used)?;
            pages.push(copy);
        }
        let sampler = samplers[i.min(samplers.len() - 1)].clone();
        lanes.push(Lane { pages, slots: shared.len, position: shared.position, input, sampler,
                          tokens: Vec::new(), done: false });
    }
    Ok(lanes)
}

impl Lane {
    /// Enqueues one fused pass over the lane's input tokens at their positions, writing
    /// the lane's own pages, computing `out` at the last input token; the pass's id.
    fn pass(&mut self, queue: &Queue, shared: &Shared, out: Output) -> Result<u64, Error> {
        let page_size = queue.page_size();
        let n = self.input.len() as u32;
        let mut input_pages = shared.full.clone();
        input_pages.extend(&self.pages);
        let last_len = if input_pages.is_empty() { 0 } else { self.slots - (input_pages.len() as u32 - 1) * page_size };
        let free = if input_pages.is_empty() { 0 } else { page_size - last_len };
        let needed = n.saturating_sub(free).div_ceil(page_size);
        let new = if needed > 0 { allocate::alloc_kvpage(queue.raw(), needed)? } else { Vec::new() };
        let mut output_pages = if free > 0 { vec![*self.pages.last().unwrap()] } else { vec![] };
        output_pages.extend(&new);
        let id = inference::execute(queue.raw(), inference::ForwardPass {
            input_embeds: Vec::new(),
            input_tokens: self.input.clone(),
            positions: (self.position..self.position + n).collect(),
            input_kv_pages: input_pages,
            input_kv_last_page_len: last_len,
            output_kv_pages: output_pages,
            output_kv_offset: if free > 0 { last_len } else { 0 },
            attention_mask: None,
            outputs: vec![Output { index: n - 1, ..out }],
            stop_tokens: Vec::new(),
        });
        let id = match id {
            Ok(id) => id,
            Err(e) => {
                let _ = allocate::dealloc_kvpage(queue.raw(), &new);
                return Err(e);
            }
        };
        self.pages.extend(new);
        self.slots += n;
        self.position += n;
        Ok(id)
    }

    /// Frees the lane's pages (after the queue's earlier calls).
    fn release(&self, queue: &Queue) {
        let _ = allocate::dealloc_kvpage(queue.raw(), &self.pages);
    }
}

/// Runs one step of every lane still going, `out(lane)` at each: every pass is enqueued
/// before any is awaited, so the step is one batch. The results, per live lane.
async fn step(queue: &Rc<Queue>, shared: &Shared, lanes: &mut [Lane],
              out: impl Fn(&Lane) -> Output) -> Result<Vec<(usize, inference::PassResult)>, Error> {
    let mut ids = Vec::new();
    for (i, lane) in lanes.iter_mut().enumerate().filter(|(_, l)| !l.done) {
        let request = out(lane);
        ids.push((i, lane.pass(queue, shared, request)?));
    }
    let mut results = Vec::new();
    for (i, id) in ids {
        let result = PassWait { id, queue: queue.clone() }.await.pop().expect("a pass's results are never empty");
        check(&result)?;
        results.push((i, result));
    }
    Ok(results)
}

/// Generates one continuation of `parent` per entry of `suffixes` (tokens appended to the
/// parent's pending tokens for that branch; pass empty ones for n plain samples), all
/// decoded together. Branch i uses `samplers[i]` (the last one if fewer are given); a
/// seeded sampler uses seed + step, like `Context::generate`. The parent's committed
/// tokens are read in place: prefill them once first (`Context::flush`).
pub async fn generate_branches(parent: &Context, suffixes: &[Vec<u32>], samplers: &[Sampler],
                               stop: &Stop) -> Result<Vec<Branch>, Error> {
    let shared = shared(parent)?;
    run(parent.queue(), &shared, parent.pending(), suffixes, samplers, stop, parent.len()).await
}

/// Decodes one lane per suffix over `shared`, then frees the lanes' pages and embeds.
async fn run(queue: &Rc<Queue>, shared: &Shared, pending: &[u32], suffixes: &[Vec<u32>], samplers: &[Sampler],
             stop: &Stop, parent_len: usize) -> Result<Vec<Branch>, Error> {
    if samplers.is_empty() {
        return Err(Error { kind: ErrorKind::InvalidArgument, message: "no sampler given".into() });
    }
    let mut lanes = lanes(queue, pending, shared, suffixes, samplers)?;
    let result = decode(queue, shared, &mut lanes, stop).await;
    lanes.iter().for_each(|lane| lane.release(queue));
    result?;
    let mut branches = Vec::new();
    for (lane, suffix) in lanes.iter().zip(suffixes) {
        let mut text = queue.detokenize(&lane.tokens)?;
        if let Some(cut) = stop.cut(&text) {
            text = cut.to_string();
        }
        branches.push(Branch { suffix: suffix.clone(), tokens: lane.tokens.clone(), text, parent_len });
    }
    Ok(branches)
}

/// Generates after a context given as raw pages: `pages` are all full (padding slots
/// masked, e.g. by [`prefill_at`]) and read in place; `input` (at least one token) starts
/// at `position`. For contexts assembled from several exports (see `modular_caching`).
/// The branch's `parent_len` is the pages' slot count.
pub async fn generate_after_pages(queue: &Rc<Queue>, pages: &[KvPage], position: u32, input: &[u32],
                                  sampler: &Sampler, stop: &Stop) -> Result<Branch, Error> {
    let len = pages.len() as u32 * queue.page_size();
    let shared = Shared { full: pages.to_vec(), partial: None, len, position };
    let branches = run(queue, &shared, &[], &[input.to_vec()], &[sampler.clone()], stop, len as usize).await?;
    Ok(branches.into_iter().next().unwrap())
}

/// Runs `tokens` through the model at positions `position..` with no context before them,
/// into new pages whose unused last slots are masked: whole pages that can be placed
/// anywhere in another context's page list. The caller owns (and frees) the pages.
pub async fn prefill_at(queue: &Queue, tokens: &[u32], position: u32) -> Result<Vec<KvPage>, Error> {
    let page_size = queue.page_size();
    let n = tokens.len() as u32;
    if n == 0 {
        return Err(Error { kind: ErrorKind::InvalidArgument, message: "nothing to prefill".into() });
    }
    let pages = allocate::alloc_kvpage(queue.raw(), (n + page_size - 1) / page_size)?;
    let embeds = allocate::alloc_emb(queue.raw(), n)?;
    let positions: Vec<u32> = (position..position + n).collect();
    let result = async {
        input_text::embed_text(queue.raw(), tokens, &positions, &embeds)?;
        forward::forward(queue.raw(), ForwardPass {
            input_kv_pages: vec![], input_kv_last_page_len: 0, input_embeds: embeds.clone(),
            output_kv_pages: pages.clone(), output_kv_offset: 0, output_embeds: vec![],
            output_token_indices: vec![], attention_mask: None,
        })?;
        let used = (n - 1) % page_size + 1;
        if used < page_size {
            let mask: Vec<bool> = (0..page_size).map(|slot| slot >= used).collect();
            forward::mask_kvpage(queue.raw(), *pages.last().unwrap(), &mask)?;
        }
        queue.synchronize().await
    }.await;
    let _ = allocate::dealloc_emb(queue.raw(), &embeds);
    match result {
        Ok(()) => Ok(pages),
        Err(e) => {
            let _ = allocate::dealloc_kvpage(queue.raw(), &pages);
            Err(e)
        }
    }
}

async fn decode(queue: &Rc<Queue>, shared: &Shared, lanes: &mut [Lane], stop: &Stop) -> Result<(), Error> {
    for _ in 0..stop.max_tokens {
        let drawn = step(queue, shared, lanes, |lane| Output { sample: Some(pass_sampler(&lane.sampler)), ..output(0) }).await?;
        for (i, result) in drawn {
            let (lane, token) = (&mut lanes[i], result.tokens[0]);
            lane.sampler.seed = lane.sampler.seed.map(|s| s.wrapping_add(1));
            lane.input = vec![token];
            if stop.eos_tokens.contains(&token) {
                lane.done = true;
                continue;
            }
            lane.tokens.push(token);
            if !stop.strings.is_empty() && stop.cut(&queue.detokenize(&lane.tokens)?).is_some() {
                lane.done = true;
            }
        }
        if lanes.iter().all(|l| l.done) {
            break;
        }
    }
    Ok(())
}

/// The `k` most likely next tokens after `parent` + each suffix, one forward per suffix,
/// all batched: e.g. score candidate thoughts by the probability of a "yes" token.
pub async fn next_dists(parent: &Context, suffixes: &[Vec<u32>], k: u32) -> Result<Vec<(Vec<u32>, Vec<f32>)>, Error> {
    let queue = parent.queue().clone();
    let shared = shared(parent)?;
    let mut lanes = lanes(&queue, parent.pending(), &shared, suffixes, &[Sampler::greedy()])?;
    let result = step(&queue, &shared, &mut lanes, |_| Output { top_k: k, ..output(0) }).await;
    lanes.iter().for_each(|lane| lane.release(&queue));
    Ok(result?.into_iter().map(|(_, mut r)| {
        let detail = r.details.pop().expect("a top-k output has its detail");
        (detail.top_ids, detail.top_probs)
    }).collect())
}

/// The total probability of `words` (each tokenized with and without a leading space)
/// among a distribution from `next_dists`.
pub fn probability_of(queue: &Queue, dist: &(Vec<u32>, Vec<f32>), words: &[&str]) -> f32 {
    let mut wanted: Vec<u32> = Vec::new();
    for word in words {
        for form in [word.to_string(), format!(" {word}")] {
            if let [token] = queue.tokenize(&form)[..] {
                wanted.push(token);
            }
        }
    }
    wanted.sort_unstable();
    wanted.dedup();
    dist.0.iter().zip(&dist.1).filter(|(t, _)| wanted.contains(t)).map(|(_, p)| p).sum()
}
