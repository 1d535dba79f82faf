"""`python -m fusedlayers.bench attention [...]` or `python -m fusedlayers.bench report [...]`.

attention   the attention benchmark on this GPU (`--quick`: the headline cells, ~2 minutes)
report      BENCHMARKS.md and docs/img/ from the runs in bench/
"""

from __future__ import annotations

import sys

COMMANDS = ("attention", "report")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv[0] not in COMMANDS:
        print(f"unknown command {argv[0]!r}\n\n{__doc__.strip()}", file=sys.stderr)
        return 2
    if argv[0] == "attention":  # imports torch and the kernels: only when asked for
        from .attention import main as command
    else:
        from .report import main as command
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
