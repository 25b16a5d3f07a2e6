"""The `pie` command line: `pie model`, `pie backend`, `pie generate`, `pie serve`, `pie run`,
`pie attach`, `pie ps`, `pie build`, `pie new`, `pie token`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.logging import RichHandler

from pie.config import ConfigError, PieConfig, load_config
from pie.transport import TransportError

if TYPE_CHECKING:
    from pie.client import PieClient

console = Console(stderr=True)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML file overriding configs/default.toml")
    parser.add_argument("--model", metavar="PATH",
                        help="local HF Llama directory (default: the pulled SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], help="override backend.dtype")
    parser.add_argument("--weight-dtype", choices=["model", "int8"],
                        help="override backend.weight_dtype (int8: quantized weights, CPU only)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _config(args: argparse.Namespace) -> PieConfig:
    config = load_config(args.config)
    if args.model:
        config.model.path = args.model
    if getattr(args, "dtype", None):
        config.backend.dtype = args.dtype
    if getattr(args, "weight_dtype", None):
        config.backend.weight_dtype = args.weight_dtype
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
    run_backend(_model_dir(config), config.backend, args.endpoint, args.exit_with)
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


def cmd_serve(args: argparse.Namespace) -> int:
    """The control process: RPC server + runtime + a spawned backend, until Ctrl-C / SIGTERM."""
    from pie.server.serve import serve

    config = _config(args)
    overrides = {"host": args.host, "port": args.port}
    config.server = dataclasses.replace(
        config.server, **{k: v for k, v in overrides.items() if v is not None})
    backend = {"replicas": args.replicas, "replica_cores": args.replica_cores, "ray": args.ray}
    config.backend = dataclasses.replace(config.backend, **{k: v for k, v in backend.items() if v is not None})
    _warn_shared_without_quotas(config)
    return serve(config, _model_dir(config), args.config, _backend_overrides(args), console,
                 verbose=args.verbose)


def _warn_shared_without_quotas(config: PieConfig) -> None:
    """Several users and no fair-share quota: any one user may take the whole KV pool or
    every instance slot (docs/security.md, "A server for several users")."""
    if len(config.server.tokens) < 2:
        return
    unset = [f"quota.user.{key}" for key in ("kv_pages", "instances")
             if not getattr(config.quota.user, key)]
    if unset:
        console.print(f"[yellow]warning:[/] {len(config.server.tokens)} users and no {' or '.join(unset)}: "
                      "one user can take the whole KV pool / every instance slot (see docs/security.md)",
                      highlight=False)


def cmd_token(args: argparse.Namespace) -> int:
    """A new random token for server.auth_tokens (or the fingerprint of a given one)."""
    import secrets

    from pie.config import MIN_TOKEN_CHARS
    from pie.control.quotas import fingerprint

    token = args.token if args.token is not None else secrets.token_urlsafe(24)
    if len(token) < MIN_TOKEN_CHARS:
        console.print(f"[red]error:[/] a token must have at least {MIN_TOKEN_CHARS} characters")
        return 2
    if args.token is None:
        print(f"token:       {token}")
    print(f"fingerprint: {fingerprint(token)}  (names this user in /stats, logs and quota.users)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run one inferlet: its messages to stdout, status to stderr; exit 0 iff it finished."""
    from pie.client import PieConnectionError, RpcError

    program = Path(args.program)
    if args.interpret and program.suffix != ".py":
        console.print("[red]error:[/] --interpret runs a Python inferlet (FILE.py) from its source")
        return 2
    if (program / "Cargo.toml").is_file() or program.suffix == ".py":  # build first, like `cargo run`
        from pie.python_build import INTERPRETER, build_python_inferlet, python_bundle
        from pie.toolchain import ToolchainError, build_inferlet

        build = build_python_inferlet if program.suffix == ".py" else build_inferlet
        try:
            if args.interpret:  # the interpreter (built once) gets the source as its first argument
                args.arguments = [python_bundle(program), *args.arguments]
                program = INTERPRETER
            program = build(program, console=console, cache=_config(args).paths.cache)
        except ToolchainError as e:
            console.print(f"[red]error:[/] {e}", highlight=False)
            return 1
    elif not program.is_file() and (program.suffix == ".wasm" or "/" in args.program):
        raise FileNotFoundError(f"no such component file or crate: {args.program}")
    data = program.read_bytes() if program.is_file() else None
    try:
        return asyncio.run(_run(args, data))
    except asyncio.CancelledError:  # SIGTERM
        return 128 + signal.SIGTERM
    except (RpcError, PieConnectionError, RuntimeError, ValueError) as e:  # ValueError: bad --server
        console.print(f"[red]error:[/] {e}")
        return 1


