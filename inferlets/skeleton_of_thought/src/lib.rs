//! `skeleton_of_thought`: a short numbered skeleton first, then every point expanded in parallel.
//!
//! Skeleton-of-Thought (Ning et al., 2023) cuts latency by having the model write the
//! outline of its answer, then expanding all points at once instead of one after another.
//! Here the skeleton is generated greedily; each point's expansion is a fork of the shared
//! prefix (question + skeleton), with its own short instruction appended, and all forks are
//! decoded in lockstep so every step's forwards batch into one backend call.
//!
//! Requirements: R1, R3
//! Host APIs: forward, embed-text, copy-kvpage (fork), sample, alloc-kvpage, dealloc-kvpage
//! Arguments: --prompt TEXT [--points N (3)] [--skeleton-tokens N (32)] [--point-tokens N (12)]
//! Output: one JSON object {"skeleton", "points": [..], "expansions": [..], "skeleton_tokens",
//!   "expansion_tokens": [..], "lengths": [tokens in each expansion's context]}.

use inferlet::flags::{arg_or, parse_args};
use inferlet::json::{json_array, json_string};
use inferlet::{chat, generate_branches, Model, Sampler, Stop};

inferlet::main!(main);

const USAGE: &str = "--prompt TEXT [--points N] [--skeleton-tokens N] [--point-tokens N]";

/// The numbered points ("1. text") of a skeleton, in order.
fn points(skeleton: &str) -> Vec<String> {
    skeleton.lines().filter_map(|line| {
        let line = line.trim().trim_start_matches(['-', '*', ' ']);
        let (number, text) = line.split_once(['.', ')'])?;
        (!number.is_empty() && number.chars().all(|c| c.is_ascii_digit()) && !text.trim().is_empty())
            .then(|| text.trim().to_string())
    }).collect()
}

async fn main() -> Result<(), String> {
    let args = parse_args(&inferlet::args(), &["prompt", "points", "skeleton-tokens", "point-tokens"], &[], USAGE)?;
    let prompt = args.get("prompt").ok_or(format!("--prompt is required; usage: {USAGE}"))?;
    let n_points: usize = arg_or(&args, "points", 3, USAGE)?;
    let skeleton_tokens: usize = arg_or(&args, "skeleton-tokens", 32, USAGE)?;
    let point_tokens: usize = arg_or(&args, "point-tokens", 12, USAGE)?;

    let mut ctx = Model::default_model()?.create_context()?;
    let queue = ctx.queue().clone();
    let eos = queue.eos_tokens();
    let ask = format!("Question: {prompt}\nWrite only a skeleton of the answer: a numbered list of {n_points} \
                       points, 3 to 5 words each, one per line.");
    ctx.fill_chat(&[chat("user", &ask)], true)?;
    let skeleton = ctx.generate(&Sampler::greedy(), &Stop::new(skeleton_tokens).eos(eos.clone())).await?;
    let skeleton_len = queue.tokenize(&skeleton).len();
    if ctx.pending().last().is_some_and(|t| eos.contains(t)) {
        ctx.truncate(ctx.len() - 1); // the assistant turn is closed below
    }
    ctx.flush()?; // the shared prefix: question + skeleton, computed once
    let points: Vec<String> = points(&skeleton).into_iter().take(n_points).collect();
    if points.is_empty() {
        return Err(format!("the skeleton has no numbered points: {skeleton:?}"));
    }
    let suffixes: Vec<Vec<u32>> = points.iter().enumerate().map(|(i, point)| queue.tokenize(&format!(
        "<|im_end|>\n<|im_start|>user\nExplain point {} of your list, \"{point}\", in one sentence.<|im_end|>\n\
         <|im_start|>assistant\n", i + 1))).collect();
    let expansions = generate_branches(&ctx, &suffixes, &[Sampler::greedy()], &Stop::new(point_tokens).eos(eos)).await?;
    inferlet::send(&format!(
        "{{\"skeleton\": {}, \"points\": {}, \"expansions\": {}, \"skeleton_tokens\": {skeleton_len}, \
         \"expansion_tokens\": {}, \"lengths\": {}}}",
        json_string(&skeleton), json_array(points.iter().map(|p| json_string(p))),
        json_array(expansions.iter().map(|b| json_string(&b.text))),
        json_array(expansions.iter().map(|b| b.tokens.len())), json_array(expansions.iter().map(|b| b.len()))));
    Ok(())
}
