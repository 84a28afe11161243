"""The servers `bench compare` runs side by side, each in a virtual environment of its own.

metal-serve       this environment; the converted default model dir
mlx-lm            `python -m mlx_lm server` on the same model dir, same mlx version
llama-cpp-python  `python -m llama_cpp.server` on the default model's GGUF
llama-server      llama.cpp's own server, built from that sdist's sources, on a float32 GGUF
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from server.bench import llama_server

# Runs our CLI from any python that can import this package.
OUR_CLI = "from server.cli import run; run()"
# mlx-lm does not load an optimized BLAS itself; without one its fp32 matmuls would run on
# the reference BLAS of the mlx CPU wheel and the comparison would not be fair.
_MLX_LM_LAUNCHER = (
    "import ctypes, runpy, sys; blas = sys.argv.pop(1); "
    "blas and ctypes.CDLL(blas, mode=ctypes.RTLD_GLOBAL); "
    "sys.argv[0] = 'mlx_lm'; runpy.run_module('mlx_lm', run_name='__main__')"
)


@dataclass(frozen=True)
class Peer:
    name: str  # also the distribution whose version the report shows
    requirements: tuple[str, ...]  # pip requirements; () runs from this environment
    import_name: str  # importable once installed
    model_name: str | None  # what requests send as `model`; None: the first of /v1/models


@dataclass(frozen=True)
class Installed:
    """A peer ready to start (`executable` set: its python, or its binary) or the reason it
    is not (`error`)."""

    executable: Path | None
    version: str | None = None
    install_s: float | None = None
    error: str | None = None


def peers() -> dict[str, Peer]:
    mlx_cpu = f"mlx[cpu]=={importlib.metadata.version('mlx')}"
    listed = [
        Peer("metal-serve", (), "server", "default"),
        Peer("mlx-lm", ("mlx-lm", mlx_cpu), "mlx_lm", "default_model"),
        Peer("llama-cpp-python", ("llama-cpp-python[server]",), "llama_cpp", None),
        Peer("llama-server", (), "", None),  # built, not pip-installed: llama_server.py
    ]
    return {peer.name: peer for peer in listed}


def server_command(
    peer: Peer, python: Path, model_dir: Path, gguf: Path, port: int, blas: str | None
) -> list[str]:
    """The command line that serves `peer` on 127.0.0.1:`port` (`python`: what `install`
    gave as its executable)."""
    if peer.name == "llama-server":
        return [*llama_server.server_args(llama_server.root_of(python), gguf), "--port", str(port)]
    if peer.name == "metal-serve":
        args = ["-c", OUR_CLI, "serve", str(model_dir), "--log-level", "warning"]
    elif peer.name == "mlx-lm":
        args = ["-c", _MLX_LM_LAUNCHER, blas or "", "server", "--model", str(model_dir)]
        args += ["--log-level", "WARNING"]
    else:
        threads = str(os.cpu_count() or 1)
        args = ["-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1"]
        # Its defaults use half the cores and cancel a running request when the next arrives.
        args += ["--n_ctx", "4096", "--n_threads", threads, "--n_threads_batch", threads]
        args += ["--interrupt_requests", "False", "--verbose", "False"]
    return [str(python), *args, "--port", str(port)]


def install(peer: Peer, work_dir: Path, timeout_s: float, allow_install: bool) -> Installed:
    """Reuse the peer's venv under `work_dir` if it imports, else create it and pip install
    (with a time limit: llama-cpp-python compiles llama.cpp from source)."""
    if peer.name == "llama-server":
        return _build_llama_server(work_dir / peer.name, timeout_s, allow_install)
    if not peer.requirements:
        return Installed(Path(sys.executable), _version(Path(sys.executable), peer))
    venv = work_dir / peer.name
    python = venv / "bin" / "python"
    record = venv / "install.json"
    if _imports(python, peer.import_name):
        seconds = json.loads(record.read_text()).get("seconds") if record.is_file() else None
        return Installed(python, _version(python, peer), seconds)
    if not allow_install:
        return Installed(None, error=f"not installed under {venv} (and --no-install)")
    print(
        f"[{peer.name}] installing {' '.join(peer.requirements)} into {venv} "
        f"(limit {timeout_s / 60:.0f} min)",
        flush=True,
    )
    start = time.monotonic()
    error = _pip_install(venv, peer.requirements, timeout_s)
    seconds = time.monotonic() - start
    if error is None and not _imports(python, peer.import_name):
        error = f"pip finished but `import {peer.import_name}` fails; see {venv}/install.log"
    record.write_text(
        json.dumps({"seconds": seconds, "requirements": peer.requirements, "error": error}) + "\n"
    )
    if error is not None:
        return Installed(None, install_s=seconds, error=error)
    return Installed(python, _version(python, peer), seconds)


def _build_llama_server(root: Path, timeout_s: float, allow_install: bool) -> Installed:
    version = llama_server.built_version(root)
    if version is None and not allow_install:
        return Installed(None, error=f"not built under {root} (and --no-install)")
    seconds = None
    if version is None:
        print(f"[llama-server] building it from the {llama_server.SDIST} sdist into {root} "
              f"(limit {timeout_s / 60:.0f} min)", flush=True)
        start = time.monotonic()
        version, error = llama_server.build(root, timeout_s)
        seconds = time.monotonic() - start
        if error is not None:
            return Installed(None, install_s=seconds, error=error)
    return Installed(llama_server.binary(root), f"llama.cpp of {llama_server.SDIST} {version}",
                     seconds)


def _pip_install(venv: Path, requirements: tuple[str, ...], timeout_s: float) -> str | None:
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    command = [str(python), "-m", "pip", "install", "--progress-bar", "off", *requirements]
    with (venv / "install.log").open("w") as log:
        # Its own session, so a timeout also stops the compilers pip started.
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return f"pip install took more than {timeout_s / 60:.0f} min; skipped"
    if code != 0:
        return f"pip install failed (exit {code}); see {venv}/install.log"
    return None


def _imports(python: Path, module: str) -> bool:
    if not python.is_file():
        return False
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def _version(python: Path, peer: Peer) -> str | None:
    probe = f"import importlib.metadata as m; print(m.version({peer.name!r}))"
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return result.stdout.strip() or None
