//! `agent_optimized`: a tool-calling agent with the three API-call optimizations of Fig. 7.
//!
//! Agents spend much of their time on API plumbing rather than reasoning. The paper shows
//! three application-specific fixes an inferlet can make, each switchable here:
//! (1) `--opt-export` retains the frequently used API docs: their prefix is prefilled once
//! and exported persistently, and later launches import its KV pages instead of running it;
//! (2) `--opt-early-call` calls an API as soon as the call is complete in the decoded text
//! (the `)` closing `calc(`), so the request is in flight while the rest of the line (a
//! comment) is still decoding, instead of after the line; (3) `--opt-mask` masks the
//! single-use API's spec out of attention once that API was called, and releases the KV
//! pages it filled entirely. The plan is fixed: the one-time `search` first, then `calc`;
//! the model writes each call's arguments (scripted ones if it does not close the call).
//!
//! Requirements: R1, R2, R3
//! Host APIs: export-kvpage, import-kvpage, unexport-kvpage, mask-kvpage, http-post,
//!   forward, sample, kvs (the export's tokens)
//! Arguments: --tools-url URL --task TEXT [--calls N (3)] [--max-tokens N per line (12)]
//!   [--opt-export] [--opt-early-call] [--opt-mask] [--export-name NAME]
//!   [--api-latency-ms N (each API answers after N ms, as a remote one would)]; or
//!   --unexport [--export-name NAME] to remove the docs export.
//! Output: one JSON object {"calls": [{"api", "args", "source", "issued_at", "line_tokens",
//!   "observation"}], "answer", "docs_tokens", "docs_imported", "docs_exported",
//!   "masked_tokens", "dropped_pages", "context_tokens", "context"}.

use inferlet::http;
use inferlet::json::{json_string, json_value};
use inferlet::{chat, spawn, Context, Line, Model};

inferlet::main!(main);

const USAGE: &str = "usage: --tools-url URL --task TEXT [--calls N] [--max-tokens N] [--opt-export] \
                     [--opt-early-call] [--opt-mask] [--export-name NAME] [--api-latency-ms N] | --unexport [--export-name NAME]";

/// The frequently used API's documentation: the same for every task, so worth keeping.
const DOCS: &str = "You are an agent that solves tasks by calling APIs. Write one call per line \
as `Action: api(arguments)  # comment`; the result comes back as `Observation: ...`.\n\n\
API calc(expression): evaluates an arithmetic expression and returns the number.\n\
Operators: + - * / // % ** and parentheses; functions: sqrt, sin, cos, tan, log, log10, exp, \
abs, floor, ceil; constants: pi, e. Integers are exact.\n\
Examples:\nAction: calc(6 * 7)  # multiply\nObservation: 42\n\
Action: calc((12 + 8) / 4)  # average of a sum\nObservation: 5.0\n\
Action: calc(2 ** 10)  # a power of two\nObservation: 1024\n\
Action: calc(sqrt(16) + 1)  # square root\nObservation: 5.0\n\
Errors come back as `Observation: error: ...`; fix the expression and call again.";

/// The single-use API's spec: needed for the first call only.
const SPEC: &str = "One-time API search(query): looks up a fact in an encyclopedia of science \
and geography and returns the best matching sentence. Call it once, first, with a few keywords.\n\
Example:\nAction: search(boiling point of water)  # look up the fact\n\
Observation: Water boils at 100 degrees Celsius at sea level.\n";

struct Options {
    url: String,
    task: String,
    calls: usize,
    max_tokens: usize,
    export: bool,
    early: bool,
    mask: bool,
    name: String,
    /// Appended to every API URL: `?latency_ms=N` makes the tool server answer after N ms.
    latency_query: String,
}

