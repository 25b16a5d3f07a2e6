//! `probe`: a test inferlet. The first argument picks a behaviour:
//!
//! - `forged` / `freed`: use a made-up / freed KV page id; reports each error as a message.
//! - `trap`, `panic`, `loop`, `membomb`, `recurse`: trap, panic, spin without host calls,
//!   allocate without bound, or recurse without bound.
//! - `println`: writes a line with `inferlet::println!` and one with `eprintln!` (the log).
//! - `export NAME PROMPT` / `import NAME PROMPT`: the exporter prefills PROMPT's whole pages
//!   and exports them; the importer decodes from the imported pages without prefilling.
//!   Both send the greedy continuation (8 tokens), so equal messages mean shared KV works.
//!   The exporter then waits for a message before ending (its export lives as long as it).
//! - `fork PROMPT`: prefills PROMPT in a Context, forks it, and greedy-decodes 8 tokens in
//!   the original and in the fork; sends both (they must be equal) and the free page count
//!   is checked by the caller.
//! - `pause CLASS PROMPT`: greedy-decodes 8 tokens of PROMPT in a Context whose pages are
//!   CLASS (pinned, swappable, discardable), sends `first: TEXT`, waits for a message, then
//!   sends `second: TEXT` (8 more): the reclaimer may move its pages while it waits.
//! - `turns PROMPT TEXT...`: greedy-decodes 8 tokens after PROMPT, then 8 after each TEXT
//!   filled into the same Context (each fill a pass that continues the live context); sends
//!   `{"tokens": [every token of the sequence], "generated": [tokens decoded per turn]}`.
//! - `textstream ID,ID,...`: pushes the token ids one at a time into an `inferlet::TextStream`;
//!   sends `{"pieces": [the text each push added], "finish": the final text}`.
//! - `objectives N`: marks N new queues latency (sends `latency: N ok` or `latency: K ok, then
//!   ERROR`), then sends the result of a 300-byte group name, a job-size hint of 2^31 tokens
//!   and one of 100 tokens, each `ok` or the error, one message each.
//! - `http URL`: GETs URL and sends `STATUS BODY` (or the error).
//! - `subscribe TOPIC` / `broadcast TOPIC TEXT`: the subscriber says "subscribed", then sends
//!   the first message published on TOPIC; the broadcaster publishes TEXT.
//! - `calls N`: times N round trips of each kind of host call and sends them as JSON
//!   (`{"call": microseconds, ...}`), for benchmarks/overhead.py.
//! - `bigsend N`: sends a message of N bytes (over the server's cap, the instance ends).
//! - `hold N`: allocates N KV pages and sends `held N` (or the error); then each message
//!   that is a number M allocates M more the same way, and any other message ends it
//!   (quota and pool tests).
//! - `queues N`: creates N more queues; sends `queues: ok` or the first error.
//! - `spam N [TOPIC]`: sends `m0` … `m{N-1}` as fast as it may (rate and backpressure
//!   tests); with TOPIC, first subscribes, sends `waiting` and waits for a broadcast on it,
//!   then keeps the subscription unread while it sends.
//! - `flood N BYTES`: sends N messages of BYTES bytes each (slow-reader tests).
//! - `leak N`: makes N `receive` futures and never drops them; sends `leaked N`.
//! - `resubscribe N`: subscribes N times, dropping each subscription before the next; sends
//!   `resubscribed N` or the error.
//! - `unexport NAME`: removes the export NAME; sends `unexport: ok` or the error.
//! - `persist NAME N`: allocates N pages, exports them persistently as NAME, frees its own
//!   ids and sends `persisted N` (or the error); the export outlives the instance.
//! - `kvs get KEY` / `kvs set KEY VALUE` / `kvs delete KEY`: sends `value: V`, `value: none`,
//!   `set: ok`, `delete: ok` or the error.
//! - `passes-trap N` / `passes-hold N`: enqueues N host-side runs of 64 steps (fused
//!   passes, each into pages of its own), then traps at once / sends `running N` and waits
//!   for a message (the test terminates it): the pools must come back full either way.
//! - `passes-bad`: fused passes with a forged page, a freed page, a token past the
//!   vocabulary, an out-of-range output index, a wrong-size mask, a position past the
//!   model's context and a log-probability asked of a token past the vocabulary; sends each
//!   error, then one good pass's token (`good: T`).
//! - `semvar`: semantic-variable mistakes (`inferlet::semvar`): malformed templates, a
//!   binding missing, extra or of another pipeline, then a call whose sampler the host
//!   refuses and a call that reads its output; sends each error, one per message.
//! - `fuzz N SEED`: N host calls with random arguments — live, freed and forged ids, wild
//!   counts, lengths, offsets and positions — each of which must come back as `Ok` or a
//!   host `Error`, never a trap; frees what it still holds and sends `{"ok": a, "err": b}`.

