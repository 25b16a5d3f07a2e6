//! `openai_completion`: serves one OpenAI-style completion request (built in, behind `/v1/*`).
//!
//! The server's OpenAI-compatible endpoints launch it once per request.
//!
//! The request arrives as flags; the inferlet prefills the prompt once, forks it `n` ways,
//! decodes the choices concurrently (their calls batch together), and streams one JSON line
//! per text delta, so the endpoint can answer with server-sent events or collect a whole
//! response. A choice without log-probabilities is one host-side decode run that wakes the
//! inferlet once, at its end, not per token: streamed (or with stop strings) the host sends
//! its text deltas and cuts it at a stop string itself (`inference.run-text`; waking the
//! inferlet to detokenize and send each token cost ~0.4 ms of control CPU per token, 16 x 64
//! tokens on a Zen 5); with `--whole` and no stop strings the text is decoded once, at the
//! end. Otherwise stop strings are held back until they can no longer match, and
//! log-probabilities come from the host's next-token distribution. One choice decodes from
//! the prompt itself, with no separate prefill pass and no fork. A one-token completion with
//! log-probabilities (a scoring request) is one pass that writes no KV (`Context::peek_next`).
//!
//! With `--grammar KIND SOURCE` every draw of every choice is masked by that grammar (each
//! choice a parse state of its own), so the text is in its language unless `max_tokens`
//! cuts it (`finish_reason: "length"`). The endpoints pass a `json-schema` for
//! `response_format` and a `lark` grammar for `tools` (a call's arguments valid against its
//! tool's parameters); the kinds are the host's: json-schema, regex, lark, ebnf.
//!
//! `--logit-bias`, `--presence-penalty`, `--frequency-penalty` and `--min-tokens` are logit
//! rules the host applies before every draw (in a run it counts the drawn tokens itself);
//! `--stop-token` ids end a choice like EOS. `--echo` starts every choice's text with the
//! prompt (with `--logprobs`, each prompt token's log-probability, from one pass that
//! writes no KV).
//!
//! Requirements: R2
//! Host APIs: apply-chat-template, tokenize, inference (execute, run, run-text, take, cancel), forward, sample, get-next-dist (log-probabilities), copy-kvpage (fork), grammar (compile, matcher sample and accept)
//! Arguments: (--prompt TEXT | --message ROLE CONTENT ...) --max-tokens N [--temperature T] [--top-p P] [--seed S] [--stop TEXT ...] [--n N] [--logprobs K] [--ignore-eos] [--whole] [--grammar KIND SOURCE] [--logit-bias ID BIAS ...] [--presence-penalty P] [--frequency-penalty F] [--min-tokens N] [--stop-token ID ...] [--echo]
//! Output: JSON lines: {"prompt_tokens": n}, then per choice {"index", "text", "logprobs"?} deltas and a final {"index", "finish_reason", "completion_tokens"}.

use inferlet::{chat, join_all, ChatMessage, Context, Grammar, GrammarKind, LogitRules, Model, Sampler, TextEcho, TextStream};
use inferlet::json::json_string;

inferlet::main!(main);

struct Request {
    prompt: Option<String>,
    messages: Vec<ChatMessage>,
    max_tokens: usize,
    sampler: Sampler,
    stops: Vec<String>,
    n: usize,
    logprobs: Option<u32>,
    ignore_eos: bool,
    whole: bool,
    grammar: Option<(GrammarKind, String)>,
    bias: Vec<(u32, f32)>,
    presence: f32,
    frequency: f32,
    min_tokens: u32,
    stop_ids: Vec<u32>,
    echo: bool,
}

