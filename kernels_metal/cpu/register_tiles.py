"""Register tiles of a weight product (`out = x @ w.T`) written in LLVM IR, for cpu_gemm.

A tile multiplies a few input rows by a few weight rows with every sum held in a vector
register, and while it reads its weight rows it prefetches weight rows further on into L2.
numba's loops of the same tiles (sums in tuples, vectorised by LLVM) took as long from
memory as streaming the weight plus multiplying it from cache: 8 rows of the default
model's layers 23 ms, where one row streamed in 13 and 8 rows from cache took 12. The core,
busy multiplying, kept too few reads in flight; with the prefetches the memory serves the
next tiles meanwhile (8 x 2 tiles: 15 ms). A prefetch in a numba loop left it unvectorised
or slower, hence the IR.

The same holds a GQA group's attention value sums in registers over a block of keys
(`weighted_rows`), and asks the cache for a block about to be read (`prefetch`).
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


class _Vectors:
    """LLVM IR for float32 vectors of VECTOR_FLOATS lanes, emitted through `builder`."""

    def __init__(self, builder):
        self.builder = builder
        self.lanes = VECTOR_FLOATS
        self.type = ir.VectorType(_FLOAT, self.lanes)
        self.zero = ir.Constant(self.type, None)
        self._indices = ir.VectorType(_I64, self.lanes)
        self._lane_ids = ir.Constant(self._indices, [_I64(i) for i in range(self.lanes)])
        mask = ir.VectorType(ir.IntType(1), self.lanes)
        module, vector, pointer = builder.module, self.type, self.type.as_pointer()
        suffix = f"v{self.lanes}f32"
        self._fma = cgutils.get_or_insert_function(
            module, ir.FunctionType(vector, [vector] * 3), f"llvm.fma.{suffix}")
        self._masked_load = cgutils.get_or_insert_function(
            module, ir.FunctionType(vector, [pointer, _I32, mask, vector]),
            f"llvm.masked.load.{suffix}.p0")
        self._masked_store = cgutils.get_or_insert_function(
            module, ir.FunctionType(ir.VoidType(), [vector, pointer, _I32, mask]),
            f"llvm.masked.store.{suffix}.p0")
        self._reduce_add = cgutils.get_or_insert_function(
            module, ir.FunctionType(_FLOAT, [_FLOAT, vector]), f"llvm.vector.reduce.fadd.{suffix}")

    def fma(self, a, b, c):
        return self.builder.call(self._fma, [a, b, c])

    def load(self, pointer, mask=None):
        """The vector at float* `pointer` (the lanes of `mask` only: the others 0)."""
        pointer = self.builder.bitcast(pointer, self.type.as_pointer())
        if mask is None:
            return self.builder.load(pointer, align=4)
        return self.builder.call(self._masked_load, [pointer, _I32(4), mask, self.zero])

    def store(self, value, pointer, mask):
        pointer = self.builder.bitcast(pointer, self.type.as_pointer())
        self.builder.call(self._masked_store, [value, pointer, _I32(4), mask])

    def total(self, value):
        return self.builder.call(self._reduce_add, [ir.Constant(_FLOAT, -0.0), value],
                                 fastmath=("reassoc",))

    def splat(self, value, vector_type=None):
        vector_type = vector_type or self.type
        one = self.builder.insert_element(ir.Constant(vector_type, None), value, _I32(0))
        return self.builder.shuffle_vector(
            one, one, ir.Constant(ir.VectorType(_I32, self.lanes), [0] * self.lanes))

    def lanes_below(self, first, limit):
        """The mask of lanes i with `first + i < limit`."""
        index = self.builder.add(self._lane_ids, self.splat(first, self._indices))
        return self.builder.icmp_unsigned("<", index, self.splat(limit, self._indices))


def _loop(builder, name: str, count, carried: list[list], body) -> list[list]:
    """IR for `for index in range(count): carried = body(index, carried)`: `carried`, a grid
    of values (phis inside the loop), goes into `body`, whose grid comes back around; the
    grid after the loop (`carried` itself where count is 0) is returned. `body` may add
    blocks of its own."""
    entry = builder.basic_block
    loop, after = (builder.append_basic_block(f"{name}.{part}") for part in ("loop", "after"))
    builder.cbranch(builder.icmp_unsigned(">", count, _I64(0)), loop, after)
    builder.position_at_end(loop)
    index = builder.phi(_I64)
    inside = _phis(builder, carried, entry)
    stepped = body(index, inside)
    end = builder.basic_block
    following = builder.add(index, _I64(1))
    index.add_incoming(_I64(0), entry)
    index.add_incoming(following, end)
    _join(inside, stepped, end)
    builder.cbranch(builder.icmp_unsigned("<", following, count), loop, after)
    builder.position_at_end(after)
    return _join(_phis(builder, carried, entry), stepped, end)


def _when(builder, name: str, condition, carried: list[list], body) -> list[list]:
    """IR for `if condition: carried = body(carried)`; returns the grid after it."""
    entry = builder.basic_block
    then, after = (builder.append_basic_block(f"{name}.{part}") for part in ("then", "after"))
    builder.cbranch(condition, then, after)
    builder.position_at_end(then)
    changed = body(carried)
    end = builder.basic_block
    builder.branch(after)
    builder.position_at_end(after)
    return _join(_phis(builder, carried, entry), changed, end)


def _phis(builder, grid: list[list], block) -> list[list]:
    """A phi for each value of `grid`, taking it when coming from `block`."""
    return _join([[builder.phi(value.type) for value in row] for row in grid], grid, block)


def _join(phis: list[list], values: list[list], block) -> list[list]:
    """Each phi of a grid takes the value at its place in `values` when coming from `block`."""
    for phi_row, value_row in zip(phis, values, strict=True):
        for phi, value in zip(phi_row, value_row, strict=True):
            phi.add_incoming(value, block)
    return phis


def _at_byte(builder, array, offset):
    """float* `offset` bytes into an array's data."""
    start = builder.bitcast(array.data, _BYTE_POINTER)
    return builder.bitcast(builder.gep(start, [offset]), _FLOAT.as_pointer())


