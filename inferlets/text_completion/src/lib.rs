//! `text_completion`: one chat-template completion, sent as one message (built in).
//!
//! The plain prefill–decode loop a serving engine runs for every request, as a program:
//! the prompt is the user turn (after the system turn, if given) of the model's chat
//! template. Decoding is greedy unless a temperature above 0 or a top-p below 1 is given
//! (top-p alone samples at temperature 1); it stops at the model's EOS tokens or after N
//! tokens.
//!
//! Requirements: R2
//! Host APIs: apply-chat-template, tokenize, inference (execute, run, take), detokenize
//! Arguments: --prompt TEXT --max-tokens N [--system TEXT] [--temperature T] [--top-p P] [--seed S]
//! Output: one message, the completion.

use inferlet::{chat, Model, Sampler, Stop};

inferlet::main!(main);

struct Options {
    prompt: String,
    max_tokens: usize,
    system: Option<String>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
}

fn parse(args: &[String]) -> Result<Options, String> {
    let (mut prompt, mut max_tokens, mut system, mut temperature, mut top_p, mut seed) =
        (None, None, None, None, None, None);
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--prompt" => prompt = Some(value.clone()),
            "--max-tokens" => max_tokens = Some(number(flag, value)?),
            "--system" => system = Some(value.clone()),
            "--temperature" => temperature = Some(number(flag, value)?),
            "--top-p" => top_p = Some(number(flag, value)?),
            "--seed" => seed = Some(number(flag, value)?),
            _ => return Err(format!("unknown argument {flag:?}; usage: --prompt TEXT --max-tokens N \
                                     [--system TEXT] [--temperature T] [--top-p P] [--seed S]")),
        }
    }
    Ok(Options {
        prompt: prompt.ok_or("--prompt is required")?,
        max_tokens: max_tokens.ok_or("--max-tokens is required")?,
        system, temperature, top_p, seed,
    })
}

fn number<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T, String> {
    value.parse().map_err(|_| format!("invalid number for {flag}: {value:?}"))
}

fn sampler(options: &Options) -> Sampler {
    let temperature = options.temperature.unwrap_or(if options.top_p.is_some() { 1.0 } else { 0.0 });
    let sampler = match options.top_p {
        Some(p) => Sampler::top_p(temperature, p),
        None => Sampler::temperature(temperature),
    };
    match options.seed {
        Some(seed) => sampler.with_seed(seed),
        None => sampler,
    }
}

async fn main() -> Result<(), String> {
    let options = parse(&inferlet::args())?;
    let model = Model::default_model()?;
    let mut ctx = model.create_context()?;
    let mut messages = Vec::new();
    if let Some(system) = &options.system {
        messages.push(chat("system", system));
    }
    messages.push(chat("user", &options.prompt));
    ctx.fill_chat(&messages, true)?;
    let stop = Stop::new(options.max_tokens).eos(ctx.queue().eos_tokens());
    let completion = ctx.generate(&sampler(&options), &stop).await?;
    inferlet::send(&completion);
    Ok(())
}
