"""cpu_threads: how the CPU backend's compiled loops are built, cached and launched."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numba

from kernels_metal.cpu import threads as cpu_threads

LOOPS = textwrap.dedent("""
    import numba
    import numpy as np

    from kernels_metal.cpu import gemm as cpu_gemm

    from kernels_metal.cpu import threads as cpu_threads


    def _threads_of(parallel):
        @cpu_threads.compile_loop(parallel)
        def threads_used(out):
            for i in numba.prange(len(out)):
                out[i] = numba.get_thread_id()

        return threads_used


    one_thread, parallel = _threads_of(False), _threads_of(True)


    @numba.njit(cache=True)
    def ones_product(out, spread):  # compiled code calling cpu_gemm's, as cpu_layer's does
        cpu_gemm.product(np.ones((2, 8), np.float32), np.ones((4, 8), np.float32), out, spread)


    def used(loop):
        out = np.zeros(64, np.int64)
        loop(out)
        return len(set(out.tolist()))
""")


def _run(script: str, module_dir, cache_dir) -> str:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir), NUMBA_NUM_THREADS="2",
               PYTHONPATH=os.pathsep.join([str(module_dir), os.getcwd()]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    return done.stdout.strip()


def test_a_loops_parallel_build_loaded_from_the_disk_cache_is_still_parallel(tmp_path):
    (tmp_path / "loops.py").write_text(LOOPS)
    cache = tmp_path / "cache"
    # The parallel build is compiled and saved first, then the one-thread build of the same
    # function: had they shared a cache entry, the second would have replaced the first.
    compiled = _run("import loops; print(loops.used(loops.parallel), loops.used(loops.one_thread))",
                    tmp_path, cache)
    loaded = _run("import loops; print(loops.used(loops.parallel), loops.used(loops.one_thread),"
                  " len(loops.parallel.stats.cache_hits))", tmp_path, cache)
    assert compiled == "2 1"
    assert loaded == "2 1 1"  # from the cache, each build its own


def test_cached_code_that_calls_parallel_builds_runs_on_one_thread(tmp_path):
    # Compiled code calling cpu_gemm's product (which calls parallel builds), compiled while
    # those builds came from the cache and then loaded from the cache itself, crashed
    # (SIGSEGV) at its first call, on its one-thread path too, unless numba's thread pool had
    # been started (as a parallel launch does).
    (tmp_path / "loops.py").write_text(LOOPS)
    cache = tmp_path / "cache"
    _run("import numpy as np; from kernels_metal.cpu import gemm as cpu_gemm; "
         "cpu_gemm.linear(np.ones((2, 8), np.float32), np.ones((4, 8), np.float32))",
         tmp_path, cache)
    script = ("import numpy as np, loops; from kernels_metal.cpu import threads as cpu_threads; "
              "cpu_threads.use_threads(1); out = np.zeros((2, 4), np.float32); "
              "cpu_threads.run(loops.ones_product, out); print(out.sum())")
    assert _run(script, tmp_path, cache) == "64.0"  # compiled, on cached builds
    assert _run(script, tmp_path, cache) == "64.0"  # loaded from the cache


def test_without_a_spinning_thread_pool_the_loops_take_one_thread(monkeypatch, caplog):
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 2)
    monkeypatch.setattr(numba.config, "THREADING_LAYER", "workqueue")
    assert cpu_threads._available_threads() == 1
    assert "libgomp1" in caplog.text
    monkeypatch.setattr(numba.config, "THREADING_LAYER", "omp")
    assert cpu_threads._available_threads() == 2


def test_work_mapped_on_threads_runs_each_blas_on_one_thread_meanwhile():
    from threadpoolctl import threadpool_info

    before = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    during = cpu_threads.map_on_threads(
        lambda item: (item, [lib["num_threads"] for lib in threadpool_info()
                             if lib["user_api"] == "blas"]), range(3))
    assert [item for item, _ in during] == [0, 1, 2]
    assert all(threads == [1] * len(before) for _, threads in during)
    assert [lib["num_threads"] for lib in threadpool_info()
            if lib["user_api"] == "blas"] == before



def test_the_spin_count_is_the_openmp_librarys_alone_not_the_child_processes():
    """The OpenMP library loads with cpu_threads' spin count unless the user chose one; the
    environment is left as it was, so a process started after (a llama-server timed beside
    this one) spins as its users run it."""
    script = textwrap.dedent("""
        import os, subprocess, sys
        from kernels_metal.cpu import threads
        child = subprocess.run([sys.executable, "-c",
                                "import os; print(os.environ.get('GOMP_SPINCOUNT'))"],
                               capture_output=True, text=True, check=True).stdout.strip()
        print(os.environ.get("GOMP_SPINCOUNT"), child)
    """)
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    env["PYTHONPATH"] = os.getcwd()

    def seen(env: dict[str, str]) -> str:
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=300, check=True).stdout.strip()

    assert seen(env) == "None None"
    assert seen(dict(env, GOMP_SPINCOUNT="1000")) == "1000 1000"  # the user's own stays
