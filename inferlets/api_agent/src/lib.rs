//! `api_agent`: an API-augmented request, the workload of APIServe (seed notes): a long
//! context, then generation interrupted by external calls whose durations differ by orders
//! of magnitude (a calculator, a QA model, an environment step, a human, image generation).
//!
//! The context is `--context` synthetic tokens (a fixed function of `--seed`, so requests do
//! not share prefixes); the agent decodes `--gen` tokens greedily, then for each of
//! `--calls` makes that call (a POST to the tool server's `slow` tool, which answers after
//! the given milliseconds), appends the answer and decodes `--gen` more. While a call is out
//! the inferlet holds its pages and waits on I/O: what happens to them under memory pressure
//! is the server's `control.kv_pressure` (keep, swap to host memory, or drop them, which
//! this context answers by computing its tokens again: `--discardable`, on by default).
//!
//! Requirements: R3
//! Host APIs: http-post, set-kv-class, execute, run, take
//! Arguments: --tools-url URL --context N --calls MS[,MS...] [--gen N (16)] [--seed S (0)]
//!   [--keep] (pages swappable only, never dropped)
//! Output: one JSON object {"context", "calls", "generated", "tokens"} (token counts; tokens:
//!   the context's length at the end, each forwarded once unless its pages were dropped).

use inferlet::http;
use inferlet::{Sampler, Stop};

inferlet::main!(main);

const USAGE: &str = "usage: --tools-url URL --context N --calls MS[,MS...] [--gen N] [--seed S] [--keep]";

async fn main() -> Result<(), String> {
    let (mut url, mut context, mut calls, mut gen, mut seed, mut discardable) =
        (None, None, Vec::new(), 16usize, 0u64, true);
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        if flag == "--keep" {
            discardable = false;
            continue;
        }
        let value = rest.next().ok_or(format!("{flag} needs a value; {USAGE}"))?;
        let bad = |what: &str| format!("bad {what} {value:?}; {USAGE}");
        match flag.as_str() {
            "--tools-url" => url = Some(value.trim_end_matches('/').to_string()),
            "--context" => context = Some(value.parse::<usize>().map_err(|_| bad("--context"))?),
            "--calls" => {
                calls = value.split(',').filter(|s| !s.is_empty())
                    .map(|s| s.parse::<f64>().map_err(|_| bad("--calls")))
                    .collect::<Result<_, _>>()?
            }
            "--gen" => gen = value.parse().map_err(|_| bad("--gen"))?,
            "--seed" => seed = value.parse().map_err(|_| bad("--seed"))?,
            _ => return Err(format!("unknown argument {flag:?}; {USAGE}")),
        }
    }
    let (url, context) = (url.ok_or(USAGE)?, context.ok_or(USAGE)?);
    if context == 0 || gen == 0 {
        return Err(format!("--context and --gen must be positive; {USAGE}"));
    }

    let mut ctx = inferlet::Model::default_model()?.create_context()?;
    ctx.set_discardable(discardable)?;
    ctx.fill_tokens(&synthetic(context, seed));
    let (greedy, stop) = (Sampler::greedy(), Stop::new(gen));
    ctx.generate(&greedy, &stop).await?;  // no stop token: exactly `gen` tokens each time
    let mut generated = gen;
    for (i, ms) in calls.iter().enumerate() {
        let body = format!("{{\"input\": \"result {i} of request {seed}\", \"latency_ms\": {ms}}}");
        let response = http::post_json(&format!("{url}/tools/slow"), &body).await?;
        ctx.fill(&format!("\nObservation: {}\n", response.body.chars().take(120).collect::<String>()));
        ctx.generate(&greedy, &stop).await?;
        generated += gen;
    }
    inferlet::send(&format!("{{\"context\": {context}, \"calls\": {}, \"generated\": {generated}, \"tokens\": {}}}",
                            calls.len(), ctx.len()));
    Ok(())
}

/// `n` ordinary-text token ids, a fixed function of `seed` (a linear congruential stream).
fn synthetic(n: usize, seed: u64) -> Vec<u32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n).map(|_| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        1000 + ((state >> 33) % 30000) as u32
    }).collect()
}