use inferlet::bindings::{allocate, forward, http, inference, input_text, kvs, memory, messaging, output_text, runtime};
use inferlet::bindings::forward::ForwardPass;
use inferlet::{KvPage, Model, Queue, Sampler};

inferlet::main!(main);

/// Recursion with no end before the stack does (each frame keeps a buffer live).
fn recurse(n: u64) -> u64 {
    let frame = std::hint::black_box([n; 64]);
    if n == 0 { 0 } else { 1 + recurse(std::hint::black_box(frame[n as usize % 64] - 1)) }
}

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
        Some("panic") => {
            let missing: Option<u32> = None;
            let _ = missing.expect("the probe panics on purpose");
            unreachable!()
        }
        Some(mode @ ("passes-trap" | "passes-hold")) => {
            let n: u32 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(4);
            for i in 0..n {
                let pages = allocate::alloc_kvpage(queue.raw(), 5)?;  // 8 + 64 - 1 slots
                inference::run(queue.raw(), fused(&[1, 2, 3, 4, 5, 6, 7, 8 + i], vec![], 0, pages), 64, false)?;
            }
            if mode == "passes-trap" {
                core::arch::wasm32::unreachable();
            }
            inferlet::send(&format!("running {n}"));
            inferlet::receive().await;
            Ok(())
        }
        Some("passes-bad") => {
            let pages = allocate::alloc_kvpage(queue.raw(), 2)?;
            allocate::dealloc_kvpage(queue.raw(), &pages[1..])?;
            let mut bad = vec![
                ("forged", fused(&[1], vec![4242], 1, vec![pages[0]])),
                ("freed", fused(&[1], vec![pages[1]], 1, vec![pages[0]])),
                ("token", fused(&[1_000_000], vec![], 0, vec![pages[0]])),
                ("index", fused(&[1], vec![], 0, vec![pages[0]])),
                ("mask", fused(&[1], vec![], 0, vec![pages[0]])),
                ("position", fused(&[1], vec![], 0, vec![])),
                ("logprobs-of", fused(&[1], vec![], 0, vec![])),
            ];
            bad[3].1.outputs[0].index = 5;
            bad[4].1.attention_mask = Some(vec![0, 0, 0]);
            bad[5].1.positions = vec![1 << 20];
            bad[6].1.outputs[0].logprobs_of = vec![1, 1_000_000];
            for (what, pass) in bad {
                report(what, inference::execute(queue.raw(), pass).map(|_| ()));
            }
            let id = inference::execute(queue.raw(), fused(&[1, 2, 3], vec![], 0, vec![pages[0]]))?;
            let result = inference::take(queue.raw(), true).into_iter().find(|r| r.pass == id).ok_or("no result")?;
            inferlet::send(&format!("good: {:?}", result.tokens));
            Ok(())
        }
        Some("recurse") => {
            inferlet::send(&format!("depth {}", recurse(u64::MAX)));
            Ok(())
        }
        Some("println") => {
            inferlet::println!("to the log: {} + {} = {}", 2, 2, 2 + 2);
            inferlet::eprintln!("a warning");
            Ok(())
        }
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
        Some("pause") => {
            // `pause CLASS PROMPT`: greedy-decodes 8 tokens of PROMPT in a Context whose pages
            // are CLASS (pinned, swappable or discardable), sends `first: TEXT`, waits for a
            // message (paused: the server may move its pages), then decodes 8 more and sends
            // `second: TEXT` (reclaimer tests: equal to a run the pool never pressed).
            let mut ctx = model.create_context()?;
            ctx.fill(&args[2]);
            ctx.flush()?;
            if args[1] == "discardable" {
                ctx.set_discardable(true)?;
            }
            let stop = inferlet::Stop::new(8);
            let greedy = Sampler::greedy();
            let first = ctx.generate(&greedy, &stop).await?;
            if args[1] == "pinned" {  // every page it holds now
                memory::set_kv_class(&ctx.page_ids(), memory::KvClass::Pinned)?;
            }
            inferlet::send(&format!("first: {first}"));
            inferlet::receive().await;
            inferlet::send(&format!("second: {}", ctx.generate(&greedy, &stop).await?));
            Ok(())
        }
        Some("turns") => {
            let mut ctx = model.create_context()?;
            let (greedy, stop) = (Sampler::greedy(), inferlet::Stop::new(8));
            let mut generated = Vec::new();
            for text in &args[1..] {
                ctx.fill(text);
                let before = ctx.len();
                ctx.generate(&greedy, &stop).await?;
                generated.push((ctx.len() - before).to_string());
            }
            let tokens: Vec<String> = ctx.tokens().iter().map(u32::to_string).collect();
            inferlet::send(&format!("{{\"tokens\": [{}], \"generated\": [{}]}}", tokens.join(","), generated.join(",")));
            Ok(())
        }
        Some("textstream") => {
            let ids: Vec<u32> = args[1].split(',').map(|t| t.parse().map_err(|_| "textstream ID,ID,..."))
                .collect::<Result<_, _>>()?;
            let mut stream = inferlet::TextStream::new(&std::rc::Rc::new(queue));
            let mut pieces = Vec::new();
            for id in ids {
                pieces.push(inferlet::json::json_string(stream.push(&[id])?));
            }
            let finish = inferlet::json::json_string(&stream.finish()?);
            inferlet::send(&format!("{{\"pieces\": [{}], \"finish\": {finish}}}", pieces.join(",")));
            Ok(())
        }
        Some("objectives") => {
            let n: usize = args[1].parse().map_err(|_| "objectives N")?;
            let mut marked = 0;
            let mut queues = Vec::new();
            let mut error = None;
            for _ in 0..n {
                let q = model.create_queue()?;
                match q.set_objective(inferlet::Objective::Latency, "") {
                    Ok(()) => marked += 1,
                    Err(e) => { error = Some(e.to_string()); break; }
                }
                queues.push(q);
            }
            inferlet::send(&match error {
                None => format!("latency: {marked} ok"),
                Some(e) => format!("latency: {marked} ok, then {e}"),
            });
            let show = |r: Result<(), inferlet::Error>| r.map_or_else(|e| e.to_string(), |()| "ok".to_string());
            inferlet::send(&show(queue.set_objective(inferlet::Objective::Throughput, &"g".repeat(300))));
            inferlet::send(&show(queue.set_job_size(1 << 31)));
            inferlet::send(&show(queue.set_job_size(100)));
            Ok(())
        }
        Some("semvar") => {
            use inferlet::semvar::{Gen, Pipeline, Template};
            for source in ["no slots", "{{input:x}", "{{inputx}}{{output:y}}", "{{foo:x}}{{output:y}}",
                           "{{output:y}}{{output:y}}", "{{input:a b}}{{output:y}}"] {
                inferlet::send(&Template::parse(source).err().unwrap_or("parsed".into()));
            }
            let pipeline = Pipeline::new(Model::default_model()?);
            let other = Pipeline::new(Model::default_model()?);
            let template = Template::parse("Q: {{input:q}} A:{{output:a}}")?;
            let (q, foreign) = (pipeline.input("q", "2+2?"), other.input("q", "3+3?"));
            let gen = Gen::greedy(4);
            for bindings in [vec![], vec![("q", &q), ("r", &q)], vec![("q", &foreign)], vec![("q", &q), ("q", &q)]] {
                inferlet::send(&pipeline.call(&template, &bindings, &gen).err().unwrap_or("called".into()));
            }
            let refused = Gen { max_tokens: 4, sampler: Sampler::temperature(-1.0) };
            let a = pipeline.call(&template, &[("q", &q)], &refused)?.remove(0);
            let b = pipeline.call(&Template::parse("Then: {{input:q}} B:{{output:b}}")?, &[("q", &a)], &gen)?.remove(0);
            inferlet::send(&pipeline.get(&b, inferlet::Objective::Throughput).await.err().unwrap_or("produced".into()));
            Ok(())
        }
        Some("http") => {
            match http::http_get(&args[1], &[]) {
                Ok(response) => match response.await {
                    Ok(r) => inferlet::send(&format!("{} {}", r.status, r.body)),
                    Err(e) => inferlet::send(&format!("{}: {}", e.kind, e.message)),
                },
                Err(e) => inferlet::send(&format!("{}: {}", e.kind, e.message)),
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
        Some("bigsend") => {
            let n: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(0);
            inferlet::send(&"x".repeat(n));
            inferlet::send("after");
            Ok(())
        }
        Some("hold") => {
            let mut n: u32 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1);
            loop {
                match allocate::alloc_kvpage(queue.raw(), n) {
                    Ok(_) => inferlet::send(&format!("held {n}")),
                    Err(e) => inferlet::send(&format!("{}: {}", e.kind, e.message)),
                }
                match inferlet::receive().await.parse() {
                    Ok(more) => n = more,
                    Err(_) => return Ok(()),
                }
            }
        }
        Some("queues") => {
            let n: u32 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1);
            let made: Result<Vec<_>, _> = (0..n).map(|_| runtime::create_queue(model.name())).collect();
            match made {
                Ok(_) => inferlet::send("queues: ok"),
                Err(e) => inferlet::send(&format!("queues: {}: {}", e.kind, e.message)),
            }
            Ok(())
        }
        Some("spam") => {
            let n: u32 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1);
            // Kept (and never read again) while it spams: its backlog is what tests watch.
            let mut _kept = None;
            if let Some(topic) = args.get(2) {
                let subscription = messaging::subscribe(topic)?;
                inferlet::send("waiting");
                subscription.next().await;
                _kept = Some(subscription);
            }
            for i in 0..n {
                inferlet::send(&format!("m{i}"));
            }
            Ok(())
        }
        Some("flood") => {
            let n: u32 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1);
            let bytes: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1);
            let message = "x".repeat(bytes);
            for _ in 0..n {
                inferlet::send(&message);
            }
            Ok(())
        }
        Some("leak") => {
            let n: u32 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1);
            for _ in 0..n {
                std::mem::forget(messaging::receive());
            }
            inferlet::send(&format!("leaked {n}"));
            Ok(())
        }
        Some("resubscribe") => {
            let n: u32 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1);
            for i in 0..n {
                if let Err(e) = messaging::subscribe("again") {
                    inferlet::send(&format!("after {i}: {}: {}", e.kind, e.message));
                    return Ok(());
                }
            }
            inferlet::send(&format!("resubscribed {n}"));
            Ok(())
        }
        Some("unexport") => {
            report("unexport", allocate::unexport_kvpage(&args[1]));
            Ok(())
        }
        Some("persist") => {
            let n: u32 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1);
            let exported = allocate::alloc_kvpage(queue.raw(), n).and_then(|pages| {
                allocate::export_kvpage(&pages, &args[1], true)?;
                allocate::dealloc_kvpage(queue.raw(), &pages)
            });
            match exported {
                Ok(()) => inferlet::send(&format!("persisted {n}")),
                Err(e) => inferlet::send(&format!("{}: {}", e.kind, e.message)),
            }
            Ok(())
        }
        Some("kvs") => {
            match (args.get(1).map(String::as_str), args.get(2)) {
                (Some("get"), Some(key)) => match kvs::store_get(key) {
                    Some(value) => inferlet::send(&format!("value: {value}")),
                    None => inferlet::send("value: none"),
                },
                (Some("set"), Some(key)) => {
                    report("set", kvs::store_set(key, args.get(3).map(String::as_str).unwrap_or("")))
                }
                (Some("delete"), Some(key)) => {
                    kvs::store_delete(key);
                    inferlet::send("delete: ok");
                }
                _ => return Err("usage: kvs get|set|delete KEY [VALUE]".into()),
            }
            Ok(())
        }
        Some("fuzz") => {
            let n: u32 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1000);
            let seed: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1);
            inferlet::send(&fuzz(&queue, n, seed).await);
            Ok(())
        }
        other => Err(format!("unknown probe mode {other:?}")),
    }
}

