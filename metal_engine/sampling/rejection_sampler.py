"""Exact verification of draft tokens on the device (speculative sampling).

A request with k draft tokens has k + 1 verified rows: row j holds the target's logits after
the drafts before j, the last row is the bonus position. Each row gets the sampler's own
processing (grammar mask, bias, min_tokens, penalties over the history with those drafts
appended, temperature, min-p, top-k/p), so p_j is exactly what `sample()` would draw from
there. Output per request: the accepted drafts and one more token, 1 to k + 1 tokens, with
each output distributed exactly as sampling from the target one token at a time.

- Draft probabilities q (a draft model): accept x with probability min(1, p(x)/q(x)), on a
  rejection draw from normalize(max(0, p - q)) (Leviathan et al. 2023, Chen et al. 2023).
- No q (n-gram, suffix: q is a point mass on x): draw y from p exactly as `sample()` would,
  accept iff y == x, and emit y either way. P(accept) = p(x) and a rejected y is p with x
  zeroed, renormalized: the same rule, but the tokens are `sample()`'s own, so greedy and
  seeded requests write the same text with and without speculation.
- Greedy rows: accept while the draft is the argmax, then the argmax.

Seeded rows draw their Gumbel noise from the sampler's key for (seed, output index) and the
acceptance uniform from a disjoint key space, so neither depends on the rest of the batch.
The draft's own randomness must not use these keys (it would correlate q's draw with the
test). Everything is vectorized over the packed rows: no loop over requests or positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from metal_engine.outputs import TokenLogprobs
from metal_engine.sampling.logprobs import LogprobArrays, compute_logprobs
from metal_engine.sampling.sampler import SamplingBatch, process_logits, sampling_logits
from metal_engine.sampling.sampling_row import SamplingRow


def verification_rows(request: SamplingRow, draft_token_ids: Sequence[int],
                      allowed_tokens: Sequence[np.ndarray | None] | None = None,
                      ) -> list[SamplingRow]:
    """The k + 1 sampling rows of `request` verifying k drafts: row j samples output index
    `num_output_tokens + j` with `draft_token_ids[:j]` appended to its output history.

    A request with a grammar passes `allowed_tokens`, one bitmask per row (the grammar after
    the drafts before it); rows past a draft the grammar rejects are never reached, any
    mask (or None) does for them.
    """
    k = len(draft_token_ids)
    if allowed_tokens is None:
        if request.allowed_tokens is not None:
            raise ValueError("a request with a grammar needs allowed_tokens for each of its "
                             f"{k + 1} verified rows (the grammar advanced through the drafts)")
        allowed_tokens = [None] * (k + 1)
    elif len(allowed_tokens) != k + 1:
        raise ValueError(f"{k} drafts verify {k + 1} rows, got {len(allowed_tokens)} bitmasks")

    def history(j: int) -> Sequence[int]:  # only penalties read it: copy it only for them
        if not request.params.has_penalties:
            return request.output_token_ids
        return [*request.output_token_ids, *draft_token_ids[:j]]

    return [
        replace(request, num_output_tokens=request.num_output_tokens + j,
                output_token_ids=history(j), allowed_tokens=allowed_tokens[j])
        for j in range(k + 1)
    ]


@dataclass(frozen=True)
class DraftBatch:
    """The rows one step verifies, built on the host. Request r owns rows
    `row_starts[r] .. row_starts[r] + k_r`; draft i of the step is verified at `draft_rows[i]`:

        request        r0 (k=2)         r1 (k=0)   r2 (k=1)
        row            0    1    2      3          4    5
        draft index    0    1    -      -          2    -
        verifies       d0   d1   bonus  bonus      d2   bonus

    The caller keeps k within max_tokens and cuts the output after a stop token.
    """

    sampling: SamplingBatch  # one row per verified row
    num_draft_tokens: np.ndarray  # [R] int32
    draft_token_ids: np.ndarray  # [D] int64, the requests' drafts in order
    num_top: list[int | None]  # [R] logprobs asked per request (None: none)

    @classmethod
    def build(cls, requests: list[SamplingRow], draft_token_ids: Sequence[Sequence[int]],
              allowed_tokens: Sequence[Sequence[np.ndarray | None] | None] | None = None,
              ) -> DraftBatch:
        """`allowed_tokens[r]`: request r's k_r + 1 bitmasks, or None when it has no grammar."""
        if not requests or len(requests) != len(draft_token_ids):
            raise ValueError(f"need one draft list per request, got {len(draft_token_ids)} "
                             f"for {len(requests)} requests (and at least one request)")
        masks = allowed_tokens if allowed_tokens is not None else [None] * len(requests)
        rows = [row for request, drafts, allowed in zip(requests, draft_token_ids, masks,
                                                        strict=True)
                for row in verification_rows(request, drafts, allowed)]
        return cls(
            sampling=SamplingBatch.build(rows),
            num_draft_tokens=np.array([len(d) for d in draft_token_ids], np.int32),
            draft_token_ids=np.array([t for d in draft_token_ids for t in d], np.int64),
            num_top=[r.params.logprobs for r in requests],
        )

    @property
    def num_rows(self) -> int:
        return int(self.num_draft_tokens.sum()) + len(self.num_draft_tokens)

    @property
    def row_starts(self) -> np.ndarray:
        return (np.cumsum(self.num_draft_tokens + 1) - self.num_draft_tokens - 1).astype(np.int32)

    @property
    def draft_rows(self) -> np.ndarray:
        """[D] the row verifying each draft: its request's start plus its position."""
        request = np.repeat(np.arange(len(self.num_draft_tokens)), self.num_draft_tokens)
        position = np.arange(len(request)) - np.repeat(
            np.cumsum(self.num_draft_tokens) - self.num_draft_tokens, self.num_draft_tokens)
        return (self.row_starts[request] + position).astype(np.int32)


