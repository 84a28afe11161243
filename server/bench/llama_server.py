"""llama-server as a `bench compare` peer: built from the llama.cpp sources that the
llama-cpp-python sdist ships (PyPI is the only registry here), serving a float32 GGUF made
from the default model's Q4_1 one, so it reads the same float32 weights metal-serve does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

SDIST = "llama-cpp-python"
TARGETS = ("llama-server", "llama-quantize")


def binary(root: Path, name: str = "llama-server") -> Path:
    return root / "build" / "bin" / name


def build(root: Path, timeout_s: float) -> tuple[str | None, str | None]:
    """Download the sdist into `root` and build the targets there; (version, error)."""
    root.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    log_path = root / "install.log"
    with log_path.open("w") as log:
        error = _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                      ":all:", SDIST, "-d", str(root)], log, deadline)
        if error:
            return None, error
        sdist = max(root.glob("llama_cpp_python-*.tar.gz"))
        version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(root, filter="data")
        source = root / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
        for command in (
            ["cmake", "-S", str(source), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release",
             "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"],
            ["cmake", "--build", str(root / "build"), "--target", *TARGETS,
             "-j", str(os.cpu_count() or 1)],
        ):
            error = _run(command, log, deadline)
            if error:
                return None, error
    (root / "install.json").write_text(json.dumps({"version": version}) + "\n")
    return version, None


def root_of(server: Path) -> Path:
    """The build root of a `binary(root)`."""
    return server.parents[2]


def built_version(root: Path) -> str | None:
    record = root / "install.json"
    if not (binary(root).is_file() and record.is_file()):
        return None
    return json.loads(record.read_text())["version"]


def f32_gguf(root: Path, gguf: Path) -> Path:
    """A float32 copy of `gguf` (made once, by the build's llama-quantize)."""
    target = root / f"{gguf.stem}.F32.gguf"
    if not target.is_file():
        partial = target.with_suffix(".partial")
        subprocess.run([str(binary(root, "llama-quantize")), "--allow-requantize", str(gguf),
                        str(partial), "F32"], check=True, capture_output=True)
        partial.replace(target)
    return target


def server_args(root: Path, gguf: Path) -> list[str]:
    """llama-server on all cores, with a slot for each of up to 16 requests at once, sharing
    one K/V buffer of 16 x 4096 tokens (so one request may hold the model's whole context)."""
    threads = str(os.cpu_count() or 1)
    return [str(binary(root)), "-m", str(f32_gguf(root, gguf)), "--host", "127.0.0.1",
            "-t", threads, "-tb", threads, "-np", "16", "-c", str(16 * 4096), "--kv-unified"]


def _run(command: list[str], log, deadline: float) -> str | None:
    left = deadline - time.monotonic()
    if left <= 0:
        return "the build ran out of time; skipped"
    # Its own session, so a timeout also stops the compilers it started.
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        code = process.wait(left)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return "the build ran out of time; skipped"
    if code != 0:
        return f"`{' '.join(command[:3])} ...` failed (exit {code}); see {log.name}"
    return None
