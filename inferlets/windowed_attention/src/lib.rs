//! `windowed_attention`: generation where each token attends only to the last W tokens, in a bounded KV cache.
//!
//! Sliding-window attention (as in Longformer's local attention and Mistral) restricts
//! every token to the W tokens before it, so the KV cache needed stays bounded. Here the
//! window is imposed on an ordinary model from outside: after each forward pass, the
//! tokens that fell out of the window are hidden with `Context::mask_range` (page mask
//! bits) and pages holding only hidden tokens are released with
//! `Context::drop_masked_pages`. The prompt streams through one page per forward pass, so
//! about W / 16 + 2 pages are held however long the sequence grows.
//!
//! Requirements: R1
//! Host APIs: mask-kvpage, dealloc-kvpage, alloc-kvpage, forward, sample
//! Arguments: --prompt TEXT [--max-tokens N (64)] [--window W (32)] [--ignore-eos]
//! Output: one JSON object {"text", "tokens", "max_pages", "dropped_pages"}.

use inferlet::{chat, Model, Sampler};
use inferlet::json::json_string;

inferlet::main!(main);

async fn main() -> Result<(), String> {
    let (mut prompt, mut max_tokens, mut window, mut ignore_eos) = (None, 64, 32u32, false);
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
            "--window" => window = number()?.max(1),
            _ => return Err(format!("unknown argument {flag:?}; usage: --prompt TEXT [--max-tokens N] \
                                     [--window W] [--ignore-eos]")),
        }
    }
    let prompt = prompt.ok_or("--prompt is required")?;
    let mut ctx = Model::default_model()?.create_context()?;
    let queue = ctx.queue().clone();
    let tokens = queue.tokenize(&queue.apply_chat_template(&[chat("user", &prompt)], true)?);
    let eos = queue.eos_tokens();
    let (mut generated, mut max_pages, mut dropped) = (Vec::new(), 0, 0);
    let (body, last) = tokens.split_at(tokens.len().saturating_sub(1));
    for chunk in body.chunks(queue.page_size() as usize) {
        ctx.fill_tokens(chunk);
        ctx.forward_pending(&[])?;
        dropped += ctx.keep_only(0, window)?;
        max_pages = max_pages.max(ctx.num_pages());
    }
    ctx.fill_tokens(last);
    while generated.len() < max_tokens as usize {
        let token = ctx.decode_step(&Sampler::greedy()).await?;
        if !ignore_eos && eos.contains(&token) {
            break;
        }
        generated.push(token);
        dropped += ctx.keep_only(0, window)?;
        max_pages = max_pages.max(ctx.num_pages());
    }
    let text = queue.detokenize(&generated)?;
    inferlet::send(&format!("{{\"text\": {}, \"tokens\": {}, \"max_pages\": {}, \"dropped_pages\": {}}}",
                            json_string(&text), generated.len(), max_pages, dropped));
    Ok(())
}

