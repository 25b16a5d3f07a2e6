"""Scheduling by objective (issue 18): the order in which waiting queues fill a batch —
objective, then priority, then the policy's key (arrival order, or `srjf`'s least estimated
work less a waiting credit) — on a real Scheduler whose fake backend stays busy while the
test queues its calls, so `_form_batch` is asked once everything waits."""

from __future__ import annotations

import re
import time

import pytest
from test_control import FakeBackend, forward

from pie import protocol as P
from pie.config import ControlConfig
from pie.control.policies import Head, Objective, Srjf, policy_for
from pie.control.scheduler import Scheduler


@pytest.fixture
def make(tmp_path):
    made = []

    def make(scheduler: str = "adaptive", srjf_lambda: float = 0.0, max_batch_tokens: int = 64,
             **control) -> Scheduler:
        endpoint = f"ipc://{tmp_path}/fake{len(made)}.sock"
        backend = FakeBackend(endpoint)
        s = Scheduler(endpoint, ControlConfig(scheduler=scheduler, srjf_lambda=srjf_lambda, **control),
                      max_batch_tokens=max_batch_tokens)
        s.backend_idle = False  # nothing is sent while the test queues
        made.append((s, backend))
        return s

    yield make
    for s, backend in made:
        s.stop()
        backend.close()


def queued(s: Scheduler, name: str, tokens: int, waited_s: float = 0.0, **fields):
    """A queue with one forward of `tokens` new tokens, enqueued `waited_s` ago."""
    q = s.create_queue(name)
    for key, value in fields.items():
        setattr(q, key, value)
    command = forward(q, tokens=tokens)
    command.enqueued = time.monotonic() - waited_s
    s.submit(command)
    return q


def first_batch(s: Scheduler) -> list[str]:
    with s.lock:
        return [c.queue.instance_id for c in s._form_batch(P.Kind.FORWARD)]


def test_latency_goes_first_then_priority_then_arrival(make):
    s = make()
    queued(s, "old", 30, waited_s=0.3)
    queued(s, "background", 10, waited_s=0.5, objective=Objective.BACKGROUND)
    queued(s, "high", 30, waited_s=0.1, priority=5)
    queued(s, "chat", 30, objective=Objective.LATENCY)
    assert first_batch(s) == ["chat", "high"]  # 60 of 64 tokens: "old" waits, background last
    assert first_batch(s) == ["old", "background"]


def test_srjf_takes_the_least_work_first_unless_a_long_job_waited(make):
    fcfs = make()
    queued(fcfs, "long", 60, waited_s=0.2)
    queued(fcfs, "short", 20, waited_s=0.1)
    assert first_batch(fcfs) == ["long"]
    srjf = make("srjf")
    queued(srjf, "long", 60, waited_s=0.2)
    queued(srjf, "short", 20, waited_s=0.1)
    assert first_batch(srjf) == ["short"]  # the long one no longer fits after it
    credit = make("srjf", srjf_lambda=1.0)  # 0.1 s more waited forgives 0.1 s of work (100 tokens)
    queued(credit, "long", 60, waited_s=0.2)
    queued(credit, "short", 20, waited_s=0.1)
    assert first_batch(credit) == ["long"]


def test_a_job_size_hint_counts_instead_of_the_call_and_counts_down(make):
    s = make("srjf")
    queued(s, "big job", 20, job_left=1000)
    q = queued(s, "small job", 40, waited_s=0.1)
    assert first_batch(s) == ["small job", "big job"]
    assert q.job_left == 0
    hinted = s.queues[0]
    assert hinted.job_left == 980  # its 20 tokens were sent


def test_a_task_group_is_ordered_by_its_oldest_call(make):
    s = make()
    queued(s, "member", 30, group=("alice", "map"))
    queued(s, "other", 30, waited_s=0.2)
    queued(s, "leader", 30, waited_s=0.3, group=("alice", "map"))
    assert first_batch(s) == ["member", "leader"]  # the group's oldest call beat "other"


