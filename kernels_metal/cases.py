"""Random paged-attention problems for checking kernels against the reference.

Used by the kernel tests, `metal-serve doctor` and the dispatcher's first-use check. Blocks
are handed out in a shuffled order; blocks no request owns are filled with NaN (a quantized
pool's: NaN scales), so a kernel that reads a wrong block cannot pass.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kernels_metal.kv_quant import KVQuant, QuantizedPool, dequantize, quantize
from kernels_metal.metadata import AttentionMetadata
from kernels_metal.reference import paged_attention_reference

# (atol, rtol) against the reference run in fp32 on the same (rounded) inputs: the kernels'
# output rounding (half an ulp: 2^-11 fp16, 2^-8 bf16) plus fp16/bf16 probabilities in P V.
# A quantized pool's inputs are its values dequantized to the queries' dtype, as the kernels
# stage them: quantization error itself is not the kernels' business.
TOLERANCE = {mx.float32: (1e-5, 1e-5), mx.float16: (1e-3, 4e-3), mx.bfloat16: (8e-3, 2e-2)}


@dataclass(frozen=True)
class Case:
    dtype: mx.Dtype  # of the pools, or of the queries over quantized pools
    head_dim: int
    block_size: int
    num_heads: int
    kv_heads: int
    requests: tuple[tuple[int, int], ...]  # (tokens cached before the step, query rows now)
    partition_size: int | None = None
    window: int | None = None  # sliding window of the layer; None: global attention
    softcap: float | None = None
    sinks: bool = False  # random per-head sink logits (`case_sinks`)
    kv_bits: int | None = None  # quantized pools (kv_quant.py) of 8 or 4 bits; None: float
    # MLA's latent rows: one KV head whose first `value_dim` elements are the values (the
    # V pool is the K pool); None: a V pool of its own.
    value_dim: int | None = None
    # Image spans whose rows see each other (AttentionMetadata.last_keys): (request, its
    # first query row in the step, rows); each of those rows sees up to the span's last.
    images: tuple[tuple[int, int, int], ...] = ()

    @property
    def name(self) -> str:
        reqs = "+".join(f"{c}:{n}" for c, n in self.requests)
        split = f"-p{self.partition_size}" if self.partition_size else ""
        window = f"-w{self.window}" if self.window else ""
        softcap = f"-cap{self.softcap:g}" if self.softcap else ""
        sinks = "-sinks" if self.sinks else ""
        dtype = str(self.dtype).removeprefix("mlx.core.")
        kv = f"-kv{self.kv_bits}" if self.kv_bits else ""
        dv = f"-dv{self.value_dim}" if self.value_dim else ""
        images = "".join(f"-img{r}:{first}+{n}" for r, first, n in self.images)
        return (f"{dtype}{kv}-d{self.head_dim}{dv}-bs{self.block_size}-h{self.num_heads}"
                f"kv{self.kv_heads}-[{reqs}]{split}{window}{softcap}{sinks}{images}")


DTYPES = (mx.float16, mx.bfloat16, mx.float32)
HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_SIZES = (16, 32)
GQA = ((4, 4), (6, 2), (8, 2), (8, 1))  # (query heads, KV heads): ratios 1, 3, 4, 8


def variant_cases() -> list[Case]:
    """One mixed step per (dtype, head dim, block size), cycling GQA ratio and partitioning."""
    cases = []
    for i, (dtype, d, bs) in enumerate(itertools.product(DTYPES, HEAD_DIMS, BLOCK_SIZES)):
        heads, kv = GQA[i % len(GQA)]
        requests = (
            (5 * bs + 3, 1),  # decode over 6 blocks
            (bs - 1, 1),  # decode at a block boundary
            (bs + 5, 19),  # prefill chunk on a cached prefix, crossing blocks mid-block
            (0, 11),  # fresh prompt
            (2 * bs, 3),  # a short multi-row run (per-token kernel)
        )
        partition = (None, 2 * bs, 3 * bs)[i % 3]
        cases.append(Case(dtype, d, bs, heads, kv, requests, partition))
    return cases


EDGE_CASES = [
    # Decode only: many requests, many partitions of very different counts.
    Case(mx.float16, 128, 16, 8, 2, tuple((c, 1) for c in (1, 17, 63, 64, 65, 200, 31, 5)), 32),
    Case(mx.bfloat16, 64, 32, 6, 2, ((300, 1), (2, 1)), 64),
    Case(mx.float32, 256, 16, 4, 1, ((150, 1),), 48),
    # Prefill only: a long chunk after a long prefix, many query tiles and key tiles.
    Case(mx.float32, 80, 32, 6, 2, ((50, 70),)),
    Case(mx.float16, 96, 16, 4, 4, ((0, 70), (33, 40))),
    Case(mx.bfloat16, 128, 32, 8, 1, ((100, 25),)),
    # Query counts around the decode / tiled switch, and tile edges.
    Case(mx.float16, 64, 16, 8, 2, ((7, 4), (7, 5), (0, 8), (0, 9), (8, 16), (8, 17))),
    Case(mx.float32, 64, 16, 8, 8, ((0, 1), (0, 32), (0, 33), (31, 2))),
    # Head groups that need two threadgroups per KV head (more than 8 queries per KV head).
    Case(mx.float16, 64, 16, 12, 1, ((40, 1), (9, 20)), 16),
    Case(mx.float32, 128, 32, 16, 1, ((70, 1), (0, 10))),
    Case(mx.bfloat16, 80, 16, 10, 2, ((25, 1), (3, 12))),
    Case(mx.float16, 64, 32, 9, 1, ((50, 1), (5, 12)), 32),  # chunks of 5 and 4 heads
    # A chunk that ends exactly on a block boundary, a context of exactly one block.
    Case(mx.float16, 256, 32, 4, 2, ((32, 32), (31, 1))),
    Case(mx.float32, 96, 16, 6, 3, ((16, 16), (15, 1), (0, 16))),
    # Mixed step with a long decode split next to a chunk (the agent case).
    Case(mx.bfloat16, 128, 16, 8, 2, ((400, 1), (60, 30), (3, 1)), 128),
    Case(mx.float16, 80, 32, 6, 2, ((130, 1), (130, 2), (40, 24)), 32),
    Case(mx.float32, 64, 32, 3, 1, ((90, 1), (0, 45)), 64),
    # Single rows everywhere, GQA 3 and 4, both block sizes.
    Case(mx.float16, 96, 32, 8, 2, tuple((c, 1) for c in range(0, 96, 13))),
    Case(mx.bfloat16, 256, 16, 6, 2, ((20, 1), (20, 6), (0, 1))),
    Case(mx.float32, 128, 16, 9, 3, ((45, 1), (12, 13)), 16),
    Case(mx.float16, 64, 32, 2, 2, ((70, 1), (0, 40)), 32),
]

# Sliding windows (Mistral, Gemma, Qwen) and soft-capped scores (Gemma 2).
WINDOW_CASES = [
    # Decode rows whose window starts mid-block, in split partitions and in one.
    Case(mx.float32, 64, 16, 8, 2, tuple((c, 1) for c in (3, 20, 37, 150, 333)), 16, window=20),
    Case(mx.float16, 128, 16, 6, 2, ((200, 1), (5, 1), (90, 2)), None, window=64),
    # Prefill chunks longer than the window: tiles skipped before it, masked across its edge.
    Case(mx.float32, 64, 16, 4, 2, ((0, 70), (30, 40)), window=13),
    Case(mx.bfloat16, 80, 32, 6, 2, ((100, 45), (0, 9), (50, 1)), 32, window=33),
    Case(mx.float16, 64, 16, 8, 1, ((40, 20), (7, 1)), window=1),  # each row sees itself only
    Case(mx.float32, 96, 16, 4, 4, ((60, 30), (250, 1)), 64, window=512),  # longer than context
    Case(mx.float32, 64, 16, 8, 2, ((20, 1), (45, 1), (0, 33), (10, 12)), 16, softcap=20.0),
    Case(mx.bfloat16, 128, 16, 4, 2, ((70, 1), (30, 25)), 32, window=24, softcap=50.0),
]


# Attention sinks (GPT-OSS: head dim 64, 64 query over 8 KV heads, a 128-key window on every
# other layer): decode in one partition and split, prefill tiles, mixed steps, with windows.
SINK_CASES = [
    Case(mx.float32, 64, 16, 8, 1, ((30, 1), (100, 1), (0, 1), (20, 40)), sinks=True),
    Case(mx.float32, 64, 16, 8, 1, ((30, 1), (100, 1), (0, 1), (20, 40)), 32, window=24,
         sinks=True),
    Case(mx.float16, 64, 16, 16, 1, ((200, 1), (7, 1), (60, 33)), 64, sinks=True),  # 2 chunks
    Case(mx.bfloat16, 64, 32, 8, 1, ((300, 1), (150, 2), (40, 70)), 48, window=128,
         sinks=True),
    Case(mx.float16, 128, 16, 6, 2, ((0, 45), (33, 17)), window=20, sinks=True),  # prefill only
    Case(mx.float32, 96, 32, 4, 4, tuple((c, 1) for c in (1, 40, 90, 170)), 32, sinks=True),
    Case(mx.bfloat16, 256, 16, 4, 2, ((70, 1), (30, 25)), 32, window=24, softcap=50.0,
         sinks=True),
    Case(mx.float16, 80, 32, 6, 3, ((5, 1), (12, 13), (64, 3)), window=9, sinks=True),
]


def image_cases() -> list[Case]:
    """Steps whose image rows see each other (Gemma's), per (dtype, head dim), cycling block
    size and GQA ratio, with windows, soft-caps and sinks (period 4): a span across query
    tiles and key tiles, one that starts a chunk (a prefix hit inside an image), two in one
    chunk, and one in a 3-row run (which must leave the per-token kernel), beside decodes."""
    cases = []
    for i, (dtype, d) in enumerate(itertools.product(DTYPES, (64, 128, 256))):
        bs = BLOCK_SIZES[i % 2]
        heads, kv = GQA[i % len(GQA)]
        requests = ((3 * bs + 1, 1), (bs + 5, 40), (2 * bs - 3, 20), (bs, 3))
        images = ((1, 6, 17), (1, 30, 9), (2, 0, 11), (3, 0, 2))
        options = i % 4
        cases.append(Case(dtype, d, bs, heads, kv, requests, (None, bs)[i % 2],
                          window=9 if options == 1 else None,
                          softcap=30.0 if options == 2 else None, sinks=options == 3,
                          images=images))
    return cases


def grid() -> list[Case]:
    """The kernel check grid over float pools: every variant once, then the edge cases."""
    return variant_cases() + EDGE_CASES + WINDOW_CASES + SINK_CASES + image_cases()


KV_BITS = (8, 4)


def quantized_variant_cases() -> list[Case]:
    """One mixed step per (KV bits, query dtype, head dim), cycling block size, GQA ratio and
    partitioning; windows, soft-caps and sinks cycle with period 7, so they meet all of those."""
    cases = []
    for i, (bits, dtype, d) in enumerate(itertools.product(KV_BITS, DTYPES, HEAD_DIMS)):
        bs = BLOCK_SIZES[i % 2]
        heads, kv = GQA[i % len(GQA)]
        requests = ((5 * bs + 3, 1), (bs - 1, 1), (bs + 5, 19), (0, 11), (2 * bs, 3))
        options = i % 7
        cases.append(Case(dtype, d, bs, heads, kv, requests, (None, 2 * bs, 3 * bs)[i % 3],
                          window=bs + 7 if options in (1, 3) else None,
                          softcap=30.0 if options in (2, 3) else None, sinks=options == 5,
                          kv_bits=bits))
    return cases


QUANTIZED_EDGE_CASES = [
    # Rows of codes that are not a multiple of 16 bytes: 8-byte loads (int8 with scale groups
    # of 8, int4 with groups of 16).
    Case(mx.float16, 72, 16, 8, 2, ((40, 1), (9, 20), (0, 1)), 16, kv_bits=8),
    Case(mx.bfloat16, 48, 32, 6, 2, ((70, 1), (20, 13)), 32, kv_bits=4),
    # Two threadgroups per KV head; a long split decode next to a chunk; a short window.
    Case(mx.bfloat16, 64, 16, 12, 1, ((40, 1), (9, 20)), 16, kv_bits=4),
    Case(mx.float16, 128, 16, 8, 2, ((400, 1), (60, 30), (3, 1)), 128, kv_bits=8),
    Case(mx.float32, 64, 16, 4, 2, ((0, 70), (30, 40)), window=13, kv_bits=4),
]


def quantized_grid() -> list[Case]:
    """The kernel check grid over int8 and int4 pools."""
    return quantized_variant_cases() + QUANTIZED_EDGE_CASES


def make_inputs(case: Case, seed: int = 0):
    """(q, k_pool, v_pool, meta, scale) for the case; the pools are `QuantizedPool`s of
    the case's random values if it is quantized."""
    rng = np.random.default_rng(seed)
    bs, d = case.block_size, case.head_dim
    seq_lens = np.array([c + n for c, n in case.requests], np.int32)
    q_lens = np.array([n for _, n in case.requests], np.int32)
    blocks_per_req = -(-seq_lens // bs)
    max_blocks = int(blocks_per_req.max())
    num_blocks = int(blocks_per_req.sum()) + 3  # block 0 stays unowned (table padding)
    order = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(seq_lens), max_blocks), np.int32)
    owned = np.zeros(num_blocks, bool)
    start = 0
    for r, n in enumerate(blocks_per_req):
        tables[r, :n] = order[start:start + n]
        owned[order[start:start + n]] = True
        start += n
    shape = (num_blocks, bs, case.kv_heads, d)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    nan_blocks = ~owned
    nan_blocks[0] = False  # the reference gathers padding through block 0: keep it finite
    cu = np.zeros(len(q_lens) + 1, np.int32)
    cu[1:] = np.cumsum(q_lens)
    q = rng.standard_normal((int(cu[-1]), case.num_heads, d)).astype(np.float32)
    meta = AttentionMetadata(
        cu_seqlens_q=cu, seq_lens=seq_lens, block_tables=tables,
        slot_mapping=np.zeros(int(cu[-1]), np.int64), block_size=bs,
    )
    if case.images:
        meta = meta.with_last_keys(image_last_keys(meta, case.images))
    k_pool, v_pool = (_pool(x, nan_blocks, case) for x in (k, v))
    if case.value_dim is not None:
        v_pool = k_pool
    return mx.array(q).astype(case.dtype), k_pool, v_pool, meta, d**-0.5


