"""A model directory with a real model's config and tokenizer and random weights.

Why: the GPU machine (benchmarks/cuda_check.sh) takes at most 64 MiB of files and reaches
no network, and the default model's GGUF alone is 98 MB. The same config gives the same
shapes — so the same kernels, the same speed, and an oracle that still holds (Pie and HF
load the same random weights) — but not the same text. `pie-source.json` says so, and
benchmarks/backend.py copies it into its results.

    python benchmarks/random_model.py --like DIR --out DIR [--seed 0]

`--like` needs config.json, tokenizer.json and tokenizer_config.json (a converted model
directory, `pie model path`); the weights are HF's own initialisation of that config
(normal, std = initializer_range), seeded, saved in fp32 as `pie model pull` saves them.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
          "chat_template.jinja")


def write_random_model(like: Path, out: Path, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    missing = [name for name in COPIED[:3] if not (like / name).is_file()]
    if missing:
        raise SystemExit(f"{like} lacks {', '.join(missing)}: give a converted model directory")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(str(like))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out))
    for name in COPIED:  # after save_pretrained, which writes its own config.json
        if (like / name).is_file():
            shutil.copy(like / name, out / name)
    (out / "pie-source.json").write_text(json.dumps(
        {"random_weights": True, "seed": seed, "config_of": str(like)}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--like", required=True, type=Path, help="model directory whose config and tokenizer to copy")
    parser.add_argument("--out", required=True, type=Path, help="where the model directory goes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_random_model(args.like, args.out, args.seed)
    print(f"random weights with the config of {args.like} → {args.out}")


if __name__ == "__main__":
    main()
