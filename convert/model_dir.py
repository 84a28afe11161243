"""Write a ModelSource as an MLX model dir, atomically: build it in a temp dir, then rename."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import mlx.core as mx
from tqdm import tqdm

from convert.layout import config_dict, stored_shapes, tensor_shapes
from convert.quantize import TensorQuantizer, quantization_entries
from convert.source import ModelSource, fingerprint
from metal_engine.loading.model_config import MANIFEST_FILE
from metal_engine.loading.model_dtype import source_dtype
from metal_engine.loading.quantization import QuantParams

# 2: Gemma 4 configs transformers' AutoConfig reads; the source's dtype in the manifest.
CONVERTER_VERSION = "2"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
MAX_SHARD_BYTES = 2 * 1024**3


def check_out_dir(out: Path, force: bool) -> None:
    """Raise FileExistsError if writing `out` would replace something without `force`."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(
            f"{out} already exists and is not empty; pass force=True (--force) to replace it"
        )


def write_model_dir(
    source: ModelSource, out: Path, dtype: str, force: bool, progress: bool,
    quantization: QuantParams | None = None,
) -> Path:
    """Write config, weights, tokenizer and manifest for `source`; `out` appears only when done.

    With `quantization`, Linear and Embedding weights are written quantized (mlx-lm's layout)
    and `dtype` is that of their scales and biases and of every other tensor. Modules the
    source hands over quantized (`source.quantized`) are written as they come.
    """
    check_out_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Same filesystem as `out`, so the final rename is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; a model dir is meant to be shared
        source.write_tokenizer(tmp)  # first: it fails fast on an unusable tokenizer
        quantizer = (TensorQuantizer(source.config, quantization, DTYPES[dtype], source.quantized)
                     if quantization else None)
        num_params = write_weights(source, tmp, dtype, progress, quantizer)
        config = config_dict(source.config, dtype, source.base_config)
        config.update(quantization_entries(quantizer, source.quantized))
        _write_json(tmp / "config.json", config)
        _write_json(tmp / MANIFEST_FILE, _manifest(source, dtype, num_params, quantization))
        _publish(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_weights(source: ModelSource, folder: Path, dtype: str, progress: bool,
                  quantizer: TensorQuantizer | None = None) -> int:
    """Write the tensors as safetensors shards of at most MAX_SHARD_BYTES; return the param count
    (of the float model, also when `quantizer` packs the weights).

    One shard is named model.safetensors; several get the Hugging Face names plus an index.
    """
    writer = _ShardWriter(folder, MAX_SHARD_BYTES)
    total = len(stored_shapes(source.config, source.quantized)) + len(source.extra_shapes)
    for name, tensor in tqdm(source.tensors(), total=total, desc="converting", unit="tensor",
                             disable=not progress):
        array = mx.array(tensor)
        stored = quantizer(name, array) if quantizer else [(name, _cast(array, DTYPES[dtype]))]
        for stored_name, stored_array in stored:
            mx.eval(stored_array)
            writer.add(stored_name, stored_array)
    writer.finish()
    return sum(math.prod(shape) for shape in tensor_shapes(source.config).values())


def _cast(array: mx.array, dtype: mx.Dtype) -> mx.array:
    # Packed weights and their uint8 scales stay as they are.
    return array.astype(dtype) if mx.issubdtype(array.dtype, mx.floating) else array


def save_shard(path: Path, tensors: dict[str, mx.array]) -> None:
    # "pt" tells transformers the layout is PyTorch's [out, in]; mlx-lm accepts it too.
    mx.save_safetensors(str(path), tensors, metadata={"format": "pt"})


class _ShardWriter:
    """Collects tensors and saves a shard whenever the next tensor would overflow it."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder, self.max_bytes = folder, max_bytes
        self.pending: dict[str, mx.array] = {}
        self.pending_bytes = self.total_bytes = 0
        self.saved: list[tuple[Path, list[str]]] = []

    def add(self, name: str, array: mx.array) -> None:
        if self.pending and self.pending_bytes + array.nbytes > self.max_bytes:
            self._save_pending()
        self.pending[name] = array
        self.pending_bytes += array.nbytes
        self.total_bytes += array.nbytes

    def finish(self) -> None:
        """Save the last shard and give every shard its final name (names need the count)."""
        self._save_pending()
        if len(self.saved) == 1:
            self.saved[0][0].rename(self.folder / "model.safetensors")
            return
        weight_map: dict[str, str] = {}
        for number, (path, names) in enumerate(self.saved, start=1):
            final = f"model-{number:05d}-of-{len(self.saved):05d}.safetensors"
            path.rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        _write_json(self.folder / INDEX_FILE, index)

    def _save_pending(self) -> None:
        path = self.folder / f"shard-{len(self.saved):05d}.safetensors"
        save_shard(path, self.pending)
        self.saved.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a model dir this package wrote, or None if there is none."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _manifest(source: ModelSource, dtype: str, num_params: int,
              quantization: QuantParams | None) -> dict[str, Any]:
    return {
        "converter_version": CONVERTER_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dtype": dtype,
        "quantization": quantization.to_dict() if quantization else None,
        "num_parameters": num_params,
        "source": {
            "kind": source.kind,
            "path": str(source.path.resolve()),
            "files": fingerprint(source.files),
            # What its publisher saved it in: `--dtype auto` runs it so on an Apple GPU.
            "dtype": source_dtype(source.base_config),
        },
    }


def _publish(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished dir to `out`, replacing an existing one only with `force`."""
    # Checked again: another process may have written `out` while this one converted.
    check_out_dir(out, force)
    if not out.exists():
        tmp.rename(out)
        return
    old = tmp.with_name(tmp.name + ".old")  # tmp is unique, so this name is free
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

