"""Checkpoint layouts beyond the default model's single model.safetensors: sharded safetensors
(with and without model.safetensors.index.json) and Llama attention/MLP biases, on tiny
random LlamaForCausalLM models that HF transformers writes here. In fp32 Pie's logits and
greedy tokens must equal HF's; a layout Pie does not load gets an error naming the file and
what is missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pie import protocol as P
from pie.backend.engine import Engine
from pie.backend.llama import Llama
from pie.backend.weights import ModelFormatError, check_model_dir, resolve_model_dir
from pie.config import BackendConfig

from conftest import hf_greedy

VOCAB = 256
PS = 16
PROMPT = [5, 17, 200, 3, 99, 42, 250, 7, 128, 64, 1, 33, 180, 9, 77, 141, 12, 230, 61]
SHARDS = [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]


def tiny_llama(directory: Path, layout: str, attention_bias: bool = True,
               mlp_bias: bool = True, seed: int = 0):
    """Write a random LlamaForCausalLM (and a word-level tokenizer) to `directory` as
    layout "index" (HF's shards + index), "no-index" (the shards alone) or "single"."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                         attention_bias=attention_bias, mlp_bias=mlp_bias)
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # HF initialises biases to 0 and norms to 1, which would make either invisible.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            else:
                fan_in = param.shape[-1] if "embed_tokens" not in name else 1
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in ** 0.5)
    if layout == "single":
        model.save_pretrained(directory)
        assert (directory / "model.safetensors").is_file()
    else:
        model.save_pretrained(directory, max_shard_size="100KB")
        assert sorted(p.name for p in directory.glob("*.safetensors")) == SHARDS
        if layout == "no-index":
            (directory / "model.safetensors.index.json").unlink()
    vocab = {f"w{i}": i for i in range(VOCAB)}
    Tokenizer(WordLevel(vocab, unk_token="w0")).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text("{}")
    return model


