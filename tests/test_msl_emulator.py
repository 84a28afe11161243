"""The MSL emulation harness on small kernels with known answers and planted bugs."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from markers import requires_emulator

from kernels_metal import emulator
from kernels_metal.emulator import build
from kernels_metal.emulator.signature import InputSpec, generate

pytestmark = requires_emulator

BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"

# Block sums: simd_sum inside each simdgroup, then a tree over threadgroup memory.
REDUCE = """
  const uint tid = thread_index_in_threadgroup;
  const uint gid = thread_position_in_grid.x;
  threadgroup float partial[32];
  float v = gid < uint(x_shape[0]) ? float(x[gid]) : 0.0f;
  v = simd_sum(v);
  if (thread_index_in_simdgroup == 0) {
    partial[simdgroup_index_in_threadgroup] = v;
  }
  BARRIER_1
  for (uint stride = simdgroups_per_threadgroup / 2; stride > 0; stride /= 2) {
    if (tid < stride) {
      partial[tid] += partial[tid + stride];
    }
    BARRIER_2
  }
  if (tid == 0) {
    out[threadgroup_position_in_grid.x] = partial[0];
  }
"""


def run(source, inputs, out_shape, grid, threadgroup, out_dtype=mx.float32, **kw):
    names = [f"x{i}" if i else "x" for i in range(len(inputs))]
    kernel = emulator.metal_kernel("t", names, ["out"], source, **kw)
    (out,) = kernel(inputs=inputs, grid=grid, threadgroup=threadgroup,
                    output_shapes=[out_shape], output_dtypes=[out_dtype])
    return np.array(out)


def reduce_source(first=BARRIER, second=BARRIER):
    return REDUCE.replace("BARRIER_1", first).replace("BARRIER_2", second)


def test_simd_sum_and_threadgroup_reduction():
    x = mx.arange(1000).astype(mx.float16) / 8
    got = run(reduce_source(), [x], (4,), grid=(1000, 1, 1), threadgroup=(256, 1, 1))
    want = np.array(x.astype(mx.float32)).reshape(-1)
    expected = [want[i * 256:(i + 1) * 256].sum() for i in range(4)]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("missing", ["first", "second"])
def test_a_missing_barrier_is_caught_as_a_race(missing):
    source = reduce_source(**{missing: ""})
    with pytest.raises(emulator.RaceError, match="output 'out' differs"):
        run(source, [mx.ones((512,))], (2,), grid=(512, 1, 1), threadgroup=(256, 1, 1))


OOB = """
  const uint gid = thread_position_in_grid.x;
  out[gid + SHIFT] = x[gid];
