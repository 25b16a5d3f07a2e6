"""`GET /metrics`: the server's statistics in Prometheus' text format (prometheus-client).

`StatsCollector` reads `Runtime.stats()` — the same numbers `/stats` serves as JSON — at
each scrape, so nothing is counted twice and nothing runs between scrapes. Series of one
backend replica (`backend.replicas`: readiness, its instances, scheduler and pools) have a
`replica` label ("0", "1", ...); server-wide ones (instance ends, host calls, users) have
none. Counters are cumulative since the server started; gauges are now.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

__all__ = ["StatsCollector", "CONTENT_TYPE", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # calls per batch


class StatsCollector:
    """A custom collector over `stats()` (a `Runtime.stats(None)`, every user's), which
    returns None while the backend is starting."""

    def __init__(self, stats: Callable[[], dict | None]):
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        up = GaugeMetricFamily("pie_backend_ready", "1 while the backend replica has handshaken and serves",
                               labels=["replica"])
        if stats is None:  # starting: no replica has handshaken yet
            up.add_metric(["0"], 0.0)
            yield up
            return
        replicas = stats["replicas"]
        for r in replicas:
            up.add_metric([str(r["replica"])], 1.0 if r["status"] == "ok" else 0.0)
        yield up
        yield from self._instances(stats, replicas)
        yield from _per_replica(self._scheduler, [(str(r["replica"]), r["scheduler"]) for r in replicas])
        yield from _per_replica(self._pools, [(str(r["replica"]), r["resources"]) for r in replicas])
        yield from self._users(stats["users"])

    def _instances(self, stats: dict, replicas: list[dict]) -> Iterator[Metric]:
        live = GaugeMetricFamily("pie_instances_running", "Live inferlet instances", labels=["replica"])
        for r in replicas:
            live.add_metric([str(r["replica"])], r["instances"])
        yield live
        ended = CounterMetricFamily("pie_instances_ended", "Instances ended, by how (finished, error, trap, "
                                    "terminated, limit)", labels=["outcome"])
        for outcome, count in sorted(stats.get("ended", {}).items()):
            ended.add_metric([outcome], count)
        yield ended
        calls = CounterMetricFamily("pie_host_calls", "Host calls made by inferlets, by program",
                                    labels=["program"])
        for program, by_function in sorted(stats["host_calls"].items()):
            calls.add_metric([program[:16]], sum(by_function.values()))
        yield calls

    def _scheduler(self, replica: str, scheduler: dict) -> Iterator[Metric]:
        for name, key, what in (("pie_scheduler_batches", "batches", "Batches sent to the backend"),
                                ("pie_scheduler_calls", "calls", "Calls sent to the backend")):
            family = CounterMetricFamily(name, f"{what}, by kind of call", labels=["replica", "kind"])
            for kind, count in sorted(scheduler[key].items()):
                family.add_metric([replica, kind], count)
            yield family
        queued = GaugeMetricFamily("pie_scheduler_queued_calls", "Calls waiting in the scheduler now, by kind",
                                   labels=["replica", "kind"])
        for kind, count in sorted(scheduler.get("queued", {}).items()):
            queued.add_metric([replica, kind], count)
        yield queued
        sizes = {int(size): batches for size, batches in scheduler["batch_sizes"].items()}
        buckets = [(str(bound), sum(n for size, n in sizes.items() if size <= bound)) for bound in BATCH_BUCKETS]
        buckets.append(("+Inf", sum(sizes.values())))
        histogram = HistogramMetricFamily("pie_scheduler_batch_size", "Calls per batch sent to the backend",
                                          labels=["replica"])
        histogram.add_metric([replica], buckets, sum_value=sum(size * n for size, n in sizes.items()))
        yield histogram
        if "step_s_buckets" in scheduler:
            steps = [(bound, count) for bound, count in scheduler["step_s_buckets"].items()]
            steps.append(("+Inf", scheduler["steps"]))
            step = HistogramMetricFamily("pie_backend_step_seconds", "Model steps (forward and pass batches): "
                                         "sent to the backend -> its reply", labels=["replica"])
            step.add_metric([replica], steps, sum_value=scheduler["step_s_total"])
            yield step
        for name, key, what in (("pie_scheduler_ahead_steps", "ahead_steps",
                                 "Decode steps the backend took on its own (control.ahead_steps)"),
                                ("pie_scheduler_interrupts", "interrupts",
                                 "Interrupts that ended the backend's steps ahead for other work")):
            if key in scheduler:
                family = CounterMetricFamily(name, what, labels=["replica"])
                family.add_metric([replica], scheduler[key])
                yield family
        for name, key, what in (("pie_scheduler_wait_seconds_mean", "mean_wait_ms", "Mean time a call waited"),
                                ("pie_scheduler_wait_seconds_max", "max_wait_ms", "Longest time a call waited")):
            family = GaugeMetricFamily(name, f"{what} in the scheduler before its batch left", labels=["replica"])
            family.add_metric([replica], scheduler[key] / 1e3)
            yield family

    def _pools(self, replica: str, pools: dict) -> Iterator[Metric]:
        for name, key, what in (("pie_kv_pages_free", "kv_pages_free", "KV pages free (cached ones nobody holds included)"),
                                ("pie_kv_pages_total", "kv_pages_total", "KV pages in the pool"),
                                ("pie_embeds_free", "embeds_free", "Embed slots free"),
                                ("pie_embeds_total", "embeds_total", "Embed slots in the pool")):
            family = GaugeMetricFamily(name, what, labels=["replica"])
            family.add_metric([replica], pools[key])
            yield family
        cache = pools.get("prefix_cache")
        if cache is not None:
            for name, key, what in (("pie_prefix_cache_lookup_tokens", "lookup_tokens", "Prompt tokens looked up"),
                                    ("pie_prefix_cache_hit_tokens", "hit_tokens", "Prompt tokens the cache supplied"),
                                    ("pie_prefix_cache_evicted_pages", "evicted_pages", "Cached pages evicted")):
                family = CounterMetricFamily(name, f"Automatic prefix cache: {what}", labels=["replica"])
                family.add_metric([replica], cache[key])
                yield family
            pages = GaugeMetricFamily("pie_prefix_cache_pages", "Automatic prefix cache: pages cached now",
                                      labels=["replica"])
            pages.add_metric([replica], cache["cached_pages"])
            yield pages

    def _users(self, users: dict) -> Iterator[Metric]:
        held = GaugeMetricFamily("pie_user_held", "What each user holds now against its quotas (users by token "
                                 "fingerprint)", labels=["user", "resource"])
        for user, account in sorted(users.items()):
            for resource, amount in sorted(account.items()):
                held.add_metric([user, resource], amount)
        yield held


def _per_replica(families: Callable[[str, dict], Iterator[Metric]],
                 parts: list[tuple[str, dict]]) -> Iterator[Metric]:
    """One family per name with every replica's samples (Prometheus wants a name once)."""
    by_name: dict[str, Metric] = {}
    for replica, part in parts:
        for family in families(replica, part):
            if family.name in by_name:
                by_name[family.name].samples.extend(family.samples)
            else:
                by_name[family.name] = family
    return iter(by_name.values())


def render(stats: Callable[[], dict | None]) -> bytes:
    """One scrape: the text exposition of a fresh registry holding a `StatsCollector`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    return generate_latest(registry)
