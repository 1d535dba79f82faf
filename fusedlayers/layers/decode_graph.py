"""`DecodeGraph`: one decode step of a model on an `InferenceParams` cache, captured in a CUDA
graph and replayed per token.

A decode step of small batches is bound by the host: at batch 1 a GPT-125M step launches a few
hundred small kernels, each a few microseconds of host time. Captured once, the step replays as
one graph launch. What makes a step capturable: its tensors keep their addresses (the caches,
`pre_step_seqlens`, the RoPE table and a static input buffer), and nothing in it reads a device
value back (the layers take cache lengths, positions and cache-write rows from
`pre_step_seqlens` on the device; see `fusedlayers.layers.cached_attention`).

    step = DecodeGraph(lambda tokens: model(tokens, inference_params=params), params, tokens)
    logits = step(next_tokens)   # copy into the static input, replay: the model's output, and
                                 # the lengths advanced by one on the device

`DecodeGraph` warms the step up eagerly first (Triton compiles and picks launch configurations,
the RoPE cos/sin tables are built), on a side stream as CUDA graphs require. The warm-up writes
the warm-up tokens' keys/values at row `pre_step_seqlens[z]` of every cache, a row the next real
step overwrites, and leaves the lengths as they were.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .inference import InferenceParams


class DecodeGraph:
    """`step(tokens)` captured with `torch.cuda.CUDAGraph`, `params.advance(tokens' length)`
    included.

    Args:
        step: a function of the input tokens (a CUDA tensor, e.g. `[b, 1]` token ids) that runs
            the model on `params` and returns its output (e.g. logits); it must not advance the
            lengths itself.
        params: the `InferenceParams` the model uses; its caches must be allocated (run the
            prompt first).
        example: a tensor of the input's shape, dtype and device (the first input).
        new_tokens: tokens per sequence and step (the lengths advance by it per replay).
        warmup: eager runs before capture (two: the first compiles, the second runs as captured).
    """

    def __init__(
        self,
        step: Callable[[torch.Tensor], torch.Tensor],
        params: InferenceParams,
        example: torch.Tensor,
        *,
        new_tokens: int = 1,
        warmup: int = 2,
    ) -> None:
        if not example.is_cuda:
            raise ValueError(f"CUDA graphs need CUDA tensors, got the input on {example.device}")
        if params.batch_size_offset:
            raise ValueError(
                f"DecodeGraph steps the whole batch: batch_size_offset is "
                f"{params.batch_size_offset}, set it to 0"
            )
        if not params.key_value_memory_dict:
            raise ValueError("params holds no cache yet: run the prompt before capturing a step")
        lens = params.host_lengths(params.max_batch_size)
        if lens is None:
            raise ValueError(
                "params' lengths are known only on the device; set them from the host "
                "(sequence_len_offset or set_sequence_lengths) before capturing, so the warm-up "
                "is checked against the cache capacity"
            )
        self.params, self.new_tokens = params, new_tokens
        self.input = example.clone()  # the static input buffer the graph reads
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(warmup):
                step(self.input)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.output = step(self.input)
            params.advance(new_tokens)
        # Capture ran nothing: the lengths are unchanged, so the host mirror is still right.
        params.set_sequence_lengths(lens)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run one step on `tokens`; returns the static output tensor (overwritten by the next
        call: copy what must outlive it). Checks the cache capacity on the host first."""
        params, rows = self.params, self.params.max_batch_size - self.params.batch_size_offset
        params.check_step(rows, self.new_tokens)
        self.input.copy_(tokens)
        self.graph.replay()
        params.note_advanced(self.new_tokens)
        return self.output


__all__ = ["DecodeGraph"]
