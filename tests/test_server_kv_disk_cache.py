"""`--kv-cache-dir` end to end: a real server on the default model spills its prefix cache at
shutdown, and a restarted server answers the same conversation from it."""

from __future__ import annotations

import openai
from server_helpers import TEST_KV_CACHE_MEMORY, running_server

from metal_engine.config import EngineConfig
from metal_engine.engine import LLMEngine
from metal_engine.engine_build import build_engine

SYSTEM = ("You are a coding agent. Tools: read_file(path), write_file(path, text), "
          "run_tests(), search(query). Answer with one tool call per turn. ") * 3


def ask(base_url: str):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    return client.chat.completions.create(
        model="default", max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "Fix the failing test in parser.py."}],
    )


def server_engine(model_dir, kv_dir) -> LLMEngine:
    return build_engine(EngineConfig(
        model_dir=model_dir, max_model_len=512, kv_cache_memory=TEST_KV_CACHE_MEMORY,
        kv_cache_dir=kv_dir,
    ))


def test_a_restarted_server_reuses_the_prefix_cache_it_spilled(default_model_dir, tmp_path):
    with running_server(server_engine(default_model_dir, tmp_path)) as url:
        first = ask(url)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert list(tmp_path.rglob("*.kvb"))  # spilled at shutdown
    with running_server(server_engine(default_model_dir, tmp_path)) as url:
        again = ask(url)
    full_blocks = (first.usage.prompt_tokens - 1) // 16 * 16
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks > 0
    assert again.choices[0].message.content == first.choices[0].message.content
