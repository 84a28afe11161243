"""Ranks on one host: rank 0 starts the others as child processes over the ring backend on
loopback (how tests and CI run several ranks; across Macs, `mlx.launch` starts every
rank instead and sets MLX_RANK and MLX_HOSTFILE itself)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from metal_engine.blas import blas_threads_for, limit_blas_threads

log = logging.getLogger(__name__)

RANK_ENV, HOSTFILE_ENV = "MLX_RANK", "MLX_HOSTFILE"
BLAS_THREADS_ENV = "OPENBLAS_NUM_THREADS"  # read by each OpenBLAS as it loads
_POLL_S = 0.5
_EXIT_WAIT_S = 30.0


def launched_by_mlx() -> bool:
    """Whether `mlx.launch` (or the operator) started this process as one rank of several."""
    return RANK_ENV in os.environ and HOSTFILE_ENV in os.environ


class LocalRanks:
    """Ranks 1..size-1 as children of this process (rank 0). The ranks share the cores: each
    gets its share of BLAS threads (OPENBLAS_NUM_THREADS, if set, wins)."""

    def __init__(self, size: int) -> None:
        hosts = [[f"127.0.0.1:{port}"] for port in _free_ports(size)]
        handle, path = tempfile.mkstemp(prefix="metal-serve-ranks-", suffix=".json")
        with os.fdopen(handle, "w") as f:
            json.dump(hosts, f)
        self.hostfile = Path(path)
        threads = os.environ.get(BLAS_THREADS_ENV) or str(blas_threads_for(size))
        env = {**os.environ, HOSTFILE_ENV: path, BLAS_THREADS_ENV: threads}
        self.processes = [
            subprocess.Popen([sys.executable, "-m", "metal_engine.parallel.worker"],
                             env={**env, RANK_ENV: str(rank)})
            for rank in range(1, size)
        ]
        os.environ[RANK_ENV], os.environ[HOSTFILE_ENV] = "0", path
        limit_blas_threads(int(threads))  # this process's BLAS is loaded already
        self._stopping = False

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call `on_lost(reason)` once, from a thread, if a rank exits before `stop()`."""
        def poll() -> None:
            while not self._stopping:
                for rank, process in enumerate(self.processes, start=1):
                    if process.poll() is not None and not self._stopping:
                        on_lost(f"rank {rank} exited with code {process.returncode}")
                        return
                time.sleep(_POLL_S)

        threading.Thread(target=poll, name="rank-watch", daemon=True).start()

    def stop(self, timeout_s: float = _EXIT_WAIT_S) -> None:
        """Wait for the ranks to exit (they were told to), killing any that do not."""
        self._stopping = True
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank process %d did not exit; killing it", process.pid)
                process.kill()
                process.wait()
        self.hostfile.unlink(missing_ok=True)


def _free_ports(count: int) -> list[int]:
    """Ports free on loopback now (held open together, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
