"""`pie new`: a new inferlet crate that builds out of the box, outside this repository.

The crate depends on the Rust SDK of this checkout by absolute path (there is no crates.io
here) and carries its own `[workspace]` and release profile, so `pie build DIR` works on it
anywhere.
"""

from __future__ import annotations

import re
from pathlib import Path

from pie.toolchain import REPO, ToolchainError

SDK_DIR = REPO / "sdk" / "rust" / "inferlet"

CARGO_TOML = """\
[package]
name = "{name}"
version = "0.1.0"
edition = "2021"

[lib]
crate-type = ["cdylib"]

[dependencies]
inferlet = {{ path = "{sdk}" }}

# A workspace of its own, so the crate builds wherever it lives.
[workspace]

[profile.release]
opt-level = "s"
lto = true
codegen-units = 1
panic = "abort"
strip = true

[profile.dev]
panic = "abort"
"""

LIB_RS = """\
//! `{name}`: answers one prompt with the model's chat template.
//!
//! A starting point: edit `main`. See docs/inferlets.md for the SDK tour and the inferlets
//! shipped with Pie for techniques (forks, grammars, speculative decoding, agents).
//!
//! Requirements: R2
//! Host APIs: tokenize, apply-chat-template, embed-text, forward, sample
//! Arguments: --prompt TEXT [--max-tokens N]
//! Output: one message, the completion.

use inferlet::flags::{{arg_or, parse_args}};
use inferlet::{{chat, Model, Sampler, Stop}};

const USAGE: &str = "--prompt TEXT [--max-tokens N]";

inferlet::main!(main);

async fn main() -> Result<(), String> {{
    let args = parse_args(&inferlet::args(), &["prompt", "max-tokens"], &[], USAGE)?;
    let prompt = args.get("prompt").ok_or(format!("--prompt is required; usage: {{USAGE}}"))?;
    let max_tokens: usize = arg_or(&args, "max-tokens", 64, USAGE)?;
    inferlet::println!("answering {{}} characters in at most {{max_tokens}} tokens", prompt.len());

    let model = Model::default_model()?;
    let mut ctx = model.create_context()?;
    ctx.fill_chat(&[chat("user", prompt)], true)?;
    let stop = Stop::new(max_tokens).eos(ctx.queue().eos_tokens());
    let answer = ctx.generate(&Sampler::greedy(), &stop).await?;
    inferlet::send(&answer);
    Ok(())
}}
"""


def new_inferlet(directory: Path, name: str | None = None) -> Path:
    """Create the crate in `directory` (which must not exist or be empty); returns it."""
    directory = Path(directory).resolve()
    name = name or directory.name.replace("-", "_")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ToolchainError(f"{name!r} is not a valid crate name: use lowercase letters, digits "
                             "and underscores, starting with a letter (or pass --name)")
    if directory.exists() and any(directory.iterdir()):
        raise ToolchainError(f"{directory} already exists and is not empty")
    if not (SDK_DIR / "Cargo.toml").is_file():
        raise ToolchainError(f"the Rust SDK is not at {SDK_DIR}: `pie new` needs a source "
                             "checkout of Pie (pip install -e .)")
    (directory / "src").mkdir(parents=True)
    (directory / "Cargo.toml").write_text(CARGO_TOML.format(name=name, sdk=SDK_DIR))
    (directory / "src" / "lib.rs").write_text(LIB_RS.format(name=name))
    (directory / ".gitignore").write_text("/target\nCargo.lock\n")
    return directory
