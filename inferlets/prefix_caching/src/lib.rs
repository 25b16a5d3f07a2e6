//! `prefix_caching`: a long shared prefix prefilled once, kept as a named export, reused by later launches.
//!
//! Prefix caching (as in SGLang's RadixAttention or vLLM's automatic prefix caching, here
//! under the application's control): the system turn holding a document is prefilled once
//! and its KV pages are exported persistently under a name derived from a hash of its
//! text. Every later launch with the same document imports those pages instead of running
//! the prefix through the model, then prefills only its own question and answers it.
//!
//! Requirements: R1
//! Host APIs: forward, export-kvpage (persistent), import-kvpage, unexport-kvpage, kvs store-get/set/delete, sample
//! Arguments: --prefix TEXT (--question TEXT [--max-tokens N (16)] [--ignore-eos] [--no-cache] | --clear)
//! Output: one JSON object {"answer", "cached" (prefix imported), "exported", "prefix_tokens", "export"}; with --clear, {"cleared", "export"}.

use inferlet::json::json_string;
use std::rc::Rc;

use inferlet::{chat, Context, Model, Stop};

inferlet::main!(main);

const USAGE: &str = "usage: --prefix TEXT (--question TEXT [--max-tokens N] [--ignore-eos] [--no-cache] | --clear)";

/// FNV-1a, 64 bits: a stable name for the prefix's content.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf29ce484222325, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

async fn main() -> Result<(), String> {
    let (mut prefix, mut question, mut max_tokens, mut cache, mut clear) = (None, None, 16usize, true, false);
    let mut ignore_eos = false; // exactly --max-tokens tokens (benchmarks/shared_prompt.py)
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        match flag.as_str() {
            "--no-cache" => cache = false,
            "--clear" => clear = true,
            "--ignore-eos" => ignore_eos = true,
            _ => {
                let value = rest.next().ok_or(format!("{flag} needs a value; {USAGE}"))?;
                match flag.as_str() {
                    "--prefix" => prefix = Some(value.clone()),
                    "--question" => question = Some(value.clone()),
                    "--max-tokens" => max_tokens = value.parse().map_err(|_| format!("invalid --max-tokens {value:?}; {USAGE}"))?,
                    _ => return Err(format!("unknown argument {flag:?}; {USAGE}")),
                }
            }
        }
    }
    let prefix = prefix.ok_or(format!("--prefix is required; {USAGE}"))?;
    let name = format!("prefix_caching.{:016x}", fnv1a(&prefix));
    if clear {
        let cleared = Context::unexport(&name).is_ok();
        inferlet::send(&format!("{{\"cleared\": {cleared}, \"export\": {}}}", json_string(&name)));
        return Ok(());
    }
    let question = question.ok_or(format!("--question is required; {USAGE}"))?;
    let queue = Rc::new(Model::default_model()?.create_queue()?);
    // The prefix: the system turn, exactly the tokens the chat template renders before the user turn.
    let system = queue.apply_chat_template(&[chat("system", &prefix)], false)?;
    let prefix_tokens = queue.tokenize(&system);

    let imported = if cache { Context::import(queue.clone(), &name)? } else { None };
    // A name clash (another text with the same hash) is treated as a miss, without export.
    let (cached, clash) = match &imported {
        Some(c) => (c.committed() == prefix_tokens, c.committed() != prefix_tokens),
        None => (false, false),
    };
    let mut exported = false;
    let mut ctx = match imported {
        Some(ctx) if cached => ctx,
        _ => {
            let mut ctx = Context::new(queue.clone());
            ctx.fill_tokens(&prefix_tokens);
            ctx.forward_pending(&[])?; // prefill the whole prefix in one pass
            if cache && !clash {
                ctx.export(&name, true).await?; // appending later copies the last page
                exported = true;
            }
            ctx
        }
    };
    let user = queue.apply_chat_template(&[chat("system", &prefix), chat("user", &question)], true)?;
    let user = user.strip_prefix(&system).ok_or("the chat template does not render the system turn as a prefix")?;
    ctx.fill(user);
    let stop = if ignore_eos { Stop::new(max_tokens) } else { Stop::new(max_tokens).eos(queue.eos_tokens()) };
    let answer = ctx.generate(&inferlet::Sampler::greedy(), &stop).await?;
    inferlet::send(&format!("{{\"answer\": {}, \"cached\": {cached}, \"exported\": {exported}, \"prefix_tokens\": {}, \"export\": {}}}",
                            json_string(&answer), prefix_tokens.len(), json_string(&name)));
    Ok(())
}
