"""metal_engine.blas: how OpenBLAS is set up before it loads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

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


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="OpenBLAS's worker threads: Linux, two cores or more")
def test_openblas_workers_stop_spinning_soon_after_a_product():
    # By default they spin ~90 ms and steal a core from the decode steps after a prefill.
    assert _idle_cpu_after_product() < 0.02
    # A user's own choice is kept: here 2^30 cycles, several hundred ms.
    assert _idle_cpu_after_product(OPENBLAS_THREAD_TIMEOUT="30") > 0.05