fn report(what: &str, result: Result<(), inferlet::Error>) {
    match result {
        Ok(()) => inferlet::send(&format!("{what}: ok")),
        Err(e) => inferlet::send(&format!("{what}: {}: {}", e.kind, e.message)),
    }
}

fn pass(pages: Vec<KvPage>, last_len: u32, embeds: Vec<u32>, out_pages: Vec<KvPage>, offset: u32) -> ForwardPass {
    ForwardPass { input_kv_pages: pages, input_kv_last_page_len: last_len, input_embeds: embeds,
                  output_kv_pages: out_pages, output_kv_offset: offset, output_embeds: vec![],
                  output_token_indices: vec![], attention_mask: None }
}

/// A fused pass of `tokens` at positions 0.. after `context` (`last_len` slots in its last
/// page) into `out` from slot 0, drawing a greedy token at the last.
fn fused(tokens: &[u32], context: Vec<KvPage>, last_len: u32, out: Vec<KvPage>) -> inference::ForwardPass {
    let sampler = inference::Sampler { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: None };
    inference::ForwardPass {
        input_embeds: vec![], input_tokens: tokens.to_vec(), positions: (0..tokens.len() as u32).collect(),
        input_kv_pages: context, input_kv_last_page_len: last_len, output_kv_pages: out,
        output_kv_offset: 0, attention_mask: None, stop_tokens: vec![],
        outputs: vec![inference::Output { index: tokens.len() as u32 - 1, sample: Some(sampler), top_k: 0,
                                          logprobs_of: vec![], entropy: false, allowed: None,
                                          grammar: None, rules: None, keep: None }],
    }
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

/// xorshift64*: a small deterministic generator for `fuzz`.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// A size that is usually small and sometimes absurd.
    fn size(&mut self) -> u32 {
        [0, 1, 2, 3, 17, 64, 5000, 1 << 20, u32::MAX][self.below(9) as usize]
    }
    /// An id from `live`, from `dead`, or made up.
    fn id(&mut self, live: &[u32], dead: &[u32]) -> u32 {
        match self.below(4) {
            0 if !live.is_empty() => live[self.below(live.len() as u64) as usize],
            1 if !dead.is_empty() => dead[self.below(dead.len() as u64) as usize],
            2 => [0, 1, 7, 4096, u32::MAX][self.below(5) as usize],
            _ => self.next() as u32,
        }
    }
    fn ids(&mut self, live: &[u32], dead: &[u32]) -> Vec<u32> {
        let n = [0, 1, 2, 5, 40][self.below(5) as usize];
        (0..n).map(|_| self.id(live, dead)).collect()
    }
}