"""


def test_out_of_bounds_write_is_caught_and_passes_once_fixed():
    x = mx.arange(64).astype(mx.float32)
    with pytest.raises(emulator.OutOfBoundsError, match="write at byte 256 of buffer 'out'"):
        run(OOB.replace("SHIFT", "1"), [x], (64,), grid=(64, 1, 1), threadgroup=(32, 1, 1))
    got = run(OOB.replace("SHIFT", "0"), [x], (64,), grid=(64, 1, 1), threadgroup=(32, 1, 1))
    np.testing.assert_array_equal(got, np.arange(64))


@pytest.mark.parametrize(("body", "message"), [
    ("out[gid] = x[gid + 1];", "read at byte 256 of buffer 'x'"),
    ("out[gid] = x[int(gid) - 1];", "read 4 bytes before the start of buffer 'x'"),
    ("out[gid] = x[gid]; out[gid + 63] = 1.0f;", "write at byte 256 of buffer 'out'"),
])
def test_out_of_bounds_reads_and_writes_name_the_buffer(body, message):
    source = "const uint gid = thread_position_in_grid.x;\n" + body
    with pytest.raises(emulator.OutOfBoundsError, match=message):
        run(source, [mx.zeros((64,))], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1))


def test_small_overflow_of_an_odd_sized_buffer_is_caught():
    # 3 floats: the buffer's tail padding is checked after the run.
    source = "out[thread_position_in_grid.x + 1] = 2.0f;"
    with pytest.raises(emulator.OutOfBoundsError, match="write at byte 12 of buffer 'out'"):
        run(source, [mx.zeros((8,))], (3,), grid=(3, 1, 1), threadgroup=(3, 1, 1))


def test_barrier_in_divergent_control_flow_is_reported():
    source = f"""
      if (thread_position_in_threadgroup.x < 16) {{ return; }}
      {BARRIER}
      out[thread_position_in_grid.x] = 1.0f;
    """
    with pytest.raises(emulator.KernelFault, match="divergent control flow"):
        run(source, [mx.zeros((8,))], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1))


def test_simd_functions_in_divergent_control_flow_are_reported():
    source = """
      float v = 1.0f;
      if (thread_index_in_simdgroup < 16) { v = simd_sum(v); }
      out[thread_position_in_grid.x] = simd_max(v);
    """
    with pytest.raises(emulator.KernelFault, match="simd_max while others wait at simd_sum"):
        run(source, [mx.zeros((8,))], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1))


@pytest.mark.parametrize(("body", "named"), [
    ("out[0] = quad_sum(x[0]);", "quad_"),
    ("atomic_fetch_add_explicit((device atomic_int*)out, 1, memory_order_relaxed);", "atomics"),
    ("out[0] = 1.5h;", "half literals"),
    ("out[0] = simd_mystery(x[0]);", "simd_mystery"),
    ("float4 v = (float4)x[0]; out[0] = v.x;", "C-style casts to vector types"),
    ("threadgroup float a[4], b[4]; a[0] = b[0] = 1; out[0] = a[0];", "several variables"),
])
def test_unsupported_msl_fails_loudly_naming_the_construct(body, named):
    with pytest.raises(emulator.MSLUnsupportedError, match=named):
        run(body, [mx.zeros((8,))], (8,), grid=(1, 1, 1), threadgroup=(1, 1, 1))


def test_threadgroup_memory_over_32_kb_is_reported():
    source = "threadgroup float big[8200]; big[0] = 1.0f; out[0] = big[0];"
    with pytest.raises(emulator.KernelFault, match="exceeds the 32 KB"):
        run(source, [mx.zeros((8,))], (8,), grid=(1, 1, 1), threadgroup=(1, 1, 1))


def test_partial_threadgroups_at_the_grid_edges():
    source = """
      const uint3 g = thread_position_in_grid;
      const uint i = (g.y * 10 + g.x) * 4;
      out[i] = threads_per_threadgroup.x;
      out[i + 1] = threads_per_threadgroup.y;
      out[i + 2] = threadgroup_position_in_grid.x + 10 * threadgroup_position_in_grid.y;
      out[i + 3] = thread_index_in_threadgroup;
    """
    got = run(source, [mx.zeros((8,))], (30 * 4,), grid=(10, 3, 1), threadgroup=(4, 2, 1),
              out_dtype=mx.uint32).reshape(3, 10, 4)
    x, y = np.meshgrid(np.arange(10), np.arange(3))
    np.testing.assert_array_equal(got[..., 0], np.where(x >= 8, 2, 4))
    np.testing.assert_array_equal(got[..., 1], np.where(y >= 2, 1, 2))
    np.testing.assert_array_equal(got[..., 2], x // 4 + 10 * (y // 2))
    np.testing.assert_array_equal(got[..., 3], x % 4 + (y % 2) * np.where(x >= 8, 2, 4))


def test_simd_shuffles_broadcasts_and_prefix_sums():
    source = """
      const uint lane = thread_index_in_simdgroup;
      const float v = float(lane * lane);
      device float* o = out + lane * 6;
      o[0] = simd_shuffle_xor(v, ushort(5));
      o[1] = simd_shuffle_down(v, ushort(3));
      o[2] = simd_shuffle_up(v, ushort(2));
      o[3] = simd_broadcast(v, ushort(7));
      o[4] = simd_prefix_exclusive_sum(v);
      o[5] = simd_shuffle(v, ushort(31 - lane));
    """
    got = run(source, [mx.zeros((8,))], (32 * 6,), grid=(32, 1, 1),
              threadgroup=(32, 1, 1)).reshape(32, 6)
    lane = np.arange(32)
    v = (lane * lane).astype(np.float32)
    np.testing.assert_array_equal(got[:, 0], v[lane ^ 5])
    down, up = np.minimum(lane + 3, 31), np.maximum(lane - 2, 0)
    np.testing.assert_array_equal(got[:, 1], np.where(lane + 3 < 32, v[down], v))
    np.testing.assert_array_equal(got[:, 2], np.where(lane >= 2, v[up], v))
    np.testing.assert_array_equal(got[:, 3], v[7])
    np.testing.assert_array_equal(got[:, 4], np.cumsum(v) - v)
    np.testing.assert_array_equal(got[:, 5], v[31 - lane])


def test_simdgroup_matrix_multiply_with_transposed_load():
    source = """
      simdgroup_matrix<T, 8, 8> a, b;
      simdgroup_matrix<float, 8, 8> c = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
      simdgroup_load(a, x, 8);
      simdgroup_load(b, x1 + 2, 10, ulong2(0, 0), true);
      simdgroup_multiply_accumulate(c, a, b, c);
      simdgroup_store(c, out, 8);
    """
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 8)).astype(np.float32)
    b = rng.standard_normal((8, 10)).astype(np.float32)
    kernel = emulator.metal_kernel("mma", ["x", "x1"], ["out"], source)
    (out,) = kernel(inputs=[mx.array(a).astype(mx.float16), mx.array(b).astype(mx.float16)],
                    template=[("T", mx.float16)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                    output_shapes=[(8, 8)], output_dtypes=[mx.float32])
    a16, b16 = a.astype(np.float16).astype(np.float32), b.astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(np.array(out), a16 @ b16[:, 2:10].T + 1.0, rtol=1e-5, atol=1e-5)


def test_vector_constructors_convert_like_msl():
    source = """
      const half4 h = half4(x[0], x[1], x[2], x[3]);
      const float4 f = float4(h);            // element-wise conversion, not a bit cast
      const int4 i = int4(f * 2.0f);
      const float4 mixed = float4(f.xy, 7.0f, float(i.w));
      const float2 splat = float2(0.5f);
      out[0] = mixed.x + mixed.y + mixed.z + mixed.w + splat.y;
      out[1] = float(bfloat(f.w) * bfloat(3.0f));
      out[2] = dot(f, float4(1.0f));
    """
    x = mx.array([1.0, 2.0, 3.0, 4.5, 0, 0, 0, 0])
    got = run(source, [x], (3,), grid=(1, 1, 1), threadgroup=(1, 1, 1))
    np.testing.assert_allclose(got, [1 + 2 + 7 + 9 + 0.5, 13.5, 10.5])


def test_16_byte_copies_through_pointer_casts_and_unroll_pragmas():
    source = """
      const uint lane = thread_index_in_threadgroup;
      threadgroup uint4 raw[32];
      threadgroup T* row = (threadgroup T*)raw;
      raw[lane] = ((const device uint4*)x)[lane];  // 8 halves per lane, bits unchanged
      threadgroup_barrier(mem_flags::mem_threadgroup);
      float s = 0.0f;
      #pragma clang loop unroll(full)
      for (int k = 0; k < 8; ++k) {
        s += float(row[((lane + 1) % 32) * 8 + k]);
      }
      out[lane] = s;
    """
    x = np.arange(256).astype(np.float16) / 4
    kernel = emulator.metal_kernel("vec", ["x"], ["out"], source)
    (out,) = kernel(inputs=[mx.array(x)], template=[("T", mx.float16)], grid=(32, 1, 1),
                    threadgroup=(32, 1, 1), output_shapes=[(32,)], output_dtypes=[mx.float32])
    expected = np.roll(x.astype(np.float32).reshape(32, 8).sum(axis=1), -1)
    np.testing.assert_array_equal(np.array(out), expected)


@pytest.mark.parametrize(("options", "message"), [
    ({"math_mode": "quick"}, "Expected math_mode to be 'safe', 'relaxed', or 'fast'"),
    ({"unroll": True}, "Unknown compile option `unroll`"),
])
def test_compile_options_are_checked_as_mlx_checks_them(options, message):
    for factory in (emulator.metal_kernel, mx.fast.metal_kernel):
        with pytest.raises(ValueError, match=message):
            factory(name="t", input_names=["x"], output_names=["out"], source="out[0] = 1;",
                    compile_options=options)


FAST_MATH = """
  const uint i = thread_position_in_grid.x;
  const uint n = threads_per_grid.x;
  out[i] = exp2(x[i]);
  out[n + i] = precise::exp2(x[i]);
  out[2 * n + i] = divide(x[i], 3.0f);
  out[3 * n + i] = exp2(half(x[i]));  // no fast variant for half
