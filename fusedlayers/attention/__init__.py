"""Attention: the front end that turns what the caller gives into what the kernels need, and
the two public ways in.

    frontend               one internal entry for the modules and the API: validate, normalize
                           layout and mask, choose kernel or reference, log the decisions
    layouts                TransformerEngine's layout names (`sb3hd`, `bshd_bs2hd`, ...) from
                           shapes, strides and storage
    masks                  mask types and windows, TE's and flash-attn's, into one spec
    validation             argument checks at the front door, with the values in the message
    packing                `split_packed`: q/k/v views of one packed tensor, one gradient buffer
    reference              `attention_reference`, the pure-PyTorch oracle and debug path
    functional             flash-attn's `flash_attn_*` functions
    paged_kv               `block_table` for `flash_attn_varlen_func`: checks and the page gather
    kvcache                `flash_attn_with_kvcache` and the decode core the layers share
    dot_product_attention  TE's `DotProductAttention` module
    context_parallel       TE's context parallelism: checks the call, the rows each rank
                           holds (`context_parallel_indices`), then runs the ring
    ring_attention         the ring: K/V blocks around the group, LSE merge, dK/dV back

Public names are imported from `fusedlayers`; this package adds none of its own.
"""
