"""Structured output: JSON-schema grammars turned into allowed-token bitmasks, with llguidance.

llguidance (a Rust core with a numpy bitmask API and no torch) compiles a schema once against
the tokenizer. Each structured request gets its own matcher; before a step it writes the
request's allowed tokens as a bitmask, which the sampler applies on the device, and after the
step it advances by the sampled token.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import llguidance
import llguidance.hf
import llguidance.numpy as llnumpy
import numpy as np

from scheduler.sampling_params import StructuredOutput

log = logging.getLogger(__name__)

ANY_JSON_OBJECT = '{"type": "object"}'
# Strict: a keyword llguidance does not implement is an error, never ignored. No free
# whitespace, so a weak model cannot wander into endless blanks; separators as json.dumps.
JSON_OPTIONS = {
    "lenient": False, "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
}


@dataclass(frozen=True)
class CompiledGrammar:
    """A checked grammar; every request gets its own matcher from it."""

    template: llguidance.LLMatcher

    def matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


def grammar_tokenizer(hf_tokenizer, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (about a second: build it once)."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=list(eos_token_ids) or None)


@functools.lru_cache(maxsize=256)
def compile_grammar(structured: StructuredOutput,
                    tokenizer: llguidance.LLTokenizer) -> CompiledGrammar:
    """Compile `structured` for `tokenizer`; cached per schema text.

    Raises ValueError, with llguidance's message naming the keyword, for a schema that is not
    JSON or uses a feature llguidance does not support.
    """
    schema = ANY_JSON_OBJECT if structured.json_schema is None else structured.json_schema
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as error:
        raise ValueError(f"the JSON schema is not a JSON object: {error}") from None
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    # A warning means part of the schema would not be enforced: refuse it like an error.
    problems = [matcher.get_error()] if matcher.is_error() else matcher.get_grammar_warnings()
    if problems:
        raise ValueError(f"unsupported JSON schema: {'; '.join(problems)}")
    return CompiledGrammar(matcher)


class StructuredOutputs:
    """An engine's grammars: compiles them and keeps each running structured request's matcher.

    Not thread-safe: the engine thread calls it. `add` / `remove` / `accept` change a request's
    matcher; `bitmasks` only reads them.
    """

    def __init__(self, hf_tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """ValueError for a schema that cannot be enforced (see compile_grammar)."""
        if self._tokenizer is None:  # built on first use: engines without grammars never pay
            self._tokenizer = grammar_tokenizer(self._hf_tokenizer, self._eos_token_ids)
            self._executor = llguidance.LLExecutor()
        return compile_grammar(structured, self._tokenizer)

    def add(self, request_id: str, grammar: CompiledGrammar) -> None:
        self._matchers[request_id] = grammar.matcher()

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher by its sampled token; True once the grammar is
        complete (nothing may follow)."""
        matcher = self._matchers[request_id]
        if not matcher.consume_token(token_id):
            log.warning("request %s: token %d breaks its grammar (%s); stopping it",
                        request_id, token_id, matcher.get_error())
        return matcher.is_stopped()

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
