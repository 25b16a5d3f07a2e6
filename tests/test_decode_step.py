"""The one-call bf16 decode step (csrc/decode_step.cpp) is bit-identical to the Python layer
loop it replaces, on the real model through the engine's fused passes."""

from __future__ import annotations

import pytest
import torch

from pie.backend.engine import Engine
from pie.config import BackendConfig

from conftest import run_sampling_passes, sampling_pass


def recorded(engine: Engine, greedy: bool) -> tuple[list[torch.Tensor], list[int]]:
    """The engine's model made to keep every forward's output (the list returned) and to count
    the fused step's calls (`run`, and with `greedy` its greedy tail too) in the one-item list."""
    hidden: list[torch.Tensor] = []
    model, calls = engine.model, [0]
    forward = model.forward

    def recording_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        hidden.append(out.clone())
        return out

    def counting(fn):
        def call(*args, **kwargs):
            calls[0] += 1
            return fn(*args, **kwargs)
        return call

    model.forward = recording_forward  # type: ignore[method-assign]
    if model.fused_decode is not None:
        model.fused_decode.run = counting(model.fused_decode.run)  # type: ignore[method-assign]
        if greedy:
            model.fused_decode.greedy = counting(model.fused_decode.greedy)  # type: ignore[method-assign]
    return hidden, calls


def run_steps(engine: Engine) -> tuple[list[torch.Tensor], list[int], int]:
    """Three prompts prefilled together, then decode steps of 1 token per sequence and one
    step where a sequence takes 3 tokens at once (causal within the step); every forward's
    final hidden states, the greedy tokens, and how many forwards the C++ loop ran."""
    hidden, fused_calls = recorded(engine, greedy=False)

    ps = engine.page_size
    prompts = [list(range(100, 140)), list(range(500, 517)), list(range(900, 933))]
    pages = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]

    tokens = run_sampling_passes(engine, [sampling_pass(p, 0, pg, ps) for p, pg in zip(prompts, pages)])
    lengths = [len(p) for p in prompts]
    generated = list(tokens)
    for step in range(5):
        feeds = [[t] for t in tokens]
        if step == 2:
            feeds[1] = [tokens[1], 42, 43]  # 5 tokens in this step: still a decode step
        tokens = run_sampling_passes(engine, [sampling_pass(f, n, pg, ps) for f, n, pg in zip(feeds, lengths, pages)])
        lengths = [n + len(f) for n, f in zip(lengths, feeds)]
        generated += tokens
    return hidden, generated, fused_calls[0]


def no_greedy_tail(engine: Engine) -> Engine:
    """Greedy draws through the logits and the sampler, as every other draw goes."""
    engine.takes_greedy = lambda items, tokens: False  # type: ignore[method-assign]
    return engine


@pytest.fixture
def kernel_limits(monkeypatch):
    """Engines whose bf16 linears keep the kernel's own limits (no AMX hand-over to oneDNN,
    pie/backend/linear.py `onednn_from`): every step of this file up to 32 tokens takes the
    fused step, and the 90-token prefill the kernel's tiles. With the hand-over the prefill
    went to oneDNN's AMX kernels, and in ~1 of 10 runs of this file on a Xeon with AMX (2
    vCPUs, 2026-12-03) two engines' prefills differed in their last bits (not explained: the
    same oneDNN call repeated 2,400 times in one process gave the same bits), which then
    fails a bit-for-bit comparison of the decode steps after it."""
    monkeypatch.setattr("pie.backend.llama.onednn_from", lambda flags, **_: None)


