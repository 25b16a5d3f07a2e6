"""LlamaForCausalLM for a paged KV cache: a plain model file.

The model never sees requests or pages. A forward pass gets the new tokens' input vectors
and positions, the KV slots to write their keys/values to, and an attention plan that says
which cached slots each token may see (built by `attention.py` from the page tables).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pie.backend.attention import AttentionPlan, PagedAttention
from pie.backend.decode_step import FusedDecode
from pie.backend.dtype import cpu_flags
from pie.backend.glue import make_glue
from pie.backend.kv_cache import KvCache
from pie.backend.linear import Int8Linear, Linear, kernel_amx, make_linear, onednn_from
from pie.backend.weight_arena import WeightArena
from pie.backend.weights import ModelFormatError, Tensors, load_checkpoint


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    bos_token_id: int
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    attention_bias: bool = False  # q/k/v/o projections carry a bias (HF's config.attention_bias)
    mlp_bias: bool = False  # gate/up/down projections carry a bias (HF's config.mlp_bias)

    @classmethod
    def from_json(cls, path: Path) -> "LlamaConfig":
        raw = json.loads(path.read_text())
        if raw.get("model_type") != "llama":
            raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not 'llama'")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = raw.get("eos_token_id", 2)
        heads = raw["num_attention_heads"]
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id", 1),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
        )


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse RoPE frequencies in fp32, as HF computes them (default, linear, llama3)."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, llama3)")


def project(linear: Linear | Int8Linear, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T (+ bias, for checkpoints with attention_bias / mlp_bias)."""
    y = linear(x)
    return y if bias is None else y + bias


class LlamaLayer:
    def __init__(self, weights: Tensors, prefix: str, config: LlamaConfig, weight_dtype: str,
                 prefill_fp32: bool, arena: WeightArena | None, onednn_rows: int | None):
        w = lambda name: weights.take(f"{prefix}.{name}")  # noqa: E731

        def biases(names: list[str], flag: str) -> torch.Tensor | None:
            if not getattr(config, flag):
                return None
            why = f" (config.json sets {flag}: true)"
            return torch.cat([weights.take(f"{prefix}.{n}.bias", why) for n in names])

        self.input_norm = w("input_layernorm.weight")
        self.post_norm = w("post_attention_layernorm.weight")
        # Fused projections: one matmul for q/k/v and one for gate/up.
        linear = lambda weight: make_linear(weight, weight_dtype, prefill_fp32, arena, onednn_rows)  # noqa: E731
        self.qkv = linear(
            torch.cat([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"),
                       w("self_attn.v_proj.weight")])
        )
        self.o = linear(w("self_attn.o_proj.weight"))
        self.gate_up = linear(torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]))
        self.down = linear(w("mlp.down_proj.weight"))
        attn, mlp = "self_attn.", "mlp."
        self.qkv_bias = biases([attn + "q_proj", attn + "k_proj", attn + "v_proj"], "attention_bias")
        self.o_bias = biases([attn + "o_proj"], "attention_bias")
        self.gate_up_bias = biases([mlp + "gate_proj", mlp + "up_proj"], "mlp_bias")
        self.down_bias = biases([mlp + "down_proj"], "mlp_bias")
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.intermediate = config.intermediate_size