def prefill(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Run `ids` into pages 0.. and return the fp32 logits at every position."""
    n = len(ids)
    pages = list(range(-(-n // PS)))
    assert engine.embed_text(P.EmbedText(ids, list(range(n)), list(range(n)))).errors == {}
    out = list(range(100, 100 + n))
    reply = engine.forward(P.Forward([], [0, 0], [0], list(range(n)), [0, n], pages,
                                     [0, len(pages)], [0], out, list(range(n)), [0, n], [None]))
    assert reply.errors == {}
    return engine.model.logits(engine.embeds.vectors[100:100 + n])


def greedy(engine: Engine, ids: list[int], steps: int) -> list[int]:
    """Pie's greedy continuation: prefill, then one forward per token into the pages."""
    logits = prefill(engine, ids)
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        pos = len(ids) + len(tokens) - 1  # the position of the token being fed
        context_pages = list(range(-(-pos // PS)))
        last_len = pos - PS * (len(context_pages) - 1)
        assert engine.embed_text(P.EmbedText([tokens[-1]], [pos], [0])).errors == {}
        reply = engine.forward(P.Forward(
            context_pages, [0, len(context_pages)], [last_len], [0], [0, 1], [pos // PS], [0, 1],
            [pos % PS], [1], [0], [0, 1], [None]))
        assert reply.errors == {}
        tokens.append(int(engine.model.logits(engine.embeds.vectors[1:2])[0].argmax()))
    return tokens


def fp32_engine(directory: Path) -> Engine:
    model_dir = resolve_model_dir(str(directory), directory / "no-cache")
    return Engine(model_dir, BackendConfig(dtype="float32", attention="torch", num_kv_pages=8,
                                           num_embeds=256, page_size=PS))


@pytest.mark.parametrize(("layout", "attention_bias", "mlp_bias"), [
    ("index", True, True), ("no-index", True, True), ("single", True, True),
    ("index", True, False), ("single", False, True), ("index", False, False),
])
def test_matches_hf_in_fp32(tmp_path, layout, attention_bias, mlp_bias):
    hf = tiny_llama(tmp_path, layout, attention_bias, mlp_bias)
    engine = fp32_engine(tmp_path)
    assert (engine.model.config.attention_bias, engine.model.config.mlp_bias) == (
        attention_bias, mlp_bias)
    ours = prefill(engine, PROMPT)
    with torch.inference_mode():
        theirs = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    # Greedy over 24 tokens (crossing page boundaries) equals HF's with its own KV cache.
    assert greedy(fp32_engine(tmp_path), PROMPT, 24) == hf_greedy(hf, PROMPT, 24)


def test_biases_matter(tmp_path):
    """The same checkpoint with its biases zeroed gives other logits: the test above would
    catch a loader that dropped them."""
    tiny_llama(tmp_path, "index")
    with_bias = prefill(fp32_engine(tmp_path), PROMPT)
    engine = fp32_engine(tmp_path)
    for layer in engine.model.layers:
        for bias in (layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias):
            bias.zero_()
    assert (prefill(engine, PROMPT) - with_bias).abs().max() > 0.1


def test_bf16_with_biases_stays_close_to_hf(tmp_path):
    hf = tiny_llama(tmp_path, "index")
    engine = Engine(tmp_path, BackendConfig(dtype="bfloat16", attention="torch", num_kv_pages=8,
                                            num_embeds=256, page_size=PS))
    ours = prefill(engine, PROMPT)
    with torch.inference_mode():
        theirs = hf(torch.tensor([PROMPT])).logits[0]
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() < 0.05 * scale


# --- layouts Pie refuses, each with the file and what is missing ---------------------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("sharded")
    tiny_llama(directory, "index")
    return directory


def copy_of(sharded: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(sharded, target)
    return target


def load(directory: Path) -> Llama:
    check_model_dir(directory)
    return Llama(directory, torch.float32, torch.device("cpu"))


def test_index_naming_a_missing_shard(sharded, tmp_path):
    d = copy_of(sharded, tmp_path)
    (d / SHARDS[2]).unlink()
    with pytest.raises(ModelFormatError, match=rf"model\.safetensors\.index\.json names shards "
                                               rf"that are not in .*: {SHARDS[2]}"):
        check_model_dir(d)


def test_shards_without_index_with_one_missing(sharded, tmp_path):
    d = copy_of(sharded, tmp_path)
    (d / "model.safetensors.index.json").unlink()
    (d / SHARDS[1]).unlink()
    with pytest.raises(ModelFormatError, match=rf"no model\.safetensors\.index\.json\) "
                                               rf"lacks {SHARDS[1]}"):
        check_model_dir(d)


def test_index_mapping_a_tensor_to_the_wrong_shard(sharded, tmp_path):
    d = copy_of(sharded, tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    real = index["weight_map"]["model.norm.weight"]
    wrong = next(s for s in SHARDS if s != real)
    index["weight_map"]["model.norm.weight"] = wrong
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match=rf"maps tensor model\.norm\.weight to {wrong}, "
                                               rf"which lacks it \(it is in {real}\)"):
        load(d)


def test_index_without_weight_map(sharded, tmp_path):
    d = copy_of(sharded, tmp_path)
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ModelFormatError, match=r"index\.json lacks a \"weight_map\""):
        check_model_dir(d)


def test_missing_tensor_names_file_and_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_llama(tmp_path, "single")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"model\.safetensors lacks tensor "
                                               r"model\.layers\.1\.mlp\.down_proj\.weight$"):
        load(tmp_path)


def test_config_asks_for_biases_the_checkpoint_lacks(tmp_path):
    tiny_llama(tmp_path, "index", attention_bias=False, mlp_bias=False)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(ModelFormatError, match=r"index\.json lacks tensor model\.layers\.0\."
                                               r"self_attn\.q_proj\.bias \(config\.json sets "
                                               r"attention_bias: true\)"):
        load(tmp_path)


def test_checkpoint_has_biases_the_config_does_not_use(sharded, tmp_path):
    d = copy_of(sharded, tmp_path)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "mlp_bias": False}))
    with pytest.raises(ModelFormatError, match=r"holds 6 tensors a Llama with this config\.json "
                                               r"does not use \(config\.json sets mlp_bias "
                                               r"false\): model\.layers\.0\.mlp\.down_proj\.bias"):
        load(d)


def test_directory_with_only_a_pytorch_bin(tmp_path):
    tiny_llama(tmp_path, "single")
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelFormatError, match=r"lacks weights: no model\.safetensors, no "
                                               r"model\.safetensors\.index\.json .*it holds "
                                               r"pytorch_model\.bin \(Pie reads only safetensors"):
        check_model_dir(tmp_path)


def test_unreadable_shard(sharded, tmp_path):
    d = copy_of(sharded, tmp_path)
    (d / SHARDS[3]).write_bytes(b"not a safetensors file")
    with pytest.raises(ModelFormatError, match=rf"{SHARDS[3]} is not a readable safetensors"):
        load(d)
