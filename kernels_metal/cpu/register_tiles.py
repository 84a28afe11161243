"""Register tiles of a weight product (`out = x @ w.T`) written in LLVM IR, for cpu_gemm.

A tile multiplies a few input rows by a few weight rows with every sum held in a vector
register, and while it reads its weight rows it prefetches weight rows further on into L2.
numba's loops of the same tiles (sums in tuples, vectorised by LLVM) took as long from
memory as streaming the weight plus multiplying it from cache: 8 rows of the default
model's layers 23 ms, where one row streamed in 13 and 8 rows from cache took 12. The core,
busy multiplying, kept too few reads in flight; with the prefetches the memory serves the
next tiles meanwhile (8 x 2 tiles: 15 ms). A prefetch in a numba loop left it unvectorised
or slower, hence the IR.
"""

from __future__ import annotations

import platform

import numba
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_FLOAT = ir.FloatType()
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_BYTE_POINTER = ir.IntType(8).as_pointer()
_CACHE_LEVEL_L2 = 2  # llvm.prefetch's locality 2: x86's prefetcht1


def _is_arm() -> bool:
    return platform.machine().lower() in ("arm64", "aarch64")


def _host_features() -> set[str]:
    chosen = numba.config.CPU_FEATURES  # a target the user set for numba
    if chosen:
        return {f[1:] for f in chosen.split(",") if f.startswith("+")}
    return {name for name, on in llvm.get_host_cpu_features().items() if on}


def _vector_floats() -> int:
    """Float32 lanes of one vector register the compiled loops use."""
    if _is_arm():
        return 4
    features = _host_features()
    return 16 if "avx512f" in features else 8 if "avx" in features else 4


VECTOR_FLOATS = _vector_floats()
# AVX-512 and Arm's NEON have 32 vector registers, AVX2 and SSE 16.
VECTOR_REGISTERS = 32 if VECTOR_FLOATS == 16 or _is_arm() else 16


def register_tile(rows: int, columns: int):
    """An intrinsic `tile(x, w, out, m, n, ahead)`: `out[m:m+rows, n:n+columns] = x[m:m+rows]
    @ w[n:n+columns].T` for float32 2-D arrays whose rows are contiguous (any length), and
    while it reads, prefetches weight rows `ahead:ahead+columns` (none where `ahead` < 0)."""
    vector = ir.VectorType(_FLOAT, VECTOR_FLOATS)

    @intrinsic
    def tile(typingctx, x, w, out, m, n, ahead):
        def codegen(context, builder, signature, args):
            return _emit_tile(context, builder, signature, args, rows, columns, vector)

        return types.void(x, w, out, m, n, ahead), codegen

    return tile


