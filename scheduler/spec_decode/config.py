"""`--speculative-config`: `auto` (the server's default), `off`, or JSON as vLLM spells it.

`auto` drafts wherever drafting pays (`never_slower`): with the checkpoint's MTP head where it
has one, else by prompt lookup over the request's own tokens and every other request's outputs
(the `suffix` method). Which of the two is settled once the model dir is known (`resolved`).
JSON takes the four methods; field names, defaults and checks follow vLLM's
`SpeculativeConfig` (vllm/config/speculative.py):

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "suffix"}                      num_speculative_tokens defaults to the tree depth
    {"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}
    {"method": "mtp"}                         num_speculative_tokens None: the checkpoint's own

- ngram: with neither bound given both are 5; with one given the other copies it (vLLM's rule;
  its docstring's "min defaults to 1" is not what its code does). Both >= 1, min <= max.
- suffix: vLLM's `suffix_decoding_*` fields and defaults. metal-serve's suffix drafter is the
  n-gram lookup over the request's own tokens and other requests' outputs, so it also reads
  `prompt_lookup_min`/`_max` (defaults 2 and 6) as the n-gram lengths it indexes; vLLM ignores
  them for this method. `suffix_decoding_min_token_prob` is checked but not used yet (the index
  keeps the latest continuation of an n-gram, not frequency counts).
- `never_slower` (metal-serve's, any method; `auto` sets it): per step, draft only the tokens
  whose expected acceptance pays for their verification rows under the step time measured on
  this machine (scheduler/spec_decode/draft_plan.py); without it, the load-based length of
  scheduler/spec_decode/draft_length.py.
- Legacy spellings vLLM still takes: no method with `"model": "[ngram]"` (ngram), no method with
  another model (draft_model), `"[ngram]"`, and MTP model types such as `"qwen3_next_mtp"` (mtp).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

SpeculativeMethod = Literal["ngram", "suffix", "draft_model", "mtp", "auto"]
METHODS: tuple[str, ...] = ("ngram", "suffix", "draft_model", "mtp", "auto")

NGRAM_DEFAULT_N = 5  # vLLM's default for both bounds when neither is given
SUFFIX_DEFAULT_MIN_N = 2
SUFFIX_DEFAULT_MAX_N = 6
# `auto`'s lookup: the lengths and draft cap the benchmarks measured (docs/benchmarks.md).
AUTO_DRAFT_TOKENS = 8
AUTO_LOOKUP = (2, 4)
# Drafts up to twice the matched n-gram (vLLM's factor 1 would cap 8 drafts at 4): the cost
# model, not the match length, decides how many of them a step verifies.
AUTO_SPEC_FACTOR = 2.0

_LOOKUP = ("prompt_lookup_min", "prompt_lookup_max")
_SUFFIX = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
           "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
# The fields each method reads besides method and num_speculative_tokens.
_METHOD_FIELDS: dict[str, tuple[str, ...]] = {
    "ngram": _LOOKUP,
    "suffix": _LOOKUP + _SUFFIX,
    "draft_model": ("model",),
    "mtp": ("model",),
    "auto": _LOOKUP,
}
_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpeculativeMethod
    # Draft tokens per step (the most; the draft-length policy may use fewer).
    num_speculative_tokens: int | None = None
    model: str | None = None  # draft_model: the draft's directory; mtp: other MTP weights
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Draft only what pays for its rows at the measured step cost (see the module doc).
    never_slower: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config: method {self.method!r} is not supported; "
                             f"use one of {', '.join(METHODS)}")
        self._check_types()
        self._check_unused_fields()
        if self.method == "auto":
            self._fill_auto()
        if self.method in ("ngram", "suffix", "auto"):
            self._resolve_lookup()
        if self.method == "suffix":
            self._check_suffix()
        if self.method == "draft_model" and not self.model:
            raise ValueError('--speculative-config: method "draft_model" needs "model": the '
                             "directory of a smaller model with the same tokenizer")
        k = self.num_speculative_tokens
        if k is None and self.method == "suffix":
            object.__setattr__(self, "num_speculative_tokens",
                               self.suffix_decoding_max_tree_depth)
        elif k is None and self.method != "mtp":
            raise ValueError(f"--speculative-config: method {self.method!r} needs "
                             f'"num_speculative_tokens" (draft tokens per step, e.g. 5)')
        elif k is not None and k < 1:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be at least 1, "
                             f"got {k}")

    @classmethod
    def from_text(cls, text: str) -> SpeculativeConfig | None:
        """The `--speculative-config` argument: `auto`, `off` (None) or a JSON object."""
        if text.strip() == "auto":
            return cls(method="auto")
        if text.strip() == "off":
            return None
        return cls.from_json(text)

    def resolved(self, *, mtp_head: bool) -> SpeculativeConfig:
        """`auto` as the method it runs: `mtp` where the model has a head it can draft with
        (`mtp_head`), else `suffix` with auto's lookup; any other method as it is."""
        if self.method != "auto":
            return self
        if mtp_head:
            return SpeculativeConfig(method="mtp", never_slower=True)
        return SpeculativeConfig(
            method="suffix", num_speculative_tokens=self.num_speculative_tokens,
            prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max,
            suffix_decoding_max_spec_factor=AUTO_SPEC_FACTOR, never_slower=True)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse the `--speculative-config` argument; ValueError names the bad field."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON ({e}); write it like "
                             f"'{_EXAMPLE}'") from None
        if not isinstance(data, dict):
            raise ValueError(f"--speculative-config must be a JSON object like '{_EXAMPLE}', "
                             f"got {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        known = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in known:
                raise ValueError(f"--speculative-config: unknown field {key!r}; metal-serve "
                                 f"reads {', '.join(known)}")
        data = dict(data)
        data["method"] = _method_of(data)
        if not isinstance(data.get("never_slower", False), bool):
            raise ValueError(f"--speculative-config: never_slower must be true or false, "
                             f"got {data['never_slower']!r}")
        if data["method"] == "ngram" and data.get("model") in ("ngram", "[ngram]"):
            del data["model"]
        return cls(**data)

    def _check_types(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in ("method", "never_slower"):
                continue
            if f.name == "model":
                ok, kind = isinstance(value, str), "a string"
            elif f.name.endswith(("_factor", "_prob")):
                ok, kind = _is_number(value), "a number"
            else:
                ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
            if not ok:
                raise ValueError(f"--speculative-config: {f.name} must be {kind}, "
                                 f"got {value!r}")

    def _check_unused_fields(self) -> None:
        reads = _METHOD_FIELDS[self.method]
        for f in dataclasses.fields(self):
            if f.name in ("method", "num_speculative_tokens", "never_slower") or f.name in reads:
                continue
            if getattr(self, f.name) != f.default:
                users = [m for m, names in _METHOD_FIELDS.items() if f.name in names]
                raise ValueError(f"--speculative-config: {f.name} applies to method "
                                 f"{' or '.join(users)}, not {self.method!r}; remove it")

    def _resolve_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in zip(_LOOKUP, (lo, hi), strict=True):
            if value is not None and value < 1:
                raise ValueError(f"--speculative-config: {name} must be at least 1, got {value}")
        if self.method == "ngram":
            lo, hi = (lo or hi or NGRAM_DEFAULT_N), (hi or lo or NGRAM_DEFAULT_N)
        else:
            lo = lo or min(SUFFIX_DEFAULT_MIN_N, hi or SUFFIX_DEFAULT_MIN_N)
            hi = hi or max(SUFFIX_DEFAULT_MAX_N, lo)
        if lo > hi:
            raise ValueError(f"--speculative-config: prompt_lookup_min ({lo}) must be at most "
                             f"prompt_lookup_max ({hi}); lower the min or raise the max")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _fill_auto(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo, hi = AUTO_LOOKUP
        object.__setattr__(self, "prompt_lookup_min", lo or hi)
        object.__setattr__(self, "prompt_lookup_max", hi or lo)
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", AUTO_DRAFT_TOKENS)
        object.__setattr__(self, "never_slower", True)

    def _check_suffix(self) -> None:
        checks = (
            ("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth >= 1,
             "at least 1"),
            ("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests >= 0,
             "at least 0 (0 turns the cross-request index off)"),
            ("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor >= 0,
             "at least 0"),
            ("suffix_decoding_min_token_prob", 0 <= self.suffix_decoding_min_token_prob <= 1,
             "between 0 and 1"),
        )
        for name, ok, bound in checks:
            if not ok:
                raise ValueError(f"--speculative-config: {name} must be {bound}, "
                                 f"got {getattr(self, name)}")


def _method_of(data: dict[str, Any]) -> str:
    """The method a vLLM config names, legacy spellings included."""
    method = data.get("method")
    if method is None:
        model = data.get("model")
        if model is None:
            raise ValueError(f'--speculative-config needs "method": one of {", ".join(METHODS)}'
                             f", e.g. '{_EXAMPLE}'")
        return "ngram" if model in ("ngram", "[ngram]") else "draft_model"
    if not isinstance(method, str):
        raise ValueError(f"--speculative-config: method must be a string, got {method!r}")
    if method == "[ngram]":
        return "ngram"
    return "mtp" if method.endswith("_mtp") else method


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
