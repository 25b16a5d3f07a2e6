//! Semantic variables (Parrot, OSDI '24) as a library: an application's LLM calls declared
//! as prompt templates with named slots, run inside one inferlet.
//!
//! A `Template` is text with `{{input:name}}` slots, filled from variables, and
//! `{{output:name}}` slots, generated. `Pipeline::call` binds a template's inputs to
//! variables (`Var`) and returns its outputs as new variables at once: the call runs as a
//! concurrent task as soon as its inputs have values, so a chain or a map-reduce is
//! declared up front and runs with no client round trip between its calls. Independent
//! calls run at once, each on its own queue, and their forward passes batch together.
//!
//! What Parrot's server deduces from the graph, the pipeline does here:
//! - `Pipeline::get(var, objective)` marks every call `var` still waits on (its producers,
//!   theirs, and so on) with the objective, so a latency-critical chain is scheduled
//!   before bulk work (`scheduling.set-queue-objective`);
//! - calls of templates with the same static prefix (the text before the first slot)
//!   share its KV: it is filled once and each call forks it (`Context::fork_on`); with
//!   `Pipeline::share_prefixes`, under a named export that other instances import. A
//!   call's prompt is still tokenized whole (the fork keeps the prefix tokens that begin
//!   it), so its output is what the same prompt text sent as one request gives.
//!
//! Errors are found before any model call where they can be: a malformed template, a
//! binding missing or extra, a variable of another pipeline. A call that fails (a host
//! error) fails its outputs with the cause, and every call that reads them fails in turn,
//! dropping its context (its pages go back).

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Poll, Waker};

use crate::executor::spawn;
use crate::{Context, Model, Objective, Queue, Sampler, Stop};

#[derive(Clone, Debug, PartialEq)]
enum Part {
    Text(String),
    Input(String),
    Output(String),
}

/// A prompt with named slots: `{{input:name}}` and `{{output:name}}` (names of letters,
/// digits and `_`; each output named once; at least one output).
#[derive(Clone, Debug)]
pub struct Template {
    parts: Vec<Part>,
}

impl Template {
    /// A template from text with `{{input:name}}` and `{{output:name}}` slots.
    pub fn parse(source: &str) -> Result<Template, String> {
        let mut parts = Vec::new();
        let mut outputs = HashSet::new();
        let mut rest = source;
        while let Some(open) = rest.find("{{") {
            if open > 0 {
                parts.push(Part::Text(rest[..open].to_string()));
            }
            let at = source.len() - rest.len() + open;
            let after = &rest[open + 2..];
            let close = after.find("}}").ok_or(format!("template: the slot at byte {at} is not closed with \"}}}}\""))?;
            let slot = &after[..close];
            let (kind, name) = slot.split_once(':').ok_or(format!(
                "template: slot {{{{{slot}}}}} at byte {at} must be {{{{input:NAME}}}} or {{{{output:NAME}}}}"))?;
            let name = name.trim();
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(format!("template: slot name {name:?} at byte {at} must be letters, digits and _"));
            }
            parts.push(match kind.trim() {
                "input" => Part::Input(name.to_string()),
                "output" if outputs.insert(name.to_string()) => Part::Output(name.to_string()),
                "output" => return Err(format!("template: output {name:?} appears twice")),
                other => return Err(format!("template: unknown slot kind {other:?} at byte {at} (input or output)")),
            });
            rest = &after[close + 2..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_string()));
        }
        if outputs.is_empty() {
            return Err("template: no {{output:NAME}} slot, so a call would generate nothing".into());
        }
        Ok(Template { parts })
    }

    /// A template in the model's chat format: `user` (slots allowed) as the user's turn,
    /// the assistant's reply generated into output `output`. The chat template's opening
    /// (a system prompt, say) is static prefix, shared by every call.
    pub fn chat(queue: &Queue, user: &str, output: &str) -> Result<Template, String> {
        let rendered = queue.apply_chat_template(&[crate::chat("user", user)], true).map_err(|e| e.message)?;
        Template::parse(&format!("{rendered}{{{{output:{output}}}}}"))
    }

    /// The names of its input slots, each once, in order of first appearance.
    pub fn inputs(&self) -> Vec<&str> {
        let mut seen = HashSet::new();
        self.parts.iter().filter_map(|p| match p {
            Part::Input(n) if seen.insert(n.as_str()) => Some(n.as_str()),
            _ => None,
        }).collect()
    }

    /// The names of its output slots, in order: the order of `Pipeline::call`'s result.
    pub fn outputs(&self) -> Vec<&str> {
        self.parts.iter().filter_map(|p| match p { Part::Output(n) => Some(n.as_str()), _ => None }).collect()
    }

    /// The text before the first slot, which every call of the template shares.
    pub fn static_prefix(&self) -> &str {
        match self.parts.first() {
            Some(Part::Text(t)) => t,
            _ => "",
        }
    }
}

