"""`metal-serve bench models`: does one model's stream keep its pace on a server of several?

Starts `metal-serve serve` with three copies of one model ("victim" and "busy" loaded at
start, "third" not), then streams from the victim three times and records the gaps between
its tokens: alone, while `--busy-streams` streams saturate "busy", and while "third" loads.
The victim's gaps against its own alone are the fairness the server gives it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from server.bench.peers import OUR_CLI
from server.bench.server_process import free_port, running_server
from server.bench.sse import SSEDecoder


def add_models_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?",
                        help="the model each of the three serves (default: the default model)")
    parser.add_argument("--busy-streams", type=int, default=16,
                        help="concurrent streams saturating the busy model (default 16)")
    parser.add_argument("--tokens", type=int, default=128,
                        help="tokens of the victim's stream (default 128)")
    parser.add_argument("--kv-cache-memory", default="256MiB",
                        help="each model's KV cache (default 256MiB)")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="each model's context (default 2048)")
    parser.add_argument("--log", type=Path, default=Path("bench-models-server.log"),
                        help="the server's log")
    parser.add_argument("--json", type=Path, help="also write the results here")


def run_models(args: argparse.Namespace) -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    reference = args.model or _default_model()
    command = [sys.executable, "-c", OUR_CLI, "serve", reference, "--port", str(port),
               "--served-model-name", "victim", "--model", f"busy={reference}",
               "--model", f"third={reference}", "--pin", "victim", "--pin", "busy",
               "--kv-cache-memory", args.kv_cache_memory,
               "--max-model-len", str(args.max_model_len)]
    with running_server(command, url, args.log):
        results = {
            "alone": _victim_gaps(url, args.tokens, lambda: None),
            "busy model saturated": _victim_gaps(
                url, args.tokens, _saturate(url, args.busy_streams, args.tokens * 4)),
            "third model loading": _victim_gaps(url, args.tokens, _load_third(url)),
        }
    alone = results["alone"]["p50_ms"]
    print(f"victim inter-token gaps, {args.tokens} tokens ({reference}; busy: "
          f"{args.busy_streams} streams)")
    print(f"{'while':<24}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'p50 vs alone':>14}")
    for phase, gaps in results.items():
        print(f"{phase:<24}{gaps['p50_ms']:>9.1f}{gaps['p99_ms']:>9.1f}{gaps['max_ms']:>9.1f}"
              f"{gaps['p50_ms'] / alone:>13.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _default_model() -> str:
    from convert.default_model import default_gguf_path

    return str(default_gguf_path())


def _victim_gaps(url: str, tokens: int, meanwhile: Callable[[], Callable[[], None] | None]
                 ) -> dict:
    """Stream `tokens` from the victim once `meanwhile()` has started (it returns what
    stops it); the gaps between the victim's tokens."""
    times: list[float] = []
    stop = meanwhile()
    _stream(url, "victim", tokens, lambda: times.append(time.monotonic()))
    if stop is not None:
        stop()
    gaps = sorted(1000 * (b - a) for a, b in zip(times, times[1:], strict=False))
    return {"p50_ms": statistics.median(gaps), "p99_ms": gaps[int(0.99 * (len(gaps) - 1))],
            "max_ms": gaps[-1], "tokens": len(times)}


def _saturate(url: str, streams: int, tokens: int) -> Callable[[], Callable[[], None]]:
    """Start `streams` long streams on "busy", return once each has its first token."""

    def start() -> Callable[[], None]:
        first = threading.Semaphore(0)
        stopping = threading.Event()

        def one() -> None:
            while not stopping.is_set():
                _stream(url, "busy", tokens, first.release, stopping)

        threads = [threading.Thread(target=one, daemon=True) for _ in range(streams)]
        for thread in threads:
            thread.start()
        for _ in range(streams):
            first.acquire()

        def stop() -> None:
            stopping.set()
            for thread in threads:
                thread.join()

        return stop

    return start


def _load_third(url: str) -> Callable[[], Callable[[], None]]:
    """Load "third" while the victim streams (a moment after it starts); unload it after."""

    def start() -> Callable[[], None]:
        def load() -> None:
            time.sleep(0.5)
            httpx.post(f"{url}/v1/models/load", json={"model": "third"}, timeout=600)

        loading = threading.Thread(target=load)
        loading.start()

        def stop() -> None:
            loading.join()
            httpx.post(f"{url}/v1/models/unload", json={"model": "third"}, timeout=600)

        return stop

    return start


def _stream(url: str, model: str, tokens: int, on_token: Callable[[], None],
            stopping: threading.Event | None = None) -> None:
    body = {"model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": "Tell me a long story."}]}
    decoder = SSEDecoder()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                      timeout=600) as response:  # fmt: skip
        for piece in response.iter_text():
            if stopping is not None and stopping.is_set():
                return
            for data in decoder.feed(piece):
                if data.strip() == "[DONE]":
                    continue
                for choice in json.loads(data).get("choices") or ():
                    if choice["delta"].get("content"):
                        on_token()