fn parse(args: &[String]) -> Result<Request, String> {
    let mut r = Request { prompt: None, messages: Vec::new(), max_tokens: 16, sampler: Sampler::greedy(),
                          stops: Vec::new(), n: 1, logprobs: None, ignore_eos: false, whole: false,
                          grammar: None, bias: Vec::new(), presence: 0.0, frequency: 0.0, min_tokens: 0,
                          stop_ids: Vec::new(), echo: false };
    let mut rest = args.iter().cloned();
    while let Some(flag) = rest.next() {
        match flag.as_str() {
            "--ignore-eos" => { r.ignore_eos = true; continue; }
            "--whole" => { r.whole = true; continue; }
            "--echo" => { r.echo = true; continue; }
            _ => {}
        }
        let mut value = || rest.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--prompt" => r.prompt = Some(value()?),
            "--message" => {
                let (role, content) = (value()?, value()?);
                r.messages.push(chat(&role, &content));
            }
            "--max-tokens" => r.max_tokens = number(&flag, value()?)?,
            "--temperature" => r.sampler.temperature = number(&flag, value()?)?,
            "--top-p" => r.sampler.top_p = number(&flag, value()?)?,
            "--seed" => r.sampler.seed = Some(number(&flag, value()?)?),
            "--stop" => r.stops.push(value()?),
            "--n" => r.n = number(&flag, value()?)?,
            "--logprobs" => r.logprobs = Some(number(&flag, value()?)?),
            "--logit-bias" => {
                let token = number(&flag, value()?)?;
                r.bias.push((token, number(&flag, value()?)?));
            }
            "--presence-penalty" => r.presence = number(&flag, value()?)?,
            "--frequency-penalty" => r.frequency = number(&flag, value()?)?,
            "--min-tokens" => r.min_tokens = number(&flag, value()?)?,
            "--stop-token" => r.stop_ids.push(number(&flag, value()?)?),
            "--grammar" => {
                let kind = match value()?.as_str() {
                    "json-schema" => GrammarKind::JsonSchema,
                    "regex" => GrammarKind::Regex,
                    "lark" => GrammarKind::Lark,
                    "ebnf" => GrammarKind::Ebnf,
                    other => return Err(format!("unknown grammar kind {other:?} (json-schema, regex, lark, ebnf)")),
                };
                r.grammar = Some((kind, value()?));
            }
            _ => return Err(format!("unknown argument {flag:?}")),
        }
    }
    if r.prompt.is_none() && r.messages.is_empty() {
        return Err("--prompt or --message is required".into());
    }
    if r.grammar.is_some() && r.ignore_eos {
        return Err("--grammar and --ignore-eos exclude each other (the grammar ends the output)".into());
    }
    Ok(r)
}

fn number<T: std::str::FromStr>(flag: &str, value: String) -> Result<T, String> {
    value.parse().map_err(|_| format!("invalid number for {flag}: {value:?}"))
}


/// How much of `text` may be sent: all of it, except a trailing partial UTF-8 character
/// and any suffix that could still grow into a stop string.
fn safe_len(text: &str, stops: &[String]) -> usize {
    let mut end = text.trim_end_matches('\u{FFFD}').len();
    for stop in stops {
        for k in (1..stop.len()).rev() {
            if stop.is_char_boundary(k) && text[..end].ends_with(&stop[..k]) {
                end = end.min(text[..end].len() - k);
                break;
            }
        }
    }
    end
}

impl Request {
    /// The tokens that end a choice: EOS (unless --ignore-eos) and every --stop-token.
    fn stop_tokens(&self, eos: &[u32]) -> Vec<u32> {
        let mut stops = if self.ignore_eos { Vec::new() } else { eos.to_vec() };
        stops.extend(&self.stop_ids);
        stops
    }

    /// The logit rules for a draw after `seen` completion tokens: the bias, the penalties
    /// over the completion so far, and the stop tokens banned until --min-tokens.
    fn rules(&self, stops: &[u32], seen: &[u32]) -> LogitRules {
        let mut rules = LogitRules::new().penalties(self.presence, self.frequency).seen(seen)
            .ban_until(stops, self.min_tokens);
        for &(token, value) in &self.bias {
            rules = rules.bias(token, value);
        }
        rules
    }
}

