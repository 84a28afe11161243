"""Prefix-cache isolation between API keys, on a real server over a tiny random Llama.

The attack it stops: a client that knows the shape of another client's prompt guesses a
secret in it one block at a time, reading from `cached_tokens` whether the block that ends in
its guess was cached. Each key is its own tenant of the cache unless the operator shares it,
and `cache_salt` splits a tenant's cache further.
"""

from __future__ import annotations

import contextlib
import json

import anthropic
import openai
import pytest
from server_helpers import running_app
from tiny_models import VOCAB, build_tiny_model
from tiny_server import CHAT_TEMPLATE
from tokenizers import Tokenizer, models, pre_tokenizers

from metal_engine.config import EngineConfig
from metal_engine.engine import LLMEngine
from metal_engine.engine_build import build_engine
from scheduler import SamplingParams
from server.app import HttpOptions, build_app
from server.async_engine import AsyncEngine
from server.cli import build_parser

BLOCK = 16  # the engine's default block size
KEY_A, KEY_B, KEY_C = "sk-alice", "sk-bob", "sk-carol"
DIGITS = list(range(20, 30))  # token ids standing for the digits 0-9
PIN = [27, 21, 29]
# Each block of Alice's prompt is 15 tokens anyone may know, then one digit of her PIN.
KNOWN = [list(range(40 + 15 * i, 55 + 15 * i)) for i in range(len(PIN))]
TAIL = [99, 98, 97]  # so that the PIN's last block can be a cache hit


def alice_prompt(pin: list[int]) -> list[int]:
    return [t for known, digit in zip(KNOWN, pin, strict=False) for t in [*known, digit]] + TAIL


def tiny_dir(path):
    """The tiny Llama with a word-level tokenizer that splits on spaces: `w<i>` is token i."""
    build_tiny_model("llama", path)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return path


def tiny_engine(model_dir, kv_cache_dir=None) -> LLMEngine:
    return build_engine(EngineConfig(
        model_dir=model_dir, max_model_len=256, kv_cache_memory=16 << 20,
        kv_cache_dir=kv_cache_dir,
    ))  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_dir(tmp_path_factory.mktemp("tiny-words"))


@contextlib.contextmanager
def serving(model_dir, report_cached_tokens: bool = True, **options):
    """The base URL of a fresh engine (an empty cache) behind an app with `options`."""
    bridge = AsyncEngine(tiny_engine(model_dir), report_cached_tokens=report_cached_tokens)
    with running_app(build_app(bridge, "m", options=HttpOptions(**options))) as url:
        yield url


def openai_client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def cached(client: openai.OpenAI, prompt: list[int], cache_salt: str | None = None) -> int:
    extra = {"cache_salt": cache_salt} if cache_salt is not None else None
    usage = client.completions.create(
        model="m", prompt=prompt, max_tokens=1, extra_body=extra
    ).usage
    return usage.prompt_tokens_details.cached_tokens


def guess_pin(client: openai.OpenAI) -> tuple[list[int], list[int]]:
    """The attack: find each digit as the guess whose block reads as cached. Returns the
    digits found (it stops at a block where no guess hits) and every `cached_tokens` seen."""
    found, seen = [], []
    for position in range(len(PIN)):
        for digit in DIGITS:
            seen.append(cached(client, alice_prompt([*found, digit])))
            if seen[-1] == (position + 1) * BLOCK:
                found.append(digit)
                break
        else:
            break
    return found, seen


def test_another_key_cannot_guess_a_pin_from_cached_tokens(model_dir):
    with serving(model_dir, api_keys=(KEY_A, KEY_B, KEY_C)) as url:
        alice = openai_client(url, KEY_A)
        assert cached(alice, alice_prompt(PIN)) == 0
        found, seen = guess_pin(openai_client(url, KEY_B))
        assert found == [] and seen == [0] * len(DIGITS)  # the attack learns nothing
        carol = openai_client(url, KEY_C)
        assert cached(carol, alice_prompt(PIN)) == 0  # not even from the exact prompt
        assert cached(alice, alice_prompt(PIN)) == len(PIN) * BLOCK  # Alice's cache works


def test_keys_sharing_the_cache_leak_the_pin_as_they_would_without_isolation(model_dir):
    with serving(model_dir, api_keys=(KEY_A, KEY_B), prefix_cache_scope="shared") as url:
        cached(openai_client(url, KEY_A), alice_prompt(PIN))
        found, _ = guess_pin(openai_client(url, KEY_B))
        assert found == PIN


