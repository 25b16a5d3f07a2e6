//! `modular_caching`: Prompt-Cache-style modules, each prefilled once at a fixed position range and composed per request.
//!
//! Prompt Cache (Gim et al., 2024) reuses attention states of prompt *modules* (a system
//! prompt, documents) across requests that combine them differently: a schema gives every
//! module its own position range, so its KV cache is valid wherever it is spliced in. Here
//! the layout is the order of `--module` arguments, module i owning positions
//! [i*slot, (i+1)*slot); each module is rendered as one chat turn, prefilled once at its
//! offset into whole pages (unused slots masked) and exported persistently. A request
//! imports the pages of the modules it uses, concatenates them in layout order, and
//! prefills only its question, at the positions after the layout.
//!
//! Requirements: R1
//! Host APIs: forward (composed page lists), embed-text (explicit positions), mask-kvpage, export-kvpage, import-kvpage, unexport-kvpage, sample
//! Arguments: --module NAME=TEXT ... (the layout, same on every launch) (--question TEXT [--use NAME,NAME]
//!   [--max-tokens N (16)] [--slot N (128)] | --clear)
//! Output: one JSON object {"answer", "used": [names], "prefilled": [modules prefilled by this launch],
//!   "module_tokens": {name: tokens}}; with --clear, {"cleared": [names]}.

use inferlet::branch::{generate_after_pages, prefill_at};
use inferlet::json::{json_array, json_string};
use inferlet::bindings::allocate;
use inferlet::{ErrorKind, KvPage, Model, Queue, Sampler, Stop};

inferlet::main!(main);

const USAGE: &str = "usage: --module NAME=TEXT ... (--question TEXT [--use NAME,NAME] [--max-tokens N] [--slot N] | --clear)";

struct Module {
    name: String,
    tokens: Vec<u32>,
    start: u32,
    export: String,
}

fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf29ce484222325, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

/// The pages of `module`'s export, prefilling and exporting it first if no launch has.
async fn module_pages(queue: &Queue, module: &Module, prefilled: &mut Vec<String>) -> Result<Vec<KvPage>, String> {
    match allocate::import_kvpage(&module.export) {
        Err(e) if e.kind == ErrorKind::NotFound => {
            let pages = prefill_at(queue, &module.tokens, module.start).await?;
            let exported = allocate::export_kvpage(&pages, &module.export, true);
            allocate::dealloc_kvpage(queue.raw(), &pages)?; // the export keeps its own reference
            match exported {
                Ok(()) => prefilled.push(module.name.clone()),
                Err(e) if e.kind == ErrorKind::AlreadyExists => {} // another launch won the race
                Err(e) => return Err(e.into()),
            }
            Ok(allocate::import_kvpage(&module.export)?)
        }
        other => Ok(other?),
    }
}

async fn main() -> Result<(), String> {
    let (mut layout, mut question, mut used, mut max_tokens, mut slot, mut clear) = (vec![], None, None, 16usize, 128u32, false);
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        if flag == "--clear" {
            clear = true;
            continue;
        }
        let value = rest.next().ok_or(format!("{flag} needs a value; {USAGE}"))?.clone();
        match flag.as_str() {
            "--module" => layout.push(value.split_once('=').map(|(n, t)| (n.to_string(), t.to_string()))
                                      .ok_or(format!("--module needs NAME=TEXT; {USAGE}"))?),
            "--question" => question = Some(value),
            "--use" => used = Some(value.split(',').map(str::to_string).collect::<Vec<_>>()),
            "--max-tokens" => max_tokens = value.parse().map_err(|_| format!("invalid --max-tokens; {USAGE}"))?,
            "--slot" => slot = value.parse().map_err(|_| format!("invalid --slot; {USAGE}"))?,
            _ => return Err(format!("unknown argument {flag:?}; {USAGE}")),
        }
    }
    let queue = std::rc::Rc::new(Model::default_model()?.create_queue()?);
    if layout.is_empty() || slot == 0 || slot % queue.page_size() != 0 {
        return Err(format!("give at least one --module, and a --slot that is a multiple of {}; {USAGE}", queue.page_size()));
    }
    let mut modules = Vec::new();
    for (i, (name, text)) in layout.iter().enumerate() {
        let role = if name == "system" { "system" } else { "user" };
        let tokens = queue.tokenize(&format!("<|im_start|>{role}\n{text}<|im_end|>\n"));
        if tokens.len() as u32 > slot {
            return Err(format!("module {name:?} has {} tokens, more than its slot of {slot}", tokens.len()));
        }
        let start = i as u32 * slot;
        let key = format!("{start}\u{0}{name}\u{0}{}", tokens.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(","));
        let export = format!("modular_caching.{name}.{:016x}", fnv1a(key.bytes()));
        modules.push(Module { name: name.clone(), tokens, start, export });
    }
    if clear {
        let cleared: Vec<String> = modules.iter().filter(|m| allocate::unexport_kvpage(&m.export).is_ok())
            .map(|m| json_string(&m.name)).collect();
        inferlet::send(&format!("{{\"cleared\": {}}}", json_array(cleared)));
        return Ok(());
    }
    let question = question.ok_or(format!("--question is required; {USAGE}"))?;
    let used = used.unwrap_or_else(|| modules.iter().map(|m| m.name.clone()).collect());
    if let Some(unknown) = used.iter().find(|u| !modules.iter().any(|m| &m.name == *u)) {
        return Err(format!("--use names unknown module {unknown:?}; {USAGE}"));
    }
    // Compose: the used modules' pages in layout order, each at its own fixed positions.
    let (mut pages, mut prefilled) = (Vec::new(), Vec::new());
    for module in modules.iter().filter(|m| used.contains(&m.name)) {
        pages.extend(module_pages(&queue, module, &mut prefilled).await?);
    }
    let ask = queue.tokenize(&format!("<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"));
    let stop = Stop::new(max_tokens).eos(queue.eos_tokens());
    let result = generate_after_pages(&queue, &pages, modules.len() as u32 * slot, &ask, &Sampler::greedy(), &stop).await;
    allocate::dealloc_kvpage(queue.raw(), &pages)?;
    let answer = result?;
    let sizes: Vec<String> = modules.iter().map(|m| format!("{}: {}", json_string(&m.name), m.tokens.len())).collect();
    inferlet::send(&format!("{{\"answer\": {}, \"used\": {}, \"prefilled\": {}, \"module_tokens\": {{{}}}}}",
                            json_string(&answer.text), json_array(used.iter().map(|u| json_string(u))),
                            json_array(prefilled.iter().map(|p| json_string(p))), sizes.join(", ")));
    Ok(())
}