def test_fused_decode_is_bit_identical_to_the_python_loop(model_dir, kernel_limits):
    config = BackendConfig(dtype="bfloat16", num_kv_pages=32, num_embeds=16)
    fused = no_greedy_tail(Engine(model_dir, config))
    if fused.model.fused_decode is None:
        pytest.skip("this CPU has neither AVX-512 BF16 nor AVX2 + FMA: the Python loop is the only decode path")
    eager = Engine(model_dir, config)
    eager.model.fused_decode = None
    fused_hidden, fused_tokens, calls = run_steps(fused)
    eager_hidden, eager_tokens, none = run_steps(eager)
    assert calls == 5 and none == 0  # the prefill (90 tokens) keeps the Python loop
    assert fused_tokens == eager_tokens
    assert len(fused_hidden) == len(eager_hidden) == 6
    for ours, theirs in zip(fused_hidden, eager_hidden):
        assert torch.equal(ours, theirs)


def test_greedy_tail_draws_what_the_logits_and_sampler_draw(model_dir):
    """The greedy tail (csrc/decode_step.cpp: final norm, LM head and argmax in the step's
    region) gives torch.argmax's token over the same bf16 logits: on the real LM head, on one
    whose rows repeat every 1000 (ties everywhere: the first index wins) and on one with NaN
    rows (NaN ranks above every number). Steps that ask more than a greedy token (here the
    prefill, which keeps the Python loop) take the logits as before."""
    from pie.backend.linear import Linear

    config = BackendConfig(dtype="bfloat16", num_kv_pages=32, num_embeds=16)
    tail = Engine(model_dir, config)
    if not tail.model.takes_greedy(1, 1, tail.attention, tail.kv):
        pytest.skip("this CPU has neither AVX-512 BF16 nor AVX2 + FMA: no fused decode step, no greedy tail")
    plain = no_greedy_tail(Engine(model_dir, config))
    weight = tail.model.embed_tokens.clone()
    tied = weight[torch.arange(weight.shape[0]) % 1000].contiguous()
    nan = weight.clone()
    nan[[30000, 7000, 41000]] = float("nan")
    drawn = []
    for lm_head in (None, tied, nan):
        if lm_head is not None:
            tail.model.lm_head, plain.model.lm_head = Linear(lm_head), Linear(lm_head)
        greedy, calls = tail.model.fused_decode.greedy, [0]

        def counting(*args, **kwargs):
            calls[0] += 1
            return greedy(*args, **kwargs)

        tail.model.fused_decode.greedy = counting  # type: ignore[method-assign]
        _, ours, _ = run_steps(tail)
        _, theirs, _ = run_steps(plain)
        tail.model.fused_decode.greedy = greedy  # type: ignore[method-assign]
        assert calls[0] == 5 and ours == theirs and plain.counters["pass.greedy_tail"] == 0
        drawn.append(ours)
    assert max(drawn[1]) < 1000 and set(drawn[2]) == {7000}  # the first of the ties; the first NaN
    assert tail.counters["pass.greedy_tail"] == 15  # the backend's stats count the steps it took


def test_fused_decode_is_only_for_bf16_kernels(model_dir):
    """fp32 (the correctness oracle's dtype), int8 weights and the torch attention backend
    keep the Python loop."""
    assert Engine(model_dir, BackendConfig(dtype="float32", num_kv_pages=8, num_embeds=8)).model.fused_decode is None
    int8 = Engine(model_dir, BackendConfig(dtype="bfloat16", weight_dtype="int8", num_kv_pages=8, num_embeds=8))
    assert int8.model.fused_decode is None
    torch_attention = Engine(model_dir, BackendConfig(dtype="bfloat16", attention="torch",
                                                      num_kv_pages=8, num_embeds=8))
    assert torch_attention.model.fused_decode is None or not torch_attention.model.fused_decode.applies(
        1, 1, torch_attention.attention, torch_attention.kv)


