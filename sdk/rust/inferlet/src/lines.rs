//! Line-by-line greedy decoding, the unit of agent protocols (`Thought: ...`,
//! `Action: tool[input]`, `Code: ...`).

use crate::bindings::types::Error;
use crate::{Context, Sampler, TextStream};

/// One decoded line.
#[derive(Clone, Debug)]
pub struct Line {
    /// The text up to the stop: before a newline, or including any other stop character.
    pub text: String,
    /// Tokens decoded (the EOS token, if any, not counted).
    pub tokens: usize,
    /// Whether a newline was decoded (as the stop, or right after another stop).
    pub newline: bool,
}

impl Context {
    /// Greedy-decodes up to `max` tokens, until the text holds one of `stops` or the model
    /// ends (an EOS token is dropped without being run). `watch(text, n)` sees the text
    /// after every token (e.g. to act on a tool call before the line ends). The last token
    /// stays pending: the next fill follows it.
    pub async fn decode_line(&mut self, max: usize, stops: &[char], mut watch: impl FnMut(&str, usize))
                             -> Result<Line, Error> {
        let eos = self.queue().eos_tokens();
        let mut line = TextStream::new(self.queue());
        while line.tokens().len() < max {
            let token = self.decode_step(&Sampler::greedy()).await?;
            if eos.contains(&token) {
                self.truncate(self.len() - 1); // still pending: nothing was run
                break;
            }
            line.push(&[token])?;
            let (text, n) = (line.text(), line.tokens().len());
            watch(text, n);
            if let Some(at) = text.find(stops) {
                let stop = text[at..].chars().next().unwrap();
                let end = if stop == '\n' { at } else { at + stop.len_utf8() };
                return Ok(Line { text: text[..end].to_string(), tokens: n, newline: text[at..].contains('\n') });
            }
        }
        let n = line.tokens().len();
        Ok(Line { text: line.finish()?, tokens: n, newline: false })
    }
}
