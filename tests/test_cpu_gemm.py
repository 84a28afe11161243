"""cpu_gemm's compiled products against numpy's, on shapes that are not whole tiles."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_metal.cpu import gemm as cpu_gemm
from kernels_metal.cpu import threads as cpu_threads


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "columns", "inner"), [(1, 13, 33), (1, 576, 1536), (2, 8, 7),
                                                        (3, 13, 33), (4, 576, 1536),
                                                        (5, 13, 33), (16, 832, 64), (31, 6, 150),
                                                        (63, 9, 70), (257, 20, 48)])
def test_products_match_numpy_with_partial_tiles_on_one_thread_or_two(monkeypatch, threads,
                                                                      rows, columns, inner):
    monkeypatch.setattr(cpu_threads, "_threads", threads)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    weight = rng.standard_normal((columns, inner)).astype(np.float32)
    got = cpu_gemm.linear(x, weight)
    assert got.shape == (rows, columns) and got.flags.c_contiguous
    np.testing.assert_allclose(got, x @ weight.T, rtol=1e-5, atol=1e-4)


def test_rows_of_a_strided_view_are_read_as_they_lie():
    rng = np.random.default_rng(0)
    packed = rng.standard_normal((6, 40)).astype(np.float32)
    weight = rng.standard_normal((12, 20)).astype(np.float32)
    x = packed[:, 10:30]  # a q/k/v slice of a packed product
    np.testing.assert_allclose(cpu_gemm.linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-4)
    one = packed[:1, 10:30]
    np.testing.assert_allclose(cpu_gemm.linear(one, weight), one @ weight.T, rtol=1e-5,
                               atol=1e-4)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize(("shape", "tail"), [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2),
                                           (2, 3), (3, 0)])
def test_every_register_tile_gives_numpys_products(shape, tail, parallel):
    """The CPU picks among them by rows and registers (`tile_for`); each is checked here,
    with rows past the last whole tile (one at a time past 2 x 4 and 4 x 6), weight rows past
    the last whole tile and k past the last whole vector."""
    tile_rows, tile_columns = cpu_gemm.TILE_SHAPES[shape]
    rng = np.random.default_rng(shape)
    x = rng.standard_normal((2 * tile_rows + tail, 37)).astype(np.float32)
    weight = rng.standard_normal((4 * tile_columns + 3, 37)).astype(np.float32)
    out = np.zeros((len(x), len(weight)), np.float32)
    tiles = cpu_gemm._parallel_tiles if parallel else cpu_gemm._tiles
    cpu_threads.run(lambda *args: tiles(*args[:-1]), x, weight, out, shape, tail,
                    parallel=parallel)
    np.testing.assert_allclose(out, x @ weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("registers", "tiles"), [
    (32, [(1, 4), (2, 4), (4, 6), (4, 6), (8, 2), (8, 2), (4, 6), (4, 6)]),
    (16, [(1, 4), (2, 4), (2, 4), (2, 4), (2, 4), (2, 4), (2, 4), (2, 4)])])
def test_the_tile_follows_the_rows_and_the_registers(monkeypatch, registers, tiles):
    monkeypatch.setattr(cpu_gemm, "VECTOR_REGISTERS", registers)
    picked = [cpu_gemm.TILE_SHAPES[cpu_gemm.tile_for.py_func(rows)]
              for rows in (1, 2, 3, 4, 5, 8, 9, 63)]
    assert picked == tiles
