"""The `convert` command's arguments and runner; the top-level CLI mounts them."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from convert.api import convert_model
from convert.model_dir import DTYPES, read_manifest


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """Add source, --out, --dtype, --force and --no-progress to `parser`."""
    parser.add_argument("source", type=Path,
                        help="a .gguf file or a Hugging Face model dir (Llama, Mistral, Qwen2, "
                             "Qwen3, Gemma 2, Gemma 3 text, Phi-3)")
    parser.add_argument("--out", type=Path, required=True, help="model directory to create")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="dtype of the written weights (default: float32)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run_convert(args: argparse.Namespace) -> int:
    """Convert, print a short summary, return the exit code (2 for a bad source or --out)."""
    start = time.perf_counter()
    try:
        out = convert_model(args.source, args.out, dtype=args.dtype, force=args.force,
                            progress=not args.no_progress)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"metal-serve convert: error: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    manifest = read_manifest(out) or {}
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out}")
    print(f"  parameters {manifest.get('num_parameters', 0):,}  dtype {args.dtype}  "
          f"size {size / 1e6:,.1f} MB  in {seconds:.1f} s")
    return 0
