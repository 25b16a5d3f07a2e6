"""Batching policies on synthetic views: no threads, no sockets, no sleeps."""

from __future__ import annotations

from pie.config import ControlConfig
from pie.control.policies import Adaptive, CountK, Eager, ReadyView, TimeT, policy_for

NOW = 0.0


def view(idle=True, last_forward_s=0.05, stragglers=(), gathering=False, **waits: float) -> ReadyView:
    """Kinds given as name=seconds the oldest call of that kind has waited (count 1 each,
    `pass_` for the kind "pass")."""
    kinds = {k.rstrip("_"): w for k, w in waits.items()}
    return ReadyView({k: 1 for k in kinds}, {k: NOW - w for k, w in kinds.items()}, idle,
                     last_forward_s, NOW, frozenset(stragglers), gathering)


def test_cheap_kinds_go_before_the_model_unless_it_waited_a_whole_forward():
    assert view(forward=0.01, sample=0.001).preferred() == "sample"
    assert view(pass_=0.01, embed_text=0.001).preferred() == "embed_text"
    assert view(forward=0.06, sample=0.001).preferred() == "forward"  # > last_forward_s
    assert view(forward=0.01, pass_=0.02).preferred() == "pass"  # both heavy: the oldest


def test_adaptive_waits_for_busy_backend_and_briefly_for_stragglers():
    adaptive = Adaptive()
    assert adaptive.choose(view(idle=False, pass_=1.0)) == (None, None)
    assert adaptive.choose(view(pass_=0.0)) == ("pass", None)
    assert adaptive.choose(view(pass_=0.0, stragglers={"pass"})) == (None, 25)  # half a forward
    assert adaptive.choose(view(pass_=0.03, stragglers={"pass"})) == ("pass", None)
    # Only prompts waiting on a wave of launches: up to GATHER_WAIT_S, or half a forward if longer.
    assert adaptive.choose(view(last_forward_s=0.02, pass_=0.0, stragglers={"pass"}, gathering=True)) == (None, 30)
    assert adaptive.choose(view(last_forward_s=0.02, pass_=0.03, stragglers={"pass"}, gathering=True)) == ("pass", None)
    assert adaptive.choose(view(last_forward_s=0.1, pass_=0.0, stragglers={"pass"}, gathering=True)) == (None, 50)
    assert not adaptive.single


def test_eager_sends_every_call_alone_even_while_busy():
    assert Eager().choose(view(idle=False, sample=0.0)) == ("sample", None) and Eager.single


def test_k_waits_for_k_calls_or_the_wait_limit():
    k = CountK(2, max_wait_s=0.1)
    two = ReadyView({"pass": 2, "sample": 1}, {"pass": NOW - 0.01, "sample": NOW}, True, 0.05, NOW)
    assert k.choose(two) == ("pass", None)
    kind, wait_ms = k.choose(view(sample=0.04))
    assert kind is None and 59 <= wait_ms <= 60
    assert k.choose(view(sample=0.1)) == ("sample", None)


def test_t_waits_until_the_oldest_waited_t():
    t = TimeT(0.02)
    kind, wait_ms = t.choose(view(sample=0.005))
    assert kind is None and 14 <= wait_ms <= 15
    assert t.choose(view(sample=0.02)) == ("sample", None)
    assert t.choose(view(idle=False, sample=1.0)) == (None, None)


def test_config_names_the_policy():
    assert isinstance(policy_for(ControlConfig(scheduler="k", batch_k=3)), CountK)
    assert policy_for(ControlConfig(scheduler="t", batch_t_ms=20)).t_s == 0.02
    assert isinstance(policy_for(ControlConfig()), Adaptive)
