"""What rides one batch: the waiting commands of one call kind that go out together.

The scheduler (pie/control/scheduler.py) decides when to dispatch and which kind, and the
policy (pie/control/policies.py) ranks the queues; `BatchFormer` takes their commands, in
that order, up to the budgets below. It reads and pops queues and does nothing else: no
I/O, no clock, no lock of its own (the scheduler calls it under its lock).

Chunked prefill: while decoding passes (at most DECODE_TOKENS new tokens) wait and are at
least as many as the prefills beside them, a batch carries every decoder and
`control.max_step_tokens` new tokens of prompts, oldest first; a longer pass sends its
leading tokens as a chunk (`Pass.split`) and keeps the rest at the head of its queue, so a
long prompt no longer stalls every decoder for its whole prefill. A prompt that would
leave no more than `max_step_tokens` goes whole (so up to 2x a chunk in one batch):
prompts that arrive together then start one batch apart, finish apart and come back
apart. Sending such a group together (one budget per waiting prompt, up to
`prefill_batch_tokens`) kept it together for good in a closed loop of streamed clients,
each of its members paying for all: at 8 clients those in 4-prompt batches waited 266 ms
for their first token, those alone 125 ms (one traced run, AMD EPYC Zen 5); one prompt a
batch took the mean from 193 to 169 ms at 8 and 1059 to 874 ms at 32, tokens/s unchanged
(8 and 6 alternating rounds in one server, docs/architecture.md). A short prompt (up to
`max_step_tokens` + MIN_CHUNK_TOKENS) goes whole while the batch's prompts stay within
`prefill_batch_tokens`: a wave of 32 chat prompts then went in 34 batches, not 37.

When prefills outnumber decoders (a wave's first arrivals already decoding), they go
whole, oldest first, up to `prefill_batch_tokens` of prompt tokens a batch (at least one
prompt), every decoder beside them: holding them back to a few tokens a step delayed more
requests than it spared (chunks of 64 spread 32 prompts over ~18 batches, +25% against the
direct driver at batch 32, benchmarks/overhead.py), and one batch of a whole wave made
every prompt wait for all (docs/architecture.md).

Latency queues are never held behind a long prefill of another class: while one is open,
the others' prompts go in chunks of `control.latency_batch_tokens`, and while one waits,
the others' share of its batch is capped at `control.latency_step_tokens`.

The prompt hold (`control.prompt_hold`, `prompt_hold_ms`): beside HOLD_DECODERS decoders
or more, prompts wait until HOLD_COUNT of them do or the oldest has waited prompt_hold_ms,
then go together: every prompt a step would take whole alone (up to 2 x max_step_tokens)
goes whole, up to prefill_batch_tokens; longer ones still go in chunks. Each prompt of
the ramp's tail would otherwise pay a step of its own beside 16-31 decoders, and where
prefills run in fp32 (AVX-512 without BF16) a step's prompt rows also cost less the more
ride it (beside 32 decoders one 128-token prompt added 1.91 ms a token, two 1.58, four
1.42, Ice Lake Xeon). At 32 streamed clients the hold lowered the p99 time to first token
in every alternating pair on an Ice Lake Xeon (fp32 prefills, 5 of 5) and on a Zen 5 EPYC
(bf16 prefills, 4 of 4: 804 against 1,007 ms, the mean 399 against 437; both with
HOLD_COUNT 3), see docs/architecture.md, "The prompt hold".
"""

from __future__ import annotations

from dataclasses import dataclass

from pie import protocol as P
from pie.config import ControlConfig
from pie.control.command import Command, CommandQueue, conflicts
from pie.control.policies import Objective

DECODE_TOKENS = 16  # a pass of at most this many new tokens decodes (one token, or a draft)
MIN_CHUNK_TOKENS = 16  # no prefill chunk smaller than this (each costs a batch's fixed work)
# The prompt hold ends when this many prompts wait. 2 against 3 on a Zen 5 (32 streamed clients,
# 8 rotated rounds of one-off A/Bs, docs/architecture.md): mean time to first token and p99
# each lower in 6 of 8 rounds (370 against 418 ms and 776 against 859, one run's medians).
HOLD_COUNT = 2
HOLD_DECODERS = 16  # no hold beside fewer decoders: a held prompt's wait would cost more than it saves


