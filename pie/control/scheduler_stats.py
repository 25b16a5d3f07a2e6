"""What the scheduler counts (`SchedulerStats`: batches, calls, waits, model-step times, for
/stats and /metrics) and estimates (`Costs`: a prompt token's forward time, a page's swap)."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Bounds of the model-step time histogram (/stats `step_s_buckets`, /metrics), seconds: a
# decode step of the default model here takes ~25-45 ms, a long prefill seconds.
STEP_BOUNDS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class SchedulerStats:
    batches: Counter = field(default_factory=Counter)  # kind -> batches
    calls: Counter = field(default_factory=Counter)  # kind -> calls
    batch_sizes: Counter = field(default_factory=Counter)  # calls per batch -> batches
    wait_s_total: float = 0.0
    wait_s_max: float = 0.0
    # Model steps (forward and pass batches): sent -> reply, the time the backend took plus
    # the round trip; counted per bucket of STEP_BOUNDS_S (the last bucket: slower than all).
    step_buckets: Counter = field(default_factory=Counter)
    step_s_total: float = 0.0
    # Steps the backend took on its own (Passes.ahead; each also counts as a pass batch of
    # the runs it stepped) and the Interrupts that ended them early for other work.
    ahead_steps: int = 0
    interrupts: int = 0

    def stepped(self, seconds: float) -> None:
        self.step_buckets[bisect.bisect_left(STEP_BOUNDS_S, seconds)] += 1
        self.step_s_total += seconds

    def as_dict(self) -> dict[str, Any]:
        calls = sum(self.calls.values())
        steps = sum(self.step_buckets.values())
        return {
            # steps at most each bound (cumulative, as Prometheus' histogram buckets), and all
            "step_s_buckets": {f"{bound:g}": sum(n for i, n in self.step_buckets.items() if i <= b)
                               for b, bound in enumerate(STEP_BOUNDS_S)},
            "steps": steps,
            "step_s_total": self.step_s_total,
            "ahead_steps": self.ahead_steps,
            "interrupts": self.interrupts,
            "batches": {str(k): v for k, v in self.batches.items()},
            "calls": {str(k): v for k, v in self.calls.items()},
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "mean_batch_size": calls / max(1, sum(self.batches.values())),
            "mean_wait_ms": 1e3 * self.wait_s_total / max(1, calls),
            "max_wait_ms": 1e3 * self.wait_s_max,
        }


@dataclass
class Costs:
    """Running estimates (exponential averages of what the backend's replies took) of a
    prompt token's forward time and of one page's swap: APIServe's waste estimate weighs
    recomputing a paused context against swapping it (pie/control/reclaimer.py). The seeds
    are this machine's order of magnitude (Xeon, 2 vCPUs): ~1 ms a token in a large batch,
    ~0.2 ms a page."""

    token_s: float = 1e-3
    page_s: float = 2e-4

    def forwarded(self, seconds: float, tokens: int) -> None:
        if tokens > 16:  # a prompt's chunk: decode steps are dominated by the fixed cost
            self.token_s += 0.2 * (seconds / tokens - self.token_s)

    def swapped(self, seconds: float, pages: int) -> None:
        if pages:
            self.page_s += 0.2 * (seconds / pages - self.page_s)