/// See the `fuzz` mode. Vectors are kept under ~5000 items: the point is the host's checks,
/// not the guest's memory.
async fn fuzz(queue: &Queue, n: u32, seed: u64) -> String {
    let q = queue.raw();
    let mut rng = Rng(seed.max(1));
    let (mut pages, mut embeds, mut dead_pages, mut dead_embeds) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut ok, mut err) = (0u32, 0u32);
    let mut tally = |result: Result<(), inferlet::Error>| match result {
        Ok(()) => ok += 1,
        Err(_) => err += 1,
    };
    for _ in 0..n {
        let small = |r: &mut Rng| r.size().min(5000);
        match rng.below(12) {
            0 => tally(allocate::alloc_kvpage(q, rng.size()).map(|ids| pages.extend(ids))),
            1 => tally(allocate::alloc_emb(q, rng.size()).map(|ids| embeds.extend(ids))),
            2 => {
                let ids = rng.ids(&pages, &dead_pages);
                let result = allocate::dealloc_kvpage(q, &ids);
                if result.is_ok() {
                    pages.retain(|p| !ids.contains(p));
                    dead_pages.extend(ids);
                }
                tally(result)
            }
            3 => {
                let ids = rng.ids(&embeds, &dead_embeds);
                let result = allocate::dealloc_emb(q, &ids);
                if result.is_ok() {
                    embeds.retain(|e| !ids.contains(e));
                    dead_embeds.extend(ids);
                }
                tally(result)
            }
            4 => {
                let (a, b) = (rng.id(&pages, &dead_pages), rng.id(&pages, &dead_pages));
                tally(allocate::copy_kvpage(q, a, b, rng.size(), rng.size(), rng.size()))
            }
            5 => {
                let len = small(&mut rng) as usize;
                let tokens: Vec<u32> = (0..len).map(|_| rng.next() as u32 % 60000).collect();
                let positions: Vec<u32> = (0..len).map(|_| rng.size()).collect();
                let targets: Vec<u32> = (0..len).map(|_| rng.id(&embeds, &dead_embeds)).collect();
                tally(input_text::embed_text(q, &tokens, &positions, &targets))
            }
            6 => {
                let pass = ForwardPass {
                    input_kv_pages: rng.ids(&pages, &dead_pages), input_kv_last_page_len: rng.size(),
                    input_embeds: rng.ids(&embeds, &dead_embeds), output_kv_pages: rng.ids(&pages, &dead_pages),
                    output_kv_offset: rng.size(), output_embeds: rng.ids(&embeds, &dead_embeds),
                    output_token_indices: (0..rng.below(3)).map(|_| rng.size()).collect(),
                    attention_mask: if rng.below(4) == 0 { Some(vec![0xff; small(&mut rng) as usize]) } else { None },
                };
                tally(forward::forward(q, pass))
            }
            7 => {
                let mask: Vec<bool> = (0..small(&mut rng).min(64)).map(|_| rng.below(2) == 0).collect();
                tally(forward::mask_kvpage(q, rng.id(&pages, &dead_pages), &mask))
            }
            8 => {
                let sampler = Sampler { temperature: [0.0, 1.0, -1.0, f32::NAN, 1e30][rng.below(5) as usize],
                                        top_k: rng.size(), top_p: [1.0, 0.5, 0.0, 2.0][rng.below(4) as usize],
                                        seed: Some(rng.next()) };
                match output_text::sample(q, rng.id(&embeds, &dead_embeds), sampler) {
                    Ok(future) => tally(future.await.map(|_| ())),
                    Err(e) => tally(Err(e)),
                }
            }
            9 => match output_text::get_next_dist(q, rng.id(&embeds, &dead_embeds), rng.size()) {
                Ok(future) => tally(future.await.map(|_| ())),
                Err(e) => tally(Err(e)),
            },
            10 => {
                let name = ["fuzz", "", "x"][rng.below(3) as usize];
                tally(match rng.below(3) {
                    0 => allocate::export_kvpage(&rng.ids(&pages, &dead_pages), name, rng.below(2) == 0),
                    1 => allocate::import_kvpage(name).map(|ids| pages.extend(ids)),
                    _ => allocate::unexport_kvpage(name),
                })
            }
            _ => {
                let ids: Vec<u32> = (0..small(&mut rng).min(64)).map(|_| rng.next() as u32).collect();
                tally(inferlet::bindings::tokenize::detokenize(q, &ids).map(|_| ()))
            }
        }
    }
    let _ = allocate::unexport_kvpage("fuzz");
    let _ = allocate::unexport_kvpage("x");
    let _ = allocate::dealloc_kvpage(q, &pages);
    let _ = allocate::dealloc_emb(q, &embeds);
    let _ = runtime::synchronize(q).await;
    format!("{{\"ok\": {ok}, \"err\": {err}}}")
}