def shared_prefix_steps(engine: Engine) -> tuple[list[torch.Tensor], list[int]]:
    """Three users on one 48-token prefix (pages 0-2, prefilled once), each with a question of
    its own, then greedy decode steps of the three: every forward's output, every draw."""
    hidden: list[torch.Tensor] = []
    forward = engine.model.forward

    def recording_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        hidden.append(out.clone())
        return out

    engine.model.forward = recording_forward  # type: ignore[method-assign]
    ps = engine.page_size
    prefix = [(7 * i) % 3000 + 50 for i in range(3 * ps)]
    run_sampling_passes(engine, [sampling_pass(prefix, 0, [0, 1, 2], ps)])
    pages = [[0, 1, 2, 3 + 2 * u, 4 + 2 * u] for u in range(3)]
    tokens = run_sampling_passes(engine, [sampling_pass([900 + 11 * u + i for i in range(4 + u)], len(prefix), pg, ps)
                                          for u, pg in enumerate(pages)])
    lengths = [len(prefix) + 4 + u for u in range(3)]
    drawn = list(tokens)
    for _ in range(4):
        tokens = run_sampling_passes(engine, [sampling_pass([t], n, pg, ps) for t, n, pg in zip(tokens, lengths, pages)])
        lengths = [n + 1 for n in lengths]
        drawn += tokens
    return hidden, drawn


def test_a_step_whose_items_share_a_prefix_takes_the_fused_step_and_its_greedy_tail(model_dir, kernel_limits):
    """Decode items on one shared prefix (csrc/shared_prefix.h's groups) in a greedy step: the
    fused step takes them with its greedy tail (on AVX-512 BF16 the prefix is a phase of the
    layers' region, elsewhere the op loop and the tail by ops; this step used to be refused,
    "a step with shared prefixes has no greedy tail"), and draws what the Python loop draws
    over the same groups, its hidden states bit for bit."""
    config = BackendConfig(dtype="bfloat16", num_kv_pages=32, num_embeds=16, shared_prefix_keys=32)
    tail = Engine(model_dir, config)
    if not tail.model.takes_greedy(1, 1, tail.attention, tail.kv):
        pytest.skip("this CPU has neither AVX-512 BF16 nor AVX2 + FMA: no fused decode step, no greedy tail")
    fused = no_greedy_tail(Engine(model_dir, config))
    eager = no_greedy_tail(Engine(model_dir, config))
    eager.model.fused_decode = None
    for engine in (tail, fused, eager):
        engine.attention.SHARED_PREFIX_MEMBERS = 2
    _, tail_draws = shared_prefix_steps(tail)
    fused_hidden, fused_draws = shared_prefix_steps(fused)
    eager_hidden, eager_draws = shared_prefix_steps(eager)
    assert tail.counters["pass.greedy_tail"] == 5  # the questions and 4 decode steps; the 48-token prefix: logits
    assert tail.attention.grouped_items == fused.attention.grouped_items == eager.attention.grouped_items == 4 * 3
    assert tail_draws == fused_draws == eager_draws
    assert len(fused_hidden) == len(eager_hidden) == 6
    for ours, theirs in zip(fused_hidden, eager_hidden):
        assert torch.equal(ours, theirs)


def test_a_step_of_questions_after_a_context_keeps_the_loops_row_counts(model_dir, kernel_limits):
    """Items of 4-6 new tokens after a 48-token context in one step (15 rows, 3 of them output
    rows), no shared-prefix groups: the fused step's last layer runs its o projection and MLP
    on the 3 output rows, as the Python loop does, and gives the loop's hidden states bit for
    bit. Before, it ran them on all 15 rows: the bf16 linear's GEMM tiles (from 8 rows on
    AVX-512 without BF16, 6 with it) against the loop's 3-row path sum in another order, and
    one value of 576 x 3 differed in its last bit (Ice Lake Xeon, CI of 2026-12-06)."""
    config = BackendConfig(dtype="bfloat16", num_kv_pages=32, num_embeds=16, shared_prefix_keys=0)
    fused = no_greedy_tail(Engine(model_dir, config))
    if fused.model.fused_decode is None:
        pytest.skip("this CPU has neither AVX-512 BF16 nor AVX2 + FMA: the Python loop is the only decode path")
    tail = Engine(model_dir, config)
    eager = no_greedy_tail(Engine(model_dir, config))
    eager.model.fused_decode = None
    fused_hidden, fused_draws = shared_prefix_steps(fused)
    eager_hidden, eager_draws = shared_prefix_steps(eager)
    _, tail_draws = shared_prefix_steps(tail)
    assert fused.attention.grouped_items == 0 and tail.counters["pass.greedy_tail"] == 5
    assert fused_draws == eager_draws == tail_draws
    for ours, theirs in zip(fused_hidden, eager_hidden):
        assert torch.equal(ours, theirs)


