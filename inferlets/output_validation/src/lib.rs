//! `output_validation`: generates until the output matches a regular expression, retrying with feedback.
//!
//! Generate-then-validate (as in Guardrails-style output validation and self-correction
//! loops) checks each model answer against a required format; a rejected answer is kept in
//! the conversation, followed by a corrective message naming the format, and the model
//! answers again with a new sampling seed, up to a limit of attempts. The check is a small
//! backtracking matcher for a regex subset written here (no crates): literals, `.`, `\d`,
//! `\w`, `\s`, escapes, classes `[a-z0-9_]` / `[^...]`, quantifiers `* + ? {n} {n,m}`,
//! optional `^`/`$`; the whole (trimmed) answer must match.
//!
//! Requirements: R2, R3
//! Host APIs: forward, sample, tokenize, apply-chat-template, alloc-kvpage, dealloc-kvpage
//! Arguments: --prompt TEXT --pattern REGEX [--max-attempts N (4)] [--max-tokens N (24)] [--seed S (1)] [--temperature T (0.7)]
//! Output: one JSON object {"valid", "attempts": [text, ...], "text"} (the last attempt is the accepted one if valid).

use inferlet::{chat, ChatMessage, Model, Sampler, Stop};
use inferlet::json::json_string;

inferlet::main!(main);

/// One pattern element: a character test repeated between `min` and `max` times.
struct Atom {
    set: Vec<(char, char)>,
    negated: bool,
    min: usize,
    max: usize,
}

impl Atom {
    fn accepts(&self, c: char) -> bool {
        self.set.iter().any(|&(lo, hi)| lo <= c && c <= hi) != self.negated
    }
}

fn escape_class(c: char) -> Option<(Vec<(char, char)>, bool)> {
    let word = vec![('a', 'z'), ('A', 'Z'), ('0', '9'), ('_', '_')];
    let space = vec![(' ', ' '), ('\t', '\r')];
    Some(match c {
        'd' => (vec![('0', '9')], false), 'D' => (vec![('0', '9')], true),
        'w' => (word, false), 'W' => (word, true),
        's' => (space, false), 'S' => (space, true),
        _ => return None,
    })
}

fn parse(pattern: &str) -> Result<Vec<Atom>, String> {
    let body = pattern.strip_prefix('^').unwrap_or(pattern);
    let body = body.strip_suffix('$').filter(|b| !b.ends_with('\\')).unwrap_or(body);
    let chars: Vec<char> = body.chars().collect();
    let mut atoms: Vec<Atom> = Vec::new();
    let mut i = 0;
    let bad = |what: &str| format!("unsupported pattern {pattern:?}: {what}");
    while i < chars.len() {
        let c = chars[i];
        i += 1;
        let (set, negated) = match c {
            '.' => (vec![], true),
            '\\' => {
                let e = *chars.get(i).ok_or_else(|| bad("trailing backslash"))?;
                i += 1;
                escape_class(e).unwrap_or((vec![(e, e)], false))
            }
            '[' => {
                let negated = chars.get(i) == Some(&'^');
                i += negated as usize;
                let mut set = Vec::new();
                while i < chars.len() && chars[i] != ']' {
                    let mut lo = chars[i];
                    if lo == '\\' && i + 1 < chars.len() {
                        i += 1;
                        if let Some((class, false)) = escape_class(chars[i]) {
                            set.extend(class);
                            i += 1;
                            continue;
                        }
                        lo = chars[i];
                    }
                    if chars.get(i + 1) == Some(&'-') && i + 2 < chars.len() && chars[i + 2] != ']' {
                        set.push((lo, chars[i + 2]));
                        i += 3;
                    } else {
                        set.push((lo, lo));
                        i += 1;
                    }
                }
                if i >= chars.len() {
                    return Err(bad("unclosed ["));
                }
                i += 1;
                (set, negated)
            }
            '*' | '+' | '?' | '{' | '(' | ')' | '|' => return Err(bad(&format!("unexpected {c:?}"))),
            c => (vec![(c, c)], false),
        };
        let (mut min, mut max) = (1, 1);
        match chars.get(i) {
            Some('*') => (min, max) = (0, usize::MAX),
            Some('+') => (min, max) = (1, usize::MAX),
            Some('?') => (min, max) = (0, 1),
            Some('{') => {
                let close = chars[i..].iter().position(|&c| c == '}').ok_or_else(|| bad("unclosed {"))? + i;
                let inside: String = chars[i + 1..close].iter().collect();
                let number = |s: &str| s.trim().parse::<usize>().map_err(|_| bad("bad {n,m}"));
                (min, max) = match inside.split_once(',') {
                    Some((lo, "")) => (number(lo)?, usize::MAX),
                    Some((lo, hi)) => (number(lo)?, number(hi)?),
                    None => (number(&inside)?, number(&inside)?),
                };
                i = close;
            }
            _ => i -= 1,
        }
        i += 1;
        atoms.push(Atom { set, negated, min, max });
    }
    Ok(atoms)
}

