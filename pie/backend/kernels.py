"""Our C++ CPU kernels, compiled once per machine with torch's cpp_extension and cached.

The first build takes ~30-40 s (mostly parsing torch's headers), later loads ~10 ms.
`python -m pie.backend.kernels` builds ahead of time (`make setup` does), so the first
backend start does not pay it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from functools import cache
from pathlib import Path
from types import ModuleType

from pie.config import PieConfig

log = logging.getLogger("pie.backend")
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"


@cache
def paged_attention_module() -> ModuleType:
    """Build (or load the cached build of) the paged-attention extension."""
    from torch.utils.cpp_extension import load

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    build_dir = PieConfig().paths.cache / "kernels" / f"paged_attention-{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not any(build_dir.glob("*.so"))
    if fresh:
        log.info("compiling the CPU paged-attention kernel (once per machine, ~30-40 s)")
    started = time.monotonic()
    os.environ.setdefault("MAX_JOBS", "2")
    module = load(
        name="pie_paged_attention",
        sources=[str(SOURCE)],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
    )
    if fresh:
        log.info("kernel compiled in %.0f s", time.monotonic() - started)
    return module


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    paged_attention_module()
    print("pie CPU kernels ready")