enum State {
    Pending(Vec<Waker>),
    Ready(String),
    Failed(String),
}

struct Cell {
    name: String,
    pipeline: *const (),
    state: RefCell<State>,
    /// The call that produces it (none for an input): where `get` sets objectives.
    producer: Option<Rc<CallNode>>,
}

/// A semantic variable: a value given now (`Pipeline::input`) or produced by a call.
#[derive(Clone)]
pub struct Var(Rc<Cell>);

impl Var {
    fn new(name: &str, pipeline: *const (), state: State, producer: Option<Rc<CallNode>>) -> Var {
        Var(Rc::new(Cell { name: name.to_string(), pipeline, state: RefCell::new(state), producer }))
    }

    /// The variable's name (its slot's).
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// Its value, if it has one yet.
    pub fn value(&self) -> Option<String> {
        match &*self.0.state.borrow() {
            State::Ready(v) => Some(v.clone()),
            _ => None,
        }
    }

    fn settle(&self, result: Result<String, String>) {
        let old = std::mem::replace(&mut *self.0.state.borrow_mut(),
                                    match result { Ok(v) => State::Ready(v), Err(e) => State::Failed(e) });
        if let State::Pending(wakers) = old {
            wakers.into_iter().for_each(Waker::wake);
        }
    }

    /// Its value once it has one, or why it never will.
    pub async fn wait(&self) -> Result<String, String> {
        poll_fn(|cx| match &mut *self.0.state.borrow_mut() {
            State::Ready(v) => Poll::Ready(Ok(v.clone())),
            State::Failed(e) => Poll::Ready(Err(e.clone())),
            State::Pending(wakers) => {
                wakers.push(cx.waker().clone());
                Poll::Pending
            }
        }).await
    }
}

/// A call as `get` walks the graph: its queues (its own, its shared prefix's) and inputs.
/// Its own queue is let go when it finishes: an open queue that ran the model lately looks
/// to the scheduler like a decoder about to send its next step, and the next call's first
/// step waited up to half a forward for it (~0.3 s a call after a long prefill).
struct CallNode {
    /// None once the call has finished.
    queue: RefCell<Option<Rc<Queue>>>,
    prefix: Option<Rc<Prefix>>,
    inputs: Vec<Var>,
}

/// How a call generates each output: up to `max_tokens` (or EOS) with `sampler`.
#[derive(Clone)]
pub struct Gen {
    pub max_tokens: usize,
    pub sampler: Sampler,
}

impl Gen {
    /// Greedy decoding of at most `max_tokens`.
    pub fn greedy(max_tokens: usize) -> Gen {
        Gen { max_tokens, sampler: Sampler::greedy() }
    }
}

/// A static prefix's shared context: filled once, forked by every call.
struct Prefix {
    ready: Var,
    context: RefCell<Option<Context>>,
    queue: Rc<Queue>,
}

/// The calls of one application and the prefixes they share.
pub struct Pipeline {
    model: Model,
    /// Its identity: variables remember the address, so one of another pipeline is refused.
    id: Rc<()>,
    prefixes: RefCell<HashMap<String, Rc<Prefix>>>,
    export_as: Option<String>,
}

