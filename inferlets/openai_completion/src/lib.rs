//! `openai_completion`: serves one OpenAI-style completion request (built in, behind `/v1/*`).
//!
//! The server's OpenAI-compatible endpoints launch it once per request.
//!
//! The request arrives as flags; the inferlet prefills the prompt once, forks it `n` ways,
//! decodes the choices concurrently (their calls batch together), and streams one JSON line
//! per text delta, so the endpoint can answer with server-sent events or collect a whole
//! response. Stop strings are held back until they can no longer match; log-probabilities
//! come from the host's next-token distribution. With `--whole` (the endpoint adds it for a
//! non-streamed response) and no stop strings the decode run wakes the inferlet once, at its
//! end, not per token (at 8 concurrent requests the per-token wake, detokenization and
//! message were ~8 ms of control CPU per step on 2 cores); one choice decodes from the prompt
//! itself, with no separate prefill pass and no fork. A one-token completion with
//! log-probabilities (a scoring request) is one pass that writes no KV (`Context::peek_next`).
//!
//! With `--grammar KIND SOURCE` every draw of every choice is masked by that grammar (each
//! choice a parse state of its own), so the text is in its language unless `max_tokens`
//! cuts it (`finish_reason: "length"`). The endpoints pass a `json-schema` for
//! `response_format` and a `lark` grammar for `tools` (a call's arguments valid against its
//! tool's parameters); the kinds are the host's: json-schema, regex, lark, ebnf.
//!
//! Requirements: R2
//! Host APIs: apply-chat-template, tokenize, inference (execute, run, take, cancel), forward, sample, get-next-dist (log-probabilities), copy-kvpage (fork), grammar (compile, matcher sample and accept)
//! Arguments: (--prompt TEXT | --message ROLE CONTENT ...) --max-tokens N [--temperature T] [--top-p P] [--seed S] [--stop TEXT ...] [--n N] [--logprobs K] [--ignore-eos] [--whole] [--grammar KIND SOURCE]
//! Output: JSON lines: {"prompt_tokens": n}, then per choice {"index", "text", "logprobs"?} deltas and a final {"index", "finish_reason", "completion_tokens"}.

use inferlet::{chat, join_all, ChatMessage, Context, Grammar, GrammarKind, Model, Sampler};
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
}

