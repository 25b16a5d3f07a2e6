//! `jacobi_decoding`: greedy generation by parallel Jacobi iteration over a window of guessed tokens.
//!
//! Jacobi decoding (Santilli et al., "Accelerating Transformer Inference for Translation via
//! Parallel Decoding"; Lookahead/CLLM build on it) treats greedy decoding of the next n
//! tokens as a fixed-point problem: guess all n, run them through the model in one forward
//! pass with an output at every position, replace each guess by the model's greedy
//! prediction there, and repeat. Every pass fixes at least one more token, and tokens whose
//! guesses already agree with the prediction converge together. Here the window is verified
//! with `inferlet::speculative::generate_speculative` and the next iterate comes from
//! `JacobiDrafter` (the previous pass's predictions past the converged prefix), so the
//! output is exactly greedy decoding.
//!
//! Requirements: R2
//! Host APIs: embed-text, forward (outputs at every window position), sample, alloc-kvpage, dealloc-kvpage
//! Arguments: --prompt TEXT [--max-tokens N (64)] [--window N (8; at most 8)]
//! Output: one JSON object {"text", "tokens", "iterations", "guessed", "converged"}.

use inferlet::speculative::{generate_speculative, JacobiDrafter};
use inferlet::{chat, Model, Stop};
use inferlet::flags::{arg_or, parse_args};
use inferlet::json::json_string;

inferlet::main!(main);

const USAGE: &str = "--prompt TEXT [--max-tokens N] [--window N]";

async fn main() -> Result<(), String> {
    let args = parse_args(&inferlet::args(), &["prompt", "max-tokens", "window"], &[], USAGE)?;
    let prompt = args.get("prompt").ok_or(format!("--prompt is required; usage: {USAGE}"))?;
    let (max_tokens, window) = (arg_or(&args, "max-tokens", 64, USAGE)?, arg_or(&args, "window", 8usize, USAGE)?.max(1));
    let mut ctx = Model::default_model()?.create_context()?;
    ctx.fill_chat(&[chat("user", &prompt)], true)?;
    let stop = Stop::new(max_tokens).eos(ctx.queue().eos_tokens());
    let out = generate_speculative(&mut ctx, &mut JacobiDrafter::new(window), &stop).await?;
    inferlet::send(&format!("{{\"text\": {}, \"tokens\": {}, \"iterations\": {}, \"guessed\": {}, \"converged\": {}}}",
                            json_string(&out.text), out.tokens.len(), out.steps, out.drafted, out.accepted));
    Ok(())
}

