//! `constrained_decoding`: output guaranteed to follow a JSON schema, EBNF/Lark grammar or regex.
//!
//! A chat completion whose every token is allowed by the grammar.
//!
//! Constrained decoding restricts every sampling step to the tokens that keep the output a
//! prefix of the grammar's language. The host compiles the grammar for the model's tokenizer
//! (llguidance) and masks the logits before drawing; tokens the grammar forces (JSON keys,
//! punctuation) are filled without sampling, in one forward pass with the next step.
//!
//! Requirements: R2
//! Host APIs: grammar.compile, grammar.sample, matcher.accept/forced-tokens/is-stopped, forward, embed-text
//! Arguments: --prompt TEXT (--json-schema SCHEMA | --ebnf GRAMMAR | --lark GRAMMAR | --regex PATTERN) [--max-tokens N] [--temperature T --seed S]
//! Output: one message, the constrained output; the instance fails if the output is incomplete after N tokens.

use inferlet::{chat, Grammar, Model, Sampler};

inferlet::main!(main);

const USAGE: &str = "usage: --prompt TEXT (--json-schema SCHEMA | --ebnf GRAMMAR | --lark GRAMMAR | \
                     --regex PATTERN) [--max-tokens N] [--temperature T --seed S]";

async fn main() -> Result<(), String> {
    let (mut prompt, mut grammar, mut max_tokens, mut temperature, mut seed) = (None, None, 128, 0.0, None);
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or(format!("{flag} needs a value; {USAGE}"))?.clone();
        match flag.as_str() {
            "--prompt" => prompt = Some(value),
            "--json-schema" | "--ebnf" | "--lark" | "--regex" => grammar = Some((flag.clone(), value)),
            "--max-tokens" => max_tokens = value.parse().map_err(|_| format!("bad --max-tokens {value:?}"))?,
            "--temperature" => temperature = value.parse().map_err(|_| format!("bad --temperature {value:?}"))?,
            "--seed" => seed = Some(value.parse().map_err(|_| format!("bad --seed {value:?}"))?),
            _ => return Err(format!("unknown argument {flag:?}; {USAGE}")),
        }
    }
    let prompt = prompt.ok_or(format!("--prompt is required; {USAGE}"))?;
    let (kind, source) = grammar.ok_or(format!("a grammar is required; {USAGE}"))?;

    let model = Model::default_model()?;
    let mut ctx = model.create_context()?;
    let queue = ctx.queue().clone();
    let grammar = match kind.as_str() {
        "--json-schema" => Grammar::json_schema(&queue, &source),
        "--ebnf" => Grammar::ebnf(&queue, &source),
        "--lark" => Grammar::lark(&queue, &source),
        _ => Grammar::regex(&queue, &source),
    }?;
    ctx.fill_chat(&[chat("user", &prompt)], true)?;
    let sampler = match seed {
        Some(seed) => Sampler::temperature(temperature).with_seed(seed),
        None => Sampler::temperature(temperature),
    };
    let output = ctx.generate_constrained(&grammar, &sampler, max_tokens).await?;
    if !grammar.is_accepting() {
        return Err(format!("the output is incomplete after {max_tokens} tokens: {output:?}"));
    }
    inferlet::send(&output);
    Ok(())
}
