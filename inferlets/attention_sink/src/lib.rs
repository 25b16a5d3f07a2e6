//! `attention_sink`: StreamingLLM-style long generation in a bounded KV cache (sink tokens + recent window).
//!
//! StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks")
//! observes that the first few tokens soak up attention ("attention sinks"): keeping them
//! plus a window of recent tokens lets a model generate indefinitely with a fixed cache.
//! After every decode step this inferlet hides every token but the first S and the last W
//! from attention (`Context::keep_only` over `mask_range`, i.e. the page mask bits) and releases pages that
//! hold only hidden tokens (`Context::drop_masked_pages`), so at most about (S + W) / 16 + 2
//! KV pages are held however long the prompt and the generation are (the prompt streams
//! through one page per forward pass). Tokens keep their original positions.
//!
//! Requirements: R1
//! Host APIs: mask-kvpage, dealloc-kvpage, alloc-kvpage, forward, sample
//! Arguments: --prompt TEXT [--max-tokens N (160)] [--sinks S (4)] [--window W (32)] [--ignore-eos]
//! Output: one JSON object {"text", "tokens", "max_pages", "dropped_pages"}.

use inferlet::{chat, Model, Sampler};
use inferlet::json::json_string;

inferlet::main!(main);

async fn main() -> Result<(), String> {
    let (mut prompt, mut max_tokens, mut sinks, mut window, mut ignore_eos) = (None, 160, 4u32, 32u32, false);
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        if flag == "--ignore-eos" {
            ignore_eos = true;
            continue;
        }
        let value = rest.next().ok_or(format!("{flag} needs a value"))?;
        let number = || value.parse::<u32>().map_err(|_| format!("invalid number for {flag}: {value:?}"));
        match flag.as_str() {
            "--prompt" => prompt = Some(value.clone()),
            "--max-tokens" => max_tokens = number()?,
            "--sinks" => sinks = number()?,
            "--window" => window = number()?.max(1),
            _ => return Err(format!("unknown argument {flag:?}; usage: --prompt TEXT [--max-tokens N] \
                                     [--sinks S] [--window W] [--ignore-eos]")),
        }
    }
    let prompt = prompt.ok_or("--prompt is required")?;
    let mut ctx = Model::default_model()?.create_context()?;
    let queue = ctx.queue().clone();
    let tokens = queue.tokenize(&queue.apply_chat_template(&[chat("user", &prompt)], true)?);
    let eos = queue.eos_tokens();
    let (mut generated, mut max_pages, mut dropped) = (Vec::new(), 0, 0);
    // A long prompt streams through too: one page of it per forward pass, then evict.
    let (body, last) = tokens.split_at(tokens.len().saturating_sub(1));
    for chunk in body.chunks(queue.page_size() as usize) {
        ctx.fill_tokens(chunk);
        ctx.forward_pending(&[])?;
        dropped += ctx.keep_only(sinks, window)?;
        max_pages = max_pages.max(ctx.num_pages());
    }
    ctx.fill_tokens(last);
    while generated.len() < max_tokens as usize {
        let token = ctx.decode_step(&Sampler::greedy()).await?;
        if !ignore_eos && eos.contains(&token) {
            break;
        }
        generated.push(token);
        // The next input (the token just sampled, pending) sees the sinks and the last W
        // tokens, itself included.
        dropped += ctx.keep_only(sinks, window)?;
        max_pages = max_pages.max(ctx.num_pages());
    }
    let text = ctx.queue().detokenize(&generated)?;
    inferlet::send(&format!("{{\"text\": {}, \"tokens\": {}, \"max_pages\": {}, \"dropped_pages\": {}}}",
                            json_string(&text), generated.len(), max_pages, dropped));
    Ok(())
}

