"""Threadgroup memory each Metal kernel declares, for every variant the dispatchers can pick.

MLX 0.32's Python API does not expose a pipeline's `staticThreadgroupMemoryLength`, so this
reads the kernel sources' `threadgroup TYPE name[N];` declarations at a launch's template
values. `metal-serve doctor` prints it per launch; the tests hold every variant at or under
`decode.THREADGROUP_MEMORY_BUDGET`, strictly below the 32 KB Metal allows.
"""

from __future__ import annotations

import ast
import contextlib
import operator
import re
from typing import NamedTuple

import mlx.core as mx

from kernels_metal import gated_delta, paged
from kernels_metal.decode import DECODE_SOURCE, REDUCE_SOURCE, decode_layout
from kernels_metal.kv_quant import KVQuant, empty_pool
from kernels_metal.prefill import PREFILL_SOURCE, prefill_tile

_CONSTEXPR_INT = re.compile(r"constexpr\s+int\s+(\w+)\s*=\s*([^;]+);")
_THREADGROUP_ARRAY = re.compile(r"threadgroup\s+(\w+)\s+\w+\s*\[([^\]]+)\]\s*;")
_SCALAR_BYTES = {"float": 4, "int": 4, "uint": 4, "half": 2, "bfloat": 2, "bfloat16_t": 2,
                 "short": 2, "ushort": 2, "char": 1, "uchar": 1, "bool": 1}
# MSL's vector types (`uint4`: 16 bytes; the kernels stage K/V tiles as them); a 3-vector
# takes the room of a 4-vector.
_SCALAR_BYTES |= {f"{name}{n}": size * (4 if n == 3 else n)
                  for name, size in list(_SCALAR_BYTES.items()) if name != "bfloat16_t"
                  for n in (2, 3, 4)}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.floordiv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
# Element types the dispatchers are asked about; they refuse those their kernels do not take.
_CANDIDATE_DTYPES = (mx.float16, mx.bfloat16, mx.float32, mx.float64, mx.int32)
# The scan's value dims checked (it takes any): a sample with the largest asked for, since no
# declaration would shrink as they grow.
SCAN_VALUE_DIMS = (1, 24, 64, 128, 256)
# MLA's latent rows checked: every width the decode kernel takes up to this (DeepSeek's 576).
LATENT_MAX_WIDTH = 1024


def declared_threadgroup_bytes(source: str, template: dict) -> int | None:
    """Bytes of the `threadgroup TYPE name[N];` arrays in `source` at the template's values
    (N over `constexpr int`s, template ints and `sizeof`); None if one is not that simple."""
    sizes = dict(_SCALAR_BYTES)
    sizes.update({k: v.size for k, v in template.items() if isinstance(v, mx.Dtype)})
    names = {k: int(v) for k, v in template.items() if isinstance(v, int)}

    def value(expr: str) -> int:
        expr = re.sub(r"sizeof\s*\(\s*(\w+)\s*\)", lambda m: str(sizes[m.group(1)]), expr)
        return _evaluate(ast.parse(expr.strip(), mode="eval").body, names)

    for name, expr in _CONSTEXPR_INT.findall(source):
        with contextlib.suppress(KeyError, SyntaxError, ValueError):  # then its arrays are not
            names[name] = value(expr)
    try:
        return sum(sizes[t] * value(n) for t, n in _THREADGROUP_ARRAY.findall(source))
    except (KeyError, SyntaxError, ValueError):
        return None


def _evaluate(node: ast.expr, names: dict[str, int]) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, names), _evaluate(node.right, names))
    raise ValueError(f"not an integer expression: {ast.dump(node)}")


