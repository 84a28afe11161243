"""Draft tokens by prompt lookup: the tokens that followed the latest earlier match of the tail.

Agents echo code, files and tool output, so the continuation of an n-gram seen before is often
what the model says next. Two indexes, one rule:

- `NgramProposer`, one per request: n-grams of that request's prompt + outputs.
- `SuffixIndex`, one per engine: n-grams of every request's outputs, so a request can draft
  what another request wrote (agents repeat each other).
- `pick_draft` takes the longer match of the two (the `suffix` method) under vLLM's caps.

The rule (vLLM's `ngram` method, except that the latest occurrence wins where vLLM takes the
earliest: recent context is the better guess in an edit loop): for n from `max_n` down to
`min_n`, look for an earlier occurrence of the last n tokens; at the first n that has one,
propose the up to k tokens that followed its latest occurrence. A request's own match P tokens
back copies on past the history's end over what it has just copied, i.e. repeats with period
P (a loop drafts k tokens, not P); a match in another request's outputs stops at their end.

    tokens  a b c d x a b c          n = 3: "a b c" ends at 3, the tail "a b c" at 8
    index   ... ("a","b","c") -> 3   draft = tokens[3 : 3 + k] = "d x a b c"[:k]

Both keep one dict from n-gram (a tuple, so lengths never collide) to where its latest
occurrence ends. An n-gram enters the dict only once the token after it exists, so every
entry has a continuation and the tail itself is never its own match. Costs, with
w = max_n - min_n + 1 lengths and L history tokens:

- index a new token: O(w * max_n) (w tuples built in C, w dict writes), whatever L is;
  a whole 30k-token prompt at once: ~15 ms for one length, ~60-120 ms for five;
- propose: O(w * max_n + k), whatever L is: ~5 us (one length) to ~20 us (five) per call on a
  30k-token history here, as for a 30-token one;
- memory: w dict entries (a tuple key each) per token, ~120-200 bytes per entry on CPython
  (a 30k-token request with 5 lengths: ~18 MB; with vLLM's default min = max = 5: ~5 MB).

A micro-benchmark, not a test (time is measured with benchmarks here, not asserted):

    import random, timeit
    p = NgramProposer(2, 5)
    ids = [random.randrange(32000) for _ in range(30000)]
    p.propose(ids, 5)                                   # indexes 30k tokens once
    timeit.timeit(lambda: p.propose(ids, 5), number=10000) / 10000   # seconds per call
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from typing import NamedTuple

# The shared index packs (sequence id, end) into one int, one object for all n at that end.
_SEQ_STRIDE = 1 << 40
# Evicted requests' token positions cleared per `SuffixIndex.update`, plus twice the tokens
# it adds, so clearing outpaces indexing (~10 us a call at 5 lengths).
_RECLAIM_PER_CALL = 64
# Up to this many new tokens are indexed one slice at a time (zips cost more to set up).
_FEW_TOKENS = 8


class Draft(NamedTuple):
    token_ids: list[int]  # the proposal, at most k tokens; [] when nothing matched
    match_len: int  # n of the n-gram that matched; 0 when nothing did


NO_DRAFT = Draft([], 0)


class NgramProposer:
    """One request's n-gram index, caught up from its token ids on each `propose` call.

    The token ids a caller passes must only grow (prompt + accepted outputs, no draft and no
    pending placeholder): rejected drafts are never in them, so nothing needs undoing.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        _check_lengths(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}

    def index(self, token_ids: Sequence[int]) -> None:
        """Index the tokens new since the last call: O(new tokens * w * max_n).

        `propose` calls this; a caller may also call it per prefill chunk, spreading the cost
        of a long prompt (~0.5 ms per 1k tokens and length on CPython) over the chunks' steps.
        """
        tokens = self._tokens
        start = len(tokens)
        if len(token_ids) != start:
            tokens.extend(_new_tokens(token_ids, start))
            _index_ends(self._last_end, tokens, start, 0, self.min_n, self.max_n)

    def propose(self, token_ids: Sequence[int], k: int) -> Draft:
        """Index what is new in `token_ids`, then draft up to k tokens to follow them."""
        self.index(token_ids)
        tokens = self._tokens
        if k < 1:
            return NO_DRAFT
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = self._last_end.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return Draft(_copy_on(tokens, end, k), n)
        return NO_DRAFT