def test_while_a_latency_queue_is_open_other_prompts_go_in_chunks(make):
    """No latency queue: a 900-token prompt goes whole. One open and idle: in chunks of
    control.latency_batch_tokens (256) a batch. With its decode step waiting, the step goes
    first and, with control.latency_step_tokens = 0, chunked prefill's own rule applies (as
    many decoders as prompts: the decoder and control.max_step_tokens = 64 of the prompt)."""
    from conftest import sampling_pass

    for latency, sent in ((None, 900), ("idle", 256), ("waiting", 1 + 64)):
        s = make(max_batch_tokens=4096, latency_step_tokens=0)  # no cap: the next test's
        if latency:
            chat = s.create_queue("chat")
            chat.objective = Objective.LATENCY
            if latency == "waiting":
                call = sampling_pass([5], 0, [100], 16)
                call.queue = chat
                s.submit(call)
        q = s.create_queue("map")
        prompt = sampling_pass([100 + i for i in range(900)], 0, list(range(60)), 16)
        prompt.queue = q
        s.submit(prompt)
        with s.lock:
            batch = s._form_batch(P.Kind.PASS)
        assert sum(c.tokens for c in batch) == sent, latency
        assert [c.queue.instance_id for c in batch][:1] == (["chat"] if latency == "waiting" else ["map"])


def test_a_latency_call_caps_the_others_share_of_its_batch(make):
    """control.latency_step_tokens = 24: beside a waiting latency decode, 20 decoders of
    other queues go (20 tokens) and a 900-token prompt does not (the 4 tokens of room left
    are less than a chunk); cap 48: the decoders, then a 28-token chunk. Without a latency
    call waiting, or with cap 0, chunked prefill's step: the decoders and 64 prompt tokens.
    The default cap is 16."""
    from conftest import sampling_pass

    def batch_of(cap: int, chat_waits: bool) -> list[tuple[str, int]]:
        s = make(max_batch_tokens=4096, latency_step_tokens=cap)
        chat = s.create_queue("chat")
        chat.objective = Objective.LATENCY
        if chat_waits:
            call = sampling_pass([5], 0, [100], 16)
            call.queue = chat
            s.submit(call)
        prompt = sampling_pass([100 + i for i in range(900)], 0, list(range(60)), 16)
        prompt.queue = s.create_queue("map prompt")
        s.submit(prompt)
        for i in range(20):
            decode = sampling_pass([7], 40, [200 + i, 300 + i], 16)
            decode.queue = s.create_queue(f"map {i}")
            s.submit(decode)
        with s.lock:
            return [(c.queue.instance_id, c.tokens) for c in s._form_batch(P.Kind.PASS)]

    capped = batch_of(24, True)
    assert capped[0] == ("chat", 1) and len(capped) == 21 and sum(t for _, t in capped) == 21
    assert batch_of(48, True)[-1] == ("map prompt", 28)
    assert sum(t for _, t in batch_of(0, True)) == 1 + 20 + 64  # chunked prefill's step
    assert sum(t for _, t in batch_of(24, False)) == 20 + 64
    assert ControlConfig().latency_step_tokens == 16
    with pytest.raises(Exception, match="latency_step_tokens"):
        ControlConfig(latency_step_tokens=8)


def test_srjf_key_and_config():
    policy = policy_for(ControlConfig(scheduler="srjf", srjf_lambda=0.25))
    assert isinstance(policy, Srjf) and policy.sizes_jobs and policy.credit == 0.25
    assert policy.key(Head(enqueued=1.0, estimate_s=2.0), now=3.0) == 1.5
    assert not policy_for(ControlConfig()).sizes_jobs
    with pytest.raises(Exception, match="srjf_lambda"):
        ControlConfig(scheduler="srjf", srjf_lambda=-1)


def test_objectives_through_a_real_server_bad_input_and_the_latency_quota(pie_server):
    """`probe objectives 20`: past quota.user.latency_queues (16) the call fails and the
    queue stays as it was; a long group name and an absurd hint are refused; the quota is
    back when the instance ends (a second run marks 16 again)."""
    from pie_server import build, run_inferlet

    program = build("probe")
    for _ in range(2):
        run = run_inferlet(pie_server, program, ["objectives", "20"])
        assert run.reason == "finished", run.messages
        latency, group, absurd, fine = run.messages
        assert re.match(r"latency: 16 ok, then out-?of-?resources", latency, re.I), latency
        assert "quota.user.latency_queues = 16" in latency
        assert re.match("invalid-?argument", group, re.I) and "256 bytes" in group
        assert re.match("invalid-?argument", absurd, re.I) and "context length" in absurd
        assert fine == "ok"
