"""An adapter's safetensors file read into float32 numpy arrays, with no MLX call.

Loading runs on a worker thread beside the engine's steps, so it must not touch MLX's
streams (an MLX array read there would be evaluated on the engine thread, file and all).
The `safetensors` package reads no bfloat16 into numpy, and adapters are often saved so: the
file's layout (an 8-byte little-endian header size, a JSON header of dtype, shape and byte
offsets per tensor, then the data) is read here directly.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_FLOATS = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def read_float_tensors(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of `file` as float32; ValueError saying what is wrong with the file."""
    data = file.read_bytes()
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    (size,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    body = memoryview(data)[8 + size :]
    header.pop("__metadata__", None)
    return {name: _tensor(name, entry, body) for name, entry in header.items()}


def _tensor(name: str, entry: dict, body: memoryview) -> np.ndarray:
    try:
        dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"tensor {name}: no dtype, shape and data_offsets") from None
    if end > len(body) or start > end:
        raise ValueError(f"tensor {name}: its data runs past the end of the file (truncated?)")
    raw = body[start:end]
    if dtype == "BF16":  # bfloat16 is float32's upper half
        values = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    elif dtype in _FLOATS:
        values = np.frombuffer(raw, np.dtype(_FLOATS[dtype]).newbyteorder("<"))
    else:
        raise ValueError(f"tensor {name} is {dtype}, not a float (a quantized adapter?)")
    if values.size != int(np.prod(shape)):
        raise ValueError(f"tensor {name}: {values.size} values for shape {shape}")
    return values.astype(np.float32).reshape(shape)
