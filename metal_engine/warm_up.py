"""Warm-up: the steps a model serves run once before the server reports healthy.

What the first requests would otherwise pay for is built here: on a Mac every kernel launch
configuration the model's steps use is compiled and checked (kernels_metal/dispatch.py: the
first-use check of each variant, then each new launch evaluated inside its call, with the
fallback on failure), on the real pools, so that 64-bit pool offsets and quantized pools are
the ones served; on the CPU backend the compiled loops (kernels_metal/cpu/) are built
or loaded from numba's disk cache. The steps cover what the launches and loops depend on:

    phase         requests                          steps it makes
    one question  1, a short prompt                 one-request prefill (MERGE=0), one-request
                                                    decodes
    a batch       8 continuing the question's       prefill-only over cached blocks (>= 7
                  cached blocks, a longer prompt   requests: device-space metadata), mixed
                  joining late; sampling mixed      prefill + decode, decode-only with shared
                  (greedy, top-k/p, min-p,          blocks (the CPU's cascade decode)
                  penalties, logprobs)
    a picture     1 with an image (a model with     the vision tower, image rows, three-axis
                  vision only)                      rope positions

Nothing else changes what is compiled: a launch's template, threadgroup and bindings do not
depend on how long a context is (split-K partitions are in each variant's first-use check),
and the CPU backend's loops are compiled per argument type (on the default model, a
529-token prompt after the warm-up compiled no further loop).

The steps run through the engine's runner but under a scheduler of their own: the engine's
scheduler, its prefix cache and the disk tier never see them. They write K/V only into
blocks the engine's scheduler holds free (at startup: all of them) and are forgotten after.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np
from PIL import Image

from kernels_metal.plan import DECODE_MAX_QUERY_LEN
from scheduler import SamplingParams, Scheduler

BATCH = 8  # requests at once: past 7, a step's cu_seqlens no longer fits MLX's constant space
MIN_CHUNK = DECODE_MAX_QUERY_LEN + 1  # rows a prefill chunk needs to go to the prefill kernel
MAX_TOKENS = 4  # decode steps per request (enough for decode-only steps behind the batch)
SAMPLING = (  # greedy, and every on-device sampling pass
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, top_p=0.9, top_k=40, seed=0,
                   ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, min_p=0.05, seed=1, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, repetition_penalty=1.1,
                   presence_penalty=0.5, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, ignore_eos=True),
)
REQUEST_ID = "metal-serve-warm-up-{}"


def warm_up(engine) -> float:
    """Run the warm-up steps on `engine`'s runner (see the module doc); the seconds taken.

    Call before the engine serves: its scheduler must hold no request.
    """
    from metal_engine.engine import LLMEngine

    if engine.has_unfinished_requests():
        raise RuntimeError("warm up an engine before it serves: it has requests")
    start = time.perf_counter()
    config = replace(engine.scheduler.config, enable_prefix_caching=True)
    private = LLMEngine(engine.runner, Scheduler(config), engine.tokenizer, engine.model_name,
                        engine.async_scheduling)
    shapes = _Shapes(config.block_size, config.max_model_len, config.max_num_batched_tokens,
                     engine.runner.model.config.vocab_size)
    ids = (REQUEST_ID.format(i) for i in itertools.count())
    question = shapes.tokens(shapes.fit(36))
    used: list[str] = []
    for phase in (([(question, SAMPLING[0])], []),
                  _batch(shapes, question, config.max_num_seqs)):
        used += _run(private, phase, ids)
    if engine.image_model is not None:
        used.append(next(ids))
        _picture(private, used[-1], engine.image_model, question)
        engine.runner.encoder.clear()  # the private scheduler's images: the engine's knows none
    engine.runner.release(used)
    engine.runner.model.settle()  # after the steps: they pack what the backend streams
    return time.perf_counter() - start


class _Shapes:
    """Prompt lengths that fit the engine's limits, and their token ids."""

    def __init__(self, block_size: int, max_model_len: int, token_budget: int,
                 vocab_size: int) -> None:
        self.block_size, self.token_budget = block_size, token_budget
        self.longest = max_model_len - MAX_TOKENS
        self._rng = np.random.default_rng(0)
        self._vocab = vocab_size

    def tokens(self, n: int) -> list[int]:
        """`n` ordinary token ids (the low ids of a vocabulary are its special tokens)."""
        low = min(256, self._vocab // 2)
        return [int(t) for t in self._rng.integers(low, self._vocab, max(1, n))]

    def fit(self, n: int) -> int:
        return max(1, min(n, self.longest))


# A phase: (prompt, params) pairs added at once, then those added after its first step.
_Phase = tuple[list[tuple[list[int], SamplingParams]], list[tuple[list[int], SamplingParams]]]


def _batch(s: _Shapes, question: list[int], max_num_seqs: int) -> _Phase:
    """Requests that continue the question's full blocks (prefix hits) with short suffixes,
    all in one step's token budget, and a longer one joining their decodes."""
    n = max(1, min(BATCH, max_num_seqs - 1))
    shared = question[: len(question) // s.block_size * s.block_size]
    width = max(0, min(s.block_size, s.token_budget // n - MIN_CHUNK))
    first = [((shared + s.tokens(MIN_CHUNK + i * width // n))[: s.longest],
              SAMPLING[i % len(SAMPLING)]) for i in range(n)]
    late = [((shared + s.tokens(130))[: s.longest], SAMPLING[1])]
    return first, late


@dataclass(frozen=True)
class _Picture:
    """A grey screenshot-sized picture, as the server hands a decoded image over."""

    image: Image.Image = field(default_factory=lambda: Image.new("RGB", (448, 448), "grey"))
    content_hash: str = "metal-serve-warm-up"
    detail: str = "auto"


def _picture(engine, request_id: str, image_model, question: list[int]) -> None:
    """One request with an image: the tower's first run and a step with image rows."""
    ids, media = image_model.place([*question[:4], image_model.placeholder_id], [_Picture()])
    engine.add_request(request_id, ids, SAMPLING[0], media=media)
    while engine.has_unfinished_requests():
        engine.step()


def _run(engine, phase: _Phase, ids: Iterator[str]) -> list[str]:
    """Step `engine` until the phase's requests finish; the ids they took."""
    first, late = phase
    used = []
    for prompt, params in first:
        used.append(next(ids))
        engine.add_request(used[-1], prompt, params)
    engine.step()
    for prompt, params in late:
        used.append(next(ids))
        engine.add_request(used[-1], prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return used