def _emit_tile(context, builder, signature, args, rows, columns, vector):
    x, w, out = (context.make_array(t)(context, builder, a)
                 for t, a in zip(signature.args[:3], args[:3], strict=True))
    m, n, ahead = (context.cast(builder, a, t, types.int64)
                   for t, a in zip(signature.args[3:], args[3:], strict=True))
    lanes = VECTOR_FLOATS
    module = builder.module
    fma = cgutils.get_or_insert_function(
        module, ir.FunctionType(vector, [vector] * 3), f"llvm.fma.v{lanes}f32")
    prefetch = cgutils.get_or_insert_function(
        module, ir.FunctionType(ir.VoidType(), [_BYTE_POINTER, _I32, _I32, _I32]),
        "llvm.prefetch.p0")
    mask_type = ir.VectorType(ir.IntType(1), lanes)
    masked_load = cgutils.get_or_insert_function(
        module, ir.FunctionType(vector, [vector.as_pointer(), _I32, mask_type, vector]),
        f"llvm.masked.load.v{lanes}f32.p0")
    reduce_add = cgutils.get_or_insert_function(
        module, ir.FunctionType(_FLOAT, [_FLOAT, vector]), f"llvm.vector.reduce.fadd.v{lanes}f32")

    inner = builder.extract_value(x.shape, 1)

    def row(array, index):  # float* to row `index` of a 2-D array (its byte stride)
        stride = builder.extract_value(array.strides, 0)
        start = builder.bitcast(array.data, _BYTE_POINTER)
        return builder.bitcast(builder.gep(start, [builder.mul(index, stride)]),
                               _FLOAT.as_pointer())

    def at(pointer, offset):
        return builder.gep(pointer, [offset], inbounds=True)

    x_rows = [row(x, builder.add(m, _I64(i))) for i in range(rows)]
    w_rows = [row(w, builder.add(n, _I64(j))) for j in range(columns)]
    ahead_rows = [row(w, builder.add(ahead, _I64(j))) for j in range(columns)]
    prefetching = builder.icmp_signed(">=", ahead, _I64(0))
    whole = builder.udiv(inner, _I64(lanes))
    left = builder.urem(inner, _I64(lanes))
    zero = ir.Constant(vector, None)

    entry = builder.basic_block
    loop = builder.append_basic_block("tile.loop")
    fetch = builder.append_basic_block("tile.prefetch")
    multiply = builder.append_basic_block("tile.multiply")
    after_loop = builder.append_basic_block("tile.after_loop")
    last = builder.append_basic_block("tile.last_part")
    done = builder.append_basic_block("tile.done")
    builder.cbranch(builder.icmp_unsigned(">", whole, _I64(0)), loop, after_loop)

    # Whole vectors of k: rows x columns fused multiply-adds per step.
    builder.position_at_end(loop)
    step = builder.phi(_I64)
    sums = [[builder.phi(vector) for _ in range(columns)] for _ in range(rows)]
    offset = builder.mul(step, _I64(lanes))
    builder.cbranch(prefetching, fetch, multiply)
    builder.position_at_end(fetch)
    for pointer in ahead_rows:
        builder.call(prefetch, [builder.bitcast(at(pointer, offset), _BYTE_POINTER), _I32(0),
                                _I32(_CACHE_LEVEL_L2), _I32(1)])
    builder.branch(multiply)
    builder.position_at_end(multiply)

    def load(pointer):
        return builder.load(builder.bitcast(at(pointer, offset), vector.as_pointer()), align=4)

    stepped = _multiply_add(builder, fma, [load(p) for p in x_rows], [load(p) for p in w_rows],
                            sums)
    following = builder.add(step, _I64(1))
    step.add_incoming(_I64(0), entry)
    step.add_incoming(following, multiply)
    for i in range(rows):
        for j in range(columns):
            sums[i][j].add_incoming(zero, entry)
            sums[i][j].add_incoming(stepped[i][j], multiply)
    builder.cbranch(builder.icmp_unsigned("<", following, whole), loop, after_loop)

    # The last k short of a whole vector, read under a mask.
    builder.position_at_end(after_loop)
    looped = [[builder.phi(vector) for _ in range(columns)] for _ in range(rows)]
    for i in range(rows):
        for j in range(columns):
            looped[i][j].add_incoming(zero, entry)
            looped[i][j].add_incoming(stepped[i][j], multiply)
    builder.cbranch(builder.icmp_unsigned(">", left, _I64(0)), last, done)
    builder.position_at_end(last)
    offset = builder.mul(whole, _I64(lanes))
    lane_ids = ir.Constant(ir.VectorType(_I64, lanes), [_I64(i) for i in range(lanes)])
    left_vector = builder.insert_element(ir.Constant(ir.VectorType(_I64, lanes), None), left,
                                         _I32(0))
    left_vector = builder.shuffle_vector(left_vector, left_vector,
                                         ir.Constant(ir.VectorType(_I32, lanes), [0] * lanes))
    mask = builder.icmp_unsigned("<", lane_ids, left_vector)

    def load_part(pointer):
        return builder.call(masked_load, [builder.bitcast(at(pointer, offset), vector.as_pointer()),
                                          _I32(4), mask, zero])

    finished = _multiply_add(builder, fma, [load_part(p) for p in x_rows],
                             [load_part(p) for p in w_rows], looped)
    builder.branch(done)

    builder.position_at_end(done)
    totals = [[builder.phi(vector) for _ in range(columns)] for _ in range(rows)]
    for i in range(rows):
        out_row = at(row(out, builder.add(m, _I64(i))), n)
        for j in range(columns):
            totals[i][j].add_incoming(looped[i][j], after_loop)
            totals[i][j].add_incoming(finished[i][j], last)
            value = builder.call(reduce_add, [ir.Constant(_FLOAT, -0.0), totals[i][j]],
                                 fastmath=("reassoc",))
            builder.store(value, at(out_row, _I64(j)))
    return context.get_dummy_value()


def _multiply_add(builder, fma, x_vectors, w_vectors, sums):
    return [[builder.call(fma, [xv, wv, sums[i][j]]) for j, wv in enumerate(w_vectors)]
            for i, xv in enumerate(x_vectors)]
