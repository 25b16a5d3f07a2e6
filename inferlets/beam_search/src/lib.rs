//! `beam_search`: the most likely completions of a chat prompt by beam search over forked contexts.
//!
//! Beam search keeps the B most probable partial sequences, extends each by its most
//! likely next tokens, and keeps the B best extensions by total log-probability, so it
//! finds sequences at least as likely as greedy decoding usually does. Each beam here is a
//! `Context::fork` of its parent, sharing its KV pages copy-on-write, and every step
//! requests all beams' next-token distributions at once (`inferlet::beam::beam_search`).
//!
//! Requirements: R2
//! Host APIs: fork (copy-kvpage), forward, get-next-dist, alloc-kvpage, dealloc-kvpage
//! Arguments: --prompt TEXT [--beams B (3)] [--max-tokens N (16)]
//! Output: one JSON object {"beams": [{"text", "tokens": [ids], "logprob"}, ...]}, best first.

use inferlet::beam::beam_search;
use inferlet::{chat, Model};
use inferlet::flags::{arg_or, parse_args};
use inferlet::json::json_string;

inferlet::main!(main);

const USAGE: &str = "--prompt TEXT [--beams B] [--max-tokens N]";

async fn main() -> Result<(), String> {
    let args = parse_args(&inferlet::args(), &["prompt", "beams", "max-tokens"], &[], USAGE)?;
    let prompt = args.get("prompt").ok_or(format!("--prompt is required; usage: {USAGE}"))?;
    let (beams, max_tokens) = (arg_or(&args, "beams", 3usize, USAGE)?, arg_or(&args, "max-tokens", 16usize, USAGE)?);
    let mut ctx = Model::default_model()?.create_context()?;
    ctx.fill_chat(&[chat("user", &prompt)], true)?;
    let eos = ctx.queue().eos_tokens();
    let found = beam_search(&ctx, beams, max_tokens, &eos).await?;
    let mut items = Vec::new();
    for (tokens, logprob) in &found {
        let text = ctx.queue().detokenize(tokens.strip_suffix(&eos[..1]).unwrap_or(tokens))?;
        let ids: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
        items.push(format!("{{\"text\": {}, \"tokens\": [{}], \"logprob\": {}}}", json_string(&text), ids.join(", "), logprob));
    }
    inferlet::send(&format!("{{\"beams\": [{}]}}", items.join(", ")));
    Ok(())
}

