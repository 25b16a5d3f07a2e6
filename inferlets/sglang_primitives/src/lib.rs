//! `sglang_primitives`: SGLang's `select`, `fork` and `gen` (with a stop string, a regex and a
//! JSON schema), with named results, on one context.
//!
//! A multiple-choice question answered the SGLang way: the choice is scored
//! (`Context::select`: every choice in one batch of passes that write no KV, normalised as
//! asked); the prompt is prefilled once and forked per choice to see how the model would go
//! on after each (`generate_branches`, SGLang's `fork`: the branches decode in lockstep, one
//! batch per step); then the model gives a one-line reason (generation until a newline), a
//! confidence from 0 to 100 (a regex grammar) and a JSON verdict whose shape a schema fixes.
//! Each generation continues the same context, so nothing before it is computed twice. The
//! twin of inferlets/python/sglang_primitives.py: same arguments, same output.
//!
//! Requirements: R2
//! Host APIs: tokenize, forward (passes that write no KV, with logprobs-of), inference.run, grammar.compile
//! Arguments: --question TEXT --choice TEXT [--choice TEXT ...] [--normalize sum|mean|unconditional] [--max-tokens N]
//! Output: one JSON object: {"answer", "scores", "logprobs", "continuations", "reason", "confidence", "verdict"}.

use inferlet::json::{json_array, json_string};
use inferlet::select::Normalize;
use inferlet::{chat, generate_branches, Grammar, Model, Sampler, Stop};

inferlet::main!(main);

const USAGE: &str = "usage: --question TEXT --choice TEXT [--choice TEXT ...] \
                     [--normalize sum|mean|unconditional] [--max-tokens N]";
const VERDICT: &str = r#"{"type": "object", "properties": {"sure": {"type": "boolean"}}, "required": ["sure"], "additionalProperties": false}"#;

async fn main() -> Result<(), String> {
    let (mut question, mut choices, mut normalize, mut max_tokens) = (None, Vec::new(), Normalize::Mean, 24usize);
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or(format!("{flag} needs a value; {USAGE}"))?.clone();
        match flag.as_str() {
            "--question" => question = Some(value),
            "--choice" => choices.push(value),
            "--normalize" => normalize = match value.as_str() {
                "sum" => Normalize::Sum,
                "mean" => Normalize::Mean,
                "unconditional" => Normalize::Unconditional,
                _ => return Err(format!("--normalize must be sum, mean or unconditional, not {value:?}")),
            },
            "--max-tokens" => max_tokens = value.parse().map_err(|_| format!("invalid --max-tokens {value:?}; {USAGE}"))?,
            _ => return Err(format!("unknown argument {flag:?}; {USAGE}")),
        }
    }
    let question = question.ok_or(format!("--question is required; {USAGE}"))?;
    if choices.is_empty() {
        return Err(format!("at least one --choice is required; {USAGE}"));
    }

    let model = Model::default_model()?;
    let mut ctx = model.create_context()?;
    ctx.fill_chat(&[chat("user", &format!("{question}\nAnswer with one of: {}.", choices.join(", ")))], true)?;
    let options: Vec<&str> = choices.iter().map(String::as_str).collect();
    let picked = ctx.select(&options, normalize).await?;

    ctx.flush()?;  // the prompt's KV, read in place by every branch
    let eos = ctx.queue().eos_tokens();
    let suffixes: Vec<Vec<u32>> = choices.iter().map(|c| ctx.queue().tokenize(c)).collect();
    let branches = generate_branches(&ctx, &suffixes, &[Sampler::greedy()],
                                     &Stop::new(max_tokens).eos(eos.clone()).string("\n")).await?;
    let continuations: Vec<String> = choices.iter().zip(&branches)
        .map(|(c, b)| format!("{}: {}", json_string(c), json_string(&b.text))).collect();

    ctx.fill(&format!("{}\nReason:", picked.text));
    let reason = ctx.gen(max_tokens, None, None, &["\n"]).await?;
    ctx.fill("\nConfidence (0-100): ");
    let confidence = ctx.gen(4, Some("[0-9]{1,2}|100"), None, &[]).await?;
    ctx.fill("\nVerdict as JSON: ");
    let schema = Grammar::json_schema(ctx.queue(), VERDICT)?;
    let verdict = ctx.generate_constrained(&schema, &Sampler::greedy(), max_tokens).await?;

    let logprobs = json_array(picked.logprobs.iter().map(|lp| json_array(lp.iter())));
    inferlet::send(&format!(
        "{{\"answer\": {}, \"scores\": {}, \"logprobs\": {logprobs}, \"continuations\": {{{}}}, \"reason\": {}, \
         \"confidence\": {}, \"verdict\": {verdict}}}",
        json_string(&picked.text), json_array(picked.scores.iter()), continuations.join(", "),
        json_string(reason.trim()), confidence.parse::<u32>().map_err(|_| format!("not a number: {confidence:?}"))?));
    Ok(())
}
