"""Attention benchmark: fusedlayers against PyTorch SDPA (flash, cuDNN, efficient) and
FlexAttention. The code is `fusedlayers.bench.attention`; this script keeps the old command.

    python examples/benchmark_attention.py --quick   # python -m fusedlayers.bench attention --quick
    python examples/benchmark_attention.py --help

The names below are re-exported for the profiling scripts in examples/perf/, which build the
benchmark's cases and providers to profile the same calls it times.
"""

from __future__ import annotations

import sys

from fusedlayers.bench.attention import (  # noqa: F401  (re-exported for examples/perf/)
    CASES,
    HIDDEN,
    PROVIDERS,
    TOKENS,
    TOLERANCE,
    build_cases,
    main,
    parse_args,
)
from fusedlayers.bench.attention_cases import DTYPES, SETUPS, Case  # noqa: F401
from fusedlayers.bench.common import attention_flops  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
