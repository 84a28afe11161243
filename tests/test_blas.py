"""metal_engine.blas: how OpenBLAS is set up before it loads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from metal_engine import blas

# CPU seconds the process burns while idle for 0.3 s right after a product on OpenBLAS's
# threads: its workers spinning, waiting for the next call.
IDLE_CPU_AFTER_PRODUCT = textwrap.dedent("""
    import time
    import metal_engine
    import numpy as np

    a = np.ones((512, 512), np.float32)
    for _ in range(3):
        a @ a
    start = time.process_time()
    time.sleep(0.3)
    print(time.process_time() - start)
""")


def _idle_cpu_after_product(**env: str) -> float:
    done = subprocess.run([sys.executable, "-c", IDLE_CPU_AFTER_PRODUCT], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env}, check=True)
    return float(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux") or blas.usable_cores() < 2,
                    reason="OpenBLAS's worker threads: Linux, two cores or more")
def test_openblas_workers_stop_spinning_soon_after_a_product():
    # By default they spin ~90 ms and steal a core from the decode steps after a prefill.
    assert _idle_cpu_after_product() < 0.02
    # A user's own choice is kept: here 2^30 cycles, several hundred ms.
    assert _idle_cpu_after_product(OPENBLAS_THREAD_TIMEOUT="30") > 0.05


def test_usable_cores_are_the_affinity_mask_where_there_is_one():
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity mask on this platform (macOS): the next tests cover it")
    assert blas.usable_cores() == len(os.sched_getaffinity(0))
    assert blas.blas_threads_for(1) == blas.usable_cores()
    assert blas.blas_threads_for(10**6) == 1


def test_on_macos_usable_cores_are_the_performance_cores(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(sys, "platform", "darwin")
    asked = []
    monkeypatch.setattr(blas, "_sysctl_int", lambda name: asked.append(name) or 6)
    monkeypatch.setattr(os, "cpu_count", lambda: 14)  # e.g. 10 performance + 4 efficiency
    assert blas.usable_cores() == 6 and asked == ["hw.perflevel0.physicalcpu"]
    assert blas.blas_threads_for(4) == 1 and blas.blas_threads_for(2) == 3


def test_without_affinity_or_core_types_usable_cores_are_every_cpu(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 14)
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(blas, "_sysctl_int", lambda name: None)  # an Intel Mac
    assert blas.usable_cores() == 14
    monkeypatch.setattr(sys, "platform", "freebsd14")
    assert blas.usable_cores() == 14
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert blas.usable_cores() == 1


def test_sysctl_reads_macos_integers_and_is_none_elsewhere():
    if sys.platform == "darwin":
        assert 0 < blas._sysctl_int("hw.physicalcpu") <= os.cpu_count()
        assert blas._sysctl_int("hw.no-such-name") is None
    else:  # glibc has no sysctlbyname
        assert blas._sysctl_int("hw.perflevel0.physicalcpu") is None