@dataclass(frozen=True, slots=True)
class Budgets:
    """One batch's budgets, fixed before it is formed (0: no such limit)."""

    step: int  # prompt tokens beside decoders (chunking), or per latency-class chunk
    chunking: bool  # long prompts go in chunks of `step`
    grouped: bool  # the prompt hold is on: prompts a step takes whole go whole together
    latency_cap: int  # tokens of other classes beside a waiting latency call
    prompt_cap: int  # whole prompts' tokens in a backlog batch


@dataclass(slots=True)
class Filled:
    """What the batch being formed holds so far, in tokens."""

    used: int = 0  # every command's
    chunked: bool = False  # a prompt's chunk is in it
    latency: int = 0  # latency queues' commands'
    prompted: int = 0  # whole prompts' (passes of more than DECODE_TOKENS)
    decoded: int = 0  # decoding passes'


class BatchFormer:
    def __init__(self, config: ControlConfig, max_batch_tokens: int, hold: bool = False):
        self.config = config
        self.max_batch_tokens = max_batch_tokens
        self.hold_s = config.prompt_hold_ms / 1000 if hold else 0.0  # 0: no prompt hold

    def form(self, queues: list[CommandQueue], kind: str, single: bool, latency_open: bool,
             keys: dict[int, float], now: float) -> list[Command]:
        """The commands of `kind` to send together from `queues` (each idle, its head of
        `kind`), popped from them; just the first one if `single`. `latency_open`: some
        latency queue is open; `keys`: the policy's rank of each queue (by id); `now`: the
        scheduler's clock (time.monotonic), which the prompt hold reads."""
        limits = self._budgets(queues, kind, single, latency_open)
        if limits.grouped:
            queues = self._unheld(queues, now)
        queues = sorted(queues, key=lambda q: (q.objective, -q.priority,
                                               limits.chunking and q.pending[0].tokens > DECODE_TOKENS
                                               and q.objective is not Objective.LATENCY, keys[id(q)]))
        batch: list[Command] = []
        filled = Filled()
        for queue in queues:
            taken = self._take(queue, kind, single, limits, filled, batch)
            for _ in taken:
                queue.pending.popleft()
            if queue.job_left:
                queue.job_left = max(1, queue.job_left - sum(c.tokens for c in taken))
            batch += taken
            if filled.used >= self.max_batch_tokens or (single and batch):
                break
        return batch

    def _budgets(self, queues: list[CommandQueue], kind: str, single: bool, latency_open: bool) -> Budgets:
        decoders = sum(q.pending[0].tokens <= DECODE_TOKENS for q in queues)
        decoding = 0 < decoders >= len(queues) - decoders
        passes = kind == P.Kind.PASS and not single
        chunking = passes and (decoding or latency_open)
        return Budgets(
            step=self.config.max_step_tokens if decoding else self.config.latency_batch_tokens,
            chunking=chunking,
            grouped=chunking and decoding and decoders >= HOLD_DECODERS and not latency_open and bool(self.hold_s),
            latency_cap=self.config.latency_step_tokens if passes and any(
                q.objective is Objective.LATENCY for q in queues) else 0,
            prompt_cap=self.config.prefill_batch_tokens if passes and not chunking else 0)

    def _take(self, queue: CommandQueue, kind: str, single: bool, limits: Budgets, filled: Filled,
              batch: list[Command]) -> list[Command]:
        """The commands `queue` gives the batch whole (vertical batching: its next ones of
        `kind` that conflict with none before them); a prompt's chunk goes into `batch` at
        once, its rest staying at the head of the queue."""
        taken: list[Command] = []
        other = queue.objective is not Objective.LATENCY
        for command in queue.pending:
            if command.kind != kind or conflicts(command, taken):
                break
            prompt = command.tokens if command.tokens > DECODE_TOKENS else 0
            if limits.prompt_cap and prompt and filled.prompted and filled.prompted + prompt > limits.prompt_cap:
                break
            if limits.latency_cap and other:
                room = limits.latency_cap - (filled.used - filled.latency)
                if command.tokens > room:  # a prompt's chunk that fits, or nothing
                    cut = min(room, command.chunkable()) if not taken else 0  # type: ignore[attr-defined]
                    if cut >= MIN_CHUNK_TOKENS:
                        batch.append(command.split(cut))  # type: ignore[attr-defined]
                        filled.used, filled.chunked = filled.used + cut, True
                    break
            if limits.chunking and other:  # every step moves a prefill on by at least MIN_CHUNK_TOKENS
                left = limits.step - (filled.used - filled.decoded)  # the budget is the prompts' tokens
                room = left if filled.chunked else max(left, MIN_CHUNK_TOKENS)
                if command.tokens > room and not self._whole(command.tokens, left, filled.prompted, limits.grouped):
                    cut = command.chunkable()  # type: ignore[attr-defined]
                    if cut >= MIN_CHUNK_TOKENS:  # the rest stays at the head of its queue
                        if not taken and room >= MIN_CHUNK_TOKENS:
                            batch.append(command.split(min(room, cut)))  # type: ignore[attr-defined]
                            filled.used, filled.chunked = filled.used + min(room, cut), True
                        break
            if filled.used + command.tokens > self.max_batch_tokens and (batch or taken):
                break
            taken.append(command)
            filled.used += command.tokens
            filled.prompted += prompt
            filled.decoded += command.tokens if not prompt else 0
            if not other:
                filled.latency += command.tokens
            if single:
                break
        return taken

    def _unheld(self, queues: list[CommandQueue], now: float) -> list[CommandQueue]:
        """`queues` less the prompts the hold keeps back (a batch of `Budgets.grouped`:
        HOLD_DECODERS decoders or more, no latency queue open): all of them while fewer
        than HOLD_COUNT wait and none has waited `prompt_hold_ms`. The rest of a chunked
        prompt is released, its wait counted from its first chunk's."""
        waits = [q.pending[0].enqueued for q in queues if q.pending[0].tokens > DECODE_TOKENS]
        if not waits or len(waits) >= HOLD_COUNT or min(waits) <= now - self.hold_s:
            return queues
        return [q for q in queues if q.pending[0].tokens <= DECODE_TOKENS]

    def _whole(self, tokens: int, left: int, prompted: int, grouped: bool) -> bool:
        """Whether a prompt of `tokens` goes whole beside decoders with `left` of the step's
        prompt budget unused and `prompted` tokens of whole prompts in the batch (`grouped`:
        the prompt hold is on, and a prompt that goes whole alone, up to 2 x max_step_tokens,
        goes whole beside others too, within prefill_batch_tokens).

        No tail shorter than a chunk: a prompt that would leave at most max_step_tokens
        after this chunk goes whole (a 128-token prompt beside 7 decoders went as 57 + 57 +
        14 tokens, three steps for one prompt). Judged on the budget left, not the chunk
        floor; but a short prompt (one that fits a step's budget and a chunk) goes whole
        while the batch's prompts stay within prefill_batch_tokens, the bound a backlog
        batch keeps. On the budget alone the wave of benchmarks/overhead.py (32 chat prompts
        of ~35 tokens) went out in 37 batches instead of 34, its later prompts two a step:
        1.338 against 1.236 s a wave, 12 of 12 pairs (Zen 5, one-off); on the floor every
        prompt of up to max_step_tokens + MIN_CHUNK_TOKENS went whole in one batch."""
        step = self.config.max_step_tokens
        if left >= MIN_CHUNK_TOKENS and tokens <= left + step:
            return True
        short = step + (step if grouped else MIN_CHUNK_TOKENS)
        return tokens <= short and prompted + tokens <= self.config.prefill_batch_tokens