class AcceptedTokens(NamedTuple):
    """One request's verified output: its accepted drafts, then the token sampled after them."""

    token_ids: list[int]  # 1 .. k + 1 tokens; len - 1 drafts were accepted
    logprobs: list[TokenLogprobs] | None  # one per token, when the request asked


@dataclass(frozen=True)
class VerifiedTokens:
    """Lazy device arrays of one verification."""

    batch: DraftBatch
    token_ids: mx.array  # [R, K + 1] int32 (K: the most drafts): each request's tokens, then -1
    num_tokens: mx.array  # [R] int32 in [1, k_r + 1]
    row_token_ids: mx.array  # [T] int32: the token each row emits if it is reached
    logprobs: LogprobArrays | None  # over the verified rows, by request row

    def arrays(self) -> list[mx.array]:
        extra = self.logprobs.arrays() if self.logprobs is not None else []
        return [self.token_ids, self.num_tokens, self.row_token_ids, *extra]

    def to_host(self) -> list[AcceptedTokens]:
        row_tokens, counts = self.row_token_ids.tolist(), self.num_tokens.tolist()
        by_row = self.logprobs.to_host(row_tokens) if self.logprobs is not None else {}
        starts = self.batch.row_starts.tolist()
        return [
            AcceptedTokens(row_tokens[start:start + n],
                           None if k is None else [by_row[row] for row in range(start, start + n)])
            for start, n, k in zip(starts, counts, self.batch.num_top, strict=True)
        ]


