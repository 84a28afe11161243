"""`metal-serve bench graph`: the kernel count read from a traced graph (views free, a
compiled chain one kernel per call, a concatenate a copy per input, a stand-in one), and a
traced step of the Metal path beside mlx-lm's."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from server.bench.graph import _settle_allocator
from server.bench.graph_configs import CONFIGS, for_trace
from server.bench.graph_trace import StandInKernel, SyncCounter, count_kernels, metal_stand_ins


def test_views_launch_nothing_and_each_compiled_call_counts():
    x = mx.random.normal((4, 8))
    mx.eval(x)
    swiglu = mx.compile(lambda g, u: nn.silu(g) * u, shapeless=True)
    h = x.reshape(8, 4).T  # two views
    gate, up = mx.split(h @ x.T, 2, axis=-1)  # one matmul, two views
    y = swiglu(swiglu(gate, up), up)  # two calls of one compiled primitive
    out = mx.concatenate([y, gate, up.astype(mx.float16).astype(mx.float32)], axis=-1)
    count = count_kernels(out)
    assert count.by_primitive == {"Matmul": 1, "Compiled": 2, "AsType": 2, "Concatenate": 3}
    assert count.kernels == 8


def test_a_stand_in_kernel_is_one_node_of_the_kernel_outputs():
    q, k = mx.ones((3, 2, 16)), mx.ones((5, 16))
    mx.eval(q, k)
    kernel = StandInKernel(name="k", input_names=["q", "k"], output_names=["a", "b"], source="")
    a, b = kernel(inputs=[q + 1, k], output_shapes=[(3, 2, 16), (7,)],
                  output_dtypes=[mx.float16, mx.float32], grid=(1, 1, 1), threadgroup=(1, 1, 1))
    assert (a.shape, a.dtype, b.shape, b.dtype) == ((3, 2, 16), mx.float16, (7,), mx.float32)
    assert count_kernels(a, b).by_primitive == {"Depends": 1, "Add": 1}  # the input's add kept


def test_fast_ops_are_stand_ins_only_inside_the_context():
    x = mx.ones((2, 1, 1, 8))
    mx.eval(x)
    with metal_stand_ins():
        traced = mx.fast.rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=0)
        assert mx.metal.is_available()
    assert count_kernels(traced).by_primitive == {"Depends": 1}
    assert count_kernels(mx.fast.rope(x, 8, traditional=False, base=10000.0, scale=1.0,
                                      offset=0)).kernels > 1  # the CPU's decomposition


def test_syncs_are_counted_and_nothing_is_evaluated():
    x = mx.ones((3,))
    mx.eval(x)
    x = x + 1
    with SyncCounter().active() as syncs:
        mx.eval(x)
        x.tolist()
        mx.synchronize()
    assert syncs.count == 3
    assert count_kernels(x).kernels == 1  # still unevaluated


@pytest.mark.slow
@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
def test_a_traced_llama_step_launches_no_more_than_mlx_lm_plus_the_paged_pair(mixed, capsys):
    pytest.importorskip("mlx_lm")
    from server.bench.graph import trace
    from server.bench.graph_steps import StepShape

    config = {**CONFIGS["llama"], "num_hidden_layers": 4}
    with metal_stand_ins():
        row = trace("llama", config, StepShape(2, mixed), steps=2)
    assert row.kernels_per_layer <= row.mlx_lm_kernels_per_layer + 2
    # The layer's products: q/k/v as one, o, gate/up as one, down.
    assert row.layer_primitives["Matmul"] == 4
    # 2 norms, 2 ropes, the decode kernel (and the prefill kernel for the chunk)
    assert row.layer_primitives["Depends"] == (6 if mixed else 5)
    assert row.syncs_per_step >= 1 and row.build_ms > 0
    assert json.loads(json.dumps(row.__dict__))["model"] == "llama"


def test_trace_widths_keep_the_layer_structure():
    narrow = for_trace(CONFIGS["gemma3"], num_layers=6)
    assert narrow["num_hidden_layers"] == 6 and narrow["hidden_size"] == 256
    assert narrow["num_attention_heads"] == CONFIGS["gemma3"]["num_attention_heads"]
    assert narrow["sliding_window_pattern"] == 6


def _glibc_fast_bin_counter():
    """A function giving the number of chunks in glibc's fast bins (`mallinfo2().smblks`),
    or None off glibc."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = MallInfo2
    return lambda: mallinfo2().smblks


def test_a_freed_graph_leaves_no_small_chunks_for_the_timed_build():
    fast_bin_chunks = _glibc_fast_bin_counter()
    if fast_bin_chunks is None:
        pytest.skip("needs glibc's mallinfo2")
    graphs = []  # many shallow graphs, as a step's pools hold theirs
    for _ in range(300):
        x = mx.zeros((4,))
        for _ in range(10):
            x = x.reshape(2, 2).reshape(4) + 1  # nodes of small shapes and input lists
        graphs.append(x)
    before = fast_bin_chunks()  # some may be other threads' arenas', which stay
    del graphs, x  # freed at once: their small chunks wait in the fast bins
    freed = fast_bin_chunks() - before
    assert freed > 1000
    _settle_allocator()
    # All merged; other threads' arenas (a server thread of an earlier test) may meanwhile
    # free a few chunks of their own, which this thread's allocation does not merge.
    assert fast_bin_chunks() - before < freed // 20
