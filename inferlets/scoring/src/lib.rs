//! `scoring`: a prefill-only request, the workload of PrefillOnly (seed notes): a user
//! profile, then for each post the probability that the user likes it, P(" Yes") against
//! P(" No") after the post and a question. Nothing is generated.
//!
//! Each post is scored by `Context::score`, a pass that writes no KV, over the profile and
//! the post, all posts enqueued at once. The request holds no pages: the server's prefix
//! cache serves each pass in place (pie/control/prefix_cache.py `_serve_in_place`), so the
//! first pass computes the profile's full pages into the cache and the others, held back a
//! batch, read them there, as do later requests with the same profile while they last.
//! With `--own-pages`, the profile is instead run once into the context's own pages (the
//! cache copies its full pages in and out), and each post's pass continues them.
//! With `--hint`, the queue tells the scheduler the request's size in new tokens
//! (`set-job-size`, for `control.scheduler = "srjf"`).
//!
//! Requirements: R1
//! Host APIs: tokenize, execute, take, set-job-size
//! Arguments: --profile TEXT --posts TEXT (posts separated by newlines) [--question TEXT]
//!   [--hint] [--own-pages]
//! Output: one JSON object {"posts": N, "p_yes": [P per post], "logprobs": [[yes, no] per
//!   post], "tokens": input tokens in all}.

use inferlet::flags::{arg_or, parse_args};
use inferlet::join_all;

inferlet::main!(main);

const USAGE: &str = "--profile TEXT --posts TEXT(newline-separated) [--question TEXT] [--hint] [--own-pages]";
const QUESTION: &str = "\nQuestion: would this user like the post above? Answer Yes or No.\nAnswer:";

async fn main() -> Result<(), String> {
    let args = parse_args(&inferlet::args(), &["profile", "posts", "question"], &["hint", "own-pages"], USAGE)?;
    let profile = args.get("profile").ok_or(format!("--profile is required; usage: {USAGE}"))?;
    let posts: Vec<&str> = args.get("posts").ok_or(format!("--posts is required; usage: {USAGE}"))?
        .lines().filter(|p| !p.trim().is_empty()).collect();
    let question: String = arg_or(&args, "question", QUESTION.to_string(), USAGE)?;
    if posts.is_empty() {
        return Err(format!("--posts holds no post; usage: {USAGE}"));
    }
    let model = inferlet::Model::default_model()?;
    let mut ctx = model.create_context()?;
    let queue = ctx.queue().clone();
    let first = |text: &str| queue.tokenize(text).first().copied().ok_or(format!("{text:?} has no token"));
    let candidates = [first(" Yes")?, first(" No")?];
    let profile_tokens = queue.tokenize(&format!("User profile:\n{profile}\n"));
    let suffixes: Vec<Vec<u32>> = posts.iter()
        .map(|post| queue.tokenize(&format!("Post: {post}{question}"))).collect();
    let tokens = profile_tokens.len() + suffixes.iter().map(Vec::len).sum::<usize>();
    if args.contains_key("hint") {
        queue.set_job_size(tokens as u32)?;
    }
    ctx.fill_tokens(&profile_tokens);
    if args.contains_key("own-pages") {
        ctx.flush()?;  // all but the profile's last token, which each score runs with its post
    }
    let scores = join_all(suffixes.iter().map(|s| ctx.score(s, &candidates))).await;
    let mut p_yes = Vec::new();
    let mut logprobs = Vec::new();
    for score in scores {
        let lp = score?;
        let (yes, no) = (lp[0].exp(), lp[1].exp());
        p_yes.push(format!("{:.6}", yes / (yes + no)));
        logprobs.push(format!("[{:.6},{:.6}]", lp[0], lp[1]));
    }
    inferlet::send(&format!("{{\"posts\": {}, \"p_yes\": [{}], \"logprobs\": [{}], \"tokens\": {tokens}}}",
                            posts.len(), p_yes.join(","), logprobs.join(",")));
    Ok(())
}
