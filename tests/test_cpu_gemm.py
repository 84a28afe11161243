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
                                                        (63, 9, 70)])
def test_few_rows_match_numpy_with_partial_tiles_on_one_thread_or_two(monkeypatch, threads,
                                                                      rows, columns, inner):
    monkeypatch.setattr(cpu_threads, "_threads", threads)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    weight = rng.standard_normal((columns, inner)).astype(np.float32)
    got = cpu_gemm.few_rows(x, weight)
    assert got.shape == (rows, columns) and got.flags.c_contiguous
    np.testing.assert_allclose(got, x @ weight.T, rtol=1e-5, atol=1e-4)


def test_rows_of_a_strided_view_are_read_as_they_lie():
    rng = np.random.default_rng(0)
    packed = rng.standard_normal((6, 40)).astype(np.float32)
    weight = rng.standard_normal((12, 20)).astype(np.float32)
    x = packed[:, 10:30]  # a q/k/v slice of a packed product
    np.testing.assert_allclose(cpu_gemm.few_rows(x, weight), x @ weight.T, rtol=1e-5, atol=1e-4)
    one = packed[:1, 10:30]
    np.testing.assert_allclose(cpu_gemm.few_rows(one, weight), one @ weight.T, rtol=1e-5,
                               atol=1e-4)


@pytest.mark.parametrize(("tile", "rows"), [(cpu_gemm._tile_2x4, 2), (cpu_gemm._tile_4x4, 4)])
def test_both_register_tiles_give_numpys_products(tile, rows):
    """The CPU picks one (`INPUT_TILE`); each is checked here whichever this one picks."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows + 1, 37)).astype(np.float32)
    weight = rng.standard_normal((5, 37)).astype(np.float32)
    out = np.zeros((rows + 1, 5), np.float32)
    tile(x, 1, weight[1], weight[2], weight[3], weight[4], out, 1)  # rows 1.., columns 1..4
    np.testing.assert_allclose(out[1:, 1:], x[1:] @ weight[1:].T, rtol=1e-5, atol=1e-4)
    assert not out[0].any() and not out[:, 0].any()