impl Pipeline {
    /// An empty pipeline on `model`.
    pub fn new(model: Model) -> Pipeline {
        Pipeline { model, id: Rc::new(()), prefixes: RefCell::new(HashMap::new()), export_as: None }
    }

    fn key(&self) -> *const () {
        Rc::as_ptr(&self.id)
    }

    /// Static prefixes are exported as `{namespace}:{hash}` (and imported where another
    /// instance did so first): instances running the same templates share their KV.
    pub fn share_prefixes(mut self, namespace: &str) -> Pipeline {
        self.export_as = Some(namespace.to_string());
        self
    }

    /// A variable with a value now.
    pub fn input(&self, name: &str, value: &str) -> Var {
        Var::new(name, self.key(), State::Ready(value.to_string()), None)
    }

    /// Declares a call of `template` with its inputs bound to variables; its outputs, in
    /// `template.outputs()` order. It starts once its inputs have values.
    pub fn call(&self, template: &Template, bindings: &[(&str, &Var)], gen: &Gen) -> Result<Vec<Var>, String> {
        let mut bound: HashMap<String, Var> = HashMap::new();
        for (name, var) in bindings {
            if var.0.pipeline != self.key() {
                return Err(format!("binding {name:?}: variable {:?} belongs to another pipeline", var.name()));
            }
            if !template.inputs().contains(name) {
                return Err(format!("binding {name:?} names no input slot of the template (inputs: {:?})", template.inputs()));
            }
            if bound.insert(name.to_string(), (*var).clone()).is_some() {
                return Err(format!("input {name:?} is bound twice"));
            }
        }
        if let Some(missing) = template.inputs().into_iter().find(|n| !bound.contains_key(*n)) {
            return Err(format!("the template reads {{{{input:{missing}}}}}, which no binding gives"));
        }
        let queue = Rc::new(self.model.create_queue().map_err(|e| e.message)?);
        let prefix = self.prefix(template.static_prefix())?;
        let node = Rc::new(CallNode { queue: RefCell::new(Some(queue.clone())), prefix: prefix.clone(),
                                      inputs: bound.values().cloned().collect() });
        let outputs: Vec<Var> = template.outputs().iter()
            .map(|name| Var::new(name, self.key(), State::Pending(Vec::new()), Some(node.clone()))).collect();
        let task = run_call(template.clone(), bound, outputs.clone(), queue, prefix, gen.clone(), node);
        drop(spawn(task));
        Ok(outputs)
    }

    /// `var`'s value, once produced; every call it still waits on runs with `objective`
    /// first (`Objective::Latency`: before other queues' work).
    pub async fn get(&self, var: &Var, objective: Objective) -> Result<String, String> {
        let mut stack = vec![var.clone()];
        let mut seen = HashSet::new();
        while let Some(v) = stack.pop() {
            let Some(node) = &v.0.producer else { continue };
            let running = node.queue.borrow().clone(); // None: the call has finished
            let Some(queue) = running.filter(|_| seen.insert(Rc::as_ptr(node))) else { continue };
            queue.set_objective(objective, "").map_err(|e| e.message)?;
            if let Some(p) = node.prefix.as_ref().filter(|p| p.ready.value().is_none()) {
                p.queue.set_objective(objective, "").map_err(|e| e.message)?;
            }
            stack.extend(node.inputs.iter().cloned());
        }
        var.wait().await
    }

    fn prefix(&self, text: &str) -> Result<Option<Rc<Prefix>>, String> {
        if text.is_empty() {
            return Ok(None);
        }
        if let Some(p) = self.prefixes.borrow().get(text) {
            return Ok(Some(p.clone()));
        }
        let queue = Rc::new(self.model.create_queue().map_err(|e| e.message)?);
        let ready = Var::new("prefix", self.key(), State::Pending(Vec::new()), None);
        let prefix = Rc::new(Prefix { ready, context: RefCell::new(None), queue });
        self.prefixes.borrow_mut().insert(text.to_string(), prefix.clone());
        let (p, text, export) = (prefix.clone(), text.to_string(), self.export_as.clone());
        drop(spawn(async move {
            let result = fill_prefix(&p, &text, export).await;
            p.ready.settle(result.map(|()| String::new()));
        }));
        Ok(Some(prefix))
    }
}

