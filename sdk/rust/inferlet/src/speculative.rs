//! Speculative decoding: a cheap drafter guesses the next tokens, one forward pass verifies
//! them all (an output at every drafted position, sampled greedily), and the longest prefix
//! the model agrees with is kept, plus the model's own token after it. The output equals
//! plain greedy decoding; each pass yields one token or more.

use crate::{Context, Error, Sampler, Stop};

/// Guesses how the token sequence continues.
pub trait Drafter {
    /// Up to `max` guessed next tokens after `tokens` (the whole sequence so far); may be empty.
    fn draft(&mut self, tokens: &[u32], max: usize) -> Vec<u32>;

    /// Told after each verification: the draft, the model's greedy token after each prefix
    /// of it (`predicted[i]` follows `draft[..i]`; one more than the draft), and how many
    /// drafted tokens were accepted. Drafters that learn from the model (Jacobi) use this.
    fn feedback(&mut self, _draft: &[u32], _predicted: &[u32], _accepted: usize) {}
}

/// Prompt lookup: finds the most recent earlier occurrence of the sequence's last `n`
/// tokens (trying `n`, then shorter suffixes down to 1) and drafts what followed it.
pub struct NgramDrafter {
    pub n: usize,
}

impl Drafter for NgramDrafter {
    fn draft(&mut self, tokens: &[u32], max: usize) -> Vec<u32> {
        for n in (1..=self.n.min(tokens.len().saturating_sub(1))).rev() {
            let suffix = &tokens[tokens.len() - n..];
            // Latest start strictly before the suffix itself.
            for start in (0..tokens.len() - n).rev() {
                if &tokens[start..start + n] == suffix {
                    let from = start + n;
                    return tokens[from..(from + max).min(tokens.len())].to_vec();
                }
            }
        }
        Vec::new()
    }
}

/// Jacobi decoding as a drafter: the guess for the next `n` tokens is the model's own
/// output for those positions in the previous pass (computed from the previous, partly wrong
/// guess), i.e. one Jacobi fixed-point iteration per pass; the prefix that has converged is
/// what verification accepts. Guesses are padded by repeating the last token.
pub struct JacobiDrafter {
    pub n: usize,
    guess: Vec<u32>,
}

impl JacobiDrafter {
    /// A drafter that guesses `n` tokens at a time.
    pub fn new(n: usize) -> JacobiDrafter {
        JacobiDrafter { n, guess: Vec::new() }
    }
}

impl Drafter for JacobiDrafter {
    fn draft(&mut self, tokens: &[u32], max: usize) -> Vec<u32> {
        let mut guess = std::mem::take(&mut self.guess);
        let pad = guess.last().or(tokens.last()).copied();
        guess.truncate(self.n.min(max));
        while let Some(pad) = pad.filter(|_| guess.len() < self.n.min(max)) {
            guess.push(pad);
        }
        guess
    }

    fn feedback(&mut self, _draft: &[u32], predicted: &[u32], accepted: usize) {
        // predicted[accepted] is kept; the outputs after it are the next iterate.
        self.guess = predicted[accepted + 1..].to_vec();
    }
}

/// What `generate_speculative` produced.
#[derive(Clone, Debug, Default)]
pub struct Speculation {
    /// The generated text (without the EOS token or stop string).
    pub text: String,
    /// The generated tokens (without the EOS token).
    pub tokens: Vec<u32>,
    /// Verification forward passes (the first also runs the prompt).
    pub steps: usize,
    /// Drafted tokens, in total.
    pub drafted: usize,
    /// Drafted tokens the model accepted.
    pub accepted: usize,
}

/// The most drafted tokens verified by one pass.
pub const MAX_DRAFT: usize = 8;

/// Greedy decoding of `ctx` (which must have a pending token, e.g. after `fill_chat`) until
/// `stop`, verifying `drafter`'s guesses: per step, one forward pass over the pending tokens
/// plus the draft with an output at the last pending token and at every drafted one; the
/// accepted draft prefix and the model's next token are kept, the rest is truncated away.
pub async fn generate_speculative(ctx: &mut Context, drafter: &mut dyn Drafter, stop: &Stop)
                                  -> Result<Speculation, Error> {
    let mut out = Speculation::default();
    let greedy = Sampler::greedy();
    'steps: while out.tokens.len() < stop.max_tokens {
        let room = stop.max_tokens - out.tokens.len() - 1;
        let mut draft = drafter.draft(&ctx.tokens(), room.min(MAX_DRAFT));
        draft.truncate(room.min(MAX_DRAFT));
        let base = ctx.len(); // the sequence up to and including the last pending token
        ctx.fill_tokens(&draft);
        let pending = ctx.pending().len() as u32;
        let indices: Vec<u32> = (pending - draft.len() as u32 - 1..pending).collect();
        let embeds = ctx.forward_pending(&indices)?;
        let predicted = ctx.queue().sample_all(&embeds, &greedy).await?;
        let accepted = draft.iter().zip(&predicted).take_while(|(d, p)| d == p).count();
        drafter.feedback(&draft, &predicted, accepted);
        out.steps += 1;
        out.drafted += draft.len();
        out.accepted += accepted;
        ctx.truncate(base + accepted);
        ctx.fill_tokens(&[predicted[accepted]]);
        // The accepted tokens are committed; the bonus token stays pending.
        for &token in &predicted[..=accepted] {
            if stop.eos_tokens.contains(&token) {
                break 'steps;
            }
            out.tokens.push(token);
            if out.tokens.len() >= stop.max_tokens {
                break;
            }
        }
        if !stop.strings.is_empty() {
            let text = ctx.queue().detokenize(&out.tokens)?;
            if let Some(cut) = stop.cut(&text) {
                out.text = cut.to_string();
                return Ok(out);
            }
        }
    }
    out.text = ctx.queue().detokenize(&out.tokens)?;
    Ok(out)
}
