//! `speculative_decoding`: greedy generation sped up by prompt-lookup drafts verified in one pass.
//!
//! Speculative decoding (Leviathan et al.; prompt lookup decoding, Saxena) lets a cheap
//! drafter guess several next tokens and has the model check them all in a single forward
//! pass; the longest agreeing prefix plus the model's own next token is kept, so the output
//! is exactly greedy decoding while each pass can yield several tokens. The drafter here
//! finds the latest earlier occurrence of the last n tokens and proposes what followed it
//! (`inferlet::speculative::NgramDrafter`); rejected tokens are dropped with `Context::truncate`.
//!
//! Requirements: R2
//! Host APIs: embed-text, forward (outputs at every drafted position), sample, alloc-kvpage, dealloc-kvpage
//! Arguments: --prompt TEXT [--max-tokens N (64)] [--ngram N (3)]
//! Output: one JSON object {"text", "tokens", "steps", "drafted", "accepted"}.

use inferlet::speculative::{generate_speculative, NgramDrafter};
use inferlet::{chat, Model, Stop};
use inferlet::flags::{arg_or, parse_args};
use inferlet::json::json_string;

inferlet::main!(main);

const USAGE: &str = "--prompt TEXT [--max-tokens N] [--ngram N]";

async fn main() -> Result<(), String> {
    let args = parse_args(&inferlet::args(), &["prompt", "max-tokens", "ngram"], &[], USAGE)?;
    let prompt = args.get("prompt").ok_or(format!("--prompt is required; usage: {USAGE}"))?;
    let (max_tokens, ngram) = (arg_or(&args, "max-tokens", 64, USAGE)?, arg_or(&args, "ngram", 3usize, USAGE)?.max(1));
    let mut ctx = Model::default_model()?.create_context()?;
    ctx.fill_chat(&[chat("user", &prompt)], true)?;
    let stop = Stop::new(max_tokens).eos(ctx.queue().eos_tokens());
    let out = generate_speculative(&mut ctx, &mut NgramDrafter { n: ngram }, &stop).await?;
    inferlet::send(&format!("{{\"text\": {}, \"tokens\": {}, \"steps\": {}, \"drafted\": {}, \"accepted\": {}}}",
                            json_string(&out.text), out.tokens.len(), out.steps, out.drafted, out.accepted));
    Ok(())
}

