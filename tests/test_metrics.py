"""`GET /metrics` (pie/server/metrics.py): Prometheus' text format over the numbers of
`/stats`. The collector on a hand-made stats dict here; a real server scraped during a run
in test_e2e.py."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pie.server.metrics import render

SCHEDULER = {"batches": {"pass": 4}, "calls": {"pass": 9}, "batch_sizes": {"1": 1, "2": 2, "4": 1},
             "mean_batch_size": 2.25, "mean_wait_ms": 1.5, "max_wait_ms": 4.0, "queued": {"pass": 2},
             "step_s_buckets": {"0.025": 1, "0.05": 3}, "steps": 4, "step_s_total": 0.15}
POOLS = {"kv_pages_free": 60, "kv_pages_total": 64, "embeds_free": 30, "embeds_total": 32,
         "exports": [], "prefix_cache": {"cached_pages": 7, "lookups": 3, "lookup_tokens": 100,
                                         "hit_tokens": 40, "hit_rate": 0.4, "saved_pages": 2,
                                         "evicted_pages": 1},
         "reclaim": {}}
STATS = {
    "instances": 3,
    "ended": {"finished": 5, "trap": 1},
    "host_calls": {"text_completion": {"forward": 10, "sample": 4}},
    "scheduler": SCHEDULER,
    "resources": POOLS,
    "replicas": [{"replica": 0, "status": "ok", "instances": 3, "scheduler": SCHEDULER, "resources": POOLS},
                 {"replica": 1, "status": "failed", "reason": "exited", "instances": 0,
                  "scheduler": {**SCHEDULER, "calls": {"pass": 1}, "queued": {}},
                  "resources": {**POOLS, "kv_pages_free": 64}}],
    "users": {"token-ab12": {"kv_pages": 4, "instances": 3}},
}


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_metrics_expose_the_stats_in_prometheus_format():
    got = samples(render(lambda: STATS))
    r = ("replica", "0")
    assert got[("pie_backend_ready", (r,))] == 1
    assert got[("pie_instances_running", (r,))] == 3
    assert got[("pie_instances_ended_total", (("outcome", "finished"),))] == 5
    assert got[("pie_scheduler_calls_total", (("kind", "pass"), r))] == 9
    assert got[("pie_scheduler_queued_calls", (("kind", "pass"), r))] == 2
    # the batch-size histogram is cumulative: 1 batch of 1, 3 of at most 2, 4 of at most 4
    assert [got[("pie_scheduler_batch_size_bucket", (("le", le), r))] for le in ("1", "2", "4", "+Inf")] == \
        [1, 3, 4, 4]
    assert got[("pie_scheduler_batch_size_sum", (r,))] == 9 and got[("pie_scheduler_batch_size_count", (r,))] == 4
    assert got[("pie_scheduler_wait_seconds_max", (r,))] == 0.004
    assert got[("pie_backend_step_seconds_bucket", (("le", "0.05"), r))] == 3
    assert got[("pie_backend_step_seconds_count", (r,))] == 4 and got[("pie_backend_step_seconds_sum", (r,))] == 0.15
    assert got[("pie_kv_pages_free", (r,))] == 60 and got[("pie_kv_pages_total", (r,))] == 64
    assert got[("pie_prefix_cache_hit_tokens_total", (r,))] == 40
    assert got[("pie_user_held", (("resource", "kv_pages"), ("user", "token-ab12")))] == 4
    assert got[("pie_host_calls_total", (("program", "text_completion"),))] == 14
    # a second replica: its own series under replica="1", down while it restarts
    r1 = ("replica", "1")
    assert got[("pie_backend_ready", (r1,))] == 0
    assert got[("pie_scheduler_calls_total", (("kind", "pass"), r1))] == 1
    assert got[("pie_kv_pages_free", (r1,))] == 64 and got[("pie_instances_running", (r1,))] == 0


def test_a_starting_server_says_only_that_it_is_not_ready():
    assert samples(render(lambda: None)) == {("pie_backend_ready", (("replica", "0"),)): 0}
