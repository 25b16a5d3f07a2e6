//! `agent_codeact`: a CodeAct agent whose actions are Python snippets run by the tool server.
//!
//! CodeAct (Wang et al.) lets the model act by writing executable code instead of JSON tool
//! calls; the interpreter's output is the observation. Here each step the model writes one
//! line of Python after `Code:`, the inferlet POSTs it to the tool server's sandboxed
//! `execute` tool, and the stdout (or the error) is appended as `Output:` to the same
//! context: the KV cache of everything before it is kept, only new tokens are run. A line
//! that is not plausible Python (no `print(`, unbalanced parentheses) is cut off and the
//! step's scripted snippet (`--fallback`, cycled) runs instead; the report says which.
//!
//! Requirements: R3
//! Host APIs: http-post, forward, sample, tokenize, detokenize
//! Arguments: --tools-url URL --task TEXT [--steps N (2)] [--max-tokens N per line (24)]
//!   [--fallback CODE]... (default: print(sum(range(10))))
//! Output: one JSON object {"task", "steps": [{"code", "output", "exit_code", "source":
//!   "model"|"scripted", "model_text"}], "model_chosen", "scripted", "context_tokens",
//!   "discarded_tokens", "context"} (context = the final context's text).

use inferlet::http;
use inferlet::json::{json_string, json_value};
use inferlet::{chat, Line};

inferlet::main!(main);

const USAGE: &str = "usage: --tools-url URL --task TEXT [--steps N] [--max-tokens N] [--fallback CODE]...";

const PROMPT: &str = "Solve the task by writing Python. Each step, write one line of Python \
that prints a result after \"Code:\"; you will see what it prints after \"Output:\".\n\
Example:\nTask: What is 6 * 7?\nCode: print(6 * 7)\nOutput: 42\n\nTask: ";

async fn main() -> Result<(), String> {
    let (mut url, mut task, mut steps, mut max_tokens, mut fallbacks) = (None, None, 2usize, 24usize, Vec::new());
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or(format!("{flag} needs a value; {USAGE}"))?;
        match flag.as_str() {
            "--tools-url" => url = Some(value.trim_end_matches('/').to_string()),
            "--task" => task = Some(value.clone()),
            "--steps" => steps = value.parse().map_err(|_| format!("bad --steps; {USAGE}"))?,
            "--max-tokens" => max_tokens = value.parse().map_err(|_| format!("bad --max-tokens; {USAGE}"))?,
            "--fallback" => fallbacks.push(value.clone()),
            _ => return Err(format!("unknown argument {flag:?}; {USAGE}")),
        }
    }
    let (url, task) = (url.ok_or(USAGE)?, task.ok_or(USAGE)?);
    if fallbacks.is_empty() {
        fallbacks.push("print(sum(range(10)))".to_string());
    }

    let mut ctx = inferlet::Model::default_model()?.create_context()?;
    ctx.fill_chat(&[chat("user", &format!("{PROMPT}{task}"))], true)?;
    let (mut records, mut chosen, mut discarded) = (Vec::new(), 0, 0);
    for step in 0..steps {
        ctx.fill("Code:");
        let mark = ctx.len();
        let Line { text, newline, .. } = ctx.decode_line(max_tokens, &['\n'], |_, _| {}).await?;
        let (code, source, newline) = if plausible_python(&text) {
            chosen += 1;
            (text.trim().to_string(), "model", newline)
        } else {
            discarded += ctx.committed().len().saturating_sub(mark);
            ctx.truncate(mark);
            let code = fallbacks[step % fallbacks.len()].clone();
            ctx.fill(&format!(" {code}"));
            (code, "scripted", false)
        };
        let response = http::post_json(&format!("{url}/tools/execute"), &format!("{{\"code\": {}}}", json_string(&code))).await?;
        let field = |key| json_value(&response.body, key).unwrap_or_default();
        let exit_code = field("exit_code");
        let output = match (exit_code.as_str(), field("error")) {
            (_, error) if !error.is_empty() => format!("Error: {error}"),
            ("0", _) => field("stdout").trim_end().to_string(),
            _ => format!("Error: {}", field("stderr").trim_end().lines().last().unwrap_or("")),
        };
        let output: String = output.chars().take(200).collect();
        ctx.fill(&format!("{}Output: {output}\n", if newline { "" } else { "\n" }));
        records.push(format!("{{\"code\": {}, \"output\": {}, \"exit_code\": {}, \"source\": {}, \"model_text\": {}}}",
            json_string(&code), json_string(&output), if exit_code.is_empty() { "null" } else { &exit_code },
            json_string(source), json_string(&text)));
    }
    let context = ctx.queue().detokenize(&ctx.tokens())?;
    inferlet::send(&format!(
        "{{\"task\": {}, \"steps\": [{}], \"model_chosen\": {chosen}, \"scripted\": {}, \"context_tokens\": {}, \
         \"discarded_tokens\": {discarded}, \"context\": {}}}",
        json_string(&task), records.join(", "), steps - chosen, ctx.len(), json_string(&context)));
    Ok(())
}

/// One line that prints something, with balanced parentheses and no markdown fence.
fn plausible_python(line: &str) -> bool {
    let mut depth = 0i32;
    for c in line.chars() {
        depth += match c { '(' => 1, ')' => -1, _ => 0 };
        if depth < 0 {
            return false;
        }
    }
    depth == 0 && line.contains("print(") && !line.contains("```")
}