async def _run(args: argparse.Namespace, data: bytes | None) -> int:
    """On `--server`, or on a private `pie serve` child started for this call (local.py)."""
    from pie.server.local import LocalServer

    # SIGTERM unwinds like Ctrl-C: the connection closes and a private server is stopped,
    # not orphaned.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    output = Output(args.json, args.quiet)
    if args.server:
        return await _run_on(args.server, args.token, args.program, data, args.arguments, output, args.detach)
    if args.detach:
        raise ValueError("--detach needs --server: a private server ends with `pie run`")
    config = _config(args)
    token = args.token or next(iter(config.server.auth_tokens), None)
    serve_args: list[str] = []
    for flag, value in (("--config", args.config), ("--model", args.model), ("--dtype", args.dtype),
                        ("--weight-dtype", args.weight_dtype)):
        if value:
            serve_args += [flag, value]
    async with LocalServer(serve_args) as url:
        return await _run_on(url, token, args.program, data, args.arguments, output)


async def _run_on(url: str, token: str | None, program: str, data: bytes | None,
                  arguments: list[str], output: Output, detach: bool = False) -> int:
    from pie.client import PieClient

    async with PieClient(url, token) as client:
        target = await client.upload(data) if data is not None else program
        instance = await client.launch(target, arguments, detached=detach, logs=not output.quiet)
        if detach:
            print(instance.id)
            console.print(f"[dim]{program}: detached; follow it with `pie attach {instance.id} "
                          f"--server {url}`[/]", highlight=False)
            return 0
        console.print(f"[dim]{program}: instance {instance.id}[/]")
        output.take_logs(instance)
        return await output.follow(program, instance)


@dataclasses.dataclass(frozen=True)
class Output:
    """How `pie run` and `pie attach` print an instance: each message on stdout followed by a
    newline, its log lines on stderr, its end on stderr when it did not finish; or, with
    `json`, one JSON object per line on stdout for every event (a message that holds
    newlines stays on one line): {"message": TEXT}, {"log": TEXT, "level": LEVEL},
    {"end": REASON, "usage": {...}}."""

    json: bool = False
    quiet: bool = False  # no log lines

    def take_logs(self, instance) -> None:
        """Print the instance's log lines from now on, those that came before first (they may
        arrive with the launch reply, before the status line is printed)."""
        for level, text in instance.logs:
            self.log(level, text)
        instance.logs.clear()
        instance.on_log = self.log

    def log(self, level: str, text: str) -> None:
        if self.quiet:
            return
        if self.json:
            self._line({"log": text, "level": level})
            return
        style = {"warn": "yellow", "error": "red"}.get(level, "dim")
        console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)

    async def follow(self, label: str, instance) -> int:
        """Print an instance's messages until it ends; 0 iff it finished."""
        async for text in instance:
            if self.json:
                self._line({"message": text})
            else:
                sys.stdout.write(text + "\n")
                sys.stdout.flush()
        reason = await instance.wait()
        if self.json:
            self._line({"end": reason, "usage": instance.usage})
        if reason == "finished":
            return 0
        if not self.json:
            console.print(f"[red]{label} did not finish:[/] {reason}", highlight=False)
        return 1

    @staticmethod
    def _line(event: dict) -> None:
        sys.stdout.write(json.dumps(event, ensure_ascii=False) + "\n")
        sys.stdout.flush()


