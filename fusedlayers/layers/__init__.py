"""TransformerEngine-style layers, built on `fusedlayers.attention` and the kernels.

    gemm_module          the GEMM modules' base: `F.linear`, or FP8 GEMMs inside `fp8_autocast`
    linear               `Linear`, `LayerNormLinear`
    normalization        `LayerNorm`, `RMSNorm` and the norm front door
    mlp                  `LayerNormMLP` and TE's MLP activations
    rope                 `RotaryPositionEmbedding`, `apply_rotary_pos_emb`
    multihead_attention  `MultiheadAttention`: QKV projection, RoPE, attention, output projection
    transformer_layer    `TransformerLayer`
    qkv_storage          fused, interleaved and separate QKV weights and their state-dict forms
    inference            `InferenceParams`, the KV cache for generation (lengths on the device)
    cached_attention     `MultiheadAttention`'s decode step over the cache (split-KV kernel)
    decode_graph         `DecodeGraph`: a decode step captured in a CUDA graph

Public names are imported from `fusedlayers`; this package adds none of its own.
"""
