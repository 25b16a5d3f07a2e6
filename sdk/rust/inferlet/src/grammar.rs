//! Grammar-constrained generation: the output is guaranteed to parse.
//!
//! The host compiles the grammar for the model's tokenizer (llguidance) and masks every
//! draw to the tokens the grammar allows next; tokens the grammar forces are filled without
//! sampling. See sdk/wit/grammar.wit.

use crate::bindings::grammar::{self, GrammarKind, Matcher};
use crate::bindings::inference::{GrammarMask, LogitRules, Output};
use crate::bindings::types::Error;
use crate::context::{output, pass_sampler, Run};
use crate::{Context, Queue, Sampler, Stop};

/// A compiled grammar and its parse state over the output so far.
pub struct Grammar {
    matcher: Matcher,
}

impl Grammar {
    /// Output that is JSON valid against `schema` (JSON Schema text).
    pub fn json_schema(queue: &Queue, schema: &str) -> Result<Grammar, Error> {
        Grammar::compile(queue, GrammarKind::JsonSchema, schema)
    }

    /// Output that matches `pattern` as a whole (Rust regex syntax).
    pub fn regex(queue: &Queue, pattern: &str) -> Result<Grammar, Error> {
        Grammar::compile(queue, GrammarKind::Regex, pattern)
    }

    /// Output in the language of a Lark grammar (`start: ...`).
    pub fn lark(queue: &Queue, source: &str) -> Result<Grammar, Error> {
        Grammar::compile(queue, GrammarKind::Lark, source)
    }

    /// Output in the language of an EBNF grammar in GBNF notation (`root ::= ...`).
    pub fn ebnf(queue: &Queue, source: &str) -> Result<Grammar, Error> {
        Grammar::compile(queue, GrammarKind::Ebnf, source)
    }

    /// Output that is exactly one of `options` (a regex alternation of the literals): SGLang's
    /// `gen(choices=...)`, which generates one, where [`Context::select`] scores them all.
    pub fn choices(queue: &Queue, options: &[&str]) -> Result<Grammar, Error> {
        let literals: Vec<String> = options.iter().map(|o| regex_literal(o)).collect();
        Grammar::regex(queue, &literals.join("|"))
    }

    /// Compiles `source` of any `kind` for the queue's model (the constructors above call this).
    pub fn compile(queue: &Queue, kind: GrammarKind, source: &str) -> Result<Grammar, Error> {
        Ok(Grammar { matcher: grammar::compile(queue.raw(), kind, source)? })
    }

    /// The host matcher, for calling `bindings::grammar` directly.
    pub fn matcher(&self) -> &Matcher {
        &self.matcher
    }

    /// Whether the output so far is a complete sentence of the grammar.
    pub fn is_accepting(&self) -> bool {
        self.matcher.is_accepting()
    }
}

impl Context {
    /// A host-side decode run (`Context::run`) whose every draw the grammar masks: the host
    /// advances the matcher over each drawn token, so the inferlet is not woken per token.
    /// Put the EOS tokens in `stop_tokens`: once the grammar is complete only they are
    /// allowed, and the run ends on one. The grammar must be compiled on this context's
    /// queue; tokens it forces are drawn one a step like any other.
    pub fn run_constrained(&mut self, grammar: &Grammar, sampler: &Sampler, steps: u32, stop_tokens: &[u32],
                           streaming: bool) -> Result<Run<'_>, Error> {
        self.run_with_rules(sampler, &LogitRules::new(), Some(grammar), steps, stop_tokens, streaming)
    }

    /// SGLang's `gen`: greedy decoding of at most `max_tokens`, until EOS or one of `stop`,
    /// constrained to match `regex` or to be exactly one of `choices` if given (unlike
    /// [`Context::select`], which scores the choices); the text joins the context. `stop`
    /// applies to unconstrained output (a grammar decides where constrained output ends).
    /// The twin of the Python SDK's `Context.gen`.
    pub async fn gen(&mut self, max_tokens: usize, regex: Option<&str>, choices: Option<&[&str]>,
                     stop: &[&str]) -> Result<String, Error> {
        let grammar = match (regex, choices) {
            (Some(pattern), _) => Some(Grammar::regex(self.queue(), pattern)?),
            (None, Some(options)) => Some(Grammar::choices(self.queue(), options)?),
            (None, None) => None,
        };
        match grammar {
            Some(grammar) => self.generate_constrained(&grammar, &Sampler::greedy(), max_tokens).await,
            None => {
                let stopping = stop.iter().fold(Stop::new(max_tokens).eos(self.queue().eos_tokens()),
                                                |s, text| s.string(text));
                self.generate(&Sampler::greedy(), &stopping).await
            }
        }
    }

    /// Decodes at most `max_tokens` tokens that the grammar allows, until the grammar is
    /// complete and the model ends (EOS) or nothing else may follow. Returns the output
    /// text; `grammar.is_accepting()` says whether it is complete.
    pub async fn generate_constrained(&mut self, grammar: &Grammar, sampler: &Sampler,
                                      max_tokens: usize) -> Result<String, Error> {
        let eos = self.queue().eos_tokens();
        let mut sampler = sampler.clone();
        let mut generated: Vec<u32> = Vec::new();
        while generated.len() < max_tokens && !grammar.matcher.is_stopped() {
            let mut forced = grammar.matcher.forced_tokens();
            forced.truncate(max_tokens - generated.len());
            if !forced.is_empty() {
                grammar.matcher.accept(&forced)?;
                self.fill_tokens(&forced);
                generated.extend(forced);
                continue;
            }
            // One fused pass: the host masks the draw with the matcher's allowed tokens.
            let mask = GrammarMask { matcher: grammar.matcher.id(), advance: false };
            let out = Output { sample: Some(pass_sampler(&sampler)), grammar: Some(mask), ..output(0) };
            let token = self.step(out).await?.tokens[0];
            sampler.seed = sampler.seed.map(|seed| seed.wrapping_add(1));
            if eos.contains(&token) {
                break;
            }
            grammar.matcher.accept(&[token])?;
            self.fill_tokens(&[token]);
            generated.push(token);
        }
        self.queue().detokenize(&generated)
    }
}

/// `text` as a regex that matches only itself.
fn regex_literal(text: &str) -> String {
    text.chars().fold(String::new(), |mut out, c| {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
        out
    })
}