def test_the_fused_step_refuses_rows_outside_the_step(model_dir):
    """decode_layers' kept rows and tail rows are checked before its parallel region (which may
    not throw): a row past the step is a clear error, not a read out of bounds."""
    engine = Engine(model_dir, BackendConfig(dtype="bfloat16", num_kv_pages=8, num_embeds=8))
    fused = engine.model.fused_decode
    if fused is None:
        pytest.skip("this CPU has neither AVX-512 BF16 nor AVX2 + FMA: no fused decode step")
    from pie.backend.attention import AttentionPlan

    model = engine.model
    x = model.embed_tokens[torch.tensor([5, 6, 7])].contiguous()
    cos, sin = model.rope_tables(torch.arange(3))
    plan = AttentionPlan([0, 3], [0, 3], torch.arange(3), torch.ones(3, dtype=torch.bool), [None])
    args = (x, cos, sin, torch.arange(3), plan, engine.attention, engine.kv)
    with pytest.raises(RuntimeError, match="kept row 3 is not a row of the step"):
        fused.run(*args, torch.tensor([3]))
    lm_head = model.lm_head
    with pytest.raises(RuntimeError, match="row 2 is not a row of the step's output"):  # 2 rows kept
        fused._call(*args, torch.tensor([0, 2]), torch.tensor([2]), model.norm, lm_head.gemv_weight, lm_head.gemv_wide)


def test_with_amx_steps_of_eight_rows_leave_the_fused_step(model_dir, monkeypatch):
    """Where oneDNN takes steps from 8 rows (AMX without the kernel's own AMX tiles,
    pie/backend/linear.py), the fused step and its greedy tail stop at 7 rows: a step of 8
    runs the op loop on oneDNN's kernels."""
    monkeypatch.setattr("pie.backend.llama.onednn_from", lambda flags, **_: 8)
    engine = Engine(model_dir, BackendConfig(dtype="bfloat16", num_kv_pages=8, num_embeds=8))
    fused = engine.model.fused_decode
    if fused is None or engine.model.layers[0].qkv.packed is None:
        pytest.skip("no fused decode step, or no oneDNN bf16 kernels to hand steps to (AVX2)")
    assert fused.max_tokens == 7
    assert fused.applies(7, 1, engine.attention, engine.kv) and not fused.applies(8, 1, engine.attention, engine.kv)
    assert engine.model.takes_greedy(7, 1, engine.attention, engine.kv)
    assert not engine.model.takes_greedy(8, 1, engine.attention, engine.kv)


