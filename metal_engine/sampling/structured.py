"""Structured output: JSON-schema grammars turned into allowed-token bitmasks, with llguidance.

llguidance (a Rust core with a numpy bitmask API and no torch) compiles a schema once against
the tokenizer. Each structured request gets its own matcher; before a step it writes the
request's allowed tokens as a bitmask, which the sampler applies on the device, and after the
step it advances by the sampled token.

A grammar can also fail while generating (a lexer or parser limit met deep in the schema, a
schema that admits no output): compiling walks its first forced steps to refuse what fails at
once, and a request whose matcher fails later ends with finish_reason "error" (`failure`).
llguidance's messages are kept short: its verbose ones quote the grammar, i.e. the client's
schema, which must not reach the logs.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import llguidance
import llguidance.hf
import llguidance.numpy as llnumpy
import numpy as np

from scheduler.sampling_params import StructuredOutput

ANY_JSON_OBJECT = '{"type": "object"}'
# Strict: a keyword llguidance does not implement is an error, never ignored. No free
# whitespace, so a weak model cannot wander into endless blanks; separators as json.dumps.
JSON_OPTIONS = {
    "lenient": False, "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
}
# llguidance's default limits, with errors that name the failure but quote no grammar or state.
LIMITS = llguidance.LLParserLimits(verbose_errors=False, initial_lexer_fuel=100_000)
# Forced tokens (the only ones a mask allows) a compile walks, looking for an early failure.
_PROBE_STEPS = 8
# Where the client wrote the schema, for the messages they get back.
_SCHEMA = "the JSON schema of response_format (or of a forced tool call's parameters)"


@dataclass(frozen=True)
class CompiledGrammar:
    """A checked grammar; every request gets its own matcher from it."""

    template: llguidance.LLMatcher

    def matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


def grammar_tokenizer(hf_tokenizer, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (about a second: build it once)."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=list(eos_token_ids) or None)


def compile_grammar(structured: StructuredOutput,
                    tokenizer: llguidance.LLTokenizer) -> CompiledGrammar:
    """Compile `structured` for `tokenizer`; cached per schema text, refusals too.

    Raises ValueError, with llguidance's message naming the keyword, for a schema that is not
    JSON or uses a feature llguidance does not support, and for one whose grammar fails in its
    first forced steps (a regex too complex for the lexer, a schema that only refers to
    itself).
    """
    compiled = _compile(structured, tokenizer)
    if isinstance(compiled, str):
        raise ValueError(compiled)
    return compiled


@functools.lru_cache(maxsize=256)
def _compile(structured: StructuredOutput,
             tokenizer: llguidance.LLTokenizer) -> CompiledGrammar | str:
    """The grammar, or why it is refused (a refused schema costs its checks once)."""
    schema = ANY_JSON_OBJECT if structured.json_schema is None else structured.json_schema
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as error:
        return f"{_SCHEMA} is not a JSON object: {error}"
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
    # A warning means part of the schema would not be enforced: refuse it like an error.
    problems = [matcher.get_error()] if matcher.is_error() else matcher.get_grammar_warnings()
    if problems:
        return f"unsupported JSON schema in {_SCHEMA}: {'; '.join(map(short, problems))}"
    failure = _early_failure(matcher.deep_copy(), tokenizer.eos_tokens)
    if failure is not None:
        return (f"{_SCHEMA} cannot be generated: {failure}. Simplify it (e.g. smaller "
                "repetition counts in a pattern, no schema that only refers to itself).")
    return CompiledGrammar(matcher)


def _early_failure(matcher: llguidance.LLMatcher, eos_tokens: list[int]) -> str | None:
    """Walk the grammar while a single token is allowed: the error it meets there, if any."""
    for _ in range(_PROBE_STEPS):
        words = np.frombuffer(matcher.compute_bitmask(), np.uint32)
        if matcher.is_error():
            return short(matcher.get_error())
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
        if len(allowed) != 1 or allowed[0] in eos_tokens or matcher.is_stopped():
            return None
        if not matcher.consume_token(int(allowed[0])):
            return short(matcher.get_error())
    return None


def short(error: str) -> str:
    """llguidance's message without the marker its non-verbose errors end with."""
    return error.replace("<non-verbose/>", "").strip() or "the grammar failed"


class StructuredOutputs:
    """An engine's grammars: compiles them and keeps each running structured request's matcher.

    The engine thread calls it; only `compile` may also be called from another thread (the
    server compiles a request's grammar before submitting it, so that a slow schema never
    holds up the engine thread, which then finds it cached). `add` / `remove` / `accept`
    change a request's matcher; `bitmasks` only reads them.
    """

    def __init__(self, hf_tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._first_use = threading.Lock()

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """ValueError for a schema that cannot be enforced (see compile_grammar). Safe to
        call from any thread; llguidance lets go of the GIL while it compiles."""
        with self._first_use:  # built on first use: engines without grammars never pay
            if self._tokenizer is None:
                self._executor = llguidance.LLExecutor()
                self._tokenizer = grammar_tokenizer(self._hf_tokenizer, self._eos_token_ids)
        return compile_grammar(structured, self._tokenizer)

    def add(self, request_id: str, grammar: CompiledGrammar) -> None:
        self._matchers[request_id] = grammar.matcher()

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher by its sampled token; True once the grammar is
        complete (nothing may follow). A token the grammar refuses leaves it failed."""
        matcher = self._matchers[request_id]
        if not matcher.is_error():
            matcher.consume_token(token_id)
        return matcher.is_stopped()

    def failure(self, request_id: str) -> str | None:
        """Why the request's grammar failed (while computing its mask or accepting a token),
        or None while it holds; a short message that quotes no schema."""
        matcher = self._matchers.get(request_id)
        if matcher is None or not matcher.is_error():
            return None
        return short(matcher.get_error())

    def draft_bitmasks(self, request_id: str, draft_token_ids: list[int]) -> list[np.ndarray]:
        """The bitmasks of the k + 1 rows verifying k drafts: the grammar's now, then after
        each draft in turn. Rows past the first draft the grammar refuses are never reached
        (that draft is never accepted): they repeat the last mask. The matcher ends as it
        began."""
        matcher = self._matchers[request_id]
        num_valid = matcher.validate_tokens(draft_token_ids)
        masks = []
        for token_id in draft_token_ids[:num_valid]:
            masks.append(np.frombuffer(matcher.compute_bitmask(), np.int32))
            matcher.consume_token(token_id)
        masks.append(np.frombuffer(matcher.compute_bitmask(), np.int32))
        if num_valid:
            matcher.rollback(num_valid)
        return masks + [masks[-1]] * (len(draft_token_ids) - num_valid)

    def bitmasks(self, request_ids: list[str]) -> dict[str, np.ndarray]:
        """The allowed-token bitmask (int32 words) of each of `request_ids` that has a grammar,
        all computed in one parallel llguidance call."""
        ids = [r for r in request_ids if r in self._matchers]
        if not ids:
            return {}
        masks = llnumpy.allocate_token_bitmask(len(ids), self._tokenizer.vocab_size)
        llnumpy.fill_next_token_bitmask_par(
            self._executor, [(self._matchers[r], i) for i, r in enumerate(ids)], masks
        )
        return dict(zip(ids, masks, strict=True))
