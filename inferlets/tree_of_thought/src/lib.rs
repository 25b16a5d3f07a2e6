//! `tree_of_thought`: a tree of partial thoughts, each scored by the model; the best is expanded.
//!
//! Tree of Thoughts (Yao et al., 2023) searches over intermediate reasoning steps: several
//! candidate next thoughts are proposed, the model itself judges each, and the search
//! continues from the most promising. Here every level proposes `breadth` thoughts as forks
//! of the current node (seeded sampling, decoded in lockstep), scores each by the model's
//! probability of answering "yes" to "is this a good step?" (one batched forward per level,
//! again on forks), and descends into the best thought for `depth` levels. Every node is a
//! fork of its parent, so the prompt's and ancestors' KV pages are shared, never recomputed.
//!
//! Requirements: R1, R3
//! Host APIs: forward, embed-text, copy-kvpage (fork), sample, get-next-dist, alloc-kvpage, dealloc-kvpage
//! Arguments: --prompt TEXT [--breadth B (3)] [--depth D (2)] [--thought-tokens N (12)] [--seed S (1)]
//! Output: one JSON object {"best_path": [thought, ...], "scores": [[per child] per level],
//!   "thoughts": [[per child] per level], "branch_tokens": [generated tokens per branch],
//!   "branch_lengths": [tokens in each branch's context], "prompt_tokens"}.

use inferlet::branch::{next_dists, probability_of};
use inferlet::flags::{arg_or, parse_args};
use inferlet::json::{json_array, json_string};
use inferlet::{chat, generate_branches, Model, Sampler, Stop};

inferlet::main!(main);

const USAGE: &str = "--prompt TEXT [--breadth B] [--depth D] [--thought-tokens N] [--seed S]";
const JUDGE: &str = "<|im_end|>\n<|im_start|>user\nIs this a good next step toward solving the problem? \
                     Answer yes or no.<|im_end|>\n<|im_start|>assistant\n";

async fn main() -> Result<(), String> {
    let args = parse_args(&inferlet::args(), &["prompt", "breadth", "depth", "thought-tokens", "seed"], &[], USAGE)?;
    let prompt = args.get("prompt").ok_or(format!("--prompt is required; usage: {USAGE}"))?;
    let breadth: usize = arg_or(&args, "breadth", 3, USAGE)?;
    let depth: usize = arg_or(&args, "depth", 2, USAGE)?;
    let tokens: usize = arg_or(&args, "thought-tokens", 12, USAGE)?;
    let seed: u64 = arg_or(&args, "seed", 1, USAGE)?;
    if !(1..=8).contains(&breadth) || !(1..=4).contains(&depth) {
        return Err(format!("--breadth must be 1..=8 and --depth 1..=4; usage: {USAGE}"));
    }
    let mut node = Model::default_model()?.create_context()?;
    let queue = node.queue().clone();
    let ask = format!("Problem: {prompt}\nSolve it step by step. Write one short step at a time.");
    node.fill_chat(&[chat("user", &ask)], true)?;
    let prompt_tokens = node.len();
    let judge = queue.tokenize(JUDGE);
    let stop = Stop::new(tokens).eos(queue.eos_tokens());
    let (mut path, mut all_scores, mut all_thoughts, mut lengths, mut counts) = (vec![], vec![], vec![], vec![], vec![]);
    for level in 0..depth as u64 {
        node.flush()?; // the node's KV, shared by its children and their judges
        let samplers: Vec<Sampler> = (0..breadth as u64)
            .map(|i| Sampler::top_k(0.8, 40).with_seed(seed + level * 1_000_003 + i * 7919)).collect();
        let children = generate_branches(&node, &vec![Vec::new(); breadth], &samplers, &stop).await?;
        let judged: Vec<Vec<u32>> = children.iter().map(|c| [c.tokens.as_slice(), &judge].concat()).collect();
        let dists = next_dists(&node, &judged, 50).await?;
        let scores: Vec<f32> = dists.iter().map(|d| probability_of(&queue, d, &["yes", "Yes"])).collect();
        let best = (0..breadth).fold(0, |b, i| if scores[i] > scores[b] { i } else { b });
        lengths.extend(children.iter().map(|c| c.len()));
        counts.extend(children.iter().map(|c| c.tokens.len()));
        all_thoughts.push(json_array(children.iter().map(|c| json_string(&c.text))));
        all_scores.push(json_array(scores.iter().map(|s| format!("{s:.4}"))));
        path.push(children[best].text.clone());
        let mut next = children[best].context(&node); // a fork: the node's pages stay shared
        next.fill("\n");
        node = next;
    }
    inferlet::send(&format!(
        "{{\"best_path\": {}, \"scores\": {}, \"thoughts\": {}, \"branch_tokens\": {}, \"branch_lengths\": {}, \
         \"prompt_tokens\": {prompt_tokens}}}",
        json_array(path.iter().map(|t| json_string(t))), json_array(all_scores), json_array(all_thoughts),
        json_array(counts), json_array(lengths)));
    Ok(())
}
