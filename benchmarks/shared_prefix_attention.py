"""One layer's decode attention for users sharing a prefix: the shared-prefix path on and off.

`--users` decode items whose contexts begin with the same `--prefix` keys (whole pages),
each with a partial page of its own after it (4 keys, the new token included), attend once
per call: with `backend.shared_prefix_keys` on (the prefix as matrix products on the CPU,
csrc/shared_prefix.h; a FlashInfer cascade on CUDA) and off (every item reads the prefix
itself). The model's attention shape (SmolLM2-135M: 9 heads, 3 KV heads, head size 64),
bf16 pools, page size 16. Groups of every size are taken here (the minimum group size is
what this sweep exists to choose: CpuKernelAttention.SHARED_PREFIX_MEMBERS,
FlashInferAttention.SHARED_PREFIX_MIN_READ). On and off
alternate round by round; medians of the per-call times; the outputs of both are compared.

    python benchmarks/shared_prefix_attention.py [--device cpu|cuda] [--users 4,8,16,32]
        [--prefix 512,2048] [--rounds 5] [--calls 20] [--quick] [--out FILE]

Results: benchmarks/results/shared_prefix_attention.json (CPU) or
shared_prefix_attention-cuda.json (`--device cuda`). `--quick` (2 and 4 users, a 64-key
prefix, 2 rounds of 2 calls) is tests/test_bench_scripts.py's run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.run_info import command_line, machine_settings, rotated, write_results
from pie.backend.attention import AttentionPlan
from pie.backend.kv_cache import KvCache

RESULTS = Path(__file__).parent / "results"
HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16
SIDES = ("on", "off")


def workload(users: int, prefix: int, device: torch.device) -> tuple[KvCache, AttentionPlan, torch.Tensor]:
    """A pool holding the prefix on pages 0.. and one page per user after it; the plan; q."""
    g = torch.Generator().manual_seed(users * 7 + prefix)
    prefix_pages = prefix // PAGE
    pages = prefix_pages + users + 1
    kv = KvCache(1, pages, PAGE, 0, KV_HEADS, DIM, torch.bfloat16, device)
    slots = torch.arange(pages * PAGE, device=device)
    kv.write(0, slots, torch.randn(len(slots), KV_HEADS, DIM, generator=g).bfloat16().to(device),
             torch.randn(len(slots), KV_HEADS, DIM, generator=g).bfloat16().to(device))
    keys, q_indptr, kv_indptr = [], [0], [0]
    for u in range(users):
        own = (prefix_pages + u) * PAGE
        item = list(range(prefix)) + list(range(own, own + 4))
        keys += item
        q_indptr.append(u + 1)
        kv_indptr.append(kv_indptr[-1] + len(item))
    plan = AttentionPlan(q_indptr, kv_indptr, torch.tensor(keys, device=device),
                         torch.ones(len(keys), dtype=torch.bool, device=device), [None] * users)
    q = torch.randn(users, HEADS, DIM, generator=g).bfloat16().to(device)
    return kv, plan, q


def attention(side: str, device: torch.device, prefix: int):
    keys = prefix if side == "on" else 0
    if device.type == "cuda":
        from pie.backend.flashinfer_attention import FlashInferAttention

        impl = FlashInferAttention(HEADS, KV_HEADS, DIM, torch.bfloat16, device, keys)
        impl.SHARED_PREFIX_MIN_READ = 0  # its rule on a group's members x prefix keys: off here
    else:
        from pie.backend.attention import CpuKernelAttention

        impl = CpuKernelAttention(keys)
    impl.SHARED_PREFIX_MEMBERS = 2  # every group size: the sweep's point
    return impl


def time_calls(impl, kv: KvCache, plan: AttentionPlan, q: torch.Tensor, calls: int) -> float:
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
    impl.run(q, kv, 0, plan)
    sync()
    started = time.perf_counter()
    for _ in range(calls):
        impl.run(q, kv, 0, plan)
    sync()
    return (time.perf_counter() - started) / calls * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--users", default="4,8,16,32")
    parser.add_argument("--prefix", default="512,2048", help="shared keys (multiples of 16)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per round and side")
    parser.add_argument("--quick", action="store_true", help="a small run (the tests' smoke run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.users, args.prefix, args.rounds, args.calls = "2,4", "64", 2, 2
    device = torch.device(args.device)
    rows = []
    for prefix in (int(p) for p in args.prefix.split(",")):
        for users in (int(u) for u in args.users.split(",")):
            kv, plan, q = workload(users, prefix, device)
            impls = {side: attention(side, device, prefix) for side in SIDES}
            outputs = {side: impl.run(q, kv, 0, plan).float() for side, impl in impls.items()}
            samples: dict[str, list[float]] = {side: [] for side in SIDES}
            for round_ in range(args.rounds):
                for side in rotated(list(SIDES), round_):
                    samples[side].append(time_calls(impls[side], kv, plan, q, args.calls))
            on, off = (statistics.median(samples[s]) for s in SIDES)
            rows.append({"users": users, "prefix": prefix, "on_ms": on, "off_ms": off, "speedup": off / on,
                         "max_abs_diff": float((outputs["on"] - outputs["off"]).abs().max()),
                         "samples": samples})
            print(f"prefix {prefix:5d} users {users:3d}: off {off:7.3f} ms  on {on:7.3f} ms  {off / on:5.2f}x",
                  flush=True)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
            "quick": args.quick, "rounds": args.rounds, "order": [rotated(list(SIDES), r) for r in range(args.rounds)],
            "model": "SmolLM2-135M attention shape", "dtype": "bfloat16", "device": args.device,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, **machine_settings()}
    out = Path(args.out or RESULTS / ("shared_prefix_attention-cuda.json" if device.type == "cuda"
                                      else "shared_prefix_attention.json"))
    write_results(out, {"meta": meta, "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM,
                                                "page_size": PAGE, "calls": args.calls}, "rows": rows})


if __name__ == "__main__":
    main()
