"""MSL source -> C++ for the compatibility header: a few mechanical rewrites, and loud refusals.

The rewrites (everything else compiles as written against msl_compat.h):

1. `[[...]]` attribute lists are dropped (`[[kernel]]`, `[[buffer(0)]]`, `[[host_name(..)]]`).
2. A threadgroup variable declaration `threadgroup T name[N]...;` becomes a reference into the
   threadgroup's arena, so all threads of a threadgroup share it (as on the GPU).
3. Vector constructors `float4(...)`, `vec<T, N>(...)` become `msl::make<...>(...)`, which
   splats, converts element-wise or concatenates like MSL (C++ would bit-cast or reject them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class MSLUnsupportedError(RuntimeError):
    """The kernel uses an MSL construct that the emulator does not model."""


_SCALARS = r"(?:float|half|bfloat|int|uint|short|ushort|char|uchar|long|ulong|bool)"

# (pattern, what to tell the user)
_UNSUPPORTED = (
    (r"\b(?:texture[123]d(?:_array)?|texturecube|depth2d|texture_buffer)\b", "textures"),
    (r"\bsampler\b", "samplers"),
    (r"\batomic_\w+|\batomic\s*<", "atomics (atomic_* functions and atomic<T> types)"),
    (r"\bsimdgroup_async_copy\b|\bsimdgroup_event\b", "simdgroup_async_copy"),
    (r"\bquad_\w+\s*\(", "quad_* functions"),
    (r"\bsimd_ballot\b|\bsimd_vote\b|\bsimd_active_threads_mask\b", "simd_ballot / simd_vote"),
    (r"\bimageblock\b", "imageblocks"),
    (r"\[\[\s*threadgroup\s*\(", "threadgroup buffer arguments ([[threadgroup(n)]])"),
    (r"(?<![\w.])(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?h\b", "half literals with the 'h' suffix"),
    (r"\(\s*(?:const\s+)?" + _SCALARS + r"[234]\s*\)\s*[\w(]", "C-style casts to vector types"),
    (r"\bvisible_function_table\b|\bintersection_function_table\b", "function tables"),
    (r"\braytracing\b", "ray tracing"),
)

_ATTRIBUTE = re.compile(r"\[\[(?:[^\[\]]|\[[^\[\]]*\])*\]\]")
_THREADGROUP_DECL = re.compile(
    r"\bthreadgroup\s+(?P<type>(?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?)\s+"
    r"(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\];]+\]\s*)*);"
)
# A threadgroup declaration the rewrite did not take (several declarators, an initializer).
_LEFTOVER_DECL = re.compile(
    r"\bthreadgroup\s+(?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?\s+"
    r"[A-Za-z_]\w*\s*(?:\[[^\];]+\]\s*)*[,=]"
)
_VECTOR_CTOR = re.compile(r"(?<![\w:.])(" + _SCALARS + r"[234])\s*\(")
_VEC_TEMPLATE_CTOR = re.compile(r"(?<![\w:.])vec\s*<([^<>()]*)>\s*\(")
_METAL_INCLUDE = re.compile(r"^\s*#\s*include\s*<metal_\w+>\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Translation:
    cpp: str
    threadgroup_sites: int


def check_supported(msl: str) -> None:
    """Raise MSLUnsupportedError naming the first construct the emulator cannot run."""
    code = _strip_comments(msl)
    for pattern, what in _UNSUPPORTED:
        m = re.search(pattern, code)
        if m:
            line = code.count("\n", 0, m.start()) + 1
            raise MSLUnsupportedError(
                f"MSL construct not supported by the emulator: {what} "
                f"(found {m.group(0).strip()!r} on line {line} of the kernel source)"
            )


def translate(msl: str) -> Translation:
    check_supported(msl)
    code = _METAL_INCLUDE.sub("", msl)
    code = _ATTRIBUTE.sub("", code)
    sites = 0

    def threadgroup_decl(m: re.Match) -> str:
        nonlocal sites
        site, sites = sites, sites + 1
        dims = re.sub(r"\s+", "", m.group("dims"))
        return (
            f"auto& {m.group('name')} = "
            f"::msl::threadgroup_array<{m.group('type')}{dims}>({site});"
        )

    code = _THREADGROUP_DECL.sub(threadgroup_decl, code)
    leftover = _LEFTOVER_DECL.search(_strip_comments(code))
    if leftover:
        raise MSLUnsupportedError(
            "MSL construct not supported by the emulator: a threadgroup declaration with "
            f"several variables or an initializer ({leftover.group(0).strip()!r}); "
            "declare one threadgroup variable per statement"
        )
    code = _VECTOR_CTOR.sub(r"::msl::make<\1>(", code)
    code = _VEC_TEMPLATE_CTOR.sub(r"::msl::make<vec<\1>>(", code)
    return Translation(code, sites)


def _strip_comments(code: str) -> str:
    """Comments blanked out (newlines kept, so line numbers hold)."""
    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    return re.sub(r"//[^\n]*|/\*.*?\*/", blank, code, flags=re.DOTALL)
