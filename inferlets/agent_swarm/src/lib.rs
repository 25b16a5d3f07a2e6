//! `agent_swarm`: a coordinator and worker agents, separate instances, talking over topics.
//!
//! Multi-agent systems split a job among agents that exchange messages instead of sharing
//! one context. Here every agent is its own inferlet instance and the messages go through
//! the server's broadcast/subscribe bus, without a round trip to the client: workers
//! subscribe to `<topic>.tasks` and say "subscribed" to their client; the coordinator
//! subscribes to `<topic>.results`, broadcasts one task addressed to each worker, and
//! collects one answer per worker; each worker answers its task with a short greedy
//! generation (batched with the other workers by the server) and broadcasts it back.
//!
//! Requirements: R3
//! Host APIs: subscribe, broadcast, subscription.next, forward, sample
//! Arguments: --role worker --id ID [--topic T (swarm)] [--max-tokens N (16)]
//!   | --role coordinator --task ID=TEXT... [--topic T]
//! Output: worker: "subscribed", then one JSON object {"id", "task", "answer"};
//!   coordinator: one JSON object {"results": [{"worker", "task", "answer"}], "messages"}.

use inferlet::json::{json_string, json_value};
use inferlet::messages::{broadcast, subscribe};
use inferlet::{chat, Model, Sampler, Stop};

inferlet::main!(main);

const USAGE: &str = "usage: --role worker --id ID [--topic T] [--max-tokens N] \
                     | --role coordinator --task ID=TEXT... [--topic T]";

async fn main() -> Result<(), String> {
    let (mut role, mut id, mut topic, mut max_tokens, mut tasks) = (None, None, "swarm".to_string(), 16, Vec::new());
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or(format!("{flag} needs a value; {USAGE}"))?.clone();
        match flag.as_str() {
            "--role" => role = Some(value),
            "--id" => id = Some(value),
            "--topic" => topic = value,
            "--max-tokens" => max_tokens = value.parse().map_err(|_| format!("bad --max-tokens; {USAGE}"))?,
            "--task" => {
                let (worker, task) = value.split_once('=').ok_or(format!("--task needs ID=TEXT; {USAGE}"))?;
                tasks.push((worker.to_string(), task.to_string()));
            }
            _ => return Err(format!("unknown argument {flag:?}; {USAGE}")),
        }
    }
    match (role.as_deref(), id) {
        (Some("worker"), Some(id)) => worker(&topic, &id, max_tokens).await,
        (Some("coordinator"), None) if !tasks.is_empty() => coordinator(&topic, &tasks).await,
        _ => Err(USAGE.to_string()),
    }
}

/// Waits for the task addressed to `id`, answers it, broadcasts the answer.
async fn worker(topic: &str, id: &str, max_tokens: usize) -> Result<(), String> {
    let tasks = subscribe(&format!("{topic}.tasks"))?;
    inferlet::send("subscribed");
    let message = tasks.next_matching(|m| json_value(m, "to").as_deref() == Some(id)).await;
    let task = json_value(&message, "task").unwrap_or_default();

    let mut ctx = Model::default_model()?.create_context()?;
    ctx.fill_chat(&[chat("user", &task)], true)?;
    let stop = Stop::new(max_tokens).eos(ctx.queue().eos_tokens());
    let answer = ctx.generate(&Sampler::greedy(), &stop).await?;

    broadcast(&format!("{topic}.results"), &format!("{{\"from\": {}, \"answer\": {}}}", json_string(id), json_string(&answer)));
    inferlet::send(&format!("{{\"id\": {}, \"task\": {}, \"answer\": {}}}", json_string(id), json_string(&task), json_string(&answer)));
    Ok(())
}

/// Sends each worker its task and collects one answer from each.
async fn coordinator(topic: &str, tasks: &[(String, String)]) -> Result<(), String> {
    let results = subscribe(&format!("{topic}.results"))?; // before any worker can answer
    for (worker, task) in tasks {
        broadcast(&format!("{topic}.tasks"), &format!("{{\"to\": {}, \"task\": {}}}", json_string(worker), json_string(task)));
    }
    let mut answers: Vec<Option<String>> = vec![None; tasks.len()];
    let mut messages = 0;
    while answers.iter().any(Option::is_none) {
        let message = results.next().await;
        messages += 1;
        let from = json_value(&message, "from").unwrap_or_default();
        if let Some(i) = tasks.iter().position(|(worker, _)| *worker == from) {
            answers[i] = Some(json_value(&message, "answer").unwrap_or_default());
        }
    }
    let results: Vec<String> = tasks.iter().zip(&answers).map(|((worker, task), answer)| {
        format!("{{\"worker\": {}, \"task\": {}, \"answer\": {}}}", json_string(worker), json_string(task),
                json_string(answer.as_deref().unwrap_or_default()))
    }).collect();
    inferlet::send(&format!("{{\"results\": [{}], \"messages\": {messages}}}", results.join(", ")));
    Ok(())
}
