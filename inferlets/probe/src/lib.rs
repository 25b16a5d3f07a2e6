//! `probe`: a test inferlet. The first argument picks a behaviour:
//!
//! - `forged` / `freed`: use a made-up / freed KV page id; reports each error as a message.
//! - `trap`, `loop`, `membomb`: trap, spin without host calls, or allocate without bound.
//! - `export NAME PROMPT` / `import NAME PROMPT`: the exporter prefills PROMPT's whole pages
//!   and exports them; the importer decodes from the imported pages without prefilling.
//!   Both send the greedy continuation (8 tokens), so equal messages mean shared KV works.
//!   The exporter then waits for a message before ending (its export lives as long as it).
//! - `fork PROMPT`: prefills PROMPT in a Context, forks it, and greedy-decodes 8 tokens in
//!   the original and in the fork; sends both (they must be equal) and the free page count
//!   is checked by the caller.
//! - `http URL`: GETs URL and sends `STATUS BODY` (or the error).
//! - `subscribe TOPIC` / `broadcast TOPIC TEXT`: the subscriber says "subscribed", then sends
//!   the first message published on TOPIC; the broadcaster publishes TEXT.
//! - `calls N`: times N round trips of each kind of host call and sends them as JSON
//!   (`{"call": microseconds, ...}`), for benchmarks/overhead.py.

use inferlet::bindings::{allocate, forward, http, input_text, kvs, messaging, output_text, runtime};
use inferlet::bindings::forward::ForwardPass;
use inferlet::{KvPage, Model, Queue, Sampler};

inferlet::main!(main);

async fn main() -> Result<(), String> {
    let args = inferlet::args();
    let model = Model::default_model()?;
    let queue = model.create_queue()?;
    match args.first().map(String::as_str) {
        Some("forged") => {
            let embed = allocate::alloc_emb(queue.raw(), 1)?;
            report("forward", forward::forward(queue.raw(), pass(vec![12345], 1, embed, vec![], 0)));
            report("dealloc", allocate::dealloc_kvpage(queue.raw(), &[777]));
            Ok(())
        }
        Some("freed") => {
            let pages = allocate::alloc_kvpage(queue.raw(), 2)?;
            allocate::dealloc_kvpage(queue.raw(), &pages[..1])?;
            report("copy", allocate::copy_kvpage(queue.raw(), pages[0], pages[1], 0, 0, 1));
            report("dealloc", allocate::dealloc_kvpage(queue.raw(), &pages[..1]));
            Ok(())
        }
        Some("trap") => core::arch::wasm32::unreachable(),
        Some("loop") => loop {
            std::hint::black_box(0u64);
        },
        Some("membomb") => {
            let mut hoard: Vec<Vec<u8>> = Vec::new();
            loop {
                hoard.push(vec![1u8; 1 << 20]);
            }
        }
        Some("export") => {
            let (pages, committed, next) = prefill(&queue, &args[2])?;
            allocate::export_kvpage(&pages, &args[1], false)?;
            inferlet::send(&continuation(&queue, &pages, committed, next).await?);
            inferlet::receive().await;
            Ok(())
        }
        Some("import") => {
            let pages = allocate::import_kvpage(&args[1])?;
            let tokens = queue.tokenize(&args[2]);
            let committed = pages.len() as u32 * queue.page_size();
            inferlet::send(&continuation(&queue, &pages, committed, tokens[committed as usize]).await?);
            Ok(())
        }
        Some("fork") => {
            let mut ctx = model.create_context()?;
            ctx.fill(&args[1]);
            ctx.flush()?;
            let mut fork = ctx.fork();
            let stop = inferlet::Stop::new(8);
            let greedy = Sampler { temperature: 0.0, top_k: 0, top_p: 1.0, seed: None };
            let (a, b) = (ctx.generate(&greedy, &stop).await?, fork.generate(&greedy, &stop).await?);
            inferlet::send(&a);
            inferlet::send(&b);
            Ok(())
        }
        Some("http") => {
            match http::http_get(&args[1], &[]) {
                Ok(response) => match response.await {
                    Ok(r) => inferlet::send(&format!("{} {}", r.status, r.body)),
                    Err(e) => inferlet::send(&format!("{:?}: {}", e.kind, e.message)),
                },
                Err(e) => inferlet::send(&format!("{:?}: {}", e.kind, e.message)),
            }
            Ok(())
        }
        Some("subscribe") => {
            let subscription = messaging::subscribe(&args[1])?;
            inferlet::send("subscribed");
            inferlet::send(&subscription.next().await);
            Ok(())
        }
        Some("broadcast") => {
            messaging::broadcast(&args[1], &args[2]);
            Ok(())
        }
        Some("calls") => {
            let n: u32 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(100);
            inferlet::send(&time_calls(&queue, n).await?);
            Ok(())
        }
        other => Err(format!("unknown probe mode {other:?}")),
    }
}

fn report(what: &str, result: Result<(), inferlet::Error>) {
    match result {
        Ok(()) => inferlet::send(&format!("{what}: ok")),
        Err(e) => inferlet::send(&format!("{what}: {:?}: {}", e.kind, e.message)),
    }
}

