"""The sha256 of a run's final weights: every tensor's name and bytes, in name order.

A refactor that must not change behaviour (issue 26) is checked by this digest of the
default's final weights before and after::

    diloco-ray train configs/tiny.yaml --set output_dir=/tmp/run
    python bench/digest.py /tmp/run

It reads ``OUTPUT_DIR/final/*.safetensors`` (the file's own bytes also hold a JSON header
whose key order could change without the weights changing, so the tensors are hashed).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import sys

from safetensors.torch import load_file


def digest(output_dir: str) -> str:
    """The sha256 over (name, bytes) of every tensor in ``output_dir/final``, names sorted."""
    files = sorted(glob.glob(os.path.join(output_dir, "final", "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{output_dir}/final: no .safetensors file (did the run finish?)")
    tensors = {}
    for path in files:
        tensors.update(load_file(path))
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="a finished run's output_dir")
    args = parser.parse_args(argv)
    try:
        print(digest(args.output_dir))
    except FileNotFoundError as e:
        print(f"digest: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
