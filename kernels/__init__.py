"""fusedlayers.kernels: Triton flash-attention kernels behind one differentiable entry.

Offers:
    flash_attention(q, k, v, *, ...) -> (out, lse)
        Forward and backward flash attention (torch.library ops `fusedlayers::flash_attn_fwd`
        and `fusedlayers::flash_attn_bwd`, traceable by torch.compile): dense [b, s, h, d] and
        varlen [t, h, d] inputs with any strides (stride(-1) == 1), MHA/GQA/MQA, d_v != d_qk,
        windows with top-left or bottom-right alignment, additive bias (with its gradient),
        ALiBi, softcap, dropout, fp32 LSE, deterministic backward. docs/internals.md holds the
        full contract.
    dropout_keep_mask(rng_state, b, h, s_q, s_k, p, device) -> bool [b, h, s_q, s_k]
        The keep-mask the kernels draw for a given (seed, offset), for tests and the reference.

The kernels assume validated input; `fusedlayers` checks and normalizes everything first.
"""

from ._dropout import dropout_keep_mask
from .ops import flash_attention

__all__ = ["dropout_keep_mask", "flash_attention"]