def register_tile(rows: int, columns: int):
    """An intrinsic `tile(x, w, out, m, n, ahead)`: `out[m:m+rows, n:n+columns] = x[m:m+rows]
    @ w[n:n+columns].T` for float32 2-D arrays whose rows are contiguous (any length), and
    while it reads, prefetches weight rows `ahead:ahead+columns` (none where `ahead` < 0)."""

    @intrinsic
    def tile(typingctx, x, w, out, m, n, ahead):
        def codegen(context, builder, signature, args):
            return _emit_tile(context, builder, signature, args, rows, columns)

        return types.void(x, w, out, m, n, ahead), codegen

    return tile


def _emit_tile(context, builder, signature, args, rows, columns):
    x, w, out = (context.make_array(t)(context, builder, a)
                 for t, a in zip(signature.args[:3], args[:3], strict=True))
    m, n, ahead = (context.cast(builder, a, t, types.int64)
                   for t, a in zip(signature.args[3:], args[3:], strict=True))
    vectors = _Vectors(builder)
    lanes = vectors.lanes
    inner = builder.extract_value(x.shape, 1)

    def row(array, index):  # float* to row `index` of a 2-D array (its byte stride)
        return _at_byte(builder, array, builder.mul(index, builder.extract_value(array.strides,
                                                                                 0)))

    def at(pointer, offset):
        return builder.gep(pointer, [offset], inbounds=True)

    x_rows = [row(x, builder.add(m, _I64(i))) for i in range(rows)]
    w_rows = [row(w, builder.add(n, _I64(j))) for j in range(columns)]
    ahead_rows = [row(w, builder.add(ahead, _I64(j))) for j in range(columns)]
    prefetching = builder.icmp_signed(">=", ahead, _I64(0))

    def whole_vectors(step, sums):  # rows x columns fused multiply-adds per vector of k
        offset = builder.mul(step, _I64(lanes))
        fetch, multiply = (builder.append_basic_block(f"tile.{part}")
                           for part in ("prefetch", "multiply"))
        builder.cbranch(prefetching, fetch, multiply)
        builder.position_at_end(fetch)
        for pointer in ahead_rows:
            _prefetch_line(builder, at(pointer, offset))
        builder.branch(multiply)
        builder.position_at_end(multiply)
        return _multiply_add(vectors, [vectors.load(at(p, offset)) for p in x_rows],
                             [vectors.load(at(p, offset)) for p in w_rows], sums)

    whole = builder.udiv(inner, _I64(lanes))
    sums = _loop(builder, "tile", whole, [[vectors.zero] * columns] * rows, whole_vectors)

    def last_part(sums):  # the k short of a whole vector, read under a mask
        offset = builder.mul(whole, _I64(lanes))
        mask = vectors.lanes_below(_I64(0), left)
        return _multiply_add(vectors, [vectors.load(at(p, offset), mask) for p in x_rows],
                             [vectors.load(at(p, offset), mask) for p in w_rows], sums)

    left = builder.urem(inner, _I64(lanes))
    totals = _when(builder, "tile.last", builder.icmp_unsigned(">", left, _I64(0)), sums,
                   last_part)
    for i in range(rows):
        out_row = at(row(out, builder.add(m, _I64(i))), n)
        for j in range(columns):
            builder.store(vectors.total(totals[i][j]), at(out_row, _I64(j)))
    return context.get_dummy_value()