fn pass(pages: Vec<KvPage>, last_len: u32, embeds: Vec<u32>, out_pages: Vec<KvPage>, offset: u32) -> ForwardPass {
    ForwardPass { input_kv_pages: pages, input_kv_last_page_len: last_len, input_embeds: embeds,
                  output_kv_pages: out_pages, output_kv_offset: offset, output_embeds: vec![],
                  output_token_indices: vec![], attention_mask: None }
}

/// Runs the prompt's whole pages through the model; returns (pages, tokens in them, next token).
fn prefill(queue: &Queue, prompt: &str) -> Result<(Vec<KvPage>, u32, u32), String> {
    let tokens = queue.tokenize(prompt);
    let ps = queue.page_size() as usize;
    let n = (tokens.len() - 1) / ps * ps;
    if n == 0 {
        return Err(format!("prompt of {} tokens fills no whole page of {ps}", tokens.len()));
    }
    let pages = allocate::alloc_kvpage(queue.raw(), (n / ps) as u32)?;
    let embeds = allocate::alloc_emb(queue.raw(), n as u32)?;
    let positions: Vec<u32> = (0..n as u32).collect();
    input_text::embed_text(queue.raw(), &tokens[..n], &positions, &embeds)?;
    forward::forward(queue.raw(), pass(vec![], 0, embeds.clone(), pages.clone(), 0))?;
    allocate::dealloc_emb(queue.raw(), &embeds)?;
    Ok((pages, n as u32, tokens[n]))
}

/// Greedy-decodes 8 tokens after `committed` tokens held (read-only) in `pages`.
async fn continuation(queue: &Queue, pages: &[KvPage], committed: u32, first: u32) -> Result<String, String> {
    let ps = queue.page_size();
    let mut own: Vec<KvPage> = Vec::new();
    let slot = allocate::alloc_emb(queue.raw(), 2)?;
    let (mut token, mut generated) = (first, Vec::new());
    for step in 0..8u32 {
        let length = committed + step;  // tokens already cached
        if (length - committed) % ps == 0 {
            own.extend(allocate::alloc_kvpage(queue.raw(), 1)?);
        }
        let context: Vec<KvPage> = pages.iter().chain(own.iter()).copied().collect();
        let cached_own = length - committed;
        let (input, last_len) = if cached_own == 0 { (pages.to_vec(), ps) } else {
            (context.clone(), (cached_own - 1) % ps + 1)
        };
        input_text::embed_text(queue.raw(), &[token], &[length], &slot[..1])?;
        forward::forward(queue.raw(), ForwardPass {
            input_kv_pages: input, input_kv_last_page_len: last_len, input_embeds: vec![slot[0]],
            output_kv_pages: vec![*own.last().unwrap()], output_kv_offset: cached_own % ps,
            output_embeds: vec![slot[1]], output_token_indices: vec![0], attention_mask: None,
        })?;
        let sampler = Sampler { temperature: 0.0, top_k: 0, top_p: 1.0, seed: None };
        token = output_text::sample(queue.raw(), slot[1], sampler)?.await?;
        generated.push(token);
    }
    allocate::dealloc_emb(queue.raw(), &slot)?;
    allocate::dealloc_kvpage(queue.raw(), &own)?;
    Ok(queue.detokenize(&generated)?)
}

/// Mean microseconds per round trip of representative control- and inference-layer calls.
async fn time_calls(queue: &Queue, n: u32) -> Result<String, String> {
    let page = allocate::alloc_kvpage(queue.raw(), 1)?;
    let embeds = allocate::alloc_emb(queue.raw(), 2)?;
    input_text::embed_text(queue.raw(), &[1], &[0], &embeds[..1])?;
    let greedy = Sampler { temperature: 0.0, top_k: 0, top_p: 1.0, seed: None };
    let mut out = Vec::new();
    macro_rules! time {
        ($name:expr, $body:expr) => {{
            let start = runtime::now();
            for _ in 0..n {
                $body;
            }
            out.push(format!("\"{}\": {:.2}", $name, (runtime::now() - start) as f64 / 1e3 / n as f64));
        }};
    }
    time!("control:instance-id", std::hint::black_box(runtime::instance_id()));
    time!("control:store-get", std::hint::black_box(kvs::store_get("probe")));
    time!("control:tokenize", std::hint::black_box(queue.tokenize("hello world")));
    time!("control:alloc+dealloc-emb", {
        let e = allocate::alloc_emb(queue.raw(), 1)?;
        allocate::dealloc_emb(queue.raw(), &e)?;
    });
    time!("inference:embed-text+sync", {
        input_text::embed_text(queue.raw(), &[1], &[0], &embeds[..1])?;
        queue.synchronize().await?;
    });
    time!("inference:forward+sync", {
        forward::forward(queue.raw(), ForwardPass {
            input_kv_pages: vec![], input_kv_last_page_len: 0, input_embeds: vec![embeds[0]],
            output_kv_pages: page.clone(), output_kv_offset: 0, output_embeds: vec![embeds[1]],
            output_token_indices: vec![0], attention_mask: None })?;
        queue.synchronize().await?;
    });
    time!("inference:sample", {
        output_text::sample(queue.raw(), embeds[1], greedy.clone())?.await?;
    });
    Ok(format!("{{{}}}", out.join(", ")))
}
