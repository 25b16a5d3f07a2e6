"""Every configuration key Pie reads, as typed dataclasses.

`configs/default.toml` sets the same values as the defaults below (a test keeps them
equal); a user file passed with `--config` overrides any subset of keys.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


MIN_TOKEN_CHARS = 16


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only. Names other than `localhost` are refused
    rather than resolved: what a name resolves to can change after the check."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


MIN_MLP_CHUNK = 256  # backend.mlp_chunk_tokens: chunks keep the many-row kernels (chunked_forward.py)


@dataclass
class ModelConfig:
    # Local HF Llama directory; empty means the default model converted by `pie model pull`.
    path: str = ""


@dataclass
class BackendConfig:
    device: str = "cpu"
    dtype: str = "auto"  # bf16 where the CPU has bf16 arithmetic, else fp32 (pie/backend/dtype.py)
    # "int8": int8 weights and per-token int8 activations in every linear (CPU only; off by
    # default: it changes outputs; speed and quality in benchmarks/results/quantization.json)
    weight_dtype: str = "model"
    # "float32": steps of 64+ tokens (prefills) multiply in fp32 over an fp32 copy of the
    # weights (memory: + 2x the bf16 weights); "auto": where a startup probe finds fp32
    # matmuls faster than bf16 ones on this CPU (pie/backend/dtype.py)
    prefill_dtype: str = "auto"
    attention: str = "auto"
    page_size: int = 16
    num_kv_pages: int = 2048
    # Pages of the host-memory tier that paused instances' pages are swapped to
    # (pie/backend/host_pages.py, control.kv_pressure): each takes a device page's bytes of
    # RAM (0.35 MiB for the default model), committed as pages are first written on the CPU
    # and pinned up front on CUDA; 0 = none.
    num_host_kv_pages: int = 2048
    # Emulate a link of this many GB/s for the host tier (0 = none: a swap is done when its
    # copy is): on the CPU a swap is a copy within RAM; a GPU's PCIe link makes swapping cost
    # far more relative to recomputing. A swap's reply is held until the link would have
    # carried it (one swap at a time) while other batches run, as a copy engine overlaps
    # compute (benchmarks/api_serve.py --swap-gbps).
    swap_gbps: float = 0.0
    num_embeds: int = 32768
    max_batch_tokens: int = 4096
    # An item of more new tokens runs alone, every op but attention's key set over at most
    # this many tokens at a time (0: off), and one that keeps no KV (scoring) holds only the
    # current layer's keys and values: a long input's activations stay bounded and results
    # equal the one-shot forward's (PrefillOnly; pie/backend/chunked_forward.py).
    mlp_chunk_tokens: int = 0
    # Decode items whose contexts begin with at least this many keys on the same pages (a
    # shared system prompt, forks of one context), 8 or more of them, attend to those pages
    # together as matrix products (CPU kernel, csrc/shared_prefix.h); 0 = off.
    shared_prefix_keys: int = 256
    threads: int = 0
    # Replay decode steps from captured CUDA graphs (pie/backend/cuda_graphs.py; 4.7 vs 30.7 ms
    # per batch-1 step on one H200); needs device = "cuda" and attention = "flashinfer".
    cuda_graphs: bool = False
    # Backend processes `pie serve` spawns (`--replicas N`): each loads the model and has
    # its own KV and embed pools, scheduler and prefix cache; an instance runs on one, placed
    # by control.placement (docs/scale-out.md).
    replicas: int = 1
    # Pin each replica to this many cores of those `pie serve` may run on (its CPU affinity):
    # replica i gets the i-th run of them, and as many torch threads. 0: no pinning, every
    # replica's threads may use every core.
    replica_cores: int = 0
    # Backends already running elsewhere (`pie backend --endpoint tcp://HOST:PORT`), attached
    # by address as more replicas after the `replicas` spawned ones (replicas = 0: remote
    # ones only). Off loopback, both ends need the same secret (docs/scale-out.md).
    endpoints: list[str] = field(default_factory=list)
    # A file holding the shared secret of tcp:// links (or PIE_BACKEND_SECRET): CURVE keys
    # derived from it authenticate and encrypt every frame (pie/transport.py).
    secret_file: str = ""
    # A remote replica is asked every 2 s whether it answers; no answer in this long (a long
    # batch may be ahead of the question) fails it and ends the instances on it.
    remote_timeout_s: float = 30.0
    # Start the `replicas` as Ray actors on this cluster instead of as child processes
    # (`pie serve --ray [ADDRESS]`): "local" starts a local Ray cluster, else a Ray address
    # ("HOST:6379", "auto"); "" = off (pie/server/ray_replicas.py).
    ray: str = ""

    def __post_init__(self) -> None:
        _check_choice("backend.device", self.device, ("cpu", "cuda"))
        if self.replicas < 0 or self.replicas + len(self.endpoints) < 1:
            raise ConfigError(f"backend.replicas must be at least 1 (or 0 with backend.endpoints), got "
                              f"{self.replicas}")
        if self.remote_timeout_s <= 0:
            raise ConfigError(f"backend.remote_timeout_s must be positive, got {self.remote_timeout_s}")
        for endpoint in self.endpoints:
            if not endpoint.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"backend.endpoints: {endpoint!r} is not a tcp:// or ipc:// address")
        if self.replica_cores < 0:
            raise ConfigError(f"backend.replica_cores must be >= 0 (0: no pinning), got {self.replica_cores}")
        _check_choice("backend.dtype", self.dtype, ("auto", "bfloat16", "float32"))
        _check_choice("backend.weight_dtype", self.weight_dtype, ("model", "int8"))
        _check_choice("backend.prefill_dtype", self.prefill_dtype, ("auto", "model", "float32"))
        if self.weight_dtype == "int8" and self.device != "cpu":
            raise ConfigError(
                "backend.weight_dtype = 'int8' runs on CPU only (its kernel is oneDNN's int8 "
                "matmul); use weight_dtype = 'model' with device = 'cuda'"
            )
        _check_choice(
            "backend.attention", self.attention, ("auto", "torch", "cpu-kernel", "flashinfer")
        )
        for key in ("page_size", "num_kv_pages", "num_embeds", "max_batch_tokens"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"backend.{key} must be positive, got {getattr(self, key)}")
        if self.num_host_kv_pages < 0:
            raise ConfigError(f"backend.num_host_kv_pages must be >= 0, got {self.num_host_kv_pages}")
        if self.swap_gbps < 0:
            raise ConfigError(f"backend.swap_gbps must be >= 0, got {self.swap_gbps}")
        if self.shared_prefix_keys < 0:
            raise ConfigError(f"backend.shared_prefix_keys must be >= 0 (0: off), got {self.shared_prefix_keys}")
        if self.threads < 0:
            raise ConfigError(f"backend.threads must be >= 0, got {self.threads}")
        if self.mlp_chunk_tokens < 0 or 0 < self.mlp_chunk_tokens < MIN_MLP_CHUNK:
            raise ConfigError(f"backend.mlp_chunk_tokens must be 0 (off) or at least {MIN_MLP_CHUNK}, "
                              f"got {self.mlp_chunk_tokens}")
        if self.cuda_graphs and (self.device != "cuda" or self.attention != "flashinfer"):
            raise ConfigError(
                "backend.cuda_graphs = true needs backend.device = \"cuda\" and backend.attention "
                f"= \"flashinfer\" (the graphs capture FlashInfer's decode kernel); got device "
                f"{self.device!r}, attention {self.attention!r}")


@dataclass
class ControlConfig:
    # Batch scheduler policy (paper Table 5): adaptive = dispatch as soon as the backend is
    # idle (work-conserving); eager = no batching, every call sent alone at once; k = wait for batch_k calls;
    # t = dispatch every batch_t_ms; srjf = as adaptive, but a batch takes the queues with
    # the least estimated work first (PrefillOnly's shortest-remaining-job-first), less
    # srjf_lambda seconds of estimated work per second waited (pie/control/policies.py).
    scheduler: str = "adaptive"
    batch_k: int = 8
    batch_t_ms: float = 10.0
    srjf_lambda: float = 0.5
    max_dist_k: int = 256  # cap on k of get-next-dist
    # A streaming run (inference.run with streaming) wakes its inferlet once per this many
    # drawn tokens, and at its end (vLLM's --stream-interval). 1: every token. Each wake is
    # a thread switch and ~3 host calls, ~0.55 ms of control CPU per token at 16 streams
    # (benchmarks/results/overhead.json); 4 divides that by ~4 for text that arrives in
    # bursts of 4 tokens and stop strings seen up to 3 tokens late (the SDKs cut the text).
    stream_interval: int = 1
    # The most decode steps of a host-side run the backend takes on its own after one the
    # scheduler sent, with no round trip between them (Passes.ahead, docs/fused-pass.md
    # §2.5): within the page the step writes, leaving its last slot to the scheduler (whose
    # step plans the prefix cache's copy of a page it completes), so at most page_size - 2;
    # any other call waiting ends them at the next step. 0: the scheduler sends every step.
    ahead_steps: int = 16
    # Chunked prefill: while the decoders are at least as many as the prompts waiting, a
    # batch carries every decoder and this many new tokens of prompts (a prompt that would
    # leave no more than this goes whole), and a longer prompt is prefilled over several
    # batches, so decoders keep going (docs/architecture.md, "Chunked prefill"). 64 keeps 16 decoders'
    # p99 gap under 3x their median while a 2,000-token prompt prefills (1.6x here; 128: 4.4x; unchunked: 64x) at +67% on that
    # prompt's time to first token (benchmarks/results/interference.json, Xeon 2 vCPU).
    max_step_tokens: int = 64
    # A backlog of prompts goes in batches of at most this many prompt tokens: whole prompts,
    # oldest first (at least one), while the prompts outnumber the decoders. Every decoder
    # rides along. So the first prompts of a wave start decoding while the rest
    # prefill, instead of all of them waiting for one batch of the whole wave (32 streaming
    # clients, AMD EPYC 2 vCPUs: mean time to first token 15.2 -> 7.0 s at equal tokens/s).
    prefill_batch_tokens: int = 512
    # While a latency queue (scheduling.set-queue-objective) is open, other queues' prompts
    # go in chunks of at most this many tokens a batch, so a latency call waits for one such
    # batch at most, while prompts still prefill at near full speed (benchmarks/objectives.py).
    latency_batch_tokens: int = 256
    # While a latency queue's call rides a batch, the other queues' calls in that batch carry
    # at most this many new tokens (decoders first, then a prompt's chunk of at least 16),
    # so a latency step costs little more than its own rows; 0 = no cap (the rules above
    # size the batch). On this CPU a step's time grows with its rows (batch 32 = 6.6x batch
    # 1, benchmarks/results/backend.json), so chat beside a saturating map-reduce
    # (benchmarks/objectives.py) ran 5.5x faster a token at 16 with the map-reduce's time
    # unchanged (0.98x); 48 helped far less, no cap hardly at all (docs/architecture.md).
    latency_step_tokens: int = 16
    # The prompt hold (pie/control/batch_former.py): beside 16 decoders or more, prompts wait
    # until 2 do or the oldest has waited prompt_hold_ms, then go whole together (each of up
    # to 2 x max_step_tokens): a step's prompt rows cost less the more ride it, and fewer
    # steps pay the decoders' share. "auto": on where the backend runs on the CPU (measured
    # on an Ice Lake Xeon with fp32 prefills and a Zen 5 EPYC with bf16 ones: at 32 streamed
    # clients the p99 time to first token fell ~20 % on both, docs/architecture.md, "The
    # prompt hold"), off on CUDA, where it is not measured; "on", "off".
    prompt_hold: str = "auto"
    prompt_hold_ms: float = 400.0
    # Hosts inferlets may reach with http-get/post (exact host names or IP literals).
    http_allowlist: list[str] = field(default_factory=lambda: ["127.0.0.1", "localhost"])
    http_timeout_s: float = 30.0
    # A KV page / embed allocation the pool cannot satisfy now waits this long for other
    # instances to free some, then fails with out-of-resources.
    alloc_wait_ms: float = 1000.0
    # What a short KV pool takes from instances paused on I/O before the allocation waits
    # (pie/control/reclaimer.py): "min-waste" (per paused instance the cheapest of keeping,
    # swapping and discarding its pages, by APIServe's waste estimate), "swap" (to the host
    # tier, backend.num_host_kv_pages), "discard" (pages the program marked discardable),
    # "preserve" or its alias "wait" (nothing), or the paper's FCFS policy
    # "terminate-newest" (instances launched after the requester are ended, newest first,
    # until they held enough; then the allocation waits for their teardown).
    kv_pressure: str = "min-waste"
    # Keep the full KV pages of prompts and copy them into later passes that start with the
    # same tokens, per user (pie/control/prefix_cache.py); their pages are the first to go
    # when the pool runs short.
    prefix_cache: bool = True
    kvs_max_bytes: int = 64 * 2**20  # keys + values in the key-value store, all users together
    # Largest HTTP response body an inferlet may fetch; a larger one fails with an `io` error
    # (read in pieces, never whole).
    http_max_response_bytes: int = 8 * 2**20
    # Which backend replica (backend.replicas > 1) a new instance runs on: "cache-aware" = the
    # one whose earlier launches share the longest prefix of its arguments (their prompts'
    # KV is likely in that replica's prefix cache), unless replicas' live instances differ
    # by more than placement_imbalance, then the least loaded; "least-loaded" = always the
    # one with the fewest live instances (pie/control/placement.py).
    placement: str = "cache-aware"
    placement_imbalance: int = 4

    def __post_init__(self) -> None:
        _check_choice("control.placement", self.placement, ("cache-aware", "least-loaded"))
        if self.placement_imbalance < 0:
            raise ConfigError(f"control.placement_imbalance must be >= 0, got {self.placement_imbalance}")
        _check_choice("control.scheduler", self.scheduler, ("adaptive", "eager", "k", "t", "srjf"))
        if self.srjf_lambda < 0:
            raise ConfigError(f"control.srjf_lambda must be >= 0, got {self.srjf_lambda}")
        _check_choice("control.kv_pressure", self.kv_pressure,
                      ("min-waste", "swap", "discard", "preserve", "wait", "terminate-newest"))
        if self.batch_k < 1 or self.batch_t_ms <= 0 or self.max_dist_k < 1 or self.stream_interval < 1:
            raise ConfigError("control.batch_k, batch_t_ms, max_dist_k and stream_interval must be positive")
        if self.ahead_steps < 0:
            raise ConfigError(f"control.ahead_steps must be >= 0 (0: none), got {self.ahead_steps}")
        if self.max_step_tokens < 16:
            raise ConfigError(f"control.max_step_tokens must be at least 16, got {self.max_step_tokens}")
        if self.prefill_batch_tokens < self.max_step_tokens:
            raise ConfigError(f"control.prefill_batch_tokens ({self.prefill_batch_tokens}) must be at least "
                              f"control.max_step_tokens ({self.max_step_tokens})")
        if self.latency_batch_tokens < self.max_step_tokens:
            raise ConfigError(f"control.latency_batch_tokens ({self.latency_batch_tokens}) must be at least "
                              f"control.max_step_tokens ({self.max_step_tokens})")
        if self.latency_step_tokens < 0 or 0 < self.latency_step_tokens < 16:
            raise ConfigError(f"control.latency_step_tokens must be 0 (no cap) or at least 16, "
                              f"got {self.latency_step_tokens}")
        if self.alloc_wait_ms < 0:
            raise ConfigError(f"control.alloc_wait_ms must be >= 0, got {self.alloc_wait_ms}")
        _check_choice("control.prompt_hold", self.prompt_hold, ("auto", "on", "off"))
        if self.prompt_hold_ms <= 0:
            raise ConfigError(f"control.prompt_hold_ms must be positive (control.prompt_hold = \"off\": "
                              f"no hold), got {self.prompt_hold_ms}")
        if self.http_max_response_bytes < 1 or self.kvs_max_bytes < 1:
            raise ConfigError("control.http_max_response_bytes and kvs_max_bytes must be positive")
        if self.kv_pressure == "terminate-newest" and self.alloc_wait_ms == 0:
            raise ConfigError("control.kv_pressure = terminate-newest needs control.alloc_wait_ms > 0 "
                              "(the time the ended instances' pages take to come back)")

    def holds_prompts(self, device: str) -> bool:
        """Whether the prompt hold is on beside a backend on `device` (its handshake's)."""
        return self.prompt_hold == "on" or (self.prompt_hold == "auto" and device == "cpu")


@dataclass
class HeldQuota:
    """What a holder may have at once, and its call rates (0 = no quota beyond the pools)."""

    kv_pages: int = 0  # KV pages held, persistent exports included
    embeds: int = 0
    queues: int = 0  # queues held at once (dropping one gives it back)
    exports: int = 0  # exports created and not yet removed (persistent ones count too)
    latency_queues: int = 0  # queues marked latency at once (scheduling.set-queue-objective)
    messages_per_s: float = 0.0  # messages sent to the client or broadcast; faster senders wait
    http_requests_per_s: float = 0.0  # faster callers wait

    def __post_init__(self) -> None:
        for key, value in dataclasses.asdict(self).items():
            if value < 0:
                raise ConfigError(f"quota keys must be >= 0 (0 = no quota); {key} = {value}")


@dataclass
class InstanceQuota(HeldQuota):
    """One instance's quota, plus its lifetime budgets: guest and host CPU time spent on the
    instance's thread, and wall-clock time since launch. Past either it is ended with the key
    named (a CPU slice bounds one stretch without host calls; this bounds the total)."""

    queues: int = 64
    exports: int = 64
    subscriptions: int = 64  # topics subscribed at once (each keeps a backlog)
    cpu_s: float = 600.0
    wall_s: float = 86400.0


@dataclass
class UserQuota(HeldQuota):
    """The same, summed over every instance one user (auth token) runs, plus live instances
    and the bytes of its keys in the key-value store."""

    exports: int = 256
    # Latency queues go before every other queue: one user marking everything latency
    # would take that from the rest.
    latency_queues: int = 16
    instances: int = 0  # live instances (runtime.max_instances bounds them all)
    kvs_bytes: int = 16 * 2**20


@dataclass
class QuotaConfig:
    instance: InstanceQuota = field(default_factory=InstanceQuota)
    user: UserQuota = field(default_factory=UserQuota)
    # Per-user overrides, by user fingerprint (`pie token` prints it):
    # [quota.users."token-1a2b3c4d".user] kv_pages = 512 — any key of quota.instance / quota.user.
    users: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.resolved: dict[str, tuple[InstanceQuota, UserQuota]] = {}
        for user, tables in self.users.items():
            if not isinstance(tables, dict) or set(tables) - {"instance", "user"}:
                raise ConfigError(f"quota.users.{user} must be a table of the tables instance and/or user")
            quotas = []
            for name, base in (("instance", self.instance), ("user", self.user)):
                table = tables.get(name, {})
                if not isinstance(table, dict):
                    raise ConfigError(f"quota.users.{user}.{name} must be a table")
                merged = {**dataclasses.asdict(base), **table}
                quotas.append(_build(type(base), merged, f"quota.users.{user}.{name}."))
            self.resolved[user] = (quotas[0], quotas[1])

    def for_user(self, user: str) -> tuple[InstanceQuota, UserQuota]:
        """The instance and user quotas that apply to `user` (a fingerprint)."""
        return self.resolved.get(user, (self.instance, self.user))


@dataclass
class RuntimeConfig:
    max_instances: int = 256
    # Threads started with the runtime for instances to run on (a launch then waits for no
    # thread to start: ~3 ms each with 128 launched at once, pie/runtime/instance_threads.py).
    # 0: a thread is started per launch (by a spawner thread, off the launcher's path).
    idle_threads: int = 128
    # Wasmtime store limits of one instance (the same for Rust and Python inferlets; a
    # Python component holds several core modules, hence the counts). memory_limit_mb caps
    # each linear memory, so an instance holds at most max_memories × memory_limit_mb: with
    # the default of one memory (what Rust and componentize-py emit), memory_limit_mb in
    # all; a component with a second memory fails to instantiate, naming max_memories.
    memory_limit_mb: int = 256  # each linear memory
    max_memories: int = 1  # linear memories
    max_tables: int = 16
    max_table_elements: int = 100_000  # entries of any one table
    max_wasm_instances: int = 64  # core module instances inside the component
    # Host objects one instance holds at once (futures, pollables, queues, subscriptions,
    # matchers: each a guest handle); past it the instance is ended.
    max_handles: int = 65536
    # Inference calls (forward, embed, sample, ...) enqueued and not yet dispatched, over all
    # the instance's queues; past it a call fails with out-of-resources until some ran.
    max_pending_calls: int = 4096
    # Longest stretch of guest computation between two host calls before the instance is
    # stopped (wasmtime epoch deadline): ends infinite loops, not long generations.
    cpu_slice_ms: int = 5000

    def __post_init__(self) -> None:
        for key in ("max_instances", "memory_limit_mb", "max_memories", "max_tables",
                    "max_table_elements", "max_wasm_instances", "max_handles", "max_pending_calls",
                    "cpu_slice_ms"):
            if getattr(self, key) < 1:
                raise ConfigError(f"runtime.{key} must be positive, got {getattr(self, key)}")
        if self.idle_threads < 0:
            raise ConfigError(f"runtime.idle_threads must be 0 or more, got {self.idle_threads}")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # Clients authenticate with one of these tokens (each a user; at least 16 characters);
    # empty = no authentication, which is only allowed on a loopback host unless
    # allow_unauthenticated says otherwise.
    auth_tokens: list[str] = field(default_factory=list)
    # Tokens that are users too and may also see every user's usage in /stats.
    admin_tokens: list[str] = field(default_factory=list)
    allow_unauthenticated: bool = False
    max_upload_bytes: int = 64 * 2**20  # one program
    max_user_upload_bytes: int = 128 * 2**20  # uploads in progress of one user, all connections
    max_total_upload_bytes: int = 512 * 2**20  # uploads in progress on the server
    max_message_bytes: int = 2**20
    max_request_bytes: int = 8 * 2**20  # an HTTP request body (/v1); larger ones get 413
    # /v1/responses kept per user for previous_response_id and GET (least recently used go
    # first); each holds its conversation's text, at most a context's worth.
    max_stored_responses: int = 256
    # Client messages an instance has not read yet; a send beyond is refused (inbox_full).
    # Also: held messages of a detached instance, unread broadcasts of a subscription.
    max_pending_messages: int = 1024
    max_pending_bytes: int = 16 * 2**20  # the same backlogs, in bytes
    # Replies and events queued for one connection that it has not read: beyond, its
    # instances' sends wait; a client that reads nothing for slow_client_timeout_s while
    # they wait is disconnected (its instances end, saying why).
    max_outbox_bytes: int = 32 * 2**20
    slow_client_timeout_s: float = 30.0
    # On SIGTERM/SIGINT: refuse new work, let running instances finish for up to this long,
    # then terminate the rest ("server shutting down"). A second signal skips the wait.
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"server.port must be in [0, 65535], got {self.port}")
        tokens = self.tokens
        for token in tokens:
            if not isinstance(token, str) or len(token.strip()) < MIN_TOKEN_CHARS or token != token.strip():
                raise ConfigError(
                    f"server.auth_tokens / admin_tokens: every token must be at least {MIN_TOKEN_CHARS} "
                    f"characters with no surrounding spaces (got one of {len(str(token))}); "
                    "`pie token` makes one")
        if len(set(tokens)) != len(tokens):
            raise ConfigError("server.auth_tokens / admin_tokens: a token appears twice")
        if not (tokens or self.allow_unauthenticated or is_loopback(self.host)):
            raise ConfigError(
                f"server.host = {self.host!r} is reachable from other machines, so "
                "authentication is required: set server.auth_tokens (clients then send "
                "`Authorization: Bearer <token>`), or server.allow_unauthenticated = true "
                "to accept anyone")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"server.drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        sizes = ("max_upload_bytes", "max_user_upload_bytes", "max_total_upload_bytes",
                 "max_message_bytes", "max_request_bytes", "max_pending_messages", "max_pending_bytes",
                 "max_outbox_bytes")
        for key in sizes:
            if getattr(self, key) < 1:
                raise ConfigError(f"server.{key} must be positive, got {getattr(self, key)}")
        if self.max_outbox_bytes < self.max_message_bytes or self.max_pending_bytes < self.max_message_bytes:
            raise ConfigError("server.max_outbox_bytes and max_pending_bytes must be at least "
                              "server.max_message_bytes (one message must fit)")
        if self.slow_client_timeout_s <= 0:
            raise ConfigError(f"server.slow_client_timeout_s must be positive, got {self.slow_client_timeout_s}")

    @property
    def tokens(self) -> list[str]:
        """Every token that authenticates (users and admins)."""
        return [*self.auth_tokens, *self.admin_tokens]