def test_decode_steps_of_up_to_the_linears_rows_keep_the_fused_step(model_dir):
    """As configured on this machine: without AMX a decode step runs the fused step and its
    greedy tail up to the bf16 linear's rows (its GEMM tiles' 255, or 63 below an fp32 copy
    for prefills), with the kernel's own AMX tiles up to 32 (oneDNN's from there); an item of more than 32 new tokens (a prompt: the
    prompt loop's or SDPA's, not the paged kernel's) keeps the op loop at any step size."""
    engine = Engine(model_dir, BackendConfig(dtype="bfloat16", num_kv_pages=8, num_embeds=8))
    fused = engine.model.fused_decode
    if fused is None:
        pytest.skip("this CPU has neither AVX-512 BF16 nor AVX2 + FMA: no fused decode step")
    from pie.backend.dtype import cpu_flags
    from pie.backend.linear import AMX_FLAGS, kernel_amx

    if AMX_FLAGS <= cpu_flags() and not kernel_amx() and engine.model.layers[0].qkv.packed is not None:
        pytest.skip("AMX, but the OS refused this process the tile state: oneDNN takes steps from 8 rows")
    # The linear's limit: the tiles' 255, 32 on the kernel's AMX tiles, 63 where an fp32 copy
    # takes prefills from 64 rows (backend.prefill_dtype = auto on AVX-512 without BF16).
    rows = engine.model.layers[0].qkv.gemv_limit
    assert fused.max_tokens == rows and (rows == 32 if engine.model.layers[0].qkv.gemv.amx_from() > 0 else rows > 32)
    for tokens in (32, rows):
        assert fused.applies(tokens, 1, engine.attention, engine.kv)
        assert engine.model.takes_greedy(tokens, 1, engine.attention, engine.kv)
    assert not fused.applies(rows + 1, 1, engine.attention, engine.kv)
    assert fused.applies(32, 32, engine.attention, engine.kv)
    assert not fused.applies(40, 33, engine.attention, engine.kv)  # a 33-token prompt beside 7 decoders
    assert not engine.model.takes_greedy(40, 33, engine.attention, engine.kv)


def wide_steps(engine: Engine, sequences: int) -> tuple[list[torch.Tensor], list[int], int]:
    """`sequences` prompts of 5-12 tokens prefilled together, then two greedy decode steps of
    all of them, then one where a 40-token prompt joins them: every forward's final hidden
    states, the draws, and how many forwards the C++ loop ran (its `run` and greedy tail)."""
    hidden, calls = recorded(engine, greedy=True)
    ps = engine.page_size
    prompts = [[100 + 37 * i + j for j in range(5 + i % 8)] for i in range(sequences)]
    pages = [[i] for i in range(sequences)]  # one page each: 16 tokens
    tokens = run_sampling_passes(engine, [sampling_pass(p, 0, pg, ps) for p, pg in zip(prompts, pages)])
    lengths = [len(p) for p in prompts]
    drawn = list(tokens)
    for step in range(3):
        items = [sampling_pass([t], n, pg, ps) for t, n, pg in zip(tokens, lengths, pages)]
        if step == 2:
            items.append(sampling_pass(list(range(2000, 2040)), 0, [sequences, sequences + 1, sequences + 2], ps))
        tokens = run_sampling_passes(engine, items)
        lengths = [n + 1 for n in lengths]
        drawn += tokens
        tokens = tokens[:sequences]
    return hidden, drawn, calls[0]


def test_a_40_sequence_decode_step_takes_the_fused_step_bit_for_bit(model_dir, kernel_limits):
    """40 decoders in one step (past the 32 rows the fused step once stopped at): the fused
    step and its greedy tail give the Python loop's hidden states bit for bit and its draws;
    with a 40-token prompt beside them the step keeps the op loop."""
    config = BackendConfig(dtype="bfloat16", num_kv_pages=48, num_embeds=64)
    fused = no_greedy_tail(Engine(model_dir, config))
    if fused.model.fused_decode is None or fused.model.fused_decode.max_tokens < 41:
        pytest.skip("no fused decode step of 41 rows here (no AVX-512 BF16 or AVX2 + FMA, or AMX's limit of 32)")
    tail = Engine(model_dir, config)
    eager = no_greedy_tail(Engine(model_dir, config))
    eager.model.fused_decode = None
    fused_hidden, fused_draws, fused_calls = wide_steps(fused, 40)
    eager_hidden, eager_draws, none = wide_steps(eager, 40)
    _, tail_draws, tail_calls = wide_steps(tail, 40)
    assert (fused_calls, none, tail_calls) == (2, 0, 2)  # the prefill and the step with a prompt: the op loop
    assert tail.counters["pass.greedy_tail"] == 2
    assert fused_draws == eager_draws == tail_draws
    assert len(fused_hidden) == len(eager_hidden) == 4
    for ours, theirs in zip(fused_hidden, eager_hidden):
        assert torch.equal(ours, theirs)