def _copy_on(tokens: list[int], end: int, k: int) -> list[int]:
    """`tokens[end : end + k]`, continued past the end as a repeat of period len - end."""
    draft = tokens[end:end + k]
    period = len(tokens) - end
    while len(draft) < k:
        draft.append(draft[len(draft) - period])
    return draft


class SuffixIndex:
    """Every request's output n-grams -> where the latest occurrence ends, shared by requests.

    `update(request_id, output_ids)` as outputs grow (what is new is indexed), `finish` when a
    request ends, `propose(token_ids, k)` from any request's tokens. Finished requests stay
    drafted from until evicted; a hit counts as a use.

    Memory bound: finished requests are evicted least recently used first while more than
    `max_cached_requests` of them are kept or the tokens kept (running and finished) exceed
    `max_cached_tokens`. Running requests are never evicted (the scheduler bounds them: at most
    max_num_seqs of max_model_len tokens). An evicted request's entries are deleted a few
    dozen tokens per `update` call (`num_reclaiming_tokens` are still held), so evicting a
    long request never stalls a step; lookups skip its stale entries meanwhile. An n-gram whose
    latest holder is evicted is forgotten even where an older request also has it (a missed
    draft, never a wrong one). Memory: ~1 KB per kept token at 5 lengths (w entries of
    ~200 bytes), so the default 2**17-token budget is ~130 MB.
    """

    def __init__(self, min_n: int, max_n: int, max_cached_requests: int = 10000,
                 max_cached_tokens: int = 1 << 17) -> None:
        _check_lengths(min_n, max_n)
        if max_cached_requests < 0 or max_cached_tokens < 0:
            raise ValueError("max_cached_requests and max_cached_tokens must be at least 0, got "
                             f"{max_cached_requests}, {max_cached_tokens}")
        self.min_n = min_n
        self.max_n = max_n
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> seq_id * STRIDE + end
        self._seqs: dict[int, list[int]] = {}  # live seq_id -> its output token ids
        self._running: dict[str, int] = {}  # request id -> seq_id
        self._finished: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._reclaiming: deque[_Reclaim] = deque()
        self._next_seq_id = 0
        self.num_tokens = 0  # tokens of live (running and finished, not evicted) requests

    @property
    def num_reclaiming_tokens(self) -> int:
        return sum(len(r.tokens) - r.next_end for r in self._reclaiming)

    def num_indexed(self, request_id: str) -> int:
        """Outputs of `request_id` indexed so far (0 for one not running)."""
        seq_id = self._running.get(request_id)
        return len(self._seqs[seq_id]) if seq_id is not None else 0

    def update(self, request_id: str, output_ids: Sequence[int]) -> None:
        """Index the outputs of `request_id` that are new since the last call."""
        seq_id = self._running.get(request_id)
        if seq_id is None:
            seq_id = self._running[request_id] = self._next_seq_id
            self._next_seq_id += 1
            self._seqs[seq_id] = []
        tokens = self._seqs[seq_id]
        start = len(tokens)
        tokens.extend(_new_tokens(output_ids, start))
        self.num_tokens += len(tokens) - start
        _index_ends(self._last_end, tokens, start, seq_id * _SEQ_STRIDE, self.min_n, self.max_n)
        self._evict()
        self._reclaim(_RECLAIM_PER_CALL + 2 * (len(tokens) - start))

    def finish(self, request_id: str) -> None:
        """The request ended: keep its outputs for others, now evictable. Unknown ids: no-op."""
        seq_id = self._running.pop(request_id, None)
        if seq_id is not None:
            self._finished[seq_id] = None
            self._evict()

    def propose(self, token_ids: Sequence[int], k: int) -> Draft:
        """Draft up to k tokens after `token_ids` from the outputs indexed here."""
        if k < 1:
            return NO_DRAFT
        tail = list(token_ids[-self.max_n:])
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            packed = self._last_end.get(tuple(tail[len(tail) - n:]))
            if packed is None:
                continue
            seq_id, end = divmod(packed, _SEQ_STRIDE)
            tokens = self._seqs.get(seq_id)
            if tokens is None:  # evicted, its entries not reclaimed yet
                continue
            if seq_id in self._finished:
                self._finished.move_to_end(seq_id)
            return Draft(tokens[end:end + k], n)
        return NO_DRAFT

    def _evict(self) -> None:
        while self._finished and (len(self._finished) > self.max_cached_requests
                                  or self.num_tokens > self.max_cached_tokens):
            seq_id, _ = self._finished.popitem(last=False)
            tokens = self._seqs.pop(seq_id)
            self.num_tokens -= len(tokens)
            self._reclaiming.append(_Reclaim(seq_id, tokens))

    def _reclaim(self, num_ends: int) -> None:
        """Delete up to `num_ends` token positions' entries of evicted requests."""
        while self._reclaiming and num_ends > 0:
            job = self._reclaiming[0]
            stop = min(len(job.tokens), job.next_end + num_ends)
            lo, hi = job.seq_id * _SEQ_STRIDE, (job.seq_id + 1) * _SEQ_STRIDE
            for n in range(self.min_n, self.max_n + 1):
                for key in _grams(job.tokens, max(job.next_end, n), stop, n):
                    if lo <= self._last_end.get(key, -1) < hi:
                        del self._last_end[key]
            num_ends -= stop - job.next_end
            job.next_end = stop
            if stop == len(job.tokens):
                self._reclaiming.popleft()