"""


def _math(mode: str, x: np.ndarray) -> np.ndarray:
    kernel = emulator.metal_kernel("m", ["x"], ["out"], FAST_MATH,
                                   compile_options={"math_mode": mode})
    (out,) = kernel(inputs=[mx.array(x)], grid=(len(x), 1, 1), threadgroup=(len(x), 1, 1),
                    output_shapes=[(4 * len(x),)], output_dtypes=[mx.float32])
    return np.array(out).reshape(4, len(x))


def test_fast_math_functions_err_at_the_bound_metal_allows():
    x = np.concatenate([np.linspace(-140, 4, 61), [0.0, -0.25, 1.0]]).astype(np.float32)
    safe, fast = _math("safe", x), _math("fast", x)
    exact = np.exp2(x.astype(np.float64))
    normal = exact >= 2.0**-126
    ulps = np.abs(fast[0] - exact) / np.spacing(exact.astype(np.float32))
    assert (ulps[normal] <= 3 + np.floor(np.abs(2 * x[normal]))).all()  # the MSL bound
    assert (ulps[normal] > 1).all()  # modelled at the bound, not the host's exp2
    assert (fast[0][~normal] == 0).all()  # subnormal results flush to zero
    quotient = x.astype(np.float64) / 3
    nonzero = quotient != 0
    q_spacing = np.spacing(np.abs(quotient[nonzero]).astype(np.float32))
    q_ulps = np.abs(fast[2] - quotient)[nonzero] / q_spacing
    assert (q_ulps <= 2.5).all() and (q_ulps > 1).all()
    np.testing.assert_array_equal(fast[1], safe[1])  # precise:: ignores the mode
    np.testing.assert_array_equal(fast[3], safe[3])
    safe_ulps = np.abs(safe[0] - exact) / np.spacing(exact.astype(np.float32))
    assert safe_ulps[normal].max() <= 1


def test_fast_math_functions_without_a_model_are_refused():
    source = "out[0] = tanh(x[0]) + precise::tanh(x[0]);"
    for mode, fails in (("safe", False), ("fast", True)):
        kernel = emulator.metal_kernel("t", ["x"], ["out"], source,
                                       compile_options={"math_mode": mode})
        call = dict(inputs=[mx.zeros((8,))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                    output_shapes=[(1,)], output_dtypes=[mx.float32])
        if not fails:
            assert np.array(kernel(**call)[0]).tolist() == [0.0]
            continue
        with pytest.raises(emulator.MSLUnsupportedError, match="call precise::tanh"):
            kernel(**call)


def test_compiled_kernels_are_reused_from_the_cache(monkeypatch):
    source = "out[thread_position_in_grid.x] = x[thread_position_in_grid.x] * 3.0f;"
    x = mx.arange(8).astype(mx.float32)
    run(source, [x], (8,), grid=(8, 1, 1), threadgroup=(8, 1, 1))

    def no_compiler(*_, **__):
        raise AssertionError("recompiled a cached kernel")

    monkeypatch.setattr(build, "_compile", no_compiler)
    got = run(source, [x], (8,), grid=(8, 1, 1), threadgroup=(8, 1, 1))
    np.testing.assert_array_equal(got, np.arange(8) * 3)


def test_generated_signature_follows_mlx_rules():
    body = "uint i = thread_position_in_grid.x; out[i] = a[i] + a_shape[0] + a_ndim;"
    kernel = generate(
        "demo", ["a", "b", "s"], ["out"], body, "// hdr\n",
        [InputSpec("a", mx.float16, 1, 16), InputSpec("b", mx.int32, 1, 3),
         InputSpec("s", mx.float32, 0, 1)],
        [mx.float32], [("T", mx.float32), ("N", 4), ("FLAG", True)],
    )
    name = "custom_kernel_demo__float_4_1_float16_t_int32_tc_floats_float"
    assert kernel.source == (
        "// hdr\ntemplate <typename T, int N, bool FLAG>\n"
        f"[[kernel]] void {name}(\n"
        "  const device float16_t* a [[buffer(0)]],\n"
        "  const constant int* a_shape [[buffer(1)]],\n"
        "  const constant int& a_ndim [[buffer(2)]],\n"
        "  const constant int32_t* b [[buffer(3)]],\n"
        "  const constant float& s [[buffer(4)]],\n"
        "  device float* out [[buffer(5)]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n"
        f"{body}\n}}\n\n"
        f'template [[host_name("{name}")]] [[kernel]] decltype({name}<float, 4, 1>) '
        f"{name}<float, 4, 1>;\n"
    )


def _mlx_generated_source(capfd, tmp_path, kernel_args, call):
    """The source MLX itself generates: exporting a function traces metal_kernel without a
    Metal device, and verbose=True prints the source it would compile."""
    kernel = mx.fast.metal_kernel(**kernel_args)

    def traced(*inputs):
        return kernel(inputs=list(inputs), verbose=True, **call["kwargs"])

    capfd.readouterr()
    mx.export_function(str(tmp_path / "k.mlxfn"), traced, *call["inputs"])
    printed = capfd.readouterr().out
    return printed.split("```\n", 1)[1].rsplit("\n```", 1)[0]


def _paged_kernel_calls():
    from kernels_metal.decode import make_decode_kernels
    from kernels_metal.kv_quant import KVQuant, empty_pool
    from kernels_metal.prefill import make_prefill_kernel

    decode, reduce = make_decode_kernels(dict)  # the specs each kernel is built from
    prefill = make_prefill_kernel(dict)
    q, pool = mx.zeros((5, 8, 64), mx.bfloat16), mx.zeros((9, 16, 2, 64), mx.bfloat16)
    k4 = empty_pool(9, 16, 2, 64, KVQuant(4))
    no_scales = mx.zeros((8,), mx.float16)
    meta = [mx.zeros((3, 8), mx.int32), mx.zeros((2, 4), mx.int32), mx.zeros((16,), mx.int32)]
    sinks = mx.zeros((8,), mx.float32)
    template = [("T", mx.bfloat16), ("D", 64), ("BS", 16), ("TILE", 32), ("IDX", mx.uint32),
                ("KL", 8), ("KW", 4), ("LDK", 72), ("KV_BITS", 0), ("KV_GROUP", 64)]
    prefill_template = template[:3] + [("TK", 32), ("IDX", mx.uint32), ("NH", 4), ("CHUNKS", 1),
                                       ("BQ", 16), ("MERGE", True), ("KV_BITS", 4),
                                       ("KV_GROUP", 32)]
    demo_body = ("uint i = thread_position_in_grid.x; out[i] = a[i] + a_shape[0] + a_ndim "
                 "+ b_strides[0] + s + threads_per_threadgroup.x;")
    return {
        "demo": (dict(name="demo", input_names=["a", "b", "s"], output_names=["out", "o2"],
                      source=demo_body, header="// hdr\n"),
                 dict(inputs=[mx.zeros((4, 4), mx.float16), mx.zeros((3,), mx.int32),
                              mx.array(1.0)],
                      kwargs=dict(template=[("T", mx.float32), ("N", 4), ("FLAG", True)],
                                  grid=(16, 1, 1), threadgroup=(16, 1, 1),
                                  output_shapes=[(16,), (2,)],
                                  output_dtypes=[mx.float32, mx.int32]))),
        "decode": (decode,
                   dict(inputs=[q, pool, pool, no_scales, no_scales, *meta, sinks],
                        kwargs=dict(template=template, grid=(64, 2, 1), threadgroup=(64, 1, 1),
                                    output_shapes=[(2, 8, 64), (1,), (1,)],
                                    output_dtypes=[mx.bfloat16, mx.float32, mx.float32]))),
        "reduce": (reduce,
                   dict(inputs=[mx.zeros((2, 2, 8, 64)), mx.zeros((2, 2, 8, 2)), *meta[1:],
                                sinks],
                        kwargs=dict(template=[("T", mx.float16), ("D", 64)], grid=(32, 8, 2),
                                    threadgroup=(32, 1, 1), output_shapes=[(2, 8, 64)],
                                    output_dtypes=[mx.float16]))),
        "prefill-int4": (prefill,
                         dict(inputs=[q, k4.codes, k4.codes, k4.scales, k4.scales, *meta, q,
                                      meta[1], sinks],
                              kwargs=dict(template=prefill_template, grid=(256, 1, 1),
                                          threadgroup=(256, 1, 1), output_shapes=[(5, 8, 64)],
                                          output_dtypes=[mx.bfloat16]))),
    }


@pytest.mark.skipif(not hasattr(mx, "export_function"), reason="needs mx.export_function")
@pytest.mark.parametrize("which", ["demo", "decode", "reduce", "prefill-int4"])
def test_generated_source_is_identical_to_what_mlx_generates(which, capfd, tmp_path):
    kernel_args, call = _paged_kernel_calls()[which]
    expected = _mlx_generated_source(capfd, tmp_path, kernel_args, call)
    ours = emulator.metal_kernel(**kernel_args).generate(
        call["inputs"], call["kwargs"]["output_dtypes"], call["kwargs"]["template"])
    assert ours.source == expected


def test_the_portable_fiber_switch_runs_kernels_too(tmp_path):
    """Hosts other than x86-64 switch fibers with ucontext: same kernels, same results."""
    code = """
import metal_engine, mlx.core as mx, numpy as np
import test_msl_emulator as t
from kernels_metal.emulator import RaceError
got = t.run(t.reduce_source(), [mx.ones((512,))], (2,), grid=(512, 1, 1), threadgroup=(256, 1, 1))
assert got.tolist() == [256.0, 256.0], got
try:
    t.run(t.reduce_source(second=""), [mx.ones((512,))], (2,), grid=(512, 1, 1),
          threadgroup=(256, 1, 1))
    raise SystemExit("race not caught")
except RaceError:
    pass
"""
    env = dict(os.environ, METAL_SERVE_MSL_EMU_UCONTEXT="1",
               METAL_SERVE_MSL_EMU_CACHE=str(tmp_path))
    tests_dir = os.path.dirname(__file__)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tests_dir)