/// Whether `atoms` match all of `text` (backtracking, greedy).
fn matches(atoms: &[Atom], text: &[char]) -> bool {
    let Some((atom, rest)) = atoms.split_first() else { return text.is_empty() };
    let run = text.iter().take(atom.max).take_while(|&&c| atom.accepts(c)).count();
    (atom.min..=run).rev().any(|n| matches(rest, &text[n..]))
}

/// The shortest text of the pattern's shape, as a hint for the model (e.g. `000-000-0000`).
fn example(atoms: &[Atom]) -> String {
    atoms.iter().map(|a| {
        let c = match (a.negated, a.set.first()) {
            (false, Some(&(lo, _))) => lo,
            _ => 'x',
        };
        c.to_string().repeat(a.min.max(1).min(a.max))
    }).collect()
}

async fn main() -> Result<(), String> {
    let (mut prompt, mut pattern, mut max_attempts, mut max_tokens, mut seed, mut temperature) =
        (None, None, 4usize, 24usize, 1u64, 0.7f32);
    let args = inferlet::args();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or(format!("{flag} needs a value"))?;
        let bad = || format!("invalid number for {flag}: {value:?}");
        match flag.as_str() {
            "--prompt" => prompt = Some(value.clone()),
            "--pattern" => pattern = Some(value.clone()),
            "--max-attempts" => max_attempts = value.parse().map_err(|_| bad())?,
            "--max-tokens" => max_tokens = value.parse().map_err(|_| bad())?,
            "--seed" => seed = value.parse().map_err(|_| bad())?,
            "--temperature" => temperature = value.parse().map_err(|_| bad())?,
            _ => return Err(format!("unknown argument {flag:?}; usage: --prompt TEXT --pattern REGEX \
                                     [--max-attempts N] [--max-tokens N] [--seed S] [--temperature T]")),
        }
    }
    let (prompt, pattern) = (prompt.ok_or("--prompt is required")?, pattern.ok_or("--pattern is required")?);
    let atoms = parse(&pattern)?;
    let model = Model::default_model()?;
    let mut messages: Vec<ChatMessage> = vec![chat("user", &prompt)];
    let (mut attempts, mut valid) = (Vec::new(), false);
    for attempt in 0..max_attempts {
        let mut ctx = model.create_context()?;
        ctx.fill_chat(&messages, true)?;
        let stop = Stop::new(max_tokens).eos(ctx.queue().eos_tokens());
        let sampler = Sampler::temperature(temperature).with_seed(seed + 1000 * attempt as u64);
        let text = ctx.generate(&sampler, &stop).await?.trim().to_string();
        valid = matches(&atoms, &text.chars().collect::<Vec<_>>());
        attempts.push(text.clone());
        if valid {
            break;
        }
        messages.push(chat("assistant", &text));
        messages.push(chat("user", &format!("Wrong format. Reply with only the answer, in the form {} \
                                              (regular expression {pattern}), and nothing else.", example(&atoms))));
    }
    let texts: Vec<String> = attempts.iter().map(|t| json_string(t)).collect();
    inferlet::send(&format!("{{\"valid\": {valid}, \"attempts\": [{}], \"text\": {}}}", texts.join(", "),
                            json_string(attempts.last().map_or("", |t| t))));
    Ok(())
}

