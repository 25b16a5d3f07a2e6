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
use inferlet::json::json_string;

inferlet::main!(main);

async fn main() -> Result<(), String> {
    let (mut prompt, mut max_tokens, mut window) = (None, 64, 8);
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or(format!("{flag} needs a value"))?;
        let number = || value.parse::<usize>().map_err(|_| format!("invalid number for {flag}: {value:?}"));
        match flag.as_str() {
            "--prompt" => prompt = Some(value.clone()),
            "--max-tokens" => max_tokens = number()?,
            "--window" => window = number()?.max(1),
            _ => return Err(format!("unknown argument {flag:?}; usage: --prompt TEXT [--max-tokens N] [--window N]")),
        }
    }
    let prompt = prompt.ok_or("--prompt is required")?;
    let mut ctx = Model::default_model()?.create_context()?;
    ctx.fill_chat(&[chat("user", &prompt)], true)?;
    let stop = Stop::new(max_tokens).eos(ctx.queue().eos_tokens());
    let out = generate_speculative(&mut ctx, &mut JacobiDrafter::new(window), &stop).await?;
    inferlet::send(&format!("{{\"text\": {}, \"tokens\": {}, \"iterations\": {}, \"guessed\": {}, \"converged\": {}}}",
                            json_string(&out.text), out.tokens.len(), out.steps, out.drafted, out.accepted));
    Ok(())
}

