//! `graph_of_thought`: thoughts generated on forks, merged into one aggregation node, then refined.
//!
//! Graph of Thoughts (Besta et al., 2023) treats thoughts as vertices of a graph: besides
//! branching (as in a tree) a thought can aggregate several others, and any thought can be
//! refined by a loop back to itself. Here `k` thoughts are generated as forks of the root
//! prompt (seeded sampling, decoded in lockstep), an aggregation node is a new fork of the
//! root whose context lists every thought and asks for one combined answer, and a
//! refinement node forks the aggregation to improve it. All nodes share the root's pages.
//!
//! Requirements: R1, R3
//! Host APIs: forward, embed-text, copy-kvpage (fork), sample, alloc-kvpage, dealloc-kvpage
//! Arguments: --prompt TEXT [--thoughts K (3)] [--thought-tokens N (12)] [--seed S (1)]
//! Output: one JSON object {"thoughts": [..], "aggregation_context" (the aggregation node's
//!   text after the root), "aggregated", "refined", "branch_tokens": [..], "branch_lengths": [..]}.

use inferlet::flags::{arg_or, parse_args};
use inferlet::json::{json_array, json_string};
use inferlet::{chat, generate_branches, Model, Sampler, Stop};

inferlet::main!(main);

const USAGE: &str = "--prompt TEXT [--thoughts K] [--thought-tokens N] [--seed S]";

async fn main() -> Result<(), String> {
    let args = parse_args(&inferlet::args(), &["prompt", "thoughts", "thought-tokens", "seed"], &[], USAGE)?;
    let prompt = args.get("prompt").ok_or(format!("--prompt is required; usage: {USAGE}"))?;
    let k: usize = arg_or(&args, "thoughts", 3, USAGE)?;
    let tokens: usize = arg_or(&args, "thought-tokens", 12, USAGE)?;
    let seed: u64 = arg_or(&args, "seed", 1, USAGE)?;
    if !(1..=8).contains(&k) {
        return Err(format!("--thoughts must be 1..=8; usage: {USAGE}"));
    }
    let mut root = Model::default_model()?.create_context()?;
    let queue = root.queue().clone();
    let stop = Stop::new(tokens).eos(queue.eos_tokens());
    root.fill_chat(&[chat("user", &format!("Question: {prompt}\nGive one short idea for the answer."))], true)?;
    root.flush()?;
    let root_len = root.len();

    // Branch: k thoughts, each a fork of the root.
    let samplers: Vec<Sampler> = (0..k as u64).map(|i| Sampler::top_k(0.8, 40).with_seed(seed + i * 7919)).collect();
    let thoughts = generate_branches(&root, &vec![Vec::new(); k], &samplers, &stop).await?;

    // Aggregate: a new fork of the root whose context holds every thought.
    let mut aggregation = root.fork();
    let listed: Vec<String> = thoughts.iter().enumerate().map(|(i, t)| format!("Idea {}: {}", i + 1, t.text.trim())).collect();
    aggregation.fill(&format!("{}<|im_end|>\n<|im_start|>user\nCombine these ideas into one better answer.<|im_end|>\n\
                               <|im_start|>assistant\n", listed.join("\n")));
    let aggregation_context = queue.detokenize(&aggregation.tokens()[root_len..])?;
    let aggregated = aggregation.generate(&Sampler::greedy(), &Stop::new(tokens + 4).eos(queue.eos_tokens())).await?;

    // Refine: a fork of the aggregation node asked to improve it.
    if aggregation.pending().last().is_some_and(|t| queue.eos_tokens().contains(t)) {
        aggregation.truncate(aggregation.len() - 1);
    }
    let mut refine = aggregation.fork();
    refine.fill("<|im_end|>\n<|im_start|>user\nImprove that answer in one sentence.<|im_end|>\n<|im_start|>assistant\n");
    let refined = refine.generate(&Sampler::greedy(), &Stop::new(tokens + 4).eos(queue.eos_tokens())).await?;

    let mut counts: Vec<usize> = thoughts.iter().map(|t| t.tokens.len()).collect();
    let mut lengths: Vec<usize> = thoughts.iter().map(|t| t.len()).collect();
    counts.extend([queue.tokenize(&aggregated).len(), queue.tokenize(&refined).len()]);
    lengths.extend([aggregation.len(), refine.len()]);
    inferlet::send(&format!(
        "{{\"thoughts\": {}, \"aggregation_context\": {}, \"aggregated\": {}, \"refined\": {}, \
         \"branch_tokens\": {}, \"branch_lengths\": {}}}",
        json_array(thoughts.iter().map(|t| json_string(&t.text))), json_string(&aggregation_context),
        json_string(&aggregated), json_string(&refined), json_array(counts), json_array(lengths)));
    Ok(())
}