async fn main() -> Result<(), String> {
    let (mut url, mut task, mut calls, mut max_tokens) = (None, None, 3usize, 12usize);
    let (mut export, mut early, mut mask, mut unexport, mut name) = (false, false, false, false, "agent_optimized.docs".to_string());
    let mut latency_query = String::new();
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let mut value = || rest.next().cloned().ok_or(format!("{flag} needs a value; {USAGE}"));
        match flag.as_str() {
            "--tools-url" => url = Some(value()?.trim_end_matches('/').to_string()),
            "--task" => task = Some(value()?),
            "--calls" => calls = value()?.parse().map_err(|_| format!("bad --calls; {USAGE}"))?,
            "--max-tokens" => max_tokens = value()?.parse().map_err(|_| format!("bad --max-tokens; {USAGE}"))?,
            "--export-name" => name = value()?,
            "--api-latency-ms" => {
                let ms: u32 = value()?.parse().map_err(|_| format!("bad --api-latency-ms; {USAGE}"))?;
                latency_query = format!("?latency_ms={ms}");
            }
            "--opt-export" => export = true,
            "--opt-early-call" => early = true,
            "--opt-mask" => mask = true,
            "--unexport" => unexport = true,
            _ => return Err(format!("unknown argument {flag:?}; {USAGE}")),
        }
    }
    if unexport {
        Context::unexport(&name)?;
        inferlet::send("{\"unexported\": true}");
        return Ok(());
    }
    let options = Options { url: url.ok_or(USAGE)?, task: task.ok_or(USAGE)?, calls, max_tokens, export, early, mask, name, latency_query };
    run(&options).await
}

async fn run(o: &Options) -> Result<(), String> {
    let queue = std::rc::Rc::new(Model::default_model()?.create_queue()?);
    // The conversation: [docs system turn][user turn: SPEC, task][assistant turn].
    let docs = queue.apply_chat_template(&[chat("system", DOCS)], false)?;
    let full = queue.apply_chat_template(&[chat("system", DOCS), chat("user", &format!("{SPEC}\nTask: {}", o.task))], true)?;
    let rest = full.strip_prefix(docs.as_str()).ok_or("chat template does not render the system turn first")?;
    let spec_at = rest.find(SPEC).ok_or("chat template altered the spec")?;

    // (1) The docs prefix: imported if exported before, else prefilled (and exported).
    let imported = if o.export { Context::import(queue.clone(), &o.name)? } else { None };
    let docs_imported = imported.is_some();
    let mut ctx = match imported {
        Some(ctx) => ctx,
        None => {
            let mut ctx = Context::new(queue.clone());
            ctx.fill(&docs);
            ctx.forward_pending(&[])?;
            if o.export {
                ctx.export(&o.name, true).await?; // appending later copies the last page
            }
            ctx
        }
    };
    let docs_tokens = ctx.len();
    ctx.fill(&rest[..spec_at]);
    let spec = (ctx.len() as u32, 0);
    ctx.fill(SPEC);
    let spec = (spec.0, ctx.len() as u32);
    ctx.fill(&rest[spec_at + SPEC.len()..]);

    let (mut records, mut masked, mut dropped) = (Vec::new(), 0, 0);
    for step in 0..o.calls {
        let api = if step == 0 { "search" } else { "calc" };
        ctx.fill(&format!("Action: {api}("));
        let call = call_line(&mut ctx, o, api).await?;
        ctx.fill(&format!("{}Observation: {}\n", if call.newline { "" } else { "\n" }, call.observation));
        records.push(format!("{{\"api\": {}, \"args\": {}, \"source\": {}, \"issued_at\": {}, \"line_tokens\": {}, \"observation\": {}}}",
            json_string(api), json_string(&call.args), json_string(call.source), call.issued_at, call.line_tokens,
            json_string(&call.observation)));
        if step == 0 && o.mask {
            // (3) The one-time API was used: hide its spec, free the pages it filled.
            ctx.mask_range(spec.0, spec.1, true)?;
            masked = spec.1 - spec.0;
            dropped = ctx.drop_masked_pages();
        }
    }
    ctx.fill("Final Answer:");
    let answer = ctx.decode_line(o.max_tokens, &['\n'], |_, _| {}).await?.text;
    let context = ctx.queue().detokenize(&ctx.tokens())?;
    inferlet::send(&format!(
        "{{\"calls\": [{}], \"answer\": {}, \"docs_tokens\": {docs_tokens}, \"docs_imported\": {docs_imported}, \
         \"docs_exported\": {}, \"masked_tokens\": {masked}, \"dropped_pages\": {dropped}, \"context_tokens\": {}, \
         \"context\": {}}}",
        records.join(", "), json_string(answer.trim()), o.export && !docs_imported, ctx.len(), json_string(&context)));
    Ok(())
}