def image_last_keys(meta: AttentionMetadata,
                    images: tuple[tuple[int, int, int], ...]) -> np.ndarray:
    """Each row's last visible key: its position, or its image span's last."""
    last_keys = meta.positions.copy()
    q_lens = np.diff(meta.cu_seqlens_q)
    for request, first, rows in images:
        if first + rows > q_lens[request]:
            raise ValueError(f"an image of rows {first}..{first + rows - 1} in request "
                             f"{request}'s {q_lens[request]} rows")
        row = int(meta.cu_seqlens_q[request]) + first
        last_keys[row:row + rows] = last_keys[row + rows - 1]
    return last_keys


def _pool(values: np.ndarray, nan_blocks: np.ndarray, case: Case) -> mx.array | QuantizedPool:
    """The case's pool of `values`, NaN (or NaN-scaled) in `nan_blocks`."""
    if case.kv_bits is None:
        values[nan_blocks] = np.nan
        return mx.array(values).astype(case.dtype)
    codes, scales = quantize(mx.array(values), KVQuant(case.kv_bits))
    scales = np.array(scales)
    scales[nan_blocks] = np.nan
    return QuantizedPool(codes, mx.array(scales), case.kv_bits)


def float_pool(pool: mx.array | QuantizedPool, dtype: mx.Dtype) -> mx.array:
    """A pool as the reference takes it, in float32: a float pool as is, a quantized one
    dequantized to `dtype` (the queries' dtype: what the kernels stage)."""
    if isinstance(pool, QuantizedPool):
        pool = dequantize(pool.codes, pool.scales, pool.bits, dtype)
    return pool.astype(mx.float32)


