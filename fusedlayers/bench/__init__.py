"""Benchmarks as data: every run is a JSON file, and BENCHMARKS.md is rendered from them.

    python -m fusedlayers.bench attention --quick     # on your GPU: JSON + plots in bench-out/
    python -m fusedlayers.bench report                # BENCHMARKS.md + docs/img/ from bench/*.json

Modules:
    record      the run's header (GPU, driver, versions, commit, command, matmul gate) and the
                JSON writer/reader every benchmark script uses
    common      measuring helpers: FLOP counts, timing, memory, the correctness check
    attention   the attention benchmark (its cases and providers in attention_cases)
    report      BENCHMARKS.md from the newest runs of each kind (tables in tables, plots in plots)

Imports point one way: this package uses fusedlayers, its kernels and models, never `examples/`.
"""