@dataclass
class PathsConfig:
    cache_dir: str = "~/.cache/pie"

    @property
    def cache(self) -> Path:
        return Path(self.cache_dir).expanduser()


@dataclass
class PieConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    quota: QuotaConfig = field(default_factory=QuotaConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)


class ConfigError(ValueError):
    """A configuration file or value that Pie cannot use."""


RENAMED = {"control.pool_full": "control.kv_pressure (pool_full = \"wait\" is kv_pressure = \"preserve\")"}


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r}")


def _build(cls: type, table: dict[str, Any], where: str) -> Any:
    """Build dataclass `cls` from a TOML table, rejecting unknown keys and wrong types."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if f"{where}{key}" in RENAMED:
            raise ConfigError(f"{where}{key} is now {RENAMED[where + key]}; rename it in your config")
        if key not in fields:
            raise ConfigError(f"unknown config key {where}{key} (known: {', '.join(fields)})")
        default = getattr(cls(), key)
        if dataclasses.is_dataclass(default):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}{key} must be a table")
            kwargs[key] = _build(type(default), value, f"{where}{key}.")
        elif type(value) is not type(default) and not (type(default) is float and type(value) is int):
            raise ConfigError(
                f"{where}{key} must be {type(default).__name__}, got {type(value).__name__}"
            )
        else:
            kwargs[key] = float(value) if type(default) is float else value
    return cls(**kwargs)


def load_config(path: str | Path | None = None) -> PieConfig:
    """Defaults, overridden by the TOML file at `path` if given."""
    if path is None:
        return PieConfig()
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    return _build(PieConfig, table, "")