def rejection_sample(logits: mx.array, batch: DraftBatch, draft_probs: mx.array | None = None,
                     draft_ids: mx.array | None = None) -> VerifiedTokens:
    """`logits [T, V]` of the verified rows (raw; packed as DraftBatch shows) and, for draft-
    model drafts, `draft_probs [D, V]`: the distribution each draft was drawn from (None: each
    draft is a point mass). A draft model's drafts are still on the device: `draft_ids [D]`
    then stands for `batch.draft_token_ids`. Returns the accepted tokens and their logprobs
    (the raw log-softmax at their rows, as `compute_logprobs` reports for `sample()`), lazy."""
    _check_shapes(logits, batch, draft_probs, draft_ids)
    drafts, is_draft = _drafts_by_row(batch, draft_ids)
    sampling = batch.sampling
    processed = process_logits(logits, sampling)
    greedy = mx.argmax(processed, axis=-1).astype(mx.int32)
    if sampling.all_greedy:
        row_tokens = greedy
    else:
        filtered = sampling_logits(processed, sampling)
        noise = _gumbel_noise(filtered.shape, sampling.seeds)
        if draft_probs is None or not len(batch.draft_token_ids):
            drawn = mx.argmax(filtered + noise, axis=-1).astype(mx.int32)
        else:
            drawn = _against_draft_probs(filtered, noise, drafts, is_draft, draft_probs, batch)
        row_tokens = mx.where(mx.array(sampling.temperature == 0), greedy, drawn)
    # A row that emits its own draft goes on: the next row's logits were computed after that
    # very token. For greedy and n-gram rows this is the acceptance rule itself; with
    # draft_probs a rejection never redraws the draft (max(0, p - q) is 0 there).
    accepted = (row_tokens == drafts) & is_draft
    num_tokens, token_ids = _accepted_prefixes(accepted, row_tokens, batch)
    row_num_top = [k for k, n in zip(batch.num_top, batch.num_draft_tokens.tolist(), strict=True)
                   for _ in range(n + 1)]
    logprobs = compute_logprobs(logits, row_tokens, row_num_top)
    return VerifiedTokens(batch, token_ids, num_tokens, row_tokens, logprobs)


def _against_draft_probs(filtered: mx.array, noise: mx.array, drafts: mx.array,
                         is_draft: mx.array, draft_probs: mx.array, batch: DraftBatch,
                         ) -> mx.array:
    """Each row's token under the standard rule: its draft when u * q(x) < p(x), else a draw
    from normalize(max(0, p - q)); a bonus row (q = 0) draws from p as `sample()` does."""
    index = np.zeros(batch.num_rows, np.int32)  # the draft_probs row of each verified row
    index[batch.draft_rows] = np.arange(len(batch.draft_rows))
    q = mx.where(is_draft[:, None], draft_probs.astype(mx.float32)[mx.array(index)], 0.0)
    p = mx.softmax(filtered, axis=-1)
    p_x = mx.take_along_axis(p, drafts[:, None], axis=-1)[:, 0]
    q_x = mx.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]
    accept = (_acceptance_uniforms(batch.sampling.seeds) * q_x < p_x) & is_draft
    residual = mx.maximum(p - q, 0.0)
    residual_logits = mx.where(residual > 0, mx.log(residual), -mx.inf)
    # p == q leaves nothing (and is then never rejected); bonus rows draw from p itself.
    use_residual = is_draft[:, None] & mx.any(residual > 0, axis=-1, keepdims=True)
    recovered = mx.argmax(mx.where(use_residual, residual_logits, filtered) + noise, axis=-1)
    return mx.where(accept, drafts, recovered.astype(mx.int32))


def _accepted_prefixes(accepted: mx.array, row_tokens: mx.array,
                       batch: DraftBatch) -> tuple[mx.array, mx.array]:
    """Per request: 1 + its leading accepted drafts, and its tokens `[R, K + 1]` padded -1."""
    k = batch.num_draft_tokens
    position = np.arange(int(k.max()) + 1)
    rows = batch.row_starts[:, None] + np.minimum(position, k[:, None])  # [R, K + 1]
    is_draft = mx.array(position[None, :] < k[:, None])
    leading = mx.cumprod((accepted[mx.array(rows)] & is_draft).astype(mx.int32), axis=1)
    num_tokens = mx.sum(leading, axis=1) + 1
    emitted = mx.array(position)[None, :] < num_tokens[:, None]
    return num_tokens.astype(mx.int32), mx.where(emitted, row_tokens[mx.array(rows)], -1)


def _drafts_by_row(batch: DraftBatch,
                   draft_ids: mx.array | None) -> tuple[mx.array, mx.array]:
    """The draft each row verifies (0 at bonus rows) and whether it verifies one."""
    is_draft = np.zeros(batch.num_rows, bool)
    is_draft[batch.draft_rows] = True
    if draft_ids is not None:
        drafts = mx.zeros(batch.num_rows, mx.int32)
        drafts[mx.array(batch.draft_rows)] = draft_ids.astype(mx.int32)
        return drafts, mx.array(is_draft)
    drafts = np.zeros(batch.num_rows, np.int32)
    drafts[batch.draft_rows] = batch.draft_token_ids
    return mx.array(drafts), mx.array(is_draft)


