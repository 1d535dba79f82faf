"""A decoder-only GPT built from `fusedlayers.TransformerLayer`.

Shapes (b = batch, s = tokens, d = d_model, V = vocab_size):
    idx [b, s] int64 -> logits [b, s, V] (fp32 under autocast too: the loss wants fp32 logits)

Every use of `TransformerLayer`, `RotaryPositionEmbedding` and `InferenceParams` is in this file.
The layers run in `config.attn_input_format`; `bshd` is the default because the token batch is
already batch-first, so it needs no transposes (the other formats are converted at the first and
last layer only, see `_to_format`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fusedlayers import (
    DecodeGraph,
    InferenceParams,
    LayerNorm,
    ReferenceSwitch,
    RMSNorm,
    RotaryPositionEmbedding,
    TransformerLayer,
    context_parallel_positions,
)
from fusedlayers.debug import debug_enabled

from .config import GPTConfig


def _normal_init(std: float):
    return lambda w: torch.nn.init.normal_(w, mean=0.0, std=std)


class GPT(ReferenceSwitch):
    """GPT language model: token (+ learned position) embedding, `n_layer` pre-norm
    `TransformerLayer`s with causal self-attention (RoPE or learned positions), final norm, LM
    head (tied to the embedding by default).

    `use_reference=True` (or `model.use_reference = True` later) runs every layer on the
    pure-PyTorch reference path; on CPU the layers take it automatically.
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        use_reference: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(use_reference)
        c = self.config = config
        factory = dict(device=device, dtype=dtype)
        self.tok_emb = torch.nn.Embedding(c.vocab_size, c.d_model, **factory)
        self.pos_emb = (
            torch.nn.Embedding(c.context_length, c.d_model, **factory)
            if c.pos_emb == "learned"
            else None
        )
        self.rope = (
            RotaryPositionEmbedding(c.head_dim, rotary_base=c.rope_base, device=device)
            if c.pos_emb == "rope"
            else None
        )
        self.emb_dropout = torch.nn.Dropout(c.embedding_dropout)
        # GPT-2's scaled init for the projections that write into the residual stream, so the
        # residual variance does not grow with depth.
        out_std = c.init_std / math.sqrt(2 * c.n_layer)
        self.layers = torch.nn.ModuleList(
            TransformerLayer(
                hidden_size=c.d_model,
                ffn_hidden_size=c.d_ff,
                num_attention_heads=c.n_head,
                num_gqa_groups=c.n_kv_head,
                kv_channels=c.head_dim,
                layernorm_epsilon=c.layernorm_epsilon,
                hidden_dropout=c.hidden_dropout,
                attention_dropout=c.attention_dropout,
                init_method=_normal_init(c.init_std),
                output_layer_init_method=_normal_init(out_std),
                layer_number=i + 1,
                self_attn_mask_type="causal",
                attn_input_format=c.attn_input_format,
                normalization=c.normalization,
                activation=c.activation,
                bias=c.bias,
                fuse_qkv_params=True,
                params_dtype=dtype,
                device=device,
                use_reference=use_reference,
            )
            for i in range(c.n_layer)
        )
        self.final_norm = (LayerNorm if c.normalization == "LayerNorm" else RMSNorm)(
            c.d_model,
            eps=c.layernorm_epsilon,
            params_dtype=dtype,
            device=device,
            use_reference=use_reference,
        )
        self.lm_head = (
            None if c.tie_embeddings else torch.nn.Linear(c.d_model, c.vocab_size, False, **factory)
        )
        self._init_embeddings()
        self.cp_size, self.cp_rank = 1, 0

    def set_context_parallel_group(
        self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p"
    ) -> None:
        """Split every sequence over `cp_group` (None: off), TE's way: `forward` then takes this
        rank's tokens `idx [b, s / cp]`, chunks r and 2cp-1-r of each sequence cut into 2*cp
        (`fusedlayers.context_parallel_indices`), and returns their
        logits. Positions (RoPE or learned) are the tokens' positions in the full sequence."""
        for layer in self.layers:
            layer.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
        self.cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)

    def _init_embeddings(self) -> None:
        for module in (self.tok_emb, self.pos_emb, self.lm_head):
            if module is not None:
                torch.nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)

    def num_parameters(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the embedding tables (the FLOP-relevant part;
        a tied LM head is a matmul, so it is counted back in)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= 0 if self.pos_emb is None else self.pos_emb.weight.numel()
            n -= 0 if self.config.tie_embeddings else self.tok_emb.weight.numel()
        return n

    def _to_format(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """[b, s, d] -> the layers' format, plus the layers' extra keyword arguments."""
        fmt = self.config.attn_input_format
        if fmt == "sbhd":
            return x.transpose(0, 1).contiguous(), {}
        if fmt == "thd":
            # Equal-length sequences packed back to back: cu_seqlens = 0, s, 2s, ... (of the
            # full sequences under context parallelism, TE's convention)
            b, s, d = x.shape
            full = s * self.cp_size
            cu = torch.arange(0, (b + 1) * full, full, dtype=torch.int32, device=x.device)
            return x.reshape(b * s, d), dict(cu_seqlens_q=cu, max_seqlen_q=full)
        return x, {}

    def _from_format(self, h: torch.Tensor, b: int, s: int) -> torch.Tensor:
        fmt = self.config.attn_input_format
        if fmt == "sbhd":
            return h.transpose(0, 1)
        if fmt == "thd":
            return h.view(b, s, -1)
        return h

    def forward(
        self, idx: torch.Tensor, inference_params: InferenceParams | None = None
    ) -> torch.Tensor:
        """idx [b, s] token ids -> logits [b, s, vocab_size] (fp32).

        With `inference_params`, `idx` holds the tokens after the `sequence_len_offset` already
        cached; the caller advances the offset afterwards (see `generate`).

        A ValueError names `idx` when it is not int64/int32 `[b, s]`, when its positions pass
        `context_length`, or when it holds ids outside `[0, vocab_size)` (read where that costs
        no device sync, see `_reads_idx_range`).
        """
        _check_idx(idx, self.config.vocab_size, read_range=_reads_idx_range(idx))
        b, s = idx.shape
        limit = self.config.context_length
        # Positions: 0.. without a cache (under context parallelism, this rank's chunks' places
        # in the full sequence); with one, from each sequence's cached length, on the device (no
        # host read, so a decode step can be captured in a CUDA graph). The limit is checked on
        # the host while the cache's host mirror of the lengths is known.
        lens = [0] if inference_params is None else inference_params.host_lengths(b)
        full = s * self.cp_size
        if lens and max(lens) + full > limit:
            start = max(lens)
            ranks = f" over {self.cp_size} context-parallel ranks" if self.cp_size > 1 else ""
            raise ValueError(
                f"idx of shape {tuple(idx.shape)}{ranks} takes positions {start}.."
                f"{start + full - 1}, which exceed context_length ({limit})"
            )
        x = self.tok_emb(idx)  # [b, s, d]
        if self.pos_emb is not None:
            positions = (
                context_parallel_positions(s, self.cp_size, self.cp_rank, idx.device)
                if inference_params is None
                else inference_params.positions(b, s, idx.device)
            )
            x = x + self.pos_emb(positions)
        h, extra = self._to_format(self.emb_dropout(x))
        if self.rope is not None:
            # The full table: layers index it by absolute position (offset while decoding).
            extra["rotary_pos_emb"] = (
                self.rope(limit) if inference_params is None else self._decode_rope_table()
            )
        h = self._from_format(self._layers_and_norm(h, inference_params, extra), b, s)
        weight = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()

    def _layers_and_norm(self, h: torch.Tensor, inference_params, extra: dict) -> torch.Tensor:
        """The layers and the final norm on `h` (the layers' format) -> the normalized output.

        The residual stream: each layer returns its MLP output and the residual unsummed and
        the next layer (or the final norm) adds them inside its norm kernel, one launch fewer
        per layer. Layers that cannot take it (post-LN forms) run the plain chain."""
        if not all(layer.supports_residual_stream for layer in self.layers):
            for layer in self.layers:
                h = layer(h, inference_params=inference_params, **extra)
            return self.final_norm(h)
        residual = None
        for layer in self.layers:
            h, residual = layer(
                h,
                inference_params=inference_params,
                residual=residual,
                return_residual=True,
                **extra,
            )
        if residual is not None and residual.dtype != h.dtype:
            # Under autocast the layers' outputs are bf16 and the residual stream fp32: add them
            # as torch's add promotes, since the norm takes one dtype.
            h, residual = residual + h, None
        return self.final_norm(h) if residual is None else self.final_norm(h, residual)[0]

    def _decode_rope_table(self) -> torch.Tensor:
        """The RoPE table, built once per device and buffer version for generation: the layers
        then compute its cos/sin once (they memoize them per table), and a captured decode step
        reads a tensor whose address does not change."""
        inv_freq = self.rope.inv_freq
        key = (inv_freq.device, inv_freq._version)
        cached = self.__dict__.get("_rope_table")
        if cached is None or cached[0] != key:
            cached = (key, self.rope(self.config.context_length))
            self.__dict__["_rope_table"] = cached
        return cached[1]

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
        cuda_graph: bool = False,
    ) -> torch.Tensor:
        """Continue `idx [b, s]` by `max_new_tokens` sampled tokens -> [b, s + max_new_tokens].

        temperature 0 is greedy decoding; `top_k` keeps the k most likely tokens. With
        `use_cache` the prompt is run once and every later step feeds only the newest token,
        reading earlier keys/values from an `InferenceParams` cache; without it every step
        reruns the whole sequence (the slow baseline the tests compare against).
        `cuda_graph=True` (CUDA, with the cache) runs the prompt eagerly, captures one decode
        step in a CUDA graph (`fusedlayers.DecodeGraph`) and replays it for
        every later token: the same kernels, so the same tokens, with one launch per token.
        """
        _check_generate_args(idx, max_new_tokens, temperature, top_k, self.config.vocab_size)
        total, limit = idx.shape[1] + max_new_tokens, self.config.context_length
        if total > limit:
            raise ValueError(f"prompt + new tokens ({total}) exceed context_length ({limit})")
        if use_cache and self.config.attn_input_format == "thd":
            raise ValueError("generation with a KV cache needs attn_input_format sbhd or bshd")
        if cuda_graph and not (use_cache and idx.is_cuda):
            raise ValueError(
                f"cuda_graph=True needs use_cache=True and CUDA tensors (got use_cache="
                f"{use_cache}, idx on {idx.device})"
            )
        was_training = self.training
        self.eval()
        cache = InferenceParams(idx.shape[0], total) if use_cache else None
        graph = None
        try:
            new = idx
            for i in range(max_new_tokens):
                if cuda_graph and i == 1:  # the prompt ran eagerly and allocated the caches
                    step = lambda t: self(t, inference_params=cache)[:, -1]
                    graph = DecodeGraph(step, cache, new)
                if graph is not None:
                    logits = graph(new)
                else:
                    logits = self(new if use_cache else idx, inference_params=cache)[:, -1]
                    if cache is not None:
                        cache.advance(new.shape[1])
                new = _sample(logits, temperature, top_k, generator)  # [b, 1]
                idx = torch.cat((idx, new), dim=1)
        finally:
            self.train(was_training)
        return idx


def _reads_idx_range(idx: torch.Tensor) -> bool:
    """Whether `forward` reads the range of `idx`'s token ids (`_check_idx`).

    An id outside the vocabulary makes the embedding raise a bare IndexError on a CPU, and on
    CUDA a device-side assert that poisons the process. On a CPU tensor the read is one
    `aminmax`, no sync: always done. On CUDA it is a device sync per forward, which would stop
    the host from running ahead of the GPU in every eager training step and cannot sit in a
    captured decode step: done only in debug mode (`FUSEDLAYERS_DEBUG=1`) outside capture.
    Never under torch.compile (a data-dependent read breaks the graph). `generate` checks its
    prompt once on any device; the tokens it samples are in range."""
    if torch.compiler.is_compiling():
        return False
    if idx.device.type == "cpu":
        return True
    return idx.is_cuda and debug_enabled() and not torch.cuda.is_current_stream_capturing()


def _check_idx(idx, vocab_size: int, read_range: bool) -> None:
    """`idx` must be integer token ids [b, s]; with `read_range`, ids in [0, vocab_size) (one
    host read of idx's min and max)."""
    if (
        not isinstance(idx, torch.Tensor)
        or idx.dim() != 2
        or idx.dtype not in (torch.int64, torch.int32)
    ):
        what = (
            f"shape {tuple(idx.shape)}, dtype {idx.dtype}"
            if isinstance(idx, torch.Tensor)
            else type(idx).__name__
        )
        raise ValueError(f"idx must be integer token ids [b, s] (int64 or int32), got {what}")
    if read_range and idx.numel():
        low, high = torch.stack(torch.aminmax(idx)).tolist()  # one host read
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"idx holds token ids in [{low}, {high}], outside [0, vocab_size={vocab_size})"
            )


def _is_int_at_least(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_generate_args(idx, max_new_tokens, temperature, top_k, vocab_size) -> None:
    """`generate`'s arguments, checked before the first forward (one host read of idx's range)."""
    _check_idx(idx, vocab_size, read_range=True)
    if idx.shape[0] == 0 or idx.shape[1] == 0:
        raise ValueError(
            f"idx of shape {tuple(idx.shape)} is empty: generation needs a prompt of at least one "
            "token per sequence (e.g. a begin-of-text token)"
        )
    if not _is_int_at_least(max_new_tokens, 0):
        raise ValueError(f"max_new_tokens ({max_new_tokens!r}) must be an integer >= 0")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature ({temperature!r}) must be a finite number >= 0 (0 = greedy)")
    if top_k is not None and not _is_int_at_least(top_k, 1):
        raise ValueError(f"top_k ({top_k!r}) must be None or an integer >= 1")


def _sample(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [b, V] -> next token ids [b, 1]."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy: logits [b, s, V], targets [b, s] -> scalar (nats)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