def _multiply_add(vectors, x_vectors, w_vectors, sums):
    return [[vectors.fma(xv, wv, sums[i][j]) for j, wv in enumerate(w_vectors)]
            for i, xv in enumerate(x_vectors)]


def weighted_rows(heads: int):
    """An intrinsic `add(weights, first, rows, out, start)`: for `h < heads`,
    `out[start + h] += weights[:, first + h] @ rows`, for float32 `weights [n, *]` (any
    strides), `rows [n, d]` and `out [*, d]` whose rows are contiguous (any stride between
    them). Each row of `rows` is read once for the `heads` sums, which stay in registers over
    the n rows (a GQA group's value sums, where a loop's `out[h] += w * row` stored and
    reloaded them every row)."""

    @intrinsic
    def add(typingctx, weights, first, rows, out, start):
        def codegen(context, builder, signature, args):
            return _emit_weighted_rows(context, builder, signature, args, heads)

        return types.void(weights, first, rows, out, start), codegen

    return add


def _emit_weighted_rows(context, builder, signature, args, heads):
    weights, rows, out = (context.make_array(signature.args[i])(context, builder, args[i])
                          for i in (0, 2, 3))
    first, start = (context.cast(builder, args[i], signature.args[i], types.int64)
                    for i in (1, 4))
    vectors = _Vectors(builder)
    lanes = vectors.lanes
    per_pass = 4 if VECTOR_REGISTERS == 32 else 2  # vectors of a row summed in one pass
    count = builder.extract_value(rows.shape, 0)
    width = builder.extract_value(rows.shape, 1)
    row_stride = builder.extract_value(rows.strides, 0)
    weight_stride = builder.extract_value(weights.strides, 0)
    column_stride = builder.extract_value(weights.strides, 1)
    out_stride = builder.extract_value(out.strides, 0)
    span = per_pass * lanes

    def one_pass(current, _):  # `per_pass` vectors of each head's sum, lanes past width off
        first_lane = builder.mul(current, _I64(span))
        lanes_of = [builder.add(first_lane, _I64(c * lanes)) for c in range(per_pass)]
        masks = [vectors.lanes_below(lane, width) for lane in lanes_of]
        lane_bytes = [builder.mul(lane, _I64(4)) for lane in lanes_of]
        out_pointers = [[_at_byte(builder, out, builder.add(
            builder.mul(builder.add(start, _I64(h)), out_stride), lane_bytes[c]))
            for c in range(per_pass)] for h in range(heads)]

        def add_row(index, sums):
            row_start = builder.mul(index, row_stride)
            values = [vectors.load(_at_byte(builder, rows, builder.add(row_start,
                                                                       lane_bytes[c])), masks[c])
                      for c in range(per_pass)]
            weight_row = builder.mul(index, weight_stride)
            summed = []
            for h in range(heads):
                offset = builder.add(weight_row,
                                     builder.mul(builder.add(first, _I64(h)), column_stride))
                weight = vectors.splat(builder.load(_at_byte(builder, weights, offset), align=4))
                summed.append([vectors.fma(weight, values[c], sums[h][c])
                               for c in range(per_pass)])
            return summed

        starting = [[vectors.load(out_pointers[h][c], masks[c]) for c in range(per_pass)]
                    for h in range(heads)]
        finals = _loop(builder, "weighted.row", count, starting, add_row)
        for h in range(heads):
            for c in range(per_pass):
                vectors.store(finals[h][c], out_pointers[h][c], masks[c])
        return []

    _loop(builder, "weighted.pass", builder.udiv(builder.add(width, _I64(span - 1)),
                                                 _I64(span)), [], one_pass)
    return context.get_dummy_value()


