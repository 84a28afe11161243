"""The README's first request, as a user sends it (no temperature), answered by the default
model under the sampling defaults `metal-serve serve` reads from its generation_config.json."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from server_helpers import running_app, small_engine

from server.app import build_app
from server.async_engine import AsyncEngine
from server.sampling_defaults import SamplingDefaults, load_sampling_defaults

README_REQUEST = {
    "model": "default",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
}
# Greedy, the answer is the same each time; at temperature 1 (what a request without
# `temperature` got before the defaults) the answer opens with "The" only 15% of the time.
TRIES = 3


def test_the_readme_request_answers_paris(default_model_dir):
    defaults = load_sampling_defaults(default_model_dir)  # what `serve` does by default
    assert defaults == SamplingDefaults(temperature=0.0)
    # A short context bounds the answers that wander off (max_tokens is left to the server).
    engine = small_engine(default_model_dir, max_model_len=128)
    with running_app(build_app(AsyncEngine(engine, sampling_defaults=defaults))) as url:

        def answer(_: int) -> str:
            response = httpx.post(f"{url}/v1/chat/completions", json=README_REQUEST, timeout=300)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["message"]["content"]

        with ThreadPoolExecutor(TRIES) as pool:
            answers = list(pool.map(answer, range(TRIES)))
    assert all("Paris" in text for text in answers), answers
