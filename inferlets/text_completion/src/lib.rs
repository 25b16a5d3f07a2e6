//! `text_completion`: one chat-template completion, or with `--turns` a chat session, one message per reply (built in).
//!
//! The plain prefill–decode loop a serving engine runs for every request, as a program:
//! the prompt is the user turn (after the system turn, if given) of the model's chat
//! template. Decoding is greedy unless a temperature above 0 or a top-p below 1 is given
//! (top-p alone samples at temperature 1); it stops at the model's EOS tokens or after N
//! tokens. With `--turns N` it is a chat session: after each reply it waits for the next
//! user message (sent to the instance) and answers it on the same context, so earlier
//! turns are never prefilled again. `--objective latency` marks its queue interactive
//! (`scheduling.set-queue-objective`: served first, other work chunked around it).
//!
//! Requirements: R2
//! Host APIs: apply-chat-template, tokenize, inference (execute, run, take), detokenize,
//!   receive, scheduling (set-queue-objective)
//! Arguments: --prompt TEXT --max-tokens N [--system TEXT] [--temperature T] [--top-p P] [--seed S]
//!   [--turns N] [--objective latency|throughput|background]
//! Output: one message per turn, the completion.

use inferlet::{chat, Model, Objective, Sampler, Stop};

inferlet::main!(main);

struct Options {
    prompt: String,
    max_tokens: usize,
    system: Option<String>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    turns: usize,
    objective: Option<Objective>,
}

const USAGE: &str = "usage: --prompt TEXT --max-tokens N [--system TEXT] [--temperature T] [--top-p P] \
                     [--seed S] [--turns N] [--objective latency|throughput|background]";

fn parse(args: &[String]) -> Result<Options, String> {
    let (mut prompt, mut max_tokens, mut system, mut temperature, mut top_p, mut seed) =
        (None, None, None, None, None, None);
    let (mut turns, mut objective) = (1, None);
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
            "--turns" => turns = number(flag, value)?,
            "--objective" => objective = Some(match value.as_str() {
                "latency" => Objective::Latency,
                "throughput" => Objective::Throughput,
                "background" => Objective::Background,
                _ => return Err(format!("--objective must be latency, throughput or background, not {value:?}")),
            }),
            _ => return Err(format!("unknown argument {flag:?}; {USAGE}")),
        }
    }
    if turns == 0 {
        return Err("--turns must be at least 1".into());
    }
    Ok(Options {
        prompt: prompt.ok_or("--prompt is required")?,
        max_tokens: max_tokens.ok_or("--max-tokens is required")?,
        system, temperature, top_p, seed, turns, objective,
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
    if let Some(objective) = options.objective {
        ctx.queue().set_objective(objective, "")?;
    }
    let mut messages = Vec::new();
    if let Some(system) = &options.system {
        messages.push(chat("system", system));
    }
    messages.push(chat("user", &options.prompt));
    let mut rendered = ctx.queue().apply_chat_template(&messages, true)?;
    ctx.fill(&rendered);
    let eos = ctx.queue().eos_tokens();
    let stop = Stop::new(options.max_tokens).eos(eos.clone());
    for turn in 1..=options.turns {
        let completion = ctx.generate(&sampler(&options), &stop).await?;
        inferlet::send(&completion);
        if turn == options.turns {
            break;
        }
        // The next turn: what the template renders beyond the conversation so far.
        let next = inferlet::receive().await;
        messages.push(chat("assistant", &completion));
        messages.push(chat("user", &next));
        let whole = ctx.queue().apply_chat_template(&messages, true)?;
        let rest = whole.strip_prefix(&format!("{rendered}{completion}"))
            .ok_or("the chat template does not render the conversation as a continuation of its earlier turns")?;
        let mut tokens = ctx.queue().tokenize(rest);
        // A reply that ended on EOS left it pending: the template's end of turn is that token.
        let ended = ctx.pending().last().is_some_and(|t| eos.contains(t));
        if ended && tokens.first() == ctx.pending().last() {
            tokens.remove(0);
        }
        ctx.fill_tokens(&tokens);
        rendered = whole;
    }
    Ok(())
}