def key_dots(head_dim: int):
    """An intrinsic `dots(q, h, keys, first, count, kv, scores, column)`: `scores[h, column
    + j] = q[h] @ keys[first + j, kv]` for j < count, for float32 `q [*, head_dim]`, `keys
    [*, *, head_dim]` (a pool's block) and `scores [*, *]` whose last axes are contiguous.

    A vector's worth of keys at a time: each key's products with the query summed into a
    vector register, then the vectors' lanes summed together in a tree of shuffles, each
    step halving the lanes of twice the keys, ending in one vector of their dot products
    (a dot product summed alone spent most of its time on its one vector's lanes)."""

    @intrinsic
    def dots(typingctx, q, h, keys, first, count, kv, scores, column):
        def codegen(context, builder, signature, args):
            return _emit_key_dots(context, builder, signature, args, head_dim)

        return types.void(q, h, keys, first, count, kv, scores, column), codegen

    return dots


def _emit_key_dots(context, builder, signature, args, head_dim):
    q, keys, scores = (context.make_array(signature.args[i])(context, builder, args[i])
                       for i in (0, 2, 6))
    h, first, count, kv, column = (context.cast(builder, args[i], signature.args[i],
                                                types.int64) for i in (1, 3, 4, 5, 7))
    vectors = _Vectors(builder)
    lanes = vectors.lanes
    parts = head_dim // lanes

    def at(array, *index):  # float* to element `index` of an array, by its byte strides
        offset = _I64(0)
        for axis, i in enumerate(index):
            stride = builder.extract_value(array.strides, axis)
            offset = builder.add(offset, builder.mul(i, stride))
        return _at_byte(builder, array, offset)

    query = at(q, h, _I64(0))
    q_parts = [vectors.load(builder.gep(query, [_I64(p * lanes)], inbounds=True))
               for p in range(parts)]
    out = at(scores, h, column)
    last = builder.sub(count, _I64(1))

    def batch(index, _):  # `lanes` keys (the last repeated past `count`, never stored)
        base = builder.mul(index, _I64(lanes))
        sums = []
        for j in range(lanes):
            key_index = builder.add(base, _I64(j))
            key_index = builder.select(builder.icmp_signed("<", key_index, count), key_index,
                                       last)
            key = at(keys, builder.add(first, key_index), kv, _I64(0))
            total = vectors.zero
            for p in range(parts):
                value = vectors.load(builder.gep(key, [_I64(p * lanes)], inbounds=True))
                total = vectors.fma(q_parts[p], value, total)
            sums.append(total)
        vectors.store(_lane_totals(builder, sums), builder.gep(out, [base], inbounds=True),
                      vectors.lanes_below(base, count))
        return []

    batches = builder.udiv(builder.add(count, _I64(lanes - 1)), _I64(lanes))
    _loop(builder, "dots", batches, [], batch)
    return context.get_dummy_value()


def _lane_totals(builder, sums: list):
    """One vector whose lane j is the sum of the lanes of `sums[j]` (as many vectors as
    lanes): pairs of vectors folded into one, each half of the lanes added to the other,
    until one vector remains (lanes - 1 folds, where summing each alone took ~2 log2(lanes)
    steps apiece)."""
    lanes = len(sums)
    width = lanes  # lanes each key still has in its vector
    while len(sums) > 1:
        width //= 2
        # Of the pair's 2 * lanes lanes (a's, then b's), the first `width` of each run of
        # 2 * width, and the second: added, each key keeps half as many lanes.
        low = [start + i for start in range(0, 2 * lanes, 2 * width) for i in range(width)]
        high = [i + width for i in low]
        low, high = (ir.Constant(ir.VectorType(_I32, lanes), [_I32(i) for i in order])
                     for order in (low, high))
        sums = [builder.fadd(builder.shuffle_vector(a, b, low),
                             builder.shuffle_vector(a, b, high), flags=("fast",))
                for a, b in zip(sums[0::2], sums[1::2], strict=True)]
    return sums[0]


_CACHE_LINE = 64


@intrinsic
def prefetch(typingctx, array):
    """Ask the cache (L2) for every line of a C-contiguous `array`, to be read soon."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0])
        size = builder.mul(data.nitems, data.itemsize)
        start = builder.bitcast(data.data, _BYTE_POINTER)
        with cgutils.for_range_slice(builder, _I64(0), size, _I64(_CACHE_LINE)) as (offset, _):
            _prefetch_line(builder, builder.gep(start, [offset]))
        return context.get_dummy_value()

    return types.void(array), codegen


def _prefetch_line(builder, pointer):
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_BYTE_POINTER, _I32, _I32, _I32]),
        "llvm.prefetch.p0")
    builder.call(function, [builder.bitcast(pointer, _BYTE_POINTER), _I32(0),
                            _I32(_CACHE_LEVEL_L2), _I32(1)])
