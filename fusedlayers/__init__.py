"""fusedlayers: TransformerEngine-style transformer layers on Triton flash-attention kernels.

`import fusedlayers as te` stands in for `import transformer_engine.pytorch as te`: the modules
carry TransformerEngine's names, arguments and defaults, and the flash-attn functions sit beside
them with flash-attn's.

Public API:
    TransformerLayer, MultiheadAttention, DotProductAttention
                                              TE's modules, on the kernels for CUDA tensors
    Linear, LayerNormLinear, LayerNormMLP, LayerNorm, RMSNorm
                                              TE's projection, MLP and norm modules
    RotaryPositionEmbedding, apply_rotary_pos_emb
                                              TE's rotary tables and their application
    InferenceParams                           the KV cache that generation passes to the modules
    DecodeGraph                               one decode step captured in a CUDA graph
    get_qkv_layout                            TE's name for the memory layout of q, k, v
    flash_attn_func, flash_attn_varlen_func,  flash-attn's functional API
    flash_attn_{qkv,kv}packed_func, flash_attn_varlen_{qkv,kv}packed_func,
    flash_attn_with_kvcache
    attention_reference                       the pure-PyTorch oracle / debug path
    split_packed                              q/k/v views of one packed tensor whose gradient
                                              comes back as one buffer, without a copy
    reference_mode                            run every module on the reference path in a block
    ReferenceSwitch                           the base of modules with a reference path: gives a
                                              model of your own the `use_reference` switch
    context_parallel_indices, context_parallel_positions
                                              a rank's rows and token positions under context
                                              parallelism (TE's load-balanced chunks)
    ArgumentError, ArgumentTypeError          what a bad argument raises: a ValueError (TypeError)
                                              and a RuntimeError, as flash-attn's checks raise
    recipe                                    TE's FP8 recipes (DelayedScaling,
                                              Float8CurrentScaling, Float8BlockScaling, ...)
    fp8_autocast, autocast                    the GEMM modules' GEMMs in FP8 inside a block
    fp8_model_init, quantized_model_init      GEMM modules whose weights are kept in FP8 only
    is_fp8_available                          whether this GPU runs FP8 GEMMs (and why not)
"""

# `fusedlayers.recipe` is TE's `common.recipe`; a module, so not in __all__.
from . import recipe as recipe
from .attention.context_parallel import context_parallel_indices, context_parallel_positions
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
from .attention.layouts import get_qkv_layout
from .attention.packing import split_packed
from .attention.reference import attention_reference
from .errors import ArgumentError, ArgumentTypeError
from .fp8 import (
    autocast,
    fp8_autocast,
    fp8_model_init,
    is_fp8_available,
    quantized_model_init,
)
from .layers.decode_graph import DecodeGraph
from .layers.inference import InferenceParams
from .layers.linear import LayerNormLinear, Linear
from .layers.mlp import LayerNormMLP
from .layers.multihead_attention import MultiheadAttention
from .layers.normalization import LayerNorm, RMSNorm
from .layers.rope import RotaryPositionEmbedding, apply_rotary_pos_emb
from .layers.transformer_layer import TransformerLayer
from .reference_switch import ReferenceSwitch, reference_mode

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "DecodeGraph",
    "DotProductAttention",
    "InferenceParams",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MultiheadAttention",
    "RMSNorm",
    "ReferenceSwitch",
    "RotaryPositionEmbedding",
    "TransformerLayer",
    "apply_rotary_pos_emb",
    "attention_reference",
    "autocast",
    "context_parallel_indices",
    "context_parallel_positions",
    "flash_attn_func",
    "fp8_autocast",
    "fp8_model_init",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "get_qkv_layout",
    "is_fp8_available",
    "quantized_model_init",
    "reference_mode",
    "split_packed",
]
