"""Model-config details the default model does not exercise: llama3 and linear RoPE scaling."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig as HFConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pie.backend.llama import LlamaConfig, rope_inv_freq

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def config_json(tmp_path, rope: dict | None):
    raw = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
           "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 131072,
           "eos_token_id": [128001, 128009], "bos_token_id": 128000}
    if rope:
        raw["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return raw


@pytest.mark.parametrize("rope", [LLAMA3_SCALING, {"rope_type": "linear", "factor": 4.0}])
def test_scaled_rope_matches_transformers(tmp_path, rope):
    raw = config_json(tmp_path, rope)
    ours = rope_inv_freq(LlamaConfig.from_json(tmp_path / "config.json"))
    hf_config = HFConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    theirs, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, torch.device("cpu"))
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)


def test_config_reads_lists_of_eos_and_rejects_other_architectures(tmp_path):
    config_json(tmp_path, LLAMA3_SCALING)
    config = LlamaConfig.from_json(tmp_path / "config.json")
    assert config.eos_token_ids == (128001, 128009) and config.head_dim == 64
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    with pytest.raises(ValueError, match="is not 'llama'"):
        LlamaConfig.from_json(tmp_path / "config.json")