struct Call {
    args: String,
    source: &'static str,
    /// Tokens of the line decoded when the request was issued.
    issued_at: usize,
    line_tokens: usize,
    newline: bool,
    observation: String,
}

/// Decodes the rest of an `Action: api(` line and calls the API: (2) with `--opt-early-call`
/// as soon as the call's `)` is decoded, else once the line is done.
async fn call_line(ctx: &mut Context, o: &Options, api: &'static str) -> Result<Call, String> {
    let mark = ctx.len();
    let start = |args: &str| {
        let (tool, body) = match api {
            "search" => ("search", format!("{{\"query\": {}, \"k\": 1}}", json_string(args))),
            _ => ("calculator", format!("{{\"expression\": {}}}", json_string(args))),
        };
        spawn(http::post_json(&format!("{}/tools/{tool}{}", o.url, o.latency_query), &body))
    };
    let mut early = None;
    let Line { text, tokens, newline } = ctx.decode_line(o.max_tokens, &['\n'], |text, n| {
        if let (true, None, Some(args)) = (o.early, &early, call_args(text)) {
            early = Some((args.to_string(), start(args), n)); // in flight while decoding goes on
        }
    }).await?;
    let (args, source, pending, issued_at) = match (early, call_args(&text)) {
        (Some((args, pending, n)), _) => (args, "model", pending, n),
        (None, Some(args)) => (args.to_string(), "model", start(args), tokens),
        (None, None) => {
            // The model did not close the call: cut its line, write a scripted one.
            ctx.truncate(mark);
            let args = scripted_args(api, &o.task);
            ctx.fill(&format!("{args})"));
            (args.clone(), "scripted", start(&args), tokens)
        }
    };
    let response = pending.await?;
    let observation = json_value(&response.body, "error").map(|e| format!("error: {e}"))
        .or_else(|| json_value(&response.body, if api == "calc" { "result" } else { "text" }))
        .unwrap_or_else(|| "no result".to_string());
    let newline = newline && source == "model";
    Ok(Call { args, source, issued_at, line_tokens: tokens, newline, observation: observation.chars().take(200).collect() })
}

/// The arguments of a call whose `(` was filled before `text`: the text up to the `)` that
/// closes it, if decoded yet.
fn call_args(text: &str) -> Option<&str> {
    let mut depth = 1;
    for (i, c) in text.char_indices() {
        depth += match c { '(' => 1, ')' => -1, '\n' => return None, _ => 0 };
        if depth == 0 {
            let args = text[..i].trim();
            return (!args.is_empty()).then_some(args);
        }
    }
    None
}

/// Fallback arguments: the task's keywords for search, its arithmetic for calc.
fn scripted_args(api: &str, task: &str) -> String {
    let math = task.split(|c: char| !"0123456789+-*/(). ".contains(c)).map(|s| s.trim().trim_end_matches('.'))
        .find(|s| s.contains(|c: char| c.is_ascii_digit()) && s.contains(['+', '-', '*', '/']));
    match (api, math) {
        ("calc", Some(math)) => math.to_string(),
        ("calc", None) => "0".to_string(),
        _ => task.trim_end_matches(['.', '?']).to_string(),
    }
}