class _Reclaim:
    """An evicted request whose entries are deleted from `next_end` on."""

    __slots__ = ("seq_id", "tokens", "next_end")

    def __init__(self, seq_id: int, tokens: list[int]) -> None:
        self.seq_id = seq_id
        self.tokens = tokens
        self.next_end = 0


def pick_draft(drafts: Sequence[Draft], *, max_spec_factor: float | None = None,
               max_depth: int | None = None) -> Draft:
    """The draft with the longest match (the first on ties: pass the request's own first).

    Suffix-decoding caps (vLLM's): at most `max_spec_factor * match_len` tokens, and
    `match_len + len(draft) <= max_depth`.
    """
    best = max(drafts, key=lambda d: d.match_len, default=NO_DRAFT)
    if best.match_len == 0:
        return NO_DRAFT
    k = len(best.token_ids)
    if max_spec_factor is not None:
        k = min(k, int(max_spec_factor * best.match_len))
    if max_depth is not None:
        k = min(k, max_depth - best.match_len)
    if k <= 0:
        return NO_DRAFT
    return best if k == len(best.token_ids) else Draft(best.token_ids[:k], best.match_len)


def _index_ends(last_end: dict[tuple[int, ...], int], tokens: list[int], start: int, base: int,
                min_n: int, max_n: int) -> None:
    """Record the n-grams ending at `start`..len-1 (each followed by a token) at base + end."""
    stop = len(tokens)
    if stop - start <= _FEW_TOKENS:  # a step's few outputs: slices beat building zips
        for end in range(max(start, min_n), stop):
            for n in range(min_n, min(max_n, end) + 1):
                last_end[tuple(tokens[end - n:end])] = base + end
        return
    for n in range(min_n, max_n + 1):
        lo = max(start, n)
        last_end.update(zip(_grams(tokens, lo, stop, n), range(base + lo, base + stop),
                            strict=True))


def _grams(tokens: list[int], lo: int, stop: int, n: int) -> Iterator[tuple[int, ...]]:
    """The n-grams of `tokens` ending at lo..stop-1 (lo >= n), built in C by zip."""
    body = tokens[lo - n:stop - 1]
    return zip(*(body[i:] for i in range(n)), strict=False)


def _check_lengths(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram lengths need 1 <= min_n <= max_n, got {min_n}, {max_n}")


def _new_tokens(token_ids: Sequence[int], start: int) -> list[int]:
    """`token_ids[start:]`, checked: an index follows one grow-only list of sampled tokens."""
    if len(token_ids) < start:
        raise ValueError(f"token ids shrank from {start} to {len(token_ids)}; index one "
                         "request's growing token ids (prompt + accepted outputs)")
    new = list(token_ids[start:])
    if new and min(new) < 0:
        raise ValueError("token ids hold a placeholder (< 0); pass only sampled tokens")
    return new
