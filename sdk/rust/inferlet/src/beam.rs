//! Beam search over forked contexts: every beam is a `Context::fork` of its parent (pages
//! shared copy-on-write), and each step asks every live beam for its next-token distribution at
//! once (the requests batch together), keeping the `beams` best extensions by total
//! log-probability.

use crate::bindings::output_text;
use crate::{Context, Error};

struct Beam {
    ctx: Context,
    tokens: Vec<u32>,
    logprob: f64,
}

/// The `beams` most likely continuations of `ctx` (which must have a pending token, e.g.
/// after `fill_chat`) found by beam search, best first: (tokens, total natural-log
/// probability). A beam ends after `max_tokens` tokens or at a token of `eos` (included in
/// its tokens and its log-probability).
pub async fn beam_search(ctx: &Context, beams: usize, max_tokens: usize, eos: &[u32])
                         -> Result<Vec<(Vec<u32>, f64)>, Error> {
    let beams = beams.max(1);
    let mut live = vec![Beam { ctx: ctx.fork(), tokens: Vec::new(), logprob: 0.0 }];
    let mut done: Vec<(Vec<u32>, f64)> = Vec::new();
    for _ in 0..max_tokens {
        if live.is_empty() {
            break;
        }
        // Every beam's forward and distribution request is enqueued before any is awaited.
        let mut requests = Vec::new();
        for beam in live.iter_mut() {
            let last = beam.ctx.pending().len() as u32 - 1;
            let embed = beam.ctx.forward_pending(&[last])?[0];
            requests.push(output_text::get_next_dist(beam.ctx.queue().raw(), embed, beams as u32)?);
        }
        let mut dists = Vec::new();
        for request in requests {
            dists.push(request.await.map(|d| (d.token_ids, d.probs)));
        }
        // Every (beam, token) extension, best first; keep the `beams` best.
        let mut candidates: Vec<(usize, u32, f64)> = Vec::new();
        for (index, dist) in dists.into_iter().enumerate() {
            let (tokens, probs) = dist?;
            for (token, p) in tokens.into_iter().zip(probs) {
                candidates.push((index, token, live[index].logprob + (p as f64).ln()));
            }
        }
        candidates.sort_by(|a, b| b.2.total_cmp(&a.2));
        candidates.truncate(beams);
        let mut next = Vec::new();
        for (index, token, logprob) in candidates {
            let parent = &live[index];
            let tokens = [parent.tokens.as_slice(), &[token]].concat();
            if eos.contains(&token) {
                done.push((tokens, logprob));
                continue;
            }
            let mut child = parent.ctx.fork();
            child.fill_tokens(&[token]);
            next.push(Beam { ctx: child, tokens, logprob });
        }
        live = next;
    }
    done.extend(live.into_iter().map(|b| (b.tokens, b.logprob)));
    done.sort_by(|a, b| b.1.total_cmp(&a.1));
    done.truncate(beams);
    Ok(done)
}
