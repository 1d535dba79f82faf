"""`GPTConfig`: the one description of a GPT's architecture, stored in every checkpoint."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

POSITIONAL_SCHEMES = ("rope", "learned")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ATTN_INPUT_FORMATS = ("bshd", "sbhd", "thd")
# Gated activations have two input projections, so their FFN width defaults to 2/3 of 4x.
GATED_ACTIVATIONS = ("swiglu", "geglu", "reglu", "qgeglu", "sreglu")


@dataclass
class GPTConfig:
    """Architecture of a decoder-only GPT built from `fusedlayers.TransformerLayer`.

    Fields left at `None` are derived in `__post_init__`: `n_kv_head` defaults to `n_head` (MHA),
    `d_ff` to 4 * d_model (8/3 * d_model rounded up to a multiple of 64 for gated activations).
    `head_dim` is always derived. Named sizes: `GPTConfig.named(name)` for "tiny", "gpt-50m",
    "gpt-125m" and "gpt-1.3b".
    """

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None
    d_model: int = 128
    d_ff: int | None = None
    context_length: int = 256
    pos_emb: str = "rope"
    normalization: str = "RMSNorm"
    activation: str = "swiglu"
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    embedding_dropout: float = 0.0
    tie_embeddings: bool = True
    bias: bool = False
    layernorm_epsilon: float = 1e-5
    init_std: float = 0.02
    rope_base: float = 10000.0
    # bshd: tokens arrive as [b, s] so embeddings, attention and logits all stay batch-first
    # with no transposes; see docs/gpt.md for the measured comparison.
    attn_input_format: str = "bshd"
    head_dim: int = field(init=False)

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})"
            )
        self.head_dim = self.d_model // self.n_head
        if self.pos_emb == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.d_ff is None:
            if self.activation in GATED_ACTIVATIONS:
                self.d_ff = -(-8 * self.d_model // 3 // 64) * 64
            else:
                self.d_ff = 4 * self.d_model
        for name, value, allowed in (
            ("pos_emb", self.pos_emb, POSITIONAL_SCHEMES),
            ("normalization", self.normalization, NORMALIZATIONS),
            ("attn_input_format", self.attn_input_format, ATTN_INPUT_FORMATS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        """The constructor arguments (derived `head_dim` left out), JSON-serializable."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """Inverse of `to_dict`; unknown keys raise, naming them."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {unknown}")
        return cls(**values)

    @classmethod
    def named(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named size, with any field overridden by keyword."""
        if name not in NAMED_SIZES:
            raise ValueError(f"unknown config name {name!r}; known: {sorted(NAMED_SIZES)}")
        return cls(**{**NAMED_SIZES[name], **overrides})


NAMED_SIZES: dict[str, dict[str, Any]] = {
    # ~0.8M parameters: trains on 2 CPU cores in minutes (reference path).
    "tiny": dict(n_layer=4, n_head=4, n_kv_head=2, d_model=128, context_length=256),
    # ~50M parameters (byte vocabulary, so nearly all of it in the blocks): one GPU, bf16.
    # head_dim 64: the kernels' block shapes want a power-of-two head size.
    "gpt-50m": dict(n_layer=10, n_head=10, d_model=640, context_length=1024),
    # GPT-2 small's shape (12 x 768) with RoPE and SwiGLU: the throughput benchmark model.
    "gpt-125m": dict(n_layer=12, n_head=12, d_model=768, context_length=2048, vocab_size=50304),
    # GPT-3 XL's shape (24 x 2048, head_dim 128): GEMMs large enough for FP8 to pay
    # (`benchmark_gpt.py --config gpt-1.3b --fp8`).
    "gpt-1.3b": dict(n_layer=24, n_head=16, d_model=2048, context_length=2048, vocab_size=50304),
}
