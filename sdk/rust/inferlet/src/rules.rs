//! Logit rules: OpenAI's `logit_bias`, `presence_penalty` and `frequency_penalty`, and
//! vLLM's `min_tokens`, applied by the host to the logits before every draw
//! (`inference.logit-rules`). In a host-side run the host counts each drawn token as seen,
//! so a penalised run still never wakes the inferlet per token.

use crate::bindings::inference::{GrammarMask, LogitRules, Output, TextEcho};
use crate::bindings::types::Error;
use crate::context::{output, pass_sampler, Run};
use crate::{Context, Grammar, Sampler};

impl LogitRules {
    /// No bias, no penalty, nothing banned.
    pub fn new() -> LogitRules {
        LogitRules { bias: Vec::new(), presence_penalty: 0.0, frequency_penalty: 0.0, seen: Vec::new(),
                     banned: Vec::new(), banned_until: 0 }
    }

    /// Adds `value` to `token`'s logit.
    pub fn bias(mut self, token: u32, value: f32) -> LogitRules {
        self.bias.push((token, value));
        self
    }

    /// Subtracts `presence` once from every token seen, and `frequency` once per time seen.
    pub fn penalties(mut self, presence: f32, frequency: f32) -> LogitRules {
        self.presence_penalty = presence;
        self.frequency_penalty = frequency;
        self
    }

    /// Tokens drawn before (the completion so far) that the penalties count.
    pub fn seen(mut self, tokens: &[u32]) -> LogitRules {
        self.seen = tokens.to_vec();
        self
    }

    /// `tokens` (say, EOS) cannot be drawn while fewer than `until` tokens are seen.
    pub fn ban_until(mut self, tokens: &[u32], until: u32) -> LogitRules {
        self.banned = tokens.to_vec();
        self.banned_until = until;
        self
    }

    /// Whether the rules change nothing (then passes carry none).
    pub fn is_empty(&self) -> bool {
        self.bias.is_empty() && self.presence_penalty == 0.0 && self.frequency_penalty == 0.0
            && (self.banned.is_empty() || self.banned_until as usize <= self.seen.len())
    }
}

impl Default for LogitRules {
    fn default() -> LogitRules {
        LogitRules::new()
    }
}

impl Context {
    /// `Context::run` with logit rules applied at every step, and optionally every draw
    /// masked by a grammar the host advances (as `run_constrained`).
    pub fn run_with_rules(&mut self, sampler: &Sampler, rules: &LogitRules, grammar: Option<&Grammar>, steps: u32,
                          stop_tokens: &[u32], streaming: bool) -> Result<Run<'_>, Error> {
        self.ruled_run(sampler, rules, grammar, steps, stop_tokens, streaming, None)
    }

    /// `run_with_rules` whose text the host sends to the client as it is drawn
    /// (`inference.run-text`): each piece as one message `echo.prefix`, the text (a JSON
    /// string literal with `echo.json`), `echo.suffix`; the run ends at a stop token or at
    /// the token that completes one of `echo.stop_strings`. No inferlet code runs per token:
    /// `Run::next` returns the tokens once, at the end.
    pub fn run_text(&mut self, sampler: &Sampler, rules: &LogitRules, grammar: Option<&Grammar>, steps: u32,
                    stop_tokens: &[u32], echo: TextEcho) -> Result<Run<'_>, Error> {
        self.ruled_run(sampler, rules, grammar, steps, stop_tokens, false, Some(echo))
    }

    fn ruled_run(&mut self, sampler: &Sampler, rules: &LogitRules, grammar: Option<&Grammar>, steps: u32,
                 stop_tokens: &[u32], streaming: bool, echo: Option<TextEcho>) -> Result<Run<'_>, Error> {
        let mask = grammar.map(|g| GrammarMask { matcher: g.matcher().id(), advance: true });
        let rules = if rules.is_empty() { None } else { Some(rules.clone()) };
        self.start_run(sampler, steps, stop_tokens, streaming, mask, rules, echo)
    }

    /// Runs the pending tokens and draws the next one in one fused pass, under `rules` and,
    /// if given, the grammar's mask (not advanced: `grammar.matcher().accept` the token);
    /// returns it with the `k` most likely tokens and their probabilities (temperature 1,
    /// after the rules and the mask; empty for k = 0). The token is left pending.
    pub async fn draw_next(&mut self, sampler: &Sampler, k: u32, grammar: Option<&Grammar>,
                           rules: Option<&LogitRules>) -> Result<(u32, Vec<u32>, Vec<f32>), Error> {
        let out = Output {
            sample: Some(pass_sampler(sampler)), top_k: k,
            grammar: grammar.map(|g| GrammarMask { matcher: g.matcher().id(), advance: false }),
            rules: rules.filter(|r| !r.is_empty()).cloned(), ..output(0)
        };
        let mut result = self.step(out).await?;
        let token = result.tokens[0];
        self.fill_tokens(&[token]);
        let (ids, probs) = match result.details.pop() {
            Some(detail) => (detail.top_ids, detail.top_probs),
            None => (Vec::new(), Vec::new()),
        };
        Ok((token, ids, probs))
    }
}