def case_sinks(case: Case, seed: int = 0) -> mx.array | None:
    """The case's `[num_heads]` float32 sink logits, or None: from well below the scores
    (unit-variance here) to far above them, so some heads give the sink most of the mass."""
    if not case.sinks:
        return None
    rng = np.random.default_rng([seed, case.num_heads])
    return mx.array(rng.uniform(-4.0, 6.0, case.num_heads).astype(np.float32))


@dataclass(frozen=True)
class CaseResult:
    max_error: float  # largest |kernel - reference|; NaN if the kernel produced NaN
    worst: float  # largest error / allowed error; <= 1 passes

    @property
    def passed(self) -> bool:
        return self.worst <= 1.0


def check(kernels, case: Case, seed: int = 0) -> CaseResult:
    """Run `kernels` on the case and compare with the fp32 reference on the same inputs."""
    q, k_pool, v_pool, meta, scale = make_inputs(case, seed)
    sinks = case_sinks(case, seed)
    f32 = [q.astype(mx.float32), float_pool(k_pool, q.dtype), float_pool(v_pool, q.dtype)]
    if case.value_dim is not None:
        f32[2] = f32[1][..., : case.value_dim]
    expected = np.array(paged_attention_reference(*f32, meta, scale, case.window, case.softcap,
                                                  sinks))
    extra = {} if case.value_dim is None else {"value_dim": case.value_dim}
    got = kernels(q, k_pool, v_pool, meta, scale, case.window, case.softcap, sinks, **extra)
    want = (*q.shape[:2], case.value_dim or q.shape[2])
    if got.shape != want or got.dtype != q.dtype:
        raise AssertionError(f"{case.name}: got {got.shape} {got.dtype}, want {want} {q.dtype}")
    got = np.array(got.astype(mx.float32))
    err = np.abs(got - expected)
    if np.isnan(err).any():
        return CaseResult(float("nan"), float("inf"))
    atol, rtol = TOLERANCE[case.dtype]
    return CaseResult(float(err.max()), float((err / (atol + rtol * np.abs(expected))).max()))