def _with_client(args: argparse.Namespace, body: Callable[[PieClient], Awaitable[int]]) -> int:
    """Run `body` on a connection to `--server`; a failed call or connection is exit 1."""
    from pie.client import PieClient, PieConnectionError, RpcError

    async def main() -> int:
        async with PieClient(args.server, args.token) as client:
            return await body(client)

    try:
        return asyncio.run(main())
    except (RpcError, PieConnectionError, ValueError) as e:
        console.print(f"[red]error:[/] {e}")
        return 1


def cmd_attach(args: argparse.Namespace) -> int:
    """Follow a detached instance: what it sent since it was last followed, then live output."""
    output = Output(args.json, args.quiet)

    async def follow(client: PieClient) -> int:
        instance = await client.attach(args.instance)
        output.take_logs(instance)
        return await output.follow(args.instance, instance)

    return _with_client(args, follow)


def cmd_ps(args: argparse.Namespace) -> int:
    """List the caller's instances on a server (live, and detached ones not yet collected)."""
    async def listing(client: PieClient) -> int:
        rows = [("INSTANCE", "PROGRAM", "STATE", "DETACHED", "ATTACHED", "STARTED")]
        for i in sorted(await client.list_instances(), key=lambda i: i.started_at):
            rows.append((i.id, i.name or i.program[:12], i.state, "yes" if i.detached else "no",
                         "yes" if i.attached else "no",
                         time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.started_at))))
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        for row in rows:  # plain columns on stdout, never truncated (ids are meant to be copied)
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        return 0

    return _with_client(args, listing)


def cmd_build(args: argparse.Namespace) -> int:
    """Build a Rust inferlet crate or a Python inferlet (.py) into a component; print its path."""
    from pie.toolchain import ToolchainError, build_inferlet

    from pie.python_build import build_python_inferlet

    config = load_config(args.config)
    target = Path(args.crate)
    try:
        if target.suffix == ".py":
            path = build_python_inferlet(target, console=console, cache=config.paths.cache)
        else:
            path = build_inferlet(target, release=True, console=console, cache=config.paths.cache)
    except ToolchainError as e:
        console.print(f"[red]error:[/] {e}", highlight=False)
        return 1
    print(path)
    return 0


def cmd_new(args: argparse.Namespace) -> int:
    """Scaffold an inferlet crate; say how to build and run it."""
    from pie.scaffold import new_inferlet
    from pie.toolchain import ToolchainError

    try:
        crate = new_inferlet(Path(args.directory), args.name)
    except ToolchainError as e:
        console.print(f"[red]error:[/] {e}", highlight=False)
        return 1
    console.print(f"Created inferlet crate {crate}\n"
                  f"  build:  pie build {args.directory}\n"
                  f"  run:    pie run {args.directory} -- --prompt \"Hello!\"", highlight=False)
    return 0


def _backend_overrides(args: argparse.Namespace) -> list[str]:
    extra = []
    if args.dtype:
        extra += ["--dtype", args.dtype]
    if args.weight_dtype:
        extra += ["--weight-dtype", args.weight_dtype]
    return extra


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """argparse, except that everything after `--` goes to `pie run`'s inferlet arguments:
    argparse cannot take them after options that follow PROGRAM (`pie run P --server U -- A`)."""
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if passthrough:
        if args.command != "run":
            parser.error("`--` passes arguments to an inferlet and is only valid with `pie run`")
        args.arguments += passthrough
    return args


