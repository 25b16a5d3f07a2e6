"""Our C++ CPU kernels, compiled once per machine with torch's cpp_extension and cached.

Each source in csrc/ is its own extension: the first build takes ~30-40 s (mostly parsing
torch's headers), later loads ~10 ms.
`python -m pie.backend.kernels` builds ahead of time (`make setup` does), so the first
backend start does not pay it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from functools import cache
from pathlib import Path
from types import ModuleType

from pie.config import PieConfig

# A build lock older than this is a build that was killed (one takes ~30-40 s here).
STALE_LOCK_S = 600

log = logging.getLogger("pie.backend")
CSRC = Path(__file__).parent / "csrc"
# -fno-trapping-math: GCC keeps a loop with a float comparison in it (a clamp, a select)
# scalar unless FP exceptions may be ignored; the values are IEEE's either way (unlike
# -ffast-math). It vectorised every exp_nonpositive loop: SiLU * up 1451 -> 480 us per
# layer at 128 rows (AMD EPYC, 2 vCPUs), the attention softmax's exponentials. Part of the
# build key.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]


@cache
def paged_attention_module() -> ModuleType:
    """The paged-attention and KV-write kernels (csrc/paged_attention.cpp)."""
    return _build("paged_attention")


@cache
def int8_linear_module() -> ModuleType:
    """The int8 weight x int8 activation linear (csrc/int8_linear.cpp)."""
    return _build("int8_linear")


@cache
def fused_ops_module() -> ModuleType:
    """Residual add + RMSNorm, RoPE, SiLU * up in bf16 (csrc/fused_ops.cpp)."""
    return _build("fused_ops")


@cache
def bf16_gemv_module() -> ModuleType:
    """The bf16 linear for steps of 1-255 tokens (csrc/bf16_gemv.cpp)."""
    return _build("bf16_gemv")


@cache
def decode_step_module() -> ModuleType:
    """Every decoder layer of a bf16 decode step in one call (csrc/decode_step.cpp)."""
    return _build("decode_step")


def clear_stale_lock(lock: Path) -> bool:
    """Remove torch's build baton if older than STALE_LOCK_S: a build killed mid-way leaves
    it behind, and every later start would wait on it forever. Whether it was removed."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= STALE_LOCK_S:
        return False  # a build in progress (another process)
    log.warning("removing the stale build lock %s (%.0f s old: a build that was killed)", lock, age)
    lock.unlink(missing_ok=True)
    return True


def _build(name: str) -> ModuleType:
    """Build (or load the cached build of) csrc/<name>.cpp, keyed by its content, the shared
    headers' and that of the sources it includes (decode_step.cpp includes three).

    It compiles a copy of those files inside the build directory: torch writes the source's
    absolute path into its build.ninja, so compiling csrc/ in place rebuilt every kernel
    (~3 min here) whenever the same commit ran from another checkout (a git worktree, CI's
    clone) and again on returning."""
    from torch.utils.cpp_extension import load

    source = CSRC / f"{name}.cpp"
    included = re.findall(r'^#include "(\w+\.cpp)"', source.read_text(), flags=re.MULTILINE)
    texts = {f.name: f.read_bytes() for f in [source, *(CSRC / i for i in included), *sorted(CSRC.glob("*.h"))]}
    digest = hashlib.sha256(b"".join(texts.values()) + " ".join(CFLAGS).encode()).hexdigest()[:12]
    build_dir = PieConfig().paths.cache / "kernels" / f"{name}-{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(build_dir / "lock")
    for file_name, text in texts.items():  # a copy cut short by a kill is rewritten
        copy = build_dir / file_name
        if not copy.exists() or copy.read_bytes() != text:
            copy.write_bytes(text)
    fresh = not any(build_dir.glob("*.so"))
    if fresh:
        log.info("compiling the CPU kernel %s (once per machine, ~30-40 s)", name)
    started = time.monotonic()
    os.environ.setdefault("MAX_JOBS", "2")
    module = load(
        name=f"pie_{name}",
        sources=[str(build_dir / source.name)],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
    )
    if fresh:
        log.info("kernel compiled in %.0f s", time.monotonic() - started)
    return module


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    paged_attention_module()
    int8_linear_module()
    fused_ops_module()
    bf16_gemv_module()
    decode_step_module()
    print("pie CPU kernels ready")