/// Fills a prefix's context (or imports it), waits until its KV is written.
async fn fill_prefix(prefix: &Prefix, text: &str, export: Option<String>) -> Result<(), String> {
    let name = export.map(|ns| format!("{ns}:{:016x}", fnv1a(text)));
    if let Some(name) = &name {
        if let Some(ctx) = Context::import(prefix.queue.clone(), name).map_err(|e| e.message)? {
            *prefix.context.borrow_mut() = Some(ctx);
            return Ok(());
        }
    }
    let mut ctx = Context::new(prefix.queue.clone());
    ctx.fill(text);
    ctx.flush().map_err(|e| e.message)?;
    prefix.queue.synchronize().await.map_err(|e| e.message)?;
    if let Some(name) = &name {
        // Another instance may have exported it meanwhile: then ours stays private.
        let _ = ctx.export(name, false).await;
    }
    *prefix.context.borrow_mut() = Some(ctx);
    Ok(())
}

async fn run_call(template: Template, bound: HashMap<String, Var>, outputs: Vec<Var>, queue: Rc<Queue>,
                  prefix: Option<Rc<Prefix>>, gen: Gen, node: Rc<CallNode>) {
    let result = generate_outputs(&template, &bound, &outputs, &queue, prefix.as_deref(), &gen).await;
    node.queue.borrow_mut().take();
    drop(queue); // with the call's context (dropped above), the last holder: the queue closes
    if let Err(cause) = result {
        for out in &outputs {
            if out.value().is_none() {
                out.settle(Err(cause.clone()));
            }
        }
    }
}

async fn generate_outputs(template: &Template, bound: &HashMap<String, Var>, outputs: &[Var],
                          queue: &Rc<Queue>, prefix: Option<&Prefix>, gen: &Gen) -> Result<(), String> {
    let mut values = HashMap::new();
    for (name, var) in bound {
        let value = var.wait().await.map_err(|e| format!("input {name:?} failed: {e}"))?;
        values.insert(name.clone(), value);
    }
    let mut ctx = match prefix {
        Some(p) => {
            p.ready.wait().await.map_err(|e| format!("shared prefix failed: {e}"))?;
            let base = p.context.borrow();
            base.as_ref().expect("a ready prefix holds its context").fork_on(queue.clone())
        }
        None => Context::new(queue.clone()),
    };
    let stop = Stop::new(gen.max_tokens).eos(queue.eos_tokens());
    // The prompt up to the first output is tokenized whole, as a client sending the same
    // text would have it, and the fork keeps the longest run of the prefix's tokens that
    // starts it (a token may straddle where the prefix ends): the outputs are those of the
    // whole prompt, and only the prefix's KV is reused.
    let mut text = String::new();
    let mut first = true;
    let mut outputs = outputs.iter();
    for part in &template.parts {
        match part {
            Part::Text(t) => text.push_str(t),
            Part::Input(name) => text.push_str(&values[name]),
            Part::Output(_) => {
                if first {
                    let tokens = queue.tokenize(&text);
                    let held = ctx.tokens();
                    let keep = held.iter().zip(&tokens).take_while(|(a, b)| a == b).count()
                        .min(tokens.len().saturating_sub(1));
                    ctx.truncate(keep);
                    ctx.fill_tokens(&tokens[keep..]);
                    first = false;
                } else {
                    ctx.fill(&text);
                }
                text.clear();
                let value = ctx.generate(&gen.sampler, &stop).await.map_err(|e| e.message)?;
                outputs.next().expect("one variable per output slot").settle(Ok(value));
            }
        }
    }
    Ok(())
}

/// A stable name for a prefix's export (FNV-1a, 64 bits).
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}