def draw_drafts(logits: mx.array, temperatures: np.ndarray,
                seeds: list[int | None]) -> tuple[mx.array, mx.array]:
    """A drafter's (draft model, MTP head) tokens and the distributions q they were drawn
    from, per row of its `logits [N, V]`: q = softmax(logits / T), one-hot at the argmax where
    T is 0. The noise of a seeded row comes from keys [2, seed]: reproducible, and never a key
    the verification uses (its draw would then be correlated with q's)."""
    tokens = mx.argmax(logits, axis=-1)
    sampled = temperatures > 0
    if sampled.any():
        temperature = np.where(sampled, temperatures, 1.0).astype(np.float32)
        scaled = logits.astype(mx.float32) / mx.array(temperature)[:, None]
        noise = _per_row(lambda s, key: mx.random.gumbel(shape=s, key=key), logits.shape[1:],
                         seeds, 2)
        rows = mx.array(sampled)
        tokens = mx.where(rows, mx.argmax(scaled + noise, axis=-1), tokens)
    one_hot = (mx.arange(logits.shape[-1])[None, :] == tokens[:, None]).astype(mx.float32)
    if not sampled.any():
        return tokens, one_hot
    return tokens, mx.where(rows[:, None], mx.softmax(scaled, axis=-1), one_hot)


def _keys(seeds: np.ndarray, space: int) -> mx.array:
    """`mx.random.key(space << 32 | s)` for each 32-bit seed, as one `[S, 2]` array."""
    return mx.array(np.stack([np.full(len(seeds), space, np.uint32),
                              seeds.astype(np.uint32)], axis=1))


def _per_row(draw, shape: tuple[int, ...], seeds: list[int | None], space: int) -> mx.array:
    """`draw(shape, key)` per row: a seeded row from its own key, the rest from the global
    stream. vmap gives each key the same values as a call of its own (tested)."""
    seeded = np.array([s is not None for s in seeds])
    if not seeded.any():
        return draw((len(seeds), *shape), None)
    values = np.array([s if s is not None else 0 for s in seeds], np.int64)
    own = mx.vmap(lambda key: draw(shape, key))(_keys(values, space))
    if seeded.all():
        return own
    mask = mx.array(seeded).reshape(-1, *([1] * len(shape)))
    return mx.where(mask, own, draw((len(seeds), *shape), None))


def _gumbel_noise(shape: tuple[int, int], seeds: list[int | None]) -> mx.array:
    """`[T, V]`; a seeded row's is the noise `sample()` uses for it (key(seed) = [0, seed])."""
    return _per_row(lambda s, key: mx.random.gumbel(shape=s, key=key), shape[1:], seeds, 0)


def _acceptance_uniforms(seeds: list[int | None]) -> mx.array:
    """`[T]` in [0, 1), seeded from keys [1, seed]: never a key the noise uses."""
    return _per_row(lambda s, key: mx.random.uniform(shape=s, key=key), (), seeds, 1)


def _check_shapes(logits: mx.array, batch: DraftBatch, draft_probs: mx.array | None,
                  draft_ids: mx.array | None) -> None:
    vocab = logits.shape[-1]
    if logits.ndim != 2 or logits.shape[0] != batch.num_rows:
        raise ValueError(f"logits must be [{batch.num_rows}, vocab] (k + 1 rows per request), "
                         f"got {list(logits.shape)}")
    ids = batch.draft_token_ids
    if draft_ids is not None:
        if draft_ids.shape != (len(ids),):
            raise ValueError(f"draft_ids must be [{len(ids)}], got {list(draft_ids.shape)}")
    elif len(ids) and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"draft token ids must be in [0, {vocab}), got {ids.min()}..{ids.max()}")
    if draft_probs is not None and tuple(draft_probs.shape) != (len(ids), vocab):
        raise ValueError(f"draft_probs must be [{len(ids)}, {vocab}] (one row per draft), "
                         f"got {list(draft_probs.shape)}")
