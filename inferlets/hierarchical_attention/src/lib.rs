//! `hierarchical_attention`: encodes documents independently (each sees only a shared header and itself), then answers over all of them.
//!
//! Hierarchical / block-wise attention (as in Parallel Context Windows, Ratner et al., and
//! hierarchical document encoders) restricts each segment's tokens to attend within their
//! own segment plus a shared prefix, so segments are encoded independently of one another
//! (and could be cached and reused in any combination), while the final query attends to
//! every segment. Here the header (system turn) is filled first; before each document is
//! run, the earlier documents are hidden with `Context::mask_range`; after the last, they
//! are all shown again and the question is answered greedily. The next-token distribution
//! at each document's last token is reported, so a test can check it does not depend on
//! the other documents (`--flat` disables the masking for comparison).
//!
//! Requirements: R1
//! Host APIs: mask-kvpage, forward, get-next-dist, sample, alloc-kvpage, dealloc-kvpage
//! Arguments: --doc TEXT (repeatable) --question TEXT [--max-tokens N (24)] [--top-k K (5)] [--flat]
//! Output: one JSON object {"segments": [{"tokens": [ids], "probs": [p]}...], "answer"}.

use inferlet::{chat, Model, Sampler, Stop};
use inferlet::json::json_string;

inferlet::main!(main);

async fn main() -> Result<(), String> {
    let (mut docs, mut question, mut max_tokens, mut top_k, mut flat) = (Vec::new(), None, 24usize, 5u32, false);
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        if flag == "--flat" {
            flat = true;
            continue;
        }
        let value = rest.next().ok_or(format!("{flag} needs a value"))?;
        let bad = || format!("invalid number for {flag}: {value:?}");
        match flag.as_str() {
            "--doc" => docs.push(value.clone()),
            "--question" => question = Some(value.clone()),
            "--max-tokens" => max_tokens = value.parse().map_err(|_| bad())?,
            "--top-k" => top_k = value.parse().map_err(|_| bad())?,
            _ => return Err(format!("unknown argument {flag:?}; usage: --doc TEXT [--doc TEXT ...] --question TEXT \
                                     [--max-tokens N] [--top-k K] [--flat]")),
        }
    }
    let question = question.ok_or("--question is required")?;
    let mut ctx = Model::default_model()?.create_context()?;
    let queue = ctx.queue().clone();
    // The chat template split around the user's turn: header | documents + question | tail.
    let marker = "\u{1}";
    let template = queue.apply_chat_template(&[chat("system", "Answer the question using the documents."),
                                               chat("user", marker)], true)?;
    let (header, tail) = template.split_once(marker).ok_or("chat template lost the user turn")?;
    ctx.fill(header);
    let header_len = ctx.len() as u32;
    let mut segments = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        if !flat {
            ctx.mask_range(header_len, ctx.committed().len() as u32, true)?;
        }
        ctx.fill(&format!("Document {}: {}\n", i + 1, doc));
        let last = ctx.pending().len() as u32 - 1;
        let embed = ctx.forward_pending(&[last])?[0];
        let (tokens, probs) = queue.next_dist(embed, top_k).await?;
        segments.push(format!("{{\"tokens\": {:?}, \"probs\": {:?}}}", tokens, probs));
    }
    ctx.mask_range(header_len, ctx.committed().len() as u32, false)?;
    ctx.fill(&format!("Question: {question}{tail}"));
    let stop = Stop::new(max_tokens).eos(queue.eos_tokens());
    let answer = ctx.generate(&Sampler::greedy(), &stop).await?;
    inferlet::send(&format!("{{\"segments\": [{}], \"answer\": {}}}", segments.join(", "), json_string(&answer)));
    Ok(())
}

