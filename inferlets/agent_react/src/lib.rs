//! `agent_react`: a ReAct agent (Thought / Action / Observation) calling tools over HTTP.
//!
//! ReAct (Yao et al.) interleaves reasoning and acting: the model writes a thought, then an
//! action naming a tool, and the tool's answer comes back as an observation it reads before
//! the next thought. Here the whole loop runs inside the inferlet: each action is a POST to
//! the tool server (calculator, search) from the inferlet itself, and each observation is
//! appended to the same context, so the KV cache of everything before it is kept and only
//! the new tokens are run (no re-prefill between calls). When the model's action line does
//! not parse as `tool[input]`, it is cut off and a scripted action for that step replaces it
//! (the report counts model-chosen and scripted steps). Decoding is greedy.
//!
//! Requirements: R3
//! Host APIs: http-post, forward, sample, tokenize, detokenize
//! Arguments: --tools-url URL --question TEXT [--steps N (3)] [--max-tokens N per line (16)]
//! Output: one JSON object {"question", "steps": [{"thought", "tool", "input", "observation",
//!   "source": "model"|"scripted", "model_text"}], "answer", "model_chosen", "scripted", "context_tokens",
//!   "discarded_tokens", "context"} (context = the final context's text).

use inferlet::http;
use inferlet::json::{json_string, json_value};
use inferlet::{chat, Line};

inferlet::main!(main);

const USAGE: &str = "usage: --tools-url URL --question TEXT [--steps N] [--max-tokens N]";

const PROMPT: &str = "Answer the question with tools.\nTools:\n\
calculator[expression]: evaluates arithmetic, e.g. calculator[2 * (3 + 4)]\n\
search[query]: looks up a fact, e.g. search[capital of Japan]\n\
Example:\nQuestion: What is 6 * 7?\nThought: I need to multiply 6 by 7.\nAction: calculator[6 * 7]\n\
Observation: 42\nFinal Answer: 42\n\nQuestion: ";

async fn main() -> Result<(), String> {
    let (mut url, mut question, mut steps, mut max_tokens) = (None, None, 3usize, 16usize);
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or(format!("{flag} needs a value; {USAGE}"))?;
        match flag.as_str() {
            "--tools-url" => url = Some(value.trim_end_matches('/').to_string()),
            "--question" => question = Some(value.clone()),
            "--steps" => steps = value.parse().map_err(|_| format!("bad --steps; {USAGE}"))?,
            "--max-tokens" => max_tokens = value.parse().map_err(|_| format!("bad --max-tokens; {USAGE}"))?,
            _ => return Err(format!("unknown argument {flag:?}; {USAGE}")),
        }
    }
    let (url, question) = (url.ok_or(USAGE)?, question.ok_or(USAGE)?);

    let mut ctx = inferlet::Model::default_model()?.create_context()?;
    ctx.fill_chat(&[chat("user", &format!("{PROMPT}{question}"))], true)?;
    let (mut records, mut chosen, mut discarded) = (Vec::new(), 0, 0);
    let mut newline = true;
    for step in 0..steps {
        ctx.fill(if newline { "Thought:" } else { "\nThought:" });
        let Line { text: thought, newline: nl, .. } = ctx.decode_line(max_tokens, &['\n'], |_, _| {}).await?;
        ctx.fill(if nl { "Action:" } else { "\nAction:" });
        let mark = ctx.len();
        let text = ctx.decode_line(max_tokens, &['\n', ']'], |_, _| {}).await?.text;
        let (tool, input, source) = match parse_action(&text) {
            Some((tool, input)) => { chosen += 1; (tool, input, "model") }
            None => {
                // Forget the unusable action line (its forwarded tokens are counted).
                discarded += ctx.committed().len().saturating_sub(mark);
                ctx.truncate(mark);
                let (tool, input) = scripted_action(step, &question);
                ctx.fill(&format!(" {tool}[{input}]"));
                (tool, input, "scripted")
            }
        };
        let observation = call_tool(&url, tool, &input).await?;
        ctx.fill(&format!("\nObservation: {observation}\n"));
        newline = true;
        records.push(format!("{{\"thought\": {}, \"tool\": {}, \"input\": {}, \"observation\": {}, \"source\": {}, \"model_text\": {}}}",
            json_string(thought.trim()), json_string(tool), json_string(&input),
            json_string(&observation), json_string(source), json_string(&text)));
    }
    ctx.fill("Final Answer:");
    let answer = ctx.decode_line(max_tokens, &['\n'], |_, _| {}).await?.text;
    let context = ctx.queue().detokenize(&ctx.tokens())?;
    inferlet::send(&format!(
        "{{\"question\": {}, \"steps\": [{}], \"answer\": {}, \"model_chosen\": {chosen}, \"scripted\": {}, \
         \"context_tokens\": {}, \"discarded_tokens\": {discarded}, \"context\": {}}}",
        json_string(&question), records.join(", "), json_string(answer.trim()), steps - chosen,
        ctx.len(), json_string(&context)));
    Ok(())
}

/// `tool[input]` with a known tool and a non-empty input.
fn parse_action(text: &str) -> Option<(&'static str, String)> {
    let (name, rest) = text.split_once('[')?;
    let input = rest.split_once(']')?.0.trim();
    let tool = ["calculator", "search"].into_iter().find(|t| name.trim().eq_ignore_ascii_case(t))?;
    (!input.is_empty()).then(|| (tool, input.to_string()))
}

/// The fallback plan: the arithmetic in the question (if any) on even steps, a search for
/// the question on odd ones.
fn scripted_action(step: usize, question: &str) -> (&'static str, String) {
    let math = question.split(|c: char| !"0123456789+-*/(). ".contains(c)).map(|s| s.trim().trim_end_matches('.'))
        .find(|s| s.contains(|c: char| c.is_ascii_digit()) && s.contains(['+', '-', '*', '/']));
    match math {
        Some(math) if step % 2 == 0 => ("calculator", math.to_string()),
        _ => ("search", question.to_string()),
    }
}

/// Calls a tool on the tool server; the observation the model reads (result, first search
/// hit, or the server's error message), at most 200 characters.
async fn call_tool(url: &str, tool: &str, input: &str) -> Result<String, String> {
    let body = match tool {
        "calculator" => format!("{{\"expression\": {}}}", json_string(input)),
        _ => format!("{{\"query\": {}, \"k\": 1}}", json_string(input)),
    };
    let response = http::post_json(&format!("{url}/tools/{tool}"), &body).await?;
    let observation = json_value(&response.body, "error")
        .or_else(|| json_value(&response.body, if tool == "calculator" { "result" } else { "text" }))
        .unwrap_or_else(|| "no result".to_string());
    Ok(observation.chars().take(200).collect())
}
