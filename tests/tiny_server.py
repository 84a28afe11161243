"""The real engine over a tiny random Llama with a chat template: for server tests where the
output's content does not matter and speed does (a step takes milliseconds on a CPU)."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_models import build_tiny_model

from metal_engine.config import EngineConfig
from metal_engine.engine import LLMEngine
from metal_engine.engine_build import build_engine

# The checkpoint's word-level tokenizer has no chat template; this one renders any roles.
CHAT_TEMPLATE = (
    "{% for m in messages %}w1 {{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w2{% endif %}"
)


def tiny_engine(path: Path, max_model_len: int = 256) -> LLMEngine:
    """Save the tiny Llama into `path` (an empty dir) and load it. It has no end-of-sequence
    token: every request runs to its max_tokens. A `max_model_len` past its trained 256 tokens
    is allowed (for streams that must last, not for their text)."""
    build_tiny_model("llama", path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return build_engine(
        EngineConfig(model_dir=path, max_model_len=max_model_len, kv_cache_memory=16 << 20,
                     allow_long_max_model_len=max_model_len > 256)
    )