def _add_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="do not print the inferlet's log lines (its log calls, print(), panics) on stderr")
    parser.add_argument("--json", action="store_true",
                        help="print every event as one JSON object per line on stdout")


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
    backend.add_argument("--endpoint", required=True,
                         help="ZeroMQ address to bind, e.g. ipc:///tmp/pie.sock, or tcp://0.0.0.0:5555 for a "
                              "remote backend (needs backend.secret_file or PIE_BACKEND_SECRET off loopback)")
    backend.add_argument("--exit-with", type=int, metavar="PID",
                         help="exit once its parent, process PID, has ended (pie serve passes its own pid: "
                              "a control process killed outright leaves no backend behind)")
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

    serve = sub.add_parser("serve", help="serve inferlets: RPC server + runtime + backend")
    _add_common(serve)
    serve.add_argument("--host", help="address to listen on (default: server.host)")
    serve.add_argument("--port", type=int, help="port to listen on; 0 = any free port (default: server.port)")
    serve.add_argument("--replicas", type=int, metavar="N",
                       help="backend processes, each with its own pools (default: backend.replicas)")
    serve.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                       help="start the replicas as Ray actors: on a local Ray cluster, or on the one at "
                            "ADDRESS (default: backend.ray)")
    serve.add_argument("--replica-cores", type=int, metavar="K",
                       help="pin replica i to the i-th run of K cores (default: backend.replica_cores; 0 = off)")
    serve.set_defaults(func=cmd_serve)

    run = sub.add_parser("run", help="run an inferlet and print its messages",
                         description="Run PROGRAM (a component file, a crate directory or a built-in inferlet name) "
                                     "with ARGS; without --server, start a private server for the call.")
    _add_common(run)
    run.add_argument("program", metavar="PROGRAM",
                     help="component file (.wasm), Rust crate directory or Python file (built first), or built-in name")
    run.add_argument("arguments", metavar="ARGS", nargs="*", help="the inferlet's arguments (after --)")
    run.add_argument("--server", metavar="URL", help="a running server, e.g. http://127.0.0.1:8080")
    run.add_argument("--token", help="authentication token (default: the first of server.auth_tokens)")
    run.add_argument("--detach", action="store_true",
                     help="with --server: print the instance id and exit; the instance keeps running")
    run.add_argument("--interpret", action="store_true",
                     help="a Python inferlet: send its source to a prebuilt interpreter instead of building "
                          "it (the edit loop: no ~9 s build, no ~10 s compile on the server)")
    _add_output(run)
    run.set_defaults(func=cmd_run)

    attach = sub.add_parser("attach", help="follow a detached instance's output")
    attach.add_argument("instance", metavar="INSTANCE_ID")
    attach.add_argument("--server", metavar="URL", required=True)
    attach.add_argument("--token", help="authentication token (the instance's user)")
    _add_output(attach)
    attach.set_defaults(func=cmd_attach)

    ps = sub.add_parser("ps", help="list your instances on a server")
    ps.add_argument("--server", metavar="URL", required=True)
    ps.add_argument("--token", help="authentication token")
    ps.set_defaults(func=cmd_ps)

    new = sub.add_parser("new", help="create a new Rust inferlet crate")
    new.add_argument("directory", metavar="DIR", help="where to create it (must not exist or be empty)")
    new.add_argument("--name", help="crate name (default: the directory's name)")
    new.set_defaults(func=cmd_new)

    token = sub.add_parser("token", help="make a new auth token and print its fingerprint",
                           description="Print a new random token for server.auth_tokens and the "
                                       "fingerprint that names its user; with TOKEN, only that "
                                       "token's fingerprint.")
    token.add_argument("token", metavar="TOKEN", nargs="?")
    token.set_defaults(func=cmd_token)

    build = sub.add_parser("build", help="build an inferlet (Rust crate or Python file) into a component")
    build.add_argument("crate", metavar="CRATE_DIR|FILE.py")
    build.add_argument("--config", metavar="FILE")
    build.set_defaults(func=cmd_build)
    return parser


def _log_handler() -> logging.Handler:
    """Rich's handler on a terminal; plain timestamped lines to a file or a pipe. Rich lays
    every record out as a table: with a log line per instance that was ~10 % of the control
    process's busy CPU under one-token completions back to back (py-spy, Zen 5, one-off)."""
    if console.is_terminal:
        handler: logging.Handler = RichHandler(console=console, show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
        return handler
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", "%Y-%m-%d %H:%M:%S"))
    return handler


def main(argv: list[str] | None = None) -> int:
    args = _parse(build_parser(), sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
                        handlers=[_log_handler()])
    try:
        return args.func(args)
    except ConfigError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    except (FileNotFoundError, TransportError) as e:
        console.print(f"[red]error:[/] {e}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