async fn choice(index: usize, mut ctx: Context, r: &Request, eos: &[u32]) -> Result<(), String> {
    let queue = ctx.queue().clone();
    let mut sampler = r.sampler.clone();
    if let Some(seed) = sampler.seed.as_mut() {
        *seed = seed.wrapping_add(1_000_003 * index as u64);
    }
    // A response format or tools: each choice's own parse state, on its queue (the host
    // masks every draw with it; once the grammar is complete only EOS is allowed).
    let grammar = match &r.grammar {
        Some((kind, source)) => Some(Grammar::compile(&queue, *kind, source)?),
        None => None,
    };
    let stops = r.stop_tokens(eos);
    if r.logprobs.is_none() {
        return streamed(index, ctx, r, eos, &stops, sampler, grammar.as_ref()).await;
    }
    // `text`: the completion's tokens and text (an EOS passed over with --ignore-eos counts
    // as a completion token but has no text, as in vLLM); `drawn`: every token drawn, which
    // the penalties count.
    let (mut text, mut drawn, mut sent, mut finish) = (TextStream::new(&queue), Vec::new(), 0usize, "length");
    while drawn.len() < r.max_tokens {
        let k = r.logprobs.map(|k| k.clamp(1, 256).max(20)).unwrap_or(0);
        let rules = r.rules(&stops, &drawn);
        let (token, ids, probs) = if r.max_tokens == 1 && grammar.is_none() && rules.is_empty() {
            // PrefillOnly's path: one pass that writes no KV draws the token with its
            // distribution (scoring requests: max_tokens 1 with logprobs).
            ctx.peek_next(&sampler, k).await?
        } else {
            // One fused pass: the rules, the grammar's mask, the draw and the distribution.
            let drew = ctx.draw_next(&sampler, k, grammar.as_ref(), Some(&rules)).await?;
            if let Some(g) = &grammar {
                if !stops.contains(&drew.0) {
                    g.matcher().accept(&[drew.0])?;
                }
            }
            drew
        };
        sampler.seed = sampler.seed.map(|s| s.wrapping_add(1));
        if stops.contains(&token) {
            finish = "stop";
            break;
        }
        let logprobs = match r.logprobs {
            Some(k) if !ids.is_empty() => {
                let p = ids.iter().position(|&t| t == token).map(|i| probs[i]).unwrap_or(*probs.last().unwrap());
                let top: Vec<String> = ids.iter().zip(&probs).filter(|(_, &p)| p > 0.0).take(k as usize)
                    .map(|(&t, &p)| Ok(format!("[{},{}]", json_string(&queue.detokenize(&[t])?), p.ln())))
                    .collect::<Result<_, inferlet::Error>>()?;
                format!(",\"token\":{},\"logprob\":{},\"top\":[{}]", json_string(&queue.detokenize(&[token])?), p.ln(), top.join(","))
            }
            _ => String::new(),
        };
        drawn.push(token);
        if eos.contains(&token) {
            if !logprobs.is_empty() {  // no text, but its log-probability like any token's
                inferlet::send(&format!("{{\"index\":{index},\"text\":\"\"{logprobs}}}"));
            }
            continue;
        }
        text.push(&[token])?;
        let cut = r.stops.iter().filter_map(|s| text.text().find(s.as_str())).min();
        let end = cut.unwrap_or_else(|| safe_len(text.text(), &r.stops));
        let line = format!("{{\"index\":{index},\"text\":{}{logprobs}", json_string(&text.text()[sent.min(end)..end]));
        inferlet::send(&(line + "}"));
        sent = sent.max(end);
        if cut.is_some() {
            finish = "stop";
            break;
        }
    }
    end_choice(index, &text.finish()?, sent, finish, drawn.len(), r)
}

/// A choice without log-probabilities: one host-side run (`Context::run_with_rules`),
/// streamed — the host queues each step on the reply to the last, without waiting for
/// this inferlet, and applies the logit rules and the grammar at every step.
async fn streamed(index: usize, mut ctx: Context, r: &Request, eos: &[u32], stops: &[u32], sampler: Sampler,
                  grammar: Option<&Grammar>) -> Result<(), String> {
    let queue = ctx.queue().clone();
    let (mut count, mut finish, mut text) = (0usize, "length", String::new());
    if r.max_tokens > 0 {
        // Text goes out as it is drawn when the client streams or a stop string must be
        // watched for: the host sends it (`run-text`), so this inferlet is not woken per
        // token; otherwise the run reports its tokens once, when it ends.
        let live = !r.whole || !r.stops.is_empty();
        let rules = r.rules(stops, &[]);
        let mut run = if live {
            let echo = TextEcho { prefix: format!("{{\"index\":{index},\"text\":"), suffix: "}".into(), json: true,
                                  stop_strings: r.stops.clone(), hidden: eos.to_vec() };
            ctx.run_text(&sampler, &rules, grammar, r.max_tokens as u32, stops, echo)?
        } else {
            ctx.run_with_rules(&sampler, &rules, grammar, r.max_tokens as u32, stops, false)?
        };
        let mut drawn = Vec::new();
        while let Some(tokens) = run.next().await? {
            drawn.extend(tokens);
        }
        run.finish()?;
        if drawn.last().is_some_and(|t| stops.contains(t)) {
            drawn.pop();
            finish = "stop";
        }
        count = drawn.len();
        let visible: Vec<u32> = drawn.into_iter().filter(|t| !eos.contains(t)).collect();
        if !live {
            text = queue.detokenize(&visible)?;  // sent now, whole
        } else if !r.stops.is_empty() {
            // The host sent the text, cut before a stop string if one ended the run.
            let sent = queue.detokenize(&visible)?;
            if r.stops.iter().any(|s| sent.contains(s.as_str())) {
                finish = "stop";
            }
        }
    }
    end_choice(index, &text, 0, finish, count, r)
}

