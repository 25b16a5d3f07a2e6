//! `watermarking`: generates text carrying a statistical green-list watermark, and detects it.
//!
//! Kirchenbauer et al. ("A Watermark for Large Language Models") let the previous token
//! seed a pseudo-random split of the vocabulary into a green list (a fraction gamma) and a
//! red list, and add delta to the green logits before sampling; text from the watermarked
//! model then holds far more green tokens than the gamma expected by chance, which a
//! one-proportion z-test detects from the tokens alone. Here each step reads the model's
//! top-k next-token distribution (`next_dist`), multiplies green probabilities by
//! exp(delta) (the same as adding delta to their logits), renormalizes, and samples with
//! a seeded splitmix64 generator; `--detect` scores a text instead.
//!
//! Requirements: R2
//! Host APIs: forward, get-next-dist, tokenize, detokenize, alloc-kvpage, dealloc-kvpage
//! Arguments: --prompt TEXT [--max-tokens N (48)] [--seed S (1)] [--key K] [--delta D (4.0)] [--top-k K (64)], or --detect TEXT [--key K]
//! Output: one JSON object {"text", "tokens", "green", "z"} (with --detect: {"tokens", "green", "z"}).

use inferlet::{chat, Model};
use inferlet::json::json_string;

inferlet::main!(main);

const GAMMA: f64 = 0.5;

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Whether `token` is in the green list that `previous` seeds under `key`.
fn is_green(key: u64, previous: u32, token: u32) -> bool {
    let mut state = key ^ ((previous as u64) << 32) ^ token as u64;
    (splitmix64(&mut state) as f64) < GAMMA * u64::MAX as f64
}

/// (green count, z-score) of `tokens`, each scored against the one before it.
fn score(key: u64, tokens: &[u32]) -> (usize, f64) {
    let t = tokens.len().saturating_sub(1) as f64;
    let green = tokens.windows(2).filter(|w| is_green(key, w[0], w[1])).count();
    let z = if t > 0.0 { (green as f64 - GAMMA * t) / (t * GAMMA * (1.0 - GAMMA)).sqrt() } else { 0.0 };
    (green, z)
}

async fn main() -> Result<(), String> {
    let (mut prompt, mut detect, mut max_tokens, mut seed, mut key, mut delta, mut top_k) =
        (None, None, 48usize, 1u64, 15485863u64, 4.0f64, 64u32);
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or(format!("{flag} needs a value"))?;
        let bad = || format!("invalid number for {flag}: {value:?}");
        match flag.as_str() {
            "--prompt" => prompt = Some(value.clone()),
            "--detect" => detect = Some(value.clone()),
            "--max-tokens" => max_tokens = value.parse().map_err(|_| bad())?,
            "--seed" => seed = value.parse().map_err(|_| bad())?,
            "--key" => key = value.parse().map_err(|_| bad())?,
            "--delta" => delta = value.parse().map_err(|_| bad())?,
            "--top-k" => top_k = value.parse().map_err(|_| bad())?,
            _ => return Err(format!("unknown argument {flag:?}; usage: --prompt TEXT [--max-tokens N] [--seed S] \
                                     [--key K] [--delta D] [--top-k K] | --detect TEXT [--key K]")),
        }
    }
    let mut ctx = Model::default_model()?.create_context()?;
    if let Some(text) = detect {
        let tokens = ctx.queue().tokenize(&text);
        let (green, z) = score(key, &tokens);
        let tokens = tokens.len();
        inferlet::send(&format!("{{\"tokens\": {tokens}, \"green\": {green}, \"z\": {z:.4}}}"));
        return Ok(());
    }
    let prompt = prompt.ok_or("--prompt or --detect is required")?;
    ctx.fill_chat(&[chat("user", &prompt)], true)?;
    let eos = ctx.queue().eos_tokens();
    let mut rng = seed;
    let mut generated: Vec<u32> = Vec::new();
    while generated.len() < max_tokens {
        let previous = *ctx.tokens().last().unwrap();
        let (tokens, probs) = ctx.next_dist(top_k).await?;
        let weights: Vec<f64> = tokens.iter().zip(&probs)
            .map(|(&t, &p)| p as f64 * if is_green(key, previous, t) { delta.exp() } else { 1.0 }).collect();
        let mut x = (splitmix64(&mut rng) >> 11) as f64 / (1u64 << 53) as f64 * weights.iter().sum::<f64>();
        let mut choice = tokens[tokens.len() - 1];
        for (&t, w) in tokens.iter().zip(&weights) {
            if x < *w {
                choice = t;
                break;
            }
            x -= w;
        }
        if eos.contains(&choice) {
            break;
        }
        generated.push(choice);
        ctx.fill_tokens(&[choice]);
    }
    let text = ctx.queue().detokenize(&generated)?;
    let (green, z) = score(key, &generated);
    inferlet::send(&format!("{{\"text\": {}, \"tokens\": {}, \"green\": {green}, \"z\": {z:.4}}}",
                            json_string(&text), generated.len()));
    Ok(())
}