class Llama:
    """Weights plus the math of one batched forward pass over a paged KV cache."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device,
                 weight_dtype: str = "model", prefill_fp32: bool = False):
        self.config = LlamaConfig.from_json(model_dir / "config.json")
        self.dtype, self.device = dtype, device
        weights = load_checkpoint(model_dir, dtype, device)
        cfg = self.config
        self.embed_tokens = weights.take("model.embed_tokens.weight")
        lm_head = weights.pop("lm_head.weight", None)
        if lm_head is None or cfg.tie_word_embeddings:
            lm_head = self.embed_tokens
        # On AVX2 the bf16 kernel takes the LM head (576 x 49,152) up to 32 tokens too: its GEMM
        # tiles (csrc/bf16_gemv.cpp) beat oneDNN's fp32 copy from 17 rows, 19.4 vs 22.6 ms at 24,
        # 27.2 vs 28.7 at 32 (AMD EPYC, 2 vCPUs; the 4-row loop before them had lost, 24.5 vs 23.4).
        # The bf16 kernel's weights in huge pages, in the order a step reads them (weight_arena.py).
        self.arena = WeightArena() if dtype == torch.bfloat16 and device.type == "cpu" else None
        # With AMX, oneDNN takes bf16 steps past the kernel's own AMX tiles (33+ rows), or of
        # 8+ rows where the kernel has none (linear.py, onednn_from).
        onednn_rows = onednn_from(cpu_flags(), kernel_amx=self.arena is not None and kernel_amx()) \
            if device.type == "cpu" else None
        self.layers = [LlamaLayer(weights, f"model.layers.{i}", cfg, weight_dtype, prefill_fp32, self.arena,
                                  onednn_rows) for i in range(cfg.num_layers)]
        self.lm_head = make_linear(lm_head, weight_dtype, arena=self.arena, onednn_rows=onednn_rows)
        self.norm = weights.take("model.norm.weight")
        weights.pop("lm_head.weight", None)
        unused = sorted(k for k in weights if "rotary_emb" not in k)
        if unused:
            flags = sorted({"attention_bias" if ".self_attn." in k else "mlp_bias"
                            for k in unused if k.endswith("_proj.bias")})
            why = f" (config.json sets {' and '.join(flags)} false)" if flags else ""
            raise ModelFormatError(
                f"{weights.source} holds {len(unused)} tensors a Llama with this config.json "
                f"does not use{why}: {', '.join(unused[:5])}"
            )
        self.inv_freq = rope_inv_freq(cfg).to(device)
        self.glue = make_glue(dtype, device)
        self.fused_decode = FusedDecode(self.layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                        cfg.rms_norm_eps) \
            if FusedDecode.usable(self.layers, dtype, device) else None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens[token_ids]

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(self.dtype)[:, None, :], angles.sin().to(self.dtype)[:, None, :]

    @torch.inference_mode()
    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        plan: AttentionPlan,
        attention: PagedAttention,
        kv: KvCache,
        out_rows: torch.Tensor,
        greedy: bool = False,
    ) -> torch.Tensor:
        """Run T new tokens; return the final-normed hidden states of rows `out_rows`, or
        with `greedy` (only where `takes_greedy`) their argmax tokens [R] (int64).

        x: [T, hidden]; positions, write_slots: [T]; out_rows: [R] indices into T.
        """
        cfg, glue, eps = self.config, self.glue, self.config.rms_norm_eps
        cos, sin = self.rope_tables(positions)
        tokens = x.shape[0]
        if greedy:
            return self.fused_decode.greedy(x, cos, sin, write_slots, plan, attention, kv,  # type: ignore[union-attr]
                                            out_rows, self.norm, self.lm_head)  # type: ignore[arg-type]
        if self.fused_decode is not None and self.fused_decode.applies(tokens, plan.longest, attention, kv):
            x = self.fused_decode.run(x, cos, sin, write_slots, plan, attention, kv, out_rows)  # type: ignore[arg-type]
            return glue.final_norm(x, self.norm, eps)
        delta = None  # the previous layer's MLP output, added to x by the next norm
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            x, h = glue.add_norm(x, delta, layer.input_norm, eps)
            qkv = project(layer.qkv, layer.qkv_bias, h)
            # RoPE on q and k heads together: one set of elementwise ops instead of two.
            qk = glue.rope(qkv[:, : layer.q_size + layer.kv_size].view(tokens, -1, cfg.head_dim),
                           cos, sin)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            v = qkv[:, layer.q_size + layer.kv_size :].view(tokens, cfg.num_kv_heads, cfg.head_dim)
            kv.write(index, write_slots, k, v)
            attn = attention.run(q, kv, index, plan).reshape(tokens, layer.q_size)
            if index == last and len(out_rows) < tokens:
                # Past the last layer's K/V only the output rows matter (PrefillOnly: a
                # prompt's last layer computes its last position alone).
                x, attn, out_rows = x[out_rows], attn[out_rows], torch.arange(len(out_rows), device=x.device)
            x, h = glue.add_norm(x, project(layer.o, layer.o_bias, attn), layer.post_norm, eps)
            delta = self.mlp(layer, h)
        x = x if delta is None else x + delta
        return glue.final_norm(x[out_rows], self.norm, eps)

    def takes_greedy(self, tokens: int, longest: int, attention: PagedAttention, kv: KvCache) -> bool:
        """Whether `forward(greedy=True)` runs a step of `tokens` tokens whose longest item has
        `longest` new tokens: the fused decode step with the LM head on the bf16 kernel."""
        return self.fused_decode is not None and self.fused_decode.applies(tokens, longest, attention, kv) \
            and isinstance(self.lm_head, Linear) and self.lm_head.gemv is not None \
            and tokens <= self.lm_head.gemv_limit

    def mlp(self, layer: LlamaLayer, h: torch.Tensor) -> torch.Tensor:
        """SiLU-gated MLP (a long item runs it a chunk at a time: chunked_forward.py)."""
        gate_up = project(layer.gate_up, layer.gate_up_bias, h)
        return project(layer.down, layer.down_bias, self.glue.silu_mul(gate_up, layer.intermediate))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-normed hidden states (computed in the model dtype, as HF does)."""
        return self.lm_head(hidden.to(self.dtype)).float()

