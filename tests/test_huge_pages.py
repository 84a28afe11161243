"""The host loops' weights collapsed into huge pages keep their values and addresses."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

from kernels_metal.cpu import huge_pages


def _huge_bytes_of_mapping(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                start, end = (int(part, 16) for part in first.split("-"))
                inside = start <= address < end
            elif inside and first == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are Linux's")
def test_collapsed_weights_keep_their_values_and_addresses():
    weight = mx.random.normal((2048, 1024))  # 8 MiB of float32, as MLX allocates it
    mx.eval(weight)
    view = np.asarray(weight)
    before, address = view.copy(), view.ctypes.data
    collapsed = huge_pages.collapse([view, np.zeros(16, np.float32)])
    assert np.array_equal(view, before) and np.array_equal(np.asarray(weight), before)
    assert np.asarray(weight).ctypes.data == address
    assert 0 <= collapsed <= view.nbytes + 2 * huge_pages.HUGE_PAGE
    if collapsed:  # a kernel before 6.1 collapses nothing
        # 8 MiB hold at least three whole 2 MiB pages, wherever they start.
        assert _huge_bytes_of_mapping(address + view.nbytes // 2) >= 3 * huge_pages.HUGE_PAGE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are Linux's")
def test_weights_collapsed_on_a_thread_keep_their_values_while_it_runs():
    weight = mx.random.normal((2048, 1024))
    mx.eval(weight)
    view = np.asarray(weight)
    before = view.copy()
    thread = huge_pages.collapse_later([view])
    during = view.sum(dtype=np.float64)  # read while the pages move
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert during == before.sum(dtype=np.float64) and np.array_equal(view, before)
    huge = _huge_bytes_of_mapping(view.ctypes.data + view.nbytes // 2)
    probe = mx.zeros((2048, 1024))
    mx.eval(probe)
    if huge_pages.collapse([np.asarray(probe)]):  # a kernel before 6.1 collapses nothing
        assert huge >= 3 * huge_pages.HUGE_PAGE


def test_small_arrays_are_left_alone():
    assert huge_pages.collapse([np.zeros(1000, np.float32)]) == 0
