"""The prompt hold (control.prompt_hold, pie/control/batch_former.py): beside HOLD_DECODERS
decoders or more, prompts wait until HOLD_COUNT do or the oldest has waited
prompt_hold_ms, then go whole together. Unit tests of the BatchFormer on its own (it does
no I/O and reads no clock: the scheduler passes `now`), and of where the switch is read."""

from __future__ import annotations

import pytest

from pie import protocol as P
from pie.config import ConfigError, ControlConfig
from pie.control.batch_former import HOLD_COUNT, HOLD_DECODERS, BatchFormer
from pie.control.command import Command, CommandQueue
from pie.control.future import HostFuture
from pie.control.policies import Objective

HOLD_MS = 400.0


class Prompt(Command):
    """A pass's stand-in for the former: it cuts off leading tokens as a chunk as
    `Pass.split` does (every token but the last may go ahead)."""

    def chunkable(self) -> int:
        return self.tokens - 1

    def split(self, n: int) -> Command:
        self.tokens -= n
        return Command(P.Kind.PASS, self.queue, HostFuture(), tokens=n, enqueued=self.enqueued)


def queue_with(tokens: int, enqueued: float, objective: Objective = Objective.THROUGHPUT) -> CommandQueue:
    """A queue whose one waiting pass has `tokens` new tokens (a decoder at 1, a prompt
    beyond DECODE_TOKENS), enqueued at `enqueued`."""
    queue = CommandQueue(f"i{tokens}-{enqueued}", objective=objective)
    queue.pending.append(Prompt(P.Kind.PASS, queue, HostFuture(), tokens=tokens, enqueued=enqueued))
    return queue


def form(former: BatchFormer, queues: list[CommandQueue], now: float, latency_open: bool = False) -> list[int]:
    """The new tokens of each command the batch formed at `now` takes, in order."""
    keys = {id(q): i for i, q in enumerate(queues)}
    return [c.tokens for c in former.form(queues, P.Kind.PASS, False, latency_open, keys, now)]


def holding(**control) -> BatchFormer:
    config = ControlConfig(prompt_hold="on", prompt_hold_ms=HOLD_MS, **control)
    return BatchFormer(config, max_batch_tokens=4096, hold=True)


def decoders(n: int = HOLD_DECODERS) -> list[CommandQueue]:
    return [queue_with(1, 0.0) for _ in range(n)]


def test_prompts_wait_beside_many_decoders_until_enough_of_them_wait():
    """Fewer than HOLD_COUNT young prompts: the batch carries the decoders only; once
    HOLD_COUNT wait they go whole together (128 tokens each: 2 x max_step_tokens), where
    without the hold one would go whole and the next in a 16-token chunk."""
    now = 10.0
    def young(n: int) -> list[CommandQueue]:
        return [queue_with(128, now - 0.1) for _ in range(n)]

    assert form(holding(), decoders() + young(HOLD_COUNT - 1), now) == [1] * HOLD_DECODERS
    assert form(holding(), decoders() + young(HOLD_COUNT), now) == [1] * HOLD_DECODERS + [128] * HOLD_COUNT
    plain = BatchFormer(ControlConfig(prompt_hold="off"), max_batch_tokens=4096)
    assert form(plain, decoders() + young(2), now) == [1] * HOLD_DECODERS + [128, 16]


def test_the_oldest_prompts_wait_ends_the_hold():
    """One prompt that has waited prompt_hold_ms goes, and every prompt waiting beside it."""
    now = 10.0
    old, young = queue_with(100, now - HOLD_MS / 1000), queue_with(100, now - 0.01)
    assert form(holding(), decoders() + [young], now) == [1] * HOLD_DECODERS
    assert form(holding(), decoders() + [young, old], now) == [1] * HOLD_DECODERS + [100, 100]


def test_no_hold_beside_few_decoders_a_latency_queue_or_a_backlog():
    """Beside fewer than HOLD_DECODERS decoders (a held prompt's wait would cost more than
    grouping saves; prompts go as without the hold, one whole and the next in a chunk),
    with a latency queue open, or when prompts outnumber the decoders (the backlog rule
    sends them whole already), a prompt goes at once."""
    now = 10.0
    prompt = queue_with(64, now)
    assert form(holding(), decoders(HOLD_DECODERS - 1) + [prompt], now) == [1] * (HOLD_DECODERS - 1) + [64]
    pair = [queue_with(128, now) for _ in range(2)]
    assert form(holding(), decoders(HOLD_DECODERS - 1) + pair, now) == [1] * (HOLD_DECODERS - 1) + [128, 16]
    prompt = queue_with(64, now)
    assert form(holding(), decoders() + [prompt], now, latency_open=True)[-1] == 64
    chat = queue_with(64, now, Objective.LATENCY)
    assert 64 in form(holding(), decoders() + [chat], now, latency_open=True)
    wave = [queue_with(64, now) for _ in range(4)]
    assert form(holding(), decoders(2) + wave, now) == [1, 1] + [64] * 4


def test_a_released_group_keeps_prefill_batch_tokens_and_long_prompts_still_chunk():
    """Released, whole prompts stop at control.prefill_batch_tokens (512 by default: the
    fifth 128-token prompt waits for the next step); a prompt longer than 2 x
    max_step_tokens goes in chunks of max_step_tokens as without the hold, so a 2,000-token
    prompt cannot stall the decoders for its whole prefill."""
    now = 10.0
    group = [queue_with(128, now) for _ in range(5)]
    assert form(holding(), decoders() + group, now) == [1] * HOLD_DECODERS + [128] * 4 + [16]
    long = [queue_with(2000, now - 1.0), queue_with(128, now), queue_with(128, now)]
    assert form(holding(), decoders() + long, now) == [1] * HOLD_DECODERS + [64, 128, 128]
    assert long[0].pending[0].tokens == 2000 - 64


def test_the_switch_follows_the_backends_device():
    """auto: on where the backend's handshake says it runs on the CPU (where the hold was
    measured), off on CUDA; on and off force it; prompt_hold_ms must be positive."""
    assert ControlConfig().holds_prompts("cpu")
    assert not ControlConfig().holds_prompts("cuda")
    assert ControlConfig(prompt_hold="on").holds_prompts("cuda")
    assert not ControlConfig(prompt_hold="off").holds_prompts("cpu")
    with pytest.raises(ConfigError, match="prompt_hold must be one of"):
        ControlConfig(prompt_hold="maybe")
    with pytest.raises(ConfigError, match="prompt_hold_ms must be positive"):
        ControlConfig(prompt_hold_ms=0)
    assert BatchFormer(ControlConfig(), 64, hold=False).hold_s == 0
    assert BatchFormer(ControlConfig(), 64, hold=True).hold_s == pytest.approx(0.4)
