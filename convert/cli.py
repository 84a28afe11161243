"""The `convert` command's arguments and runner; the top-level CLI mounts them."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from convert.api import convert_model, local_source
from convert.model_dir import DTYPES
from metal_engine.loading.model_config import ModelConfig, read_config_json
from metal_engine.loading.parameter_count import count_parameters
from metal_engine.loading.quantization import GROUP_SIZES


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the source and the options of `metal-serve convert` to `parser`."""
    parser.add_argument("source",
                        help="a .gguf file, a Hugging Face model dir, or a hub repo id (org/name) "
                             "of Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, Phi-3, "
                             "Mixtral, Qwen3-MoE or GLM-4.5")
    parser.add_argument("--out", type=Path, required=True, help="model directory to create")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="dtype of the written weights, or of the scales and biases of "
                             "quantized ones (default: float32)")
    parser.add_argument("--quantize", type=int, choices=(4, 8),
                        help="quantize Linear, Embedding and expert weights to this many bits "
                             "(MLX affine quantization, as mlx-lm writes it)")
    parser.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=64,
                        help="weights sharing one scale and bias when quantizing (default: 64)")
    parser.add_argument("--text-only", action="store_true",
                        help="leave a multimodal checkpoint's vision tower out (Qwen3.5, "
                             "Qwen3-VL keep it by default)")
    parser.add_argument("--revision", help="branch, tag or commit of a hub repo (default: main)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--no-validate", dest="validate", action="store_false",
                        help="skip loading the result and comparing its logits with the source")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run_convert(args: argparse.Namespace) -> int:
    """Convert, validate, print a short summary; return the exit code (2 for a bad source or
    --out, 1 when the result's logits are off)."""
    start = time.perf_counter()
    try:
        out = convert_model(args.source, args.out, dtype=args.dtype, force=args.force,
                            progress=not args.no_progress, quantize=args.quantize,
                            group_size=args.group_size, revision=args.revision,
                            text_only=args.text_only)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"metal-serve convert: error: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    bits = f"  {args.quantize}-bit (group size {args.group_size})" if args.quantize else ""
    parameters = count_parameters(ModelConfig.from_dict(read_config_json(out)))
    print(f"wrote {out}")
    print(f"  {parameters.describe()}  dtype {args.dtype}{bits}  "
          f"size {size / 1e6:,.1f} MB  in {seconds:.1f} s")
    if not args.validate:
        return 0
    from convert.validate import validate_conversion  # loads the engine: only when asked

    try:
        check = validate_conversion(local_source(args.source, args.revision), out)
    except (ValueError, FileNotFoundError) as exc:  # e.g. the result does not load
        print(f"metal-serve convert: validation failed: {exc}", file=sys.stderr)
        return 1
    verdict = "ok" if check.passed else f"FAILED (tolerance {check.tolerance:g})"
    print(f"  logits vs {check.reference}: relative error {check.relative_error:.2e}  {verdict}")
    return 0 if check.passed else 1
