"""Sampling defaults for requests that leave a parameter unset, as vLLM picks them: the model's
generation_config.json (or another folder's, or none), with the server's overrides on top.

Built once at the CLI edge; a request's own values always win (see `sampling_params`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from scheduler.sampling_params import check_sampling_ranges

GENERATION_CONFIG_FILE = "generation_config.json"
# `--generation-config` values that are not folders.
FROM_MODEL, NEUTRAL = "auto", "vllm"


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for each of these it does not send. The neutral values (temperature
    1, no top-k/top-p/min-p filter, no repetition penalty) are the OpenAI API's defaults.

    Output length: a request without max_tokens may generate `max_new_tokens` (None: up to
    the end of the context); no request more than `max_tokens_limit` (None: no limit but the
    context). Agent CLIs ask for 32000-128000, which a small model lost in a loop fills.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None
    max_tokens_limit: int | None = None

    def __post_init__(self) -> None:
        check_sampling_ranges(
            self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty
        )
        for name in ("max_new_tokens", "max_tokens_limit"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):  # fmt: skip
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SamplingDefaults:
        """The defaults `values` sets (generation_config.json keys); other keys are ignored,
        as are nulls. A negative top_k means off, as in vLLM."""
        picked = {k: values[k] for k in DEFAULT_KEYS if values.get(k) is not None}
        for key, value in picked.items():
            _check_number(key, value)
        for key in ("top_k", MAX_NEW_TOKENS):
            if key in picked and picked[key] != int(picked[key]):
                raise ValueError(f"{key} must be an integer, got {picked[key]}")
        if "top_k" in picked:
            picked["top_k"] = max(int(picked["top_k"]), 0)
        if MAX_NEW_TOKENS in picked:
            picked[MAX_NEW_TOKENS] = int(picked[MAX_NEW_TOKENS])
        return cls(**picked)

    def max_tokens(self, requested: int | None) -> int | None:
        """What a request asking for `requested` tokens (None: unset) may generate, before
        the context caps it (None: the context alone)."""
        asked = self.max_new_tokens if requested is None else requested
        if self.max_tokens_limit is None:
            return asked
        return self.max_tokens_limit if asked is None else min(asked, self.max_tokens_limit)

    def merged(self, override: Mapping[str, Any]) -> SamplingDefaults:
        """These defaults with `override`'s keys replaced."""
        limit = {"max_tokens_limit": self.max_tokens_limit}
        return replace(SamplingDefaults.from_mapping({**asdict(self), **override}), **limit)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items() if v is not None)


# The knobs a request may also set by the same name.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# generation_config.json's (and vLLM's) name for the default output length.
MAX_NEW_TOKENS = "max_new_tokens"
DEFAULT_KEYS = (*SAMPLING_KEYS, MAX_NEW_TOKENS)


def _check_number(key: str, value: Any) -> None:
    """A ValueError naming `key` unless `value` is a finite number: JSON readers take
    `Infinity`, `NaN` and `1e999`, which would pass a range check or fail with no key named."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")


def parse_override(text: str) -> dict[str, Any]:
    """`--override-generation-config`'s JSON object; raises ValueError naming what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f'expected a JSON object such as \'{{"temperature": 0.5}}\', got {text!r}')
    unknown = sorted(set(value) - set(DEFAULT_KEYS))
    if unknown:
        raise ValueError(f"unknown keys {', '.join(unknown)}; known: {', '.join(DEFAULT_KEYS)}")
    SamplingDefaults.from_mapping(value)  # a ValueError naming a bad value
    return value


def generation_config_path(model_dir: Path, choice: str) -> Path | None:
    """The generation_config.json that `--generation-config choice` reads, None for none:
    "auto" the model dir's (if it has one), "vllm" none, else the named folder's."""
    if choice == NEUTRAL:
        return None
    if choice == FROM_MODEL:
        path = Path(model_dir) / GENERATION_CONFIG_FILE
        return path if path.is_file() else None
    path = Path(choice).expanduser() / GENERATION_CONFIG_FILE
    if not path.is_file():
        raise ValueError(
            f"--generation-config {choice}: {path} does not exist; pass a folder holding a "
            f"{GENERATION_CONFIG_FILE}, `auto` (the model's) or `vllm` (neutral defaults)"
        )
    return path


def load_sampling_defaults(
    model_dir: Path, choice: str = FROM_MODEL, override: Mapping[str, Any] | None = None
) -> SamplingDefaults:
    """The defaults in effect: the generation config `choice` names, under `override`
    (where `--default-max-tokens` lands too, as `max_new_tokens`)."""
    path = generation_config_path(model_dir, choice)
    loaded = SamplingDefaults()
    if path is not None:
        try:
            loaded = SamplingDefaults.from_mapping(json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, AttributeError) as exc:  # AttributeError: JSON but not an object
            raise ValueError(
                f"{path}: {exc}; fix the file, or pass --generation-config vllm to ignore it"
            ) from exc
    return loaded.merged(override or {})
