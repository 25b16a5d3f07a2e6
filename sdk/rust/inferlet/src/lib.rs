//! Pie's Rust SDK: write an inferlet as `async fn main() -> Result<(), String>`.
//!
//! ```ignore
//! inferlet::main!(main);
//!
//! async fn main() -> Result<(), String> {
//!     let model = inferlet::Model::default_model()?;
//!     let mut ctx = model.create_context()?;
//!     ctx.fill_chat(&[inferlet::chat("user", "Hi!")], true)?;
//!     let eos = ctx.queue().eos_tokens();
//!     let text = ctx.generate(&inferlet::Sampler::greedy(), &inferlet::Stop::new(32).eos(eos)).await?;
//!     inferlet::send(&text);
//!     Ok(())
//! }
//! ```
//!
//! Layers, bottom up: `bindings` (generated canonical-ABI glue for sdk/wit, one module per
//! WIT interface, usable directly), `abi` (its memory helpers), `executor` (async over the
//! host's `poll`), then the safe wrappers `Model`/`Queue`, `Context`, samplers and stop
//! conditions.

pub mod abi;
pub mod beam;
pub mod bindings;
pub mod branch;
mod context;
mod executor;
pub mod flags;
mod grammar;
pub mod http;
pub mod json;
mod lines;
pub mod messages;
pub mod semvar;
mod model;
mod oom;
mod rules;
mod sampling;
pub mod select;
pub mod speculative;
mod text_stream;

pub use bindings::output_text::Sampler;
pub use bindings::scheduling::Objective;
pub use bindings::tokenize::ChatMessage;
pub use bindings::types::{Embed, Error, ErrorKind, KvPage};
pub use branch::{generate_branches, Branch};
pub use context::{Context, Run};
pub use executor::{block_on, join_all, spawn, HostFuture, HostResult, JoinHandle};
pub use bindings::grammar::GrammarKind;
pub use bindings::inference::{LogitRules, TextEcho};
pub use grammar::Grammar;
pub use lines::Line;
pub use model::{Model, Queue};
pub use sampling::Stop;
pub use select::{Normalize, Selection};
pub use text_stream::TextStream;

use bindings::{messaging, runtime};

/// Declares the inferlet's entry point: `inferlet::main!(main);` with
/// `async fn main() -> Result<(), String>`. An `Err` ends the instance as failed, with the
/// message as the reason the client sees.
#[macro_export]
macro_rules! main {
    ($main:path) => {
        $crate::__export_world!(run: || {
            $crate::report_panics();
            $crate::block_on($main())
        });
    };
}

/// Installs the panic hook `main!` sets first: a panic's message and location go to the
/// instance's log at error level as `panicked at FILE:LINE:COLUMN: MESSAGE` before the
/// inferlet aborts, and the host makes that line the instance's end reason
/// (`trap: panicked at ...`) instead of guessing at the `unreachable` trap.
#[doc(hidden)]
pub fn report_panics() {
    std::panic::set_hook(Box::new(|info| {
        let place = info.location().map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()));
        let message = info.payload_as_str().unwrap_or("(a panic payload that is not a string)");
        runtime::log(runtime::LogLevel::Error,
                     &format!("panicked at {}: {message}", place.as_deref().unwrap_or("an unknown place")));
    }));
}

/// The arguments the client passed at launch, without the program name.
pub fn args() -> Vec<String> {
    runtime::get_arguments()
}

/// Sends a message to the client that launched this instance.
pub fn send(message: &str) {
    messaging::send(message)
}

/// The next message from the client.
pub async fn receive() -> String {
    messaging::receive().await
}

/// Writes a line to the instance's log: the server log, and the client's stderr when it
/// launched with logs (`pie run` does unless `--quiet`). Also [`println!`](crate::println).
pub fn log(message: &str) {
    runtime::log(runtime::LogLevel::Info, message)
}

/// One turn of a conversation, for [`Context::fill_chat`].
pub fn chat(role: &str, content: &str) -> ChatMessage {
    ChatMessage { role: role.to_string(), content: content.to_string() }
}

/// Writes a line to the instance's log at info level, formatted like `std::println!` (which
/// writes nowhere on wasm32-unknown-unknown: a component has no stdout).
#[macro_export]
macro_rules! println {
    ($($arg:tt)*) => {
        $crate::bindings::runtime::log($crate::bindings::runtime::LogLevel::Info, &::std::format!($($arg)*))
    };
}

/// Writes a line to the instance's log at warn level, formatted like `std::eprintln!`.
#[macro_export]
macro_rules! eprintln {
    ($($arg:tt)*) => {
        $crate::bindings::runtime::log($crate::bindings::runtime::LogLevel::Warn, &::std::format!($($arg)*))
    };
}

/// The WIT name of the kind (`invalid-argument`), as in docs/api.md and the Python SDK.
impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ErrorKind::InvalidHandle => "invalid-handle",
            ErrorKind::InvalidArgument => "invalid-argument",
            ErrorKind::OutOfResources => "out-of-resources",
            ErrorKind::NotFound => "not-found",
            ErrorKind::AlreadyExists => "already-exists",
            ErrorKind::PermissionDenied => "permission-denied",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Io => "io",
            ErrorKind::InferenceFailed => "inference-failed",
            ErrorKind::Discarded => "discarded",
        })
    }
}

/// `KIND: MESSAGE`, the kind spelled as in the WIT (`invalid-argument: ...`).
impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

impl std::error::Error for Error {}

/// Lets `?` turn host errors into the `String` error of `main`.
impl From<Error> for String {
    fn from(error: Error) -> String {
        error.to_string()
    }
}
