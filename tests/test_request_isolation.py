"""One request's parameters must never fail another's: requests that once broke the engine
step for everyone, sent while a victim stream runs on the real engine."""

from __future__ import annotations

import threading

import httpx
import openai
from server_helpers import running_server, small_engine

HUGE_TOP_K = 2**40  # past int32: it was an OverflowError on the engine thread
QUESTION = [{"role": "user", "content": "Count from one to twenty."}]


def test_a_huge_top_k_ends_well_and_spares_the_other_streams(default_model_dir):
    with running_server(small_engine(default_model_dir, 512)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        victim: dict = {}

        def stream_victim() -> None:
            chunks = client.chat.completions.create(
                model="default", messages=QUESTION, max_tokens=48, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            victim["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]

        thread = threading.Thread(target=stream_victim)
        thread.start()
        answers = [
            httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "m", "messages": QUESTION, "max_tokens": 4, "top_k": HUGE_TOP_K}),
            httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": "m", "prompt": "One, two,", "max_tokens": 4, "top_k": HUGE_TOP_K}),
            httpx.post(f"{url}/v1/messages", timeout=120, json={
                "model": "m", "messages": QUESTION, "max_tokens": 4, "top_k": HUGE_TOP_K}),
        ]  # fmt: skip
        thread.join(120)
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert victim["finish"] == "length"