fn parse(args: &[String]) -> Result<Request, String> {
    let mut r = Request { prompt: None, messages: Vec::new(), max_tokens: 16, sampler: Sampler::greedy(),
                          stops: Vec::new(), n: 1, logprobs: None, ignore_eos: false, whole: false,
                          grammar: None };
    let mut rest = args.iter().cloned();
    while let Some(flag) = rest.next() {
        match flag.as_str() {
            "--ignore-eos" => { r.ignore_eos = true; continue; }
            "--whole" => { r.whole = true; continue; }
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
    if r.logprobs.is_none() {
        return streamed(index, ctx, r, eos, sampler, grammar.as_ref()).await;
    }
    // `generated`: the tokens whose text is the completion (an EOS passed over with
    // --ignore-eos counts as a completion token but has no text, as in vLLM).
    let (mut generated, mut count, mut sent, mut finish) = (Vec::new(), 0usize, 0usize, "length");
    while count < r.max_tokens {
        let k = r.logprobs.map(|k| k.clamp(1, 256).max(20));
        let (token, dist) = if let (1, Some(k), None) = (r.max_tokens, k, &grammar) {
            // PrefillOnly's path: one pass that writes no KV draws the token with its
            // distribution (scoring requests: max_tokens 1 with logprobs).
            let (token, ids, probs) = ctx.peek_next(&sampler, k).await?;
            (token, Some((ids, probs)))
        } else {
            let last = ctx.pending().len() as u32 - 1;
            let output = ctx.forward_pending(&[last])?[0];
            let dist = match k {
                Some(k) => Some(queue.next_dist(output, k).await?),
                None => None,
            };
            let token = match &grammar {
                Some(g) => {
                    let token = g.matcher().sample(output, sampler.clone())?.await?;
                    if !eos.contains(&token) {
                        g.matcher().accept(&[token])?;
                    }
                    token
                }
                None => queue.sample(output, &sampler).await?,
            };
            (token, dist)
        };
        sampler.seed = sampler.seed.map(|s| s.wrapping_add(1));
        let is_eos = eos.contains(&token);
        if is_eos && !r.ignore_eos {
            finish = "stop";
            break;
        }
        let logprobs = match (r.logprobs, dist) {
            (Some(k), Some((ids, probs))) => {
                let p = ids.iter().position(|&t| t == token).map(|i| probs[i]).unwrap_or(*probs.last().unwrap());
                let top: Vec<String> = ids.iter().zip(&probs).take(k as usize)
                    .map(|(&t, &p)| Ok(format!("[{},{}]", json_string(&queue.detokenize(&[t])?), p.ln())))
                    .collect::<Result<_, inferlet::Error>>()?;
                format!(",\"token\":{},\"logprob\":{},\"top\":[{}]", json_string(&queue.detokenize(&[token])?), p.ln(), top.join(","))
            }
            _ => String::new(),
        };
        ctx.fill_tokens(&[token]);
        count += 1;
        if is_eos {
            if !logprobs.is_empty() {  // no text, but its log-probability like any token's
                inferlet::send(&format!("{{\"index\":{index},\"text\":\"\"{logprobs}}}"));
            }
            continue;
        }
        generated.push(token);
        let text = queue.detokenize(&generated)?;
        let cut = r.stops.iter().filter_map(|s| text.find(s.as_str())).min();
        let end = cut.unwrap_or_else(|| safe_len(&text, &r.stops));
        let line = format!("{{\"index\":{index},\"text\":{}{logprobs}", json_string(&text[sent.min(end)..end]));
        inferlet::send(&(line + "}"));
        sent = sent.max(end);
        if cut.is_some() {
            finish = "stop";
            break;
        }
    }
    end_choice(index, &queue.detokenize(&generated)?, sent, finish, count, r)
}

/// A choice without log-probabilities: one host-side run (`Context::run`), streamed — the
/// host queues each step on the reply to the last, without waiting for this inferlet.
async fn streamed(index: usize, mut ctx: Context, r: &Request, eos: &[u32], sampler: Sampler,
                  grammar: Option<&Grammar>) -> Result<(), String> {
    let queue = ctx.queue().clone();
    let (mut generated, mut count, mut sent, mut finish) = (Vec::new(), 0usize, 0usize, "length");
    if r.max_tokens > 0 {
        let stop_tokens: &[u32] = if r.ignore_eos { &[] } else { eos };
        // Text goes out as it is drawn when the client streams or a stop string must be
        // watched for; otherwise the run reports its tokens once, when it ends.
        let live = !r.whole || !r.stops.is_empty();
        let mut run = match grammar {
            Some(g) => ctx.run_constrained(g, &sampler, r.max_tokens as u32, stop_tokens, live)?,
            None => ctx.run(&sampler, r.max_tokens as u32, stop_tokens, live)?,
        };
        let mut ended = false;
        while let Some(tokens) = run.next().await? {
            for token in tokens {
                if ended {
                    continue;  // drawn before the cancel took effect: not part of the answer
                }
                let is_eos = eos.contains(&token);
                if is_eos && !r.ignore_eos {
                    finish = "stop";
                    ended = true;
                    continue;
                }
                count += 1;
                if is_eos {
                    continue;
                }
                generated.push(token);
                if !live {
                    continue;
                }
                let text = queue.detokenize(&generated)?;
                let cut = r.stops.iter().filter_map(|s| text.find(s.as_str())).min();
                let end = cut.unwrap_or_else(|| safe_len(&text, &r.stops));
                if end > sent {
                    inferlet::send(&format!("{{\"index\":{index},\"text\":{}}}", json_string(&text[sent..end])));
                }
                sent = sent.max(end);
                if cut.is_some() {
                    finish = "stop";
                    ended = true;
                    run.cancel()?;
                }
            }
        }
        run.finish()?;
    }
    end_choice(index, &queue.detokenize(&generated)?, sent, finish, count, r)
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

async fn main() -> Result<(), String> {
    let r = parse(&inferlet::args())?;
    let model = Model::default_model()?;
    let mut root = model.create_context()?;
    match &r.prompt {
        Some(prompt) => root.fill(prompt),
        None => root.fill_chat(&r.messages, true)?,
    }
    inferlet::send(&format!("{{\"prompt_tokens\":{}}}", root.len()));
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
