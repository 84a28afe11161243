"""convert_model: turn a GGUF file, a Hugging Face dir or a hub repo id into an MLX model dir."""

from __future__ import annotations

from pathlib import Path

from convert.gguf_source import open_gguf
from convert.hf_source import open_hf_dir
from convert.hub import hub_snapshot, is_repo_id
from convert.model_dir import DTYPES, check_out_dir, write_model_dir
from convert.source import ModelSource
from metal_engine.loading.quantization import QuantParams


def local_source(source: str | Path, revision: str | None = None) -> Path:
    """The local file or dir `source` names: a path as it is, a hub repo id as its snapshot."""
    path = Path(source).expanduser()
    if not path.exists() and is_repo_id(str(source)):
        return hub_snapshot(str(source), revision)
    if not path.exists():
        raise FileNotFoundError(
            f"model source {source} does not exist (neither a local path nor a hub repo id "
            "such as org/name)"
        )
    return path


def open_source(path: Path, text_only: bool = False) -> ModelSource:
    """Open a local .gguf file or Hugging Face dir; nothing heavy is read yet. `text_only`:
    leave a multimodal checkpoint's vision tower out."""
    if path.is_dir():
        return open_hf_dir(path, text_only)
    if path.is_file() and path.suffix == ".gguf":
        return open_gguf(path)
    raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face model dir")


def convert_model(
    source: str | Path,
    out: str | Path,
    dtype: str = "float32",
    force: bool = False,
    progress: bool = True,
    quantize: int | None = None,
    group_size: int = 64,
    revision: str | None = None,
    text_only: bool = False,
) -> Path:
    """Convert `source` (a .gguf file, a Hugging Face model dir or hub repo id) into the model
    dir `out`, with Linear/Embedding weights quantized to `quantize` bits if given. A Qwen
    vision tower comes along (float, never quantized) unless `text_only`.

    `out` appears only once complete; an existing non-empty `out` is replaced only with `force`.
    Returns `out`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    quantization = QuantParams(group_size, quantize) if quantize else None
    path, out = local_source(source, revision), Path(out).expanduser()
    if out.resolve() == path.resolve() or out.resolve() in path.resolve().parents:
        raise ValueError(f"--out {out} would replace the source {source}; choose another --out")
    check_out_dir(out, force)  # before reading a large source, not after
    return write_model_dir(open_source(path, text_only), out, dtype, force, progress,
                           quantization)
