//! `parallel_generation`: n completions of one prompt, prefilled once and decoded together.
//!
//! Parallel sampling (as in vLLM's `n` or best-of-n): the prompt's KV cache is computed
//! once and shared by n forks; every fork copies only the partly filled last page and
//! grows its own pages. The forks are decoded in lockstep (`inferlet::branch`), so each
//! step's n forward passes are batched into one backend call.
//!
//! Requirements: R1
//! Host APIs: forward, embed-text, copy-kvpage (fork), sample, alloc-kvpage, dealloc-kvpage
//! Arguments: --prompt TEXT [--n N (4)] [--max-tokens N (16)] [--temperature T (0.8 if n > 1, else 0)] [--seed S (0)]
//! Output: one JSON object {"completions": [text, ...], "tokens": [count, ...], "prompt_tokens": N}.

use inferlet::json::{json_array, json_string};
use inferlet::{chat, generate_branches, Model, Sampler, Stop};

inferlet::main!(main);

const USAGE: &str = "usage: --prompt TEXT [--n N] [--max-tokens N] [--temperature T] [--seed S]";

async fn main() -> Result<(), String> {
    let (mut prompt, mut n, mut max_tokens, mut temperature, mut seed) = (None, 4usize, 16usize, None, 0u64);
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or(format!("{flag} needs a value; {USAGE}"))?;
        let bad = || format!("invalid value for {flag}: {value:?}; {USAGE}");
        match flag.as_str() {
            "--prompt" => prompt = Some(value.clone()),
            "--n" => n = value.parse().map_err(|_| bad())?,
            "--max-tokens" => max_tokens = value.parse().map_err(|_| bad())?,
            "--temperature" => temperature = Some(value.parse::<f32>().map_err(|_| bad())?),
            "--seed" => seed = value.parse().map_err(|_| bad())?,
            _ => return Err(format!("unknown argument {flag:?}; {USAGE}")),
        }
    }
    let prompt = prompt.ok_or(format!("--prompt is required; {USAGE}"))?;
    if !(1..=64).contains(&n) {
        return Err(format!("--n must be in 1..=64; {USAGE}"));
    }
    let temperature = temperature.unwrap_or(if n > 1 { 0.8 } else { 0.0 });
    let mut ctx = Model::default_model()?.create_context()?;
    ctx.fill_chat(&[chat("user", &prompt)], true)?;
    let prompt_tokens = ctx.len();
    ctx.flush()?; // the prompt's KV, computed once for all n
    // Fork i draws with seed + i * 1000003 (+ step), so no two forks share a seed sequence.
    let samplers: Vec<Sampler> = (0..n as u64)
        .map(|i| Sampler::temperature(temperature).with_seed(seed.wrapping_add(i * 1_000_003))).collect();
    let stop = Stop::new(max_tokens).eos(ctx.queue().eos_tokens());
    let branches = generate_branches(&ctx, &vec![Vec::new(); n], &samplers, &stop).await?;
    inferlet::send(&format!("{{\"completions\": {}, \"tokens\": {}, \"prompt_tokens\": {prompt_tokens}}}",
                            json_array(branches.iter().map(|b| json_string(&b.text))),
                            json_array(branches.iter().map(|b| b.tokens.len()))));
    Ok(())
}
