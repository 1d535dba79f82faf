"""fusedlayers.kernels: Triton flash-attention, normalization, MLP-activation and rotary-embedding
kernels, each behind one differentiable entry.

Offers:
    flash_attention(q, k, v, *, ...) -> (out, lse)
        Forward and backward flash attention (torch.library ops `fusedlayers::flash_attn_fwd`
        and `fusedlayers::flash_attn_bwd`, traceable by torch.compile): dense [b, s, h, d] and
        varlen [t, h, d] inputs with any strides (stride(-1) == 1), MHA/GQA/MQA, d_v != d_qk,
        windows with top-left or bottom-right alignment, additive bias (with its gradient),
        ALiBi, softcap, dropout, fp32 LSE (differentiable: a loss may read it), deterministic
        backward; float8_e4m3fn q/k/v with FlashAttention-3's descales, forward only, bf16 out
        (portable kernel). docs/internals.md holds the full contract.
    set_forward_path("auto" | "portable" | "sm90") -> previous setting; forward_path()
        Which forward kernel `flash_attention` runs: on sm_90 GPUs a warp-specialized Gluon
        kernel takes the calls it covers (kernels/dispatch.py), the portable Triton kernel
        everything else. "auto" (the default, or FUSEDLAYERS_ATTENTION_PATH at import) follows
        the measured table; the others pin a path for tests and benchmarks.
    set_backward_path("auto" | "portable" | "sm90") -> previous setting; backward_path()
        The same for the backward: on sm_90 GPUs a warp-specialized Gluon kernel (one launch for
        dQ, dK and dV) can take the non-deterministic calls it covers (kernels/dispatch.py).
    decode_attention(q, k_cache, v_cache, seqlens_k, *, ...) -> (out, lse)
        Split-KV ("flash-decoding") inference forward for few queries over a contiguous or paged
        KV cache (kernels/_flash_decode.py); `check_page_size` states its page-size rule;
        lse is None with `return_lse=False` (one allocation fewer). Under torch.compile it is
        the torch.library op `fusedlayers::decode_attention` (kernels/decode_ops.py).
    rotate_and_append(q, k, v, k_cache, v_cache, seqlens, *, ...) -> (q, seqlens + s_new)
        A decode step's rotary embedding and KV-cache writes in one launch, lengths advanced on
        the device (kernels/_cache_append.py); under torch.compile the op
        `fusedlayers::rotate_and_append`, which mutates the caches.
    dropout_keep_mask(rng_state, b, h, s_q, s_k, p, device) -> bool [b, h, s_q, s_k]
        The keep-mask the kernels draw for a given (seed, offset), for tests and the reference.
    layer_norm(x, weight, bias, eps, *, rms, zero_centered_gamma) -> y
        Fused LayerNorm / RMSNorm forward and backward over the last dim of x [..., n]
        (torch.library ops `fusedlayers::norm_fwd` and `fusedlayers::norm_bwd`): fp16/bf16/fp32
        input, parameters of any of those dtypes, optional bias, TE's zero-centered gamma, fp32
        statistics, deterministic dweight/dbias (no atomics); n up to `MAX_NORM_HIDDEN`.
    add_layer_norm(x, residual, weight, bias, eps, *, rms, zero_centered_gamma) -> (y, h)
        The same norm of h = x + residual, with h, in one pass (op `fusedlayers::add_norm_fwd`):
        a transformer block's residual add fused into its next norm.
    fused_activation(x, activation) -> y
        TransformerEngine's MLP activations (`KERNEL_ACTIVATIONS`: gelu (tanh form), relu, qgelu,
        srelu, silu and the gated geglu, reglu, qgeglu, sreglu, swiglu) in one kernel forward and
        one backward (torch.library ops `fusedlayers::activation_fwd` and
        `fusedlayers::activation_bwd`): x [..., w] -> y [..., w], or [..., w / 2] for gated ones;
        fp16/bf16/fp32 (`ACTIVATION_DTYPES`), fp32 math, the backward recomputes the activation
        from x and writes both halves of a gated dx in one pass.
    rope(t, cos, sin, positions=None, *, seq_dim, interleaved) -> out
        Fused rotary position embedding forward and backward (torch.library ops
        `fusedlayers::rope_fwd` and `fusedlayers::rope_bwd`): t [s, b, h, d], [b, s, h, d] or
        [t, h, d] in `ROPE_DTYPES`, any strides (stride(-1) == 1) read in place; fp32 cos/sin
        tables [n_pos, d_rot]; positions from the sequence index or an int tensor; rotate-half
        or interleaved pairs, partial rotation (channels d_rot..d pass through).
    rope_pair(q, k, cos, sin, positions=None, *, seq_dim, interleaved) -> (q_out, k_out)
        `rope` of q and of k (same tokens and positions, their own head counts) in one launch
        per pass and one autograd node.

The kernels assume validated input; `fusedlayers` checks and normalizes everything first.
"""

from ._activation import ACTIVATIONS as _ACTIVATIONS
from ._activation import SUPPORTED_DTYPES as ACTIVATION_DTYPES
from ._dropout import dropout_keep_mask
from ._flash_decode import check_page_size
from ._norm import MAX_HIDDEN as MAX_NORM_HIDDEN
from ._norm import SUPPORTED_DTYPES as NORM_DTYPES
from ._rope import SUPPORTED_DTYPES as ROPE_DTYPES
from .activation_ops import fused_activation
from .attention_ops import flash_attention
from .decode_ops import decode_attention, rotate_and_append
from .dispatch import backward_path, forward_path, set_backward_path, set_forward_path
from .norm_ops import add_layer_norm, layer_norm
from .rope_ops import rope, rope_pair

KERNEL_ACTIVATIONS = tuple(_ACTIVATIONS)

__all__ = [
    "ACTIVATION_DTYPES",
    "KERNEL_ACTIVATIONS",
    "MAX_NORM_HIDDEN",
    "NORM_DTYPES",
    "ROPE_DTYPES",
    "backward_path",
    "check_page_size",
    "decode_attention",
    "dropout_keep_mask",
    "forward_path",
    "flash_attention",
    "fused_activation",
    "layer_norm",
    "add_layer_norm",
    "rope",
    "rope_pair",
    "rotate_and_append",
    "set_backward_path",
    "set_forward_path",
]
