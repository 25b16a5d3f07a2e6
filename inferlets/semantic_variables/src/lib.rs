//! `semantic_variables`: Parrot's applications as one program, with semantic variables
//! (`inferlet::semvar`): every LLM call a prompt template whose inputs are earlier calls'
//! outputs, declared up front and run inside this instance, with no client round trip
//! between calls and the templates' static prefixes prefilled once and shared.
//!
//! - `chain`: a running summary over the chunks, one call per chunk, each reading the
//!   summary so far (Parrot's chain summarization);
//! - `map-reduce`: one call per chunk at once, then one call over their summaries.
//!
//! Requirements: R1, R3
//! Host APIs: forward, embed-text, sample, create-queue, copy-kvpage (fork), set-queue-objective, export-kvpage
//! Arguments: --app chain|map-reduce --chunk TEXT [--chunk TEXT ...] [--max-tokens N (32)] [--objective latency|throughput (latency)] [--share NAMESPACE]
//! Output: one JSON object {"result": text, "calls": N, "summaries": [text, ...]}.

use inferlet::json::{json_array, json_string};
use inferlet::semvar::{Gen, Pipeline, Template, Var};
use inferlet::{Model, Objective};

inferlet::main!(main);

const USAGE: &str = "usage: --app chain|map-reduce --chunk TEXT [--chunk TEXT ...] [--max-tokens N] \
                     [--objective latency|throughput] [--share NAMESPACE]";
// The user's turn of each call, in the model's chat format (`Template::chat`).
const CHAIN: &str = "Keep a running summary of a document read in parts.\n\
                     Summary so far: {{input:summary}}\nNext part: {{input:chunk}}\n\
                     Reply with the updated summary in one sentence.";
const MAP: &str = "Summarize this text in one sentence.\nText: {{input:chunk}}";
const REDUCE: &str = "Combine these summaries into one paragraph.";

async fn main() -> Result<(), String> {
    let (mut app, mut chunks, mut max_tokens, mut objective, mut share) =
        (None, Vec::new(), 32usize, Objective::Latency, None);
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or(format!("{flag} needs a value; {USAGE}"))?;
        let bad = || format!("invalid value for {flag}: {value:?}; {USAGE}");
        match flag.as_str() {
            "--app" => app = Some(value.clone()),
            "--chunk" => chunks.push(value.clone()),
            "--max-tokens" => max_tokens = value.parse().map_err(|_| bad())?,
            "--objective" => objective = match value.as_str() {
                "latency" => Objective::Latency,
                "throughput" => Objective::Throughput,
                _ => return Err(bad()),
            },
            "--share" => share = Some(value.clone()),
            _ => return Err(format!("unknown argument {flag:?}; {USAGE}")),
        }
    }
    if chunks.is_empty() {
        return Err(format!("at least one --chunk is required; {USAGE}"));
    }
    let model = Model::default_model()?;
    let queue = model.create_queue()?;
    let mut pipeline = Pipeline::new(model);
    if let Some(namespace) = &share {
        pipeline = pipeline.share_prefixes(namespace);
    }
    let gen = Gen::greedy(max_tokens);
    let mut summaries: Vec<Var> = Vec::new();
    let result = match app.as_deref() {
        Some("chain") => {
            let template = Template::chat(&queue, CHAIN, "summary")?;
            let mut summary = pipeline.input("summary", "(nothing yet)");
            for chunk in &chunks {
                let chunk = pipeline.input("chunk", chunk);
                summary = pipeline.call(&template, &[("summary", &summary), ("chunk", &chunk)], &gen)?.remove(0);
                summaries.push(summary.clone());
            }
            summary
        }
        Some("map-reduce") => {
            let map = Template::chat(&queue, MAP, "summary")?;
            for chunk in &chunks {
                let chunk = pipeline.input("chunk", chunk);
                summaries.push(pipeline.call(&map, &[("chunk", &chunk)], &gen)?.remove(0));
            }
            let slots: Vec<String> = (0..chunks.len()).map(|i| format!("- {{{{input:s{i}}}}}")).collect();
            let reduce = Template::chat(&queue, &format!("{REDUCE}\n{}", slots.join("\n")), "paragraph")?;
            let names: Vec<String> = (0..chunks.len()).map(|i| format!("s{i}")).collect();
            let bindings: Vec<(&str, &Var)> = names.iter().map(String::as_str).zip(&summaries).collect();
            pipeline.call(&reduce, &bindings, &gen)?.remove(0)
        }
        _ => return Err(format!("--app must be chain or map-reduce; {USAGE}")),
    };
    let text = pipeline.get(&result, objective).await?;
    let summaries: Vec<String> = summaries.iter().map(|s| s.value().unwrap_or_default()).collect();
    let calls = summaries.len() + usize::from(app.as_deref() == Some("map-reduce"));
    inferlet::send(&format!("{{\"result\": {}, \"calls\": {calls}, \"summaries\": {}}}", json_string(&text),
                            json_array(summaries.iter().map(|s| json_string(s)))));
    Ok(())
}