class KernelVariant(NamedTuple):
    """What a kernel's threadgroup memory depends on: its element type and head dims (the
    heads, block size and step only change the grid)."""

    kernel: str
    dtype: mx.Dtype
    head_dim: int
    value_dim: int | None = None  # the gated-delta scan's; the attention kernels' is head_dim
    kv_bits: int | None = None

    @property
    def name(self) -> str:
        dtype = str(self.dtype).removeprefix("mlx.core.")
        kv = f"-kv{self.kv_bits}" if self.kv_bits else ""
        dims = f"-dk{self.head_dim}-dv{self.value_dim}" if self.value_dim else f"-d{self.head_dim}"
        return f"{self.kernel}-{dtype}{kv}{dims}"


def threadgroup_bytes(variant: KernelVariant) -> int | None:
    """Bytes `variant`'s kernel declares at the template its launch passes (None: unread)."""
    dtype, d = variant.dtype, variant.head_dim
    if variant.kernel == "paged_attention_decode":  # with a value_dim: MLA's latent rows
        latent = variant.value_dim is not None
        kl, kw, ldk, tile = decode_layout(dtype.size, d, latent)
        template = {"T": dtype, "D": d, "DV": variant.value_dim or d, "VK": latent,
                    "TILE": tile, "KL": kl, "KW": kw, "LDK": ldk}
        return declared_threadgroup_bytes(DECODE_SOURCE, template)
    if variant.kernel == "paged_attention_reduce":
        return declared_threadgroup_bytes(REDUCE_SOURCE, {"T": dtype, "D": d})
    if variant.kernel == "paged_attention_prefill":
        template = {"T": dtype, "D": d, "TK": prefill_tile(dtype.size, d)}
        return declared_threadgroup_bytes(PREFILL_SOURCE, template)
    if variant.kernel == "gated_delta_scan":
        kg, _ = gated_delta.scan_layout(d, variant.value_dim)
        template = {"T": dtype, "DK": d, "DV": variant.value_dim, "KG": kg}
        return declared_threadgroup_bytes(gated_delta.SCAN_SOURCE, template)
    raise ValueError(f"unknown kernel {variant.kernel!r}")


def dispatchable_variants(max_dim: int = 512) -> list[KernelVariant]:
    """Every kernel variant the attention and gated-delta dispatchers send to a kernel, as
    their own `unsupported_reason` decides: element types x head dims (1..max_dim) x float,
    int8 and int4 pools; MLA's latent widths; the scan's key dims (1..max_dim) x
    `SCAN_VALUE_DIMS`."""
    variants = []
    for dtype in _CANDIDATE_DTYPES:
        for d in range(1, max_dim + 1):
            for bits in (None, 8, 4):
                if _attention_takes(dtype, d, bits):
                    variants += [KernelVariant(kernel, dtype, d, kv_bits=bits) for kernel in
                                 ("paged_attention_decode", "paged_attention_reduce",
                                  "paged_attention_prefill")]
        for width in range(8, LATENT_MAX_WIDTH + 1, 8):
            latent = mx.zeros((1, 1, 1, width), dtype)
            if paged.latent_unsupported_reason(mx.zeros((1, 1, width), dtype), latent,
                                               width - 8) is None:
                variants.append(KernelVariant("paged_attention_decode", dtype, width,
                                              width - 8))
        for dk in range(1, max_dim + 1):
            for dv in (*SCAN_VALUE_DIMS, max_dim):
                q, v = mx.zeros((1, 1, dk), dtype), mx.zeros((1, 1, dv), dtype)
                if gated_delta.unsupported_reason(q, q, v) is None:
                    variants.append(KernelVariant("gated_delta_scan", dtype, dk, dv))
    return variants


def _attention_takes(dtype: mx.Dtype, head_dim: int, kv_bits: int | None) -> bool:
    q = mx.zeros((1, 1, head_dim), dtype)
    if kv_bits is None:
        return paged.unsupported_reason(q, mx.zeros((1, 1, 1, head_dim), dtype)) is None
    try:
        pool = empty_pool(1, 1, 1, head_dim, KVQuant(kv_bits))
    except ValueError:  # no int8/int4 pool has this head dim
        return False
    return paged.unsupported_reason(q, pool) is None
