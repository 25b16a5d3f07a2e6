"""The `pie` command line: `pie model pull`, `pie backend`, `pie generate`."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler

from pie.config import ConfigError, PieConfig, load_config

console = Console(stderr=True)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML file overriding configs/default.toml")
    parser.add_argument("--model", metavar="PATH",
                        help="local HF Llama directory (default: the pulled SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="override backend.dtype")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _config(args: argparse.Namespace) -> PieConfig:
    config = load_config(args.config)
    if args.model:
        config.model.path = args.model
    if getattr(args, "dtype", None):
        config.backend.dtype = args.dtype
    return config


def _model_dir(config: PieConfig) -> Path:
    from pie.backend.weights import resolve_model_dir

    return resolve_model_dir(config.model.path, config.paths.cache)


def cmd_model_pull(args: argparse.Namespace) -> int:
    from pie.backend.weights import pull_default_model

    config = load_config(args.config)
    path = pull_default_model(config.paths.cache, console, force=args.force)
    print(path)
    return 0


def cmd_model_path(args: argparse.Namespace) -> int:
    print(_model_dir(_config(args)))
    return 0


def cmd_backend(args: argparse.Namespace) -> int:
    from pie.backend.server import run_backend

    config = _config(args)
    run_backend(_model_dir(config), config.backend, args.endpoint)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Start a backend, drive it directly from Python, stream the completion to stdout."""
    from tokenizers import Tokenizer

    from pie.control.backend_link import BackendProcess
    from pie.control.chat_template import chat_prompt
    from pie.control.direct import DirectDriver, SamplingParams

    config = _config(args)
    model_dir = _model_dir(config)
    backend = BackendProcess(model_dir, args.config, _backend_overrides(args))
    try:
        with console.status(f"starting the backend ({model_dir.name}, {config.backend.dtype})"):
            link, hs = backend.connect()
        tokenizer = Tokenizer.from_str(hs.tokenizer_json)
        text = args.prompt
        if args.chat:
            text = chat_prompt(hs.chat_template, args.prompt)
        prompt = tokenizer.encode(text, add_special_tokens=False).ids
        driver = DirectDriver(link, hs)
        generated: list[int] = []
        printed = ""

        def on_step(tokens: dict[int, int]) -> None:
            nonlocal printed
            generated.append(tokens[0])
            text_so_far = tokenizer.decode(generated, skip_special_tokens=True)
            sys.stdout.write(text_so_far[len(printed):])
            sys.stdout.flush()
            printed = text_so_far

        started = time.perf_counter()
        driver.generate(
            [prompt], args.max_tokens,
            SamplingParams(args.temperature, args.top_k, args.top_p, args.seed),
            stop_token_ids=tuple(hs.eos_token_ids), on_step=on_step,
        )
        elapsed = time.perf_counter() - started
        sys.stdout.write("\n")
        console.print(f"[dim]{len(prompt)} prompt tokens, {len(generated)} generated in "
                      f"{elapsed:.2f} s ({len(generated) / elapsed:.1f} tokens/s)[/]")
        link.close()
    finally:
        backend.stop()
    return 0


def _backend_overrides(args: argparse.Namespace) -> list[str]:
    extra = []
    if args.dtype:
        extra += ["--dtype", args.dtype]
    return extra


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pie", description="Pie: a programmable LLM serving system")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", help="prepare and locate model weights")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    pull = model_sub.add_parser("pull", help="convert the default model (SmolLM2-135M-Instruct) once")
    pull.add_argument("--config", metavar="FILE")
    pull.add_argument("--force", action="store_true", help="convert again even if cached")
    pull.set_defaults(func=cmd_model_pull)
    path = model_sub.add_parser("path", help="print the model directory the backend would load")
    _add_common(path)
    path.set_defaults(func=cmd_model_path)

    backend = sub.add_parser("backend", help="run the inference process (normally spawned by `pie serve`)")
    _add_common(backend)
    backend.add_argument("--endpoint", required=True, help="ZeroMQ address to bind, e.g. ipc:///tmp/pie.sock")
    backend.set_defaults(func=cmd_backend)

    generate = sub.add_parser("generate", help="generate text by driving a backend directly (no inferlets)")
    _add_common(generate)
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=-1)
    generate.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )
    try:
        return args.func(args)
    except ConfigError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    except FileNotFoundError as e:
        console.print(f"[red]error:[/] {e}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
