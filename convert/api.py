"""convert_model: turn a GGUF file or a Hugging Face dir into an MLX model dir."""

from __future__ import annotations

from pathlib import Path

from convert.gguf_source import open_gguf
from convert.hf_source import open_hf_dir
from convert.model_dir import DTYPES, check_out_dir, write_model_dir


def convert_model(
    source: str | Path,
    out: str | Path,
    dtype: str = "float32",
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Convert `source` (a .gguf file or a Hugging Face model dir) into the model dir `out`.

    `out` appears only once complete; an existing non-empty `out` is replaced only with `force`.
    Returns `out`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    source, out = Path(source).expanduser(), Path(out).expanduser()
    if out.resolve() == source.resolve() or out.resolve() in source.resolve().parents:
        raise ValueError(f"--out {out} would replace the source {source}; choose another --out")
    check_out_dir(out, force)  # before reading a large source, not after
    if source.is_dir():
        opened = open_hf_dir(source)
    elif source.is_file() and source.suffix == ".gguf":
        opened = open_gguf(source)
    elif source.exists():
        raise ValueError(f"{source} is neither a .gguf file nor a Hugging Face model dir")
    else:
        raise FileNotFoundError(f"model source {source} does not exist")
    return write_model_dir(opened, out, dtype, force, progress)
