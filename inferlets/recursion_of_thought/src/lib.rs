//! `recursion_of_thought`: a problem split recursively into sub-questions, each solved in a forked child context.
//!
//! Recursion of Thought (Lee & Kim, 2023) lets a model work past its context limits by
//! delegating sub-problems to fresh recursive calls whose answers are spliced back into
//! the caller. Here each level asks the model for one simpler sub-question, solves it in a
//! child context forked from the current one (so the whole ancestry's KV pages are shared),
//! recursing until the depth bound, where the sub-question is answered directly; each
//! answer is then fed back into its parent, which answers its own question with it.
//!
//! Requirements: R1, R3
//! Host APIs: forward, embed-text, copy-kvpage (fork), sample, alloc-kvpage, dealloc-kvpage
//! Arguments: --prompt TEXT [--depth D (3, at most 5)] [--step-tokens N (10)]
//! Output: one JSON object {"answer", "depth" (deepest level reached), "levels": [{"question",
//!   "subquestion", "answer"}, ...] from the root down, "branch_lengths": [tokens in each level's context]}.

use std::future::Future;
use std::pin::Pin;

use inferlet::flags::{arg_or, parse_args};
use inferlet::json::{json_array, json_string};
use inferlet::{chat, Context, Model, Sampler, Stop};

inferlet::main!(main);

const USAGE: &str = "--prompt TEXT [--depth D (0..=5)] [--step-tokens N]";
const MAX_DEPTH: usize = 5;

struct Level {
    question: String,
    subquestion: String,
    answer: String,
    length: usize,
}

fn turn(user: &str) -> String {
    format!("<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

/// The user's request at a level: decompose (below the depth bound) or answer directly.
fn request(question: &str, decompose: bool) -> String {
    let task = if decompose { "Before answering, ask one simpler sub-question that would help." } else { "Answer briefly." };
    format!("Question: {question}\n{task}")
}

/// Answers the question `ctx` ends with (an open assistant turn), at recursion `level`:
/// below `depth`, first a sub-question, solved recursively in a fork, its answer fed back.
fn solve<'a>(mut ctx: Context, question: String, level: usize, depth: usize, stop: &'a Stop,
             levels: &'a mut Vec<Level>) -> Pin<Box<dyn Future<Output = Result<String, String>> + 'a>> {
    Box::pin(async move {
        let greedy = Sampler::greedy();
        let index = levels.len();
        levels.push(Level { question: question.clone(), subquestion: String::new(), answer: String::new(), length: 0 });
        if level < depth {
            ctx.fill("Sub-question:");
            let sub = ctx.generate(&greedy, stop).await?.trim().to_string();
            drop_eos(&mut ctx);
            // The child: a fork of this context (its pages shared), asked the sub-question.
            let mut child = ctx.fork();
            child.fill(&turn(&request(&sub, level + 1 < depth)));
            let sub_answer = solve(child, sub.clone(), level + 1, depth, stop, levels).await?;
            ctx.fill(&turn(&format!("The answer to your sub-question is: {sub_answer}\nNow answer the question \"{question}\" briefly.")));
            levels[index].subquestion = sub;
        }
        let answer = ctx.generate(&greedy, stop).await?.trim().to_string();
        levels[index].answer = answer.clone();
        levels[index].length = ctx.len();
        Ok(answer)
    })
}

/// Drops a trailing pending EOS token (the turn is closed by the next fill).
fn drop_eos(ctx: &mut Context) {
    if ctx.pending().last().is_some_and(|t| ctx.queue().eos_tokens().contains(t)) {
        ctx.truncate(ctx.len() - 1);
    }
}

async fn main() -> Result<(), String> {
    let args = parse_args(&inferlet::args(), &["prompt", "depth", "step-tokens"], &[], USAGE)?;
    let prompt = args.get("prompt").ok_or(format!("--prompt is required; usage: {USAGE}"))?;
    let depth: usize = arg_or(&args, "depth", 3, USAGE)?;
    if depth > MAX_DEPTH {
        return Err(format!("--depth {depth} is too deep: at most {MAX_DEPTH} levels of recursion; usage: {USAGE}"));
    }
    let step_tokens: usize = arg_or(&args, "step-tokens", 10, USAGE)?;
    let mut ctx = Model::default_model()?.create_context()?;
    ctx.fill_chat(&[chat("user", &request(prompt, depth > 0))], true)?;
    let stop = Stop::new(step_tokens).eos(ctx.queue().eos_tokens()).string("\n");
    let mut levels = Vec::new();
    let answer = solve(ctx, prompt.clone(), 0, depth, &stop, &mut levels).await?;
    let reached = levels.len() - 1;
    let json = levels.iter().map(|l| format!("{{\"question\": {}, \"subquestion\": {}, \"answer\": {}}}",
                                             json_string(&l.question), json_string(&l.subquestion), json_string(&l.answer)));
    inferlet::send(&format!("{{\"answer\": {}, \"depth\": {reached}, \"levels\": {}, \"branch_lengths\": {}}}",
                            json_string(&answer), json_array(json), json_array(levels.iter().map(|l| l.length))));
    Ok(())
}
