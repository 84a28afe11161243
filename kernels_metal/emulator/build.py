"""Compile translated kernels with clang into shared objects, cached on disk by source hash."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from functools import cache
from pathlib import Path

from kernels_metal.emulator.translate import MSLUnsupportedError

HERE = Path(__file__).parent
CLANG_NAMES = ("clang-19", "clang++-19", "clang")
# A Mac's clang is Apple's (Xcode or its command line tools), as clang++ on PATH.
MAC_CLANG_NAMES = ("clang-19", "clang++-19", "clang++", "clang")
INSTALL_HINTS = {
    "darwin": "a clang on PATH (xcode-select --install gives Apple's; Homebrew's llvm works too)",
    "linux": "clang 19 (apt-get install clang-19)",
}
# No type-based aliasing: kernels view one buffer through several types (16-byte copies).
CXXFLAGS = ("-std=c++17", "-O1", "-fPIC", "-shared", "-fno-exceptions", "-fno-rtti", "-w",
            "-fno-strict-aliasing")
# macOS's linker refuses a library with unresolved symbols unless told they resolve at load
# time: the kernels' calls into the runtime (libmslrt, loaded globally first).
LINK_FLAGS = ("-Wl,-undefined,dynamic_lookup",) if sys.platform == "darwin" else ()
# Bump when the launch ABI between msl_runtime.cpp and generated launchers changes.
ABI_VERSION = "2"
RUNTIME_SOURCES = ("msl_runtime.cpp", "msl_buffers.cpp")
# What the availability check compiles: the headers' half and bfloat arithmetic, which every
# kernel uses and an older clang may lack (arithmetic on `__bf16` is recent in clang).
PROBE_SOURCE = """#include "msl_compat.h"
extern "C" float msl_probe(float x) {
  half h = half(x);
  bfloat b = bfloat(x);
  return float(h * h + h) + float(b * b + b);
}
"""


class MSLCompileError(RuntimeError):
    """clang rejected the translated kernel; the message carries its diagnostics."""


def find_clang() -> str | None:
    override = os.environ.get("METAL_SERVE_CLANG")
    if override:
        return override if shutil.which(override) else None
    names = MAC_CLANG_NAMES if sys.platform == "darwin" else CLANG_NAMES
    return next((path for name in names if (path := shutil.which(name))), None)


@cache
def unavailable_reason() -> str | None:
    """Why the emulator cannot build kernels here, or None: a clang on PATH that compiles
    `PROBE_SOURCE` (checked once per compiler and headers, the result cached on disk)."""
    clang = find_clang()
    if clang is None:
        hint = INSTALL_HINTS.get(sys.platform, INSTALL_HINTS["linux"])
        return f"The MSL emulator needs {hint}, or set METAL_SERVE_CLANG"
    path = cache_dir() / f"probe-{_digest(PROBE_SOURCE, _headers(), clang, *CXXFLAGS)}.so"
    if path.exists():
        return None
    try:
        with _lock:
            _compile([PROBE_SOURCE], path, LINK_FLAGS)
    except (MSLCompileError, MSLUnsupportedError, OSError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        first = next((line for line in lines if "error:" in line),
                     lines[-1] if len(lines) > 1 else "it failed without a message")
        return f"{clang} cannot compile the MSL emulator's headers: {first}"
    return None


def cache_dir() -> Path:
    root = os.environ.get("METAL_SERVE_MSL_EMU_CACHE")
    path = Path(root) if root else Path.home() / ".cache" / "metal-serve" / "msl-emu"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _clang() -> str:
    clang = find_clang()
    if clang is None:
        raise RuntimeError(unavailable_reason())
    return clang


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _compile(sources: list[str], out: Path, extra: tuple[str, ...] = ()) -> None:
    """clang C++ `sources` into `out` atomically (concurrent test workers share the cache)."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        files = []
        for i, source in enumerate(sources):
            files.append(Path(tmp) / f"unit{i}.cpp")
            files[-1].write_text(source)
        target = Path(tmp) / out.name
        cmd = [_clang(), *CXXFLAGS, f"-I{HERE}", *map(str, files), "-o", str(target), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise _compile_error(proc.stderr)
        os.replace(target, out)


# clang's words for a name the compatibility header does not define.
_UNDECLARED = re.compile(
    r"use of undeclared identifier '(\w+)'|no member named '(\w+)' in namespace 'metal'"
    r"|unknown type name '(\w+)'|no template named '(\w+)'"
)


_UNMODELLED = re.compile(r"(fast-math \w+ is not modelled by the MSL emulator: call precise::\w+)")


def _compile_error(stderr: str) -> Exception:
    errors = [line for line in stderr.splitlines() if "error:" in line]
    unmodelled = _UNMODELLED.search(stderr)
    if unmodelled:
        return MSLUnsupportedError(
            f"MSL construct not supported by the emulator: {unmodelled.group(1)}")
    m = _UNDECLARED.search(stderr)
    if m:
        name = next(g for g in m.groups() if g)
        return MSLUnsupportedError(
            f"MSL construct not supported by the emulator (or a typo in the kernel): {name!r}\n"
            + "\n".join(errors[:5])
        )
    return MSLCompileError("clang rejected the kernel:\n" + "\n".join(errors[:10]) +
                           "\n\n" + stderr[-4000:])


_lock = threading.Lock()


@cache
def runtime_library() -> ctypes.CDLL:
    """libmslrt: fibers, barriers, guarded buffers. Loaded globally so kernels bind to it."""
    sources = [(HERE / name).read_text() for name in RUNTIME_SOURCES]
    # The portable (ucontext) fiber switch, to test the path non-x86 hosts take.
    extra = ("-DMSL_USE_UCONTEXT",) if os.environ.get("METAL_SERVE_MSL_EMU_UCONTEXT") else ()
    digest = _digest(*sources, _headers(), *CXXFLAGS, *extra, ABI_VERSION)
    path = cache_dir() / f"libmslrt-{digest}.so"
    with _lock:
        if not path.exists():
            _compile(sources, path, ("-lpthread", *extra))
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    lib.msl_buffer_alloc.restype = ctypes.c_void_p
    lib.msl_buffer_alloc.argtypes = [ctypes.c_size_t, ctypes.c_char_p, ctypes.c_int]
    lib.msl_buffer_set_readonly.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.msl_buffer_check.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.msl_buffer_free.argtypes = [ctypes.c_void_p]
    lib.msl_run.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint32),
        ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
    ]
    return lib


@cache
def _headers() -> str:
    return "".join(p.read_text() for p in sorted(HERE.glob("*.h")))


def kernel_library_path(cpp: str) -> Path:
    return cache_dir() / f"kernel-{_digest(cpp, _headers(), *CXXFLAGS, ABI_VERSION)}.so"


def build_kernel(cpp: str) -> Path:
    """Compile (or find in the cache) the shared object for a full translated kernel TU."""
    path = kernel_library_path(cpp)
    if not path.exists():
        _compile([cpp], path, ("-lm", *LINK_FLAGS))
    return path