/// The rest of the text (up to a stop string) and the choice's finish line.
fn end_choice(index: usize, text: &str, sent: usize, finish: &str, count: usize, r: &Request) -> Result<(), String> {
    let end = r.stops.iter().filter_map(|s| text.find(s.as_str())).min().unwrap_or(text.len());
    if end > sent {
        inferlet::send(&format!("{{\"index\":{index},\"text\":{}}}", json_string(&text[sent..end])));
    }
    inferlet::send(&format!("{{\"index\":{index},\"finish_reason\":\"{finish}\",\"completion_tokens\":{count}}}"));
    Ok(())
}

/// `--echo`: the prompt as the start of every choice's text — with `--logprobs`, a line per
/// prompt token with its log-probability after the tokens before it (none for the first),
/// from one pass that writes no KV; without, one line. The fields after "index".
async fn echo(root: &Context, r: &Request) -> Result<Vec<String>, String> {
    let queue = root.queue();
    let prompt = root.pending().to_vec();
    let Some(k) = r.logprobs else {
        return Ok(vec![format!("\"text\":{}", json_string(&queue.detokenize(&prompt)?))]);
    };
    let scored = root.prompt_logprobs(k.max(1)).await?;
    let (mut lines, mut sent) = (Vec::new(), 0usize);
    for (i, &token) in prompt.iter().enumerate() {
        let text = queue.detokenize(&prompt[..=i])?;
        let end = if i + 1 == prompt.len() { text.len() } else { safe_len(&text, &[]) };
        let piece = json_string(&text[sent.min(end)..end]);
        sent = sent.max(end);
        let token_text = json_string(&queue.detokenize(&[token])?);
        lines.push(match i.checked_sub(1).map(|j| &scored[j]) {
            None => format!("\"text\":{piece},\"token\":{token_text},\"logprob\":null,\"top\":null"),
            Some((logprob, ids, probs)) => {
                let top: Vec<String> = ids.iter().zip(probs).filter(|(_, &p)| p > 0.0).take(k as usize)
                    .map(|(&t, &p)| Ok(format!("[{},{}]", json_string(&queue.detokenize(&[t])?), p.ln())))
                    .collect::<Result<_, inferlet::Error>>()?;
                format!("\"text\":{piece},\"token\":{token_text},\"logprob\":{logprob},\"top\":[{}]", top.join(","))
            }
        });
    }
    Ok(lines)
}

async fn main() -> Result<(), String> {
    let r = parse(&inferlet::args())?;
    let model = Model::default_model()?;
    let mut root = model.create_context()?;
    match &r.prompt {
        Some(prompt) => root.fill(prompt),
        None => root.fill_chat(&r.messages, true)?,
    }
    inferlet::send(&format!("{{\"prompt_tokens\":{}}}", root.len()));
    if r.echo {
        let lines = echo(&root, &r).await?;
        for index in 0..r.n {
            for line in &lines {
                inferlet::send(&format!("{{\"index\":{index},{line}}}"));
            }
        }
    }
    let eos = root.queue().eos_tokens();
    if r.n == 1 {
        return choice(0, root, &r, &eos).await;
    }
    root.flush()?;
    let forks: Vec<Context> = (0..r.n).map(|_| root.fork()).collect();
    drop(root);
    for outcome in join_all(forks.into_iter().enumerate().map(|(i, ctx)| choice(i, ctx, &r, &eos))).await {
        outcome?;
    }
    Ok(())
}