def test_cache_salt_splits_one_key_and_a_keyless_server(model_dir):
    prompt = alice_prompt(PIN)
    hit = len(PIN) * BLOCK
    with serving(model_dir, api_keys=(KEY_A,)) as url:
        alice = openai_client(url, KEY_A)
        assert cached(alice, prompt, cache_salt="agent-1") == 0
        assert cached(alice, prompt, cache_salt="agent-2") == 0
        assert cached(alice, prompt) == 0
        assert cached(alice, prompt, cache_salt="agent-1") == hit
    with serving(model_dir) as url:  # no keys: one tenant, still split by salt
        anyone = openai_client(url)
        assert cached(anyone, prompt) == 0
        assert cached(anyone, prompt, cache_salt="mine") == 0
        assert cached(anyone, prompt) == hit and cached(anyone, prompt, cache_salt="mine") == hit


MESSAGE = " ".join(f"w{t}" for t in alice_prompt(PIN))


def anthropic_cached(url: str, key: str) -> int:
    client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    message = client.messages.create(
        model="m", max_tokens=1, messages=[{"role": "user", "content": MESSAGE}]
    )
    return message.usage.cache_read_input_tokens


def responses_cached(url: str, key: str) -> int:
    response = openai_client(url, key).responses.create(
        model="m", max_output_tokens=1, input=MESSAGE
    )
    return response.usage.input_tokens_details.cached_tokens


def chat_cached(url: str, key: str) -> int:
    completion = openai_client(url, key).chat.completions.create(
        model="m", max_tokens=1, messages=[{"role": "user", "content": MESSAGE}]
    )
    return completion.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("api_cached", [chat_cached, responses_cached, anthropic_cached])
def test_every_api_keeps_keys_apart(model_dir, api_cached):
    with serving(model_dir, api_keys=(KEY_A, KEY_B)) as url:
        assert api_cached(url, KEY_A) == 0
        assert api_cached(url, KEY_B) == 0
        assert api_cached(url, KEY_A) >= len(PIN) * BLOCK


@pytest.mark.parametrize("api_cached", [chat_cached, responses_cached, anthropic_cached])
def test_cached_tokens_can_be_withheld(model_dir, api_cached):
    with serving(model_dir, report_cached_tokens=False) as url:
        assert [api_cached(url, "none") for _ in range(2)] == [0, 0]
        assert cached(openai_client(url), alice_prompt(PIN)) == 0


def test_a_salted_block_on_disk_stays_its_salts(model_dir, tmp_path):
    def cached_tokens(engine: LLMEngine, rid: str, cache_salt: str | None) -> int:
        engine.add_request(rid, alice_prompt(PIN), SamplingParams(max_tokens=1),
                           cache_salt=cache_salt)  # fmt: skip
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        return outputs[-1].num_cached_tokens

    first = tiny_engine(model_dir, tmp_path)
    assert cached_tokens(first, "a", "alice") == 0
    first.close()  # spills every cached block to disk
    restarted = tiny_engine(model_dir, tmp_path)
    assert cached_tokens(restarted, "b", "bob") == 0
    assert cached_tokens(restarted, "c", None) == 0
    assert restarted.scheduler.prefix_cache.stats.stored_hit_tokens == 0
    assert cached_tokens(restarted, "d", "alice") == len(PIN) * BLOCK
    assert restarted.scheduler.prefix_cache.stats.stored_hit_tokens == len(PIN) * BLOCK


# ---- the command line -----------------------------------------------------------------------


def serve_args(argv: list[str]):
    return build_parser(["serve", *argv]).parse_args(["serve", *argv])


def test_api_keys_come_repeated_or_comma_separated_and_replace_the_environment(monkeypatch):
    monkeypatch.setenv("METAL_SERVE_API_KEY", "env-1, env-2")
    assert serve_args([]).api_keys == ("env-1", "env-2")
    args = serve_args(["--api-key", "a,b", "--api-key", " c "])
    assert args.api_keys == ("a", "b", "c")
    monkeypatch.delenv("METAL_SERVE_API_KEY")
    args = serve_args([])
    assert args.api_keys == () and args.prefix_cache_scope == "key"
    assert args.report_cached_tokens
    args = serve_args(["--prefix-cache-scope", "shared", "--no-report-cached-tokens"])
    assert args.prefix_cache_scope == "shared" and not args.report_cached_tokens


@pytest.mark.parametrize("keys", [("a", ""), (" ",)])
def test_an_empty_key_among_several_is_refused(keys):
    with pytest.raises(ValueError, match="an API key is empty"):
        HttpOptions(api_keys=keys)


def test_responses_requests_take_a_cache_salt_too(model_dir):
    def responses_salted(url: str, salt: str) -> int:
        response = openai_client(url).responses.create(
            model="m", max_output_tokens=1, input=MESSAGE, extra_body={"cache_salt": salt}
        )
        return response.usage.input_tokens_details.cached_tokens

    with serving(model_dir) as url:
        assert responses_salted(url, "agent-1") == 0
        assert responses_salted(url, "agent-2") == 0
        assert responses_salted(url, "agent-1") > 0
