"""fusedlayers: TransformerEngine-style attention layers on Triton flash-attention kernels.

Public API:
    DotProductAttention                       TE's module, on the kernels for CUDA tensors
    flash_attn_func, flash_attn_varlen_func,  flash-attn's functional API
    flash_attn_{qkv,kv}packed_func, flash_attn_varlen_{qkv,kv}packed_func
    attention_reference                       the pure-PyTorch oracle / debug path
    split_packed                              q/k/v views of one packed tensor whose gradient
                                              comes back as one buffer, without a copy
    reference_mode                            run every module on the reference path in a block
"""

from .attention.dot_product_attention import DotProductAttention
from .attention.functional import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .attention.kvcache import flash_attn_with_kvcache
from .attention.packing import split_packed
from .attention.reference import attention_reference
from .reference_switch import reference_mode

__version__ = "0.1.0"

__all__ = [
    "DotProductAttention",
    "attention_reference",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "reference_mode",
    "split_packed",
]
