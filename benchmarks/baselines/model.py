"""The default model in the forms the baselines read, from the very weights Pie serves.

- vLLM reads an HF directory, but its transformers pin (< 5.20) knows neither the
  `TokenizersBackend` tokenizer class our newer transformers writes nor a separate
  `chat_template.jinja`: we give it a sibling directory with the weights symlinked and the
  tokenizer config rewritten (`PreTrainedTokenizerFast`, chat template inlined).
- llama.cpp reads GGUF: written from that directory by the converter in the vendored
  llama.cpp tree, at the benchmark's dtype (bf16 by default), never from the Q4_1 original,
  so that every engine multiplies the same numbers.

    python -m benchmarks.baselines.model [--dtype bf16]     # prints both paths
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path

from pie.backend.weights import DEFAULT_MODEL_NAME, check_model_dir, default_model_dir
from pie.config import PieConfig

BASELINES = Path(os.environ.get("PIE_BASELINES", "~/.cache/pie/baselines")).expanduser()
LLAMA_CPP = BASELINES / "llama.cpp-0.3.36"
CONVERTER_PYTHON = BASELINES / "llama.cpp-venv" / "bin" / "python"
GGUF_TYPES = {"bfloat16": "bf16", "float32": "f32", "bf16": "bf16", "f32": "f32"}


def pie_model_dir() -> Path:
    """Pie's prepared default model (`pie model pull` writes it)."""
    return check_model_dir(default_model_dir(PieConfig().paths.cache))


def hf_dir() -> Path:
    """An HF directory older transformers can read, sharing Pie's weight file."""
    source = pie_model_dir()
    target = BASELINES / "models" / f"{DEFAULT_MODEL_NAME}-hf"
    if (target / "tokenizer_config.json").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    weights = target / "model.safetensors"
    if not weights.exists():
        weights.symlink_to(source / "model.safetensors")
    tokenizer = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = source / "chat_template.jinja"
    if template.is_file():
        tokenizer["chat_template"] = template.read_text()
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2))
    return target


def gguf(dtype: str = "bfloat16") -> Path:
    """The same weights as a GGUF at `dtype`, written by llama.cpp's own converter once."""
    outtype = GGUF_TYPES[dtype]
    target = BASELINES / "models" / f"{DEFAULT_MODEL_NAME}-{outtype}.gguf"
    if target.is_file():
        return target
    converter = LLAMA_CPP / "convert_hf_to_gguf.py"
    if not (converter.is_file() and CONVERTER_PYTHON.is_file()):
        raise FileNotFoundError(f"{converter} is missing: run benchmarks/baselines/llamacpp.sh first")
    partial = target.with_suffix(".partial")
    env = {**os.environ, "PYTHONPATH": str(LLAMA_CPP / "gguf-py")}
    subprocess.run([str(CONVERTER_PYTHON), str(converter), str(hf_dir()), "--outtype", outtype,
                    "--outfile", str(partial)], check=True, env=env, stdout=subprocess.DEVNULL)
    partial.rename(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description="Prepare the default model for the baselines.")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(GGUF_TYPES))
    args = parser.parse_args()
    print(hf_dir())
    print(gguf(args.dtype))


if __name__ == "__main__":
    main()
