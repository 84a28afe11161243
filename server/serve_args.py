"""Arguments of `metal-serve serve`, and the size and count parsers they use."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Literal

from metal_engine.config import TASKS
from scheduler.spec_decode.config import SpeculativeConfig
from server.arg_types import (
    comma_list,
    non_negative_int,
    parse_size,
    positive_int,
    positive_seconds,
    seconds,
)
from server.core.tool_parser_choice import PARSERS
from server.media.options import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
)
from server.sampling_defaults import FROM_MODEL, parse_override

# Each choice is a request of its own in the scheduler; more would crowd out other clients.
DEFAULT_MAX_N = 16
MAX_N = 128  # OpenAI's limit on `n`, for chat and completions alike
# Chat requests are small; 8 MiB leaves room for long agent transcripts.
DEFAULT_MAX_REQUEST_BODY = 8 << 20
# Requests waiting for their first token beyond this get a 429 with Retry-After.
DEFAULT_MAX_QUEUED_REQUESTS = 1024
API_KEY_ENV = "METAL_SERVE_API_KEY"
# key: each API key's prompts share prefix-cache blocks only with that key's; shared: all keys.
PrefixCacheScope = Literal["key", "shared"]
PREFIX_CACHE_SCOPES: tuple[PrefixCacheScope, ...] = ("key", "shared")
# Under the 30 s that process managers (Kubernetes, systemd) wait before SIGKILL.
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
# Headers, then the body, then each response write: a local client needs far less.
DEFAULT_CLIENT_TIMEOUT_S = 30.0
# kernels_metal.kv_quant.KV_CACHE_DTYPES, spelled out so that parsing never imports mlx (a
# test keeps the two equal).
KV_CACHE_DTYPES = ("auto", "int8", "int4")


def _max_n(text: str) -> int:
    value = positive_int(text)
    if value > MAX_N:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_N} (the OpenAI API's limit on n), got {value}"
        )
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_and_http_arguments(parser)
    _add_engine_arguments(parser.add_argument_group("engine"))
    _add_parallel_arguments(parser.add_argument_group("ranks (docs/distributed.md)"))
    _add_sampling_arguments(parser.add_argument_group("sampling defaults"))
    _add_prefix_cache_arguments(parser.add_argument_group("prefix cache"))
    _add_image_arguments(parser.add_argument_group("images (models with vision)"))
    _add_lora_arguments(parser.add_argument_group("LoRA adapters (docs/lora.md)"))
    add_hardening_arguments(parser)


def _add_model_and_http_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir",
        nargs="?",
        type=Path,
        help="converted model directory (default: the bundled SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--revision", help="hub repo ids: the branch, tag or commit to serve (default: main)"
    )
    parser.add_argument(
        "--cache-dir", type=Path, help="where the default model is converted and kept"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name",
        default="default",
        help="model id listed by /v1/models besides the directory name (any name is accepted)",
    )
    parser.add_argument(
        "--task", choices=TASKS,
        help="what the model serves: generate (chat and completions), embed (/v1/embeddings), "
        "rerank or score (/v1/rerank and /v1/score); auto (default) as the checkpoint says: "
        "a ...ForSequenceClassification cross-encoder reranks, an encoder or a checkpoint "
        "without an LM head embeds (docs/embeddings.md)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        help="how the model writes tool calls (default: recognized from the chat template)",
    )
    parser.add_argument(
        "--max-n",
        type=_max_n,
        default=DEFAULT_MAX_N,
        help=f"most choices (`n`) one request may ask for, 1 to {MAX_N} (default "
        f"{DEFAULT_MAX_N})",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )


def _add_engine_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--max-num-seqs", type=positive_int, help="most requests per step")
    group.add_argument(
        "--max-num-batched-tokens", type=positive_int,
        help="most tokens per step (default: 512 on an Apple GPU, 256 on the CPU backend)",
    )
    group.add_argument(
        "--max-model-len", type=positive_int,
        help="context limit in tokens (default: the model's trained context, or what the KV "
        "cache holds if less)",
    )
    group.add_argument(
        "--allow-long-max-model-len", action="store_true",
        help="accept a --max-model-len beyond the model's trained context (its output there "
        "may be garbage)",
    )
    group.add_argument(
        "--kv-cache-memory", type=parse_size,
        help='KV cache size, e.g. "2GiB", "512MB" (default: what the machine has left after '
        "the weights and a headroom; see docs/memory.md)",
    )
    group.add_argument(
        "--encoder-cache-memory", type=parse_size,
        help='for a model that reads images: what the vision tower\'s outputs may take while '
        'prompts read them and for the same picture later (default "256MiB"; docs/images.md)',
    )
    group.add_argument(
        "--dtype", choices=("auto", "float32", "float16", "bfloat16"),
        help="what the weights and activations run in: auto (default) float32 on the CPU "
        "backend; on a Mac the checkpoint's own half dtype (bfloat16 stays bfloat16), float16 "
        "for a float32 one (bfloat16 for Gemma)",
    )
    group.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES,
        help="how the KV cache stores keys and values: auto (default) the model's dtype; int8 "
        "or int4 codes with float16 scales, ~2x or ~3.5x the tokens in the same memory",
    )
    group.add_argument(
        "--dry-run", action="store_true",
        help="print the memory plan (weights, KV budget, tokens and concurrent requests it "
        "holds) without loading the model, then exit: 0 if it fits, 2 if not",
    )
    group.add_argument("--block-size", type=positive_int, help="tokens per KV cache block")
    group.add_argument("--seed", type=int, help="the engine's random seed")
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="queue step N+1 on the device before step N's tokens are back, overlapping host "
        "work with the forward (default: on with Metal, off on the CPU backend, whose forward "
        "runs synchronously)",
    )
    group.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        help="fcfs (default): first come, first served; priority: requests with a lower "
        "`priority` field go first, and are preempted last",
    )
    group.add_argument(
        "--speculative-config", type=_speculative_config, default="auto",
        metavar="auto|off|JSON",
        help="speculative decoding, verified inside the batch with the same outputs as "
        "without: auto (default) drafts by prompt lookup over the request's and other "
        "requests' tokens, or with the checkpoint's MTP head, only where the step time "
        "measured on this machine says it pays; off; or vLLM's JSON, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}\' '
        '(methods: ngram, suffix, mtp, draft_model with "model": DIR)',
    )


def _add_parallel_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--tensor-parallel-size", type=positive_int, metavar="N",
        help="split every layer's heads and inner width over N ranks (processes) that run "
        "each step together over mx.distributed: on this host, or one per Mac under "
        "`mlx.launch` (see docs/distributed.md); default 1",
    )
    group.add_argument(
        "--pipeline-parallel-size", type=positive_int, metavar="N",
        help="split the layers into N runs, one per rank, for a model larger than one Mac's "
        "memory; each step's requests pass through the ranks in micro-batches (see "
        "docs/distributed.md); default 1",
    )


def _speculative_config(text: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.from_text(text)
    except ValueError as exc:  # argparse names the option itself
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--speculative-config: ")) from None


def _override(text: str) -> dict:
    try:
        return parse_override(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_sampling_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--generation-config",
        default=FROM_MODEL,
        metavar="auto|vllm|DIR",
        help="where requests that leave temperature, top_p, top_k, min_p, "
        "repetition_penalty or max_tokens unset get them: auto (default) the model's "
        "generation_config.json, vllm the neutral defaults (temperature 1, no filters), or "
        "DIR/generation_config.json",
    )
    group.add_argument(
        "--override-generation-config",
        type=_override,
        default={},
        metavar="JSON",
        help='a JSON object over those defaults, e.g. \'{"temperature": 0.5}\' or '
        '\'{"max_new_tokens": 4096}\'',
    )
    group.add_argument(
        "--default-max-tokens", type=positive_int, metavar="N",
        help="most tokens an answer may have when its request sets no max_tokens (default: "
        "the generation config's max_new_tokens, else up to the end of the context)",
    )
    group.add_argument(
        "--max-tokens-limit", type=positive_int, metavar="N",
        help="most tokens any answer may have, whatever its request asks for (agent CLIs ask "
        "for 32000-128000); past it the answer ends with finish_reason length (default: the "
        "context's end)",
    )


def _add_prefix_cache_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=None,
        help="compute every prompt in full instead of reusing the KV cache of seen prefixes",
    )
    group.add_argument(
        "--kv-cache-dir",
        type=Path,
        help="keep prefix-cache blocks evicted from memory (and all of them at shutdown) in "
        "this directory, so a restarted server reuses them (off by default)",
    )
    group.add_argument(
        "--kv-cache-dir-size",
        type=parse_size,
        help='most disk the --kv-cache-dir cache may use, e.g. "20GiB" (default 8GiB); '
        "least recently used blocks go first",
    )
    group.add_argument(
        "--kv-write-through",
        action="store_true",
        default=None,
        help="save each block to --kv-cache-dir as soon as it is computed, before the "
        "request's answer goes out: the prefill server of a prefill/decode split, whose "
        "decode server shares the directory (see docs/distributed.md)",
    )


def _image_limit(text: str) -> int:
    """Images per request: N, or vLLM's JSON spelling '{"image": N}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f'expected N or {{"image": N}}, got {text!r}') from None
    if isinstance(value, dict) and set(value) <= {"image"}:
        value = value.get("image", DEFAULT_MAX_IMAGES)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise argparse.ArgumentTypeError(
            f'expected N or {{"image": N}} with N at least 0 (only images are read), got {text!r}'
        )
    return value


def _hosts(text: str) -> frozenset[str]:
    return frozenset(comma_list(text.lower()))


def _add_image_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--allowed-media-domains", type=_hosts,
        default=frozenset(), metavar="HOSTS",
        help="comma-separated hosts whose http(s) image URLs the server fetches, e.g. "
        '"upload.wikimedia.org" (default: none; images come as data URLs)',
    )
    group.add_argument(
        "--allow-media-urls", action="store_true",
        help="fetch image URLs from any host, internal addresses included: only for trusted "
        "clients",
    )
    group.add_argument(
        "--limit-mm-per-prompt", type=_image_limit, default=DEFAULT_MAX_IMAGES,
        metavar='N|{"image":N}',
        help=f"most images one request may hold (default {DEFAULT_MAX_IMAGES})",
    )
    group.add_argument(
        "--max-image-pixels", type=positive_int, default=DEFAULT_MAX_IMAGE_PIXELS, metavar="N",
        help="most pixels (width x height) of one image, checked before it is decoded "
        f"(default {DEFAULT_MAX_IMAGE_PIXELS})",
    )
    group.add_argument(
        "--max-image-bytes", type=parse_size, default=DEFAULT_MAX_IMAGE_BYTES, metavar="SIZE",
        help="largest image file, fetched or sent (default 20MiB; data URLs also count "
        "toward --max-request-body)",
    )
    group.add_argument(
        "--media-fetch-timeout", type=positive_seconds, default=DEFAULT_FETCH_TIMEOUT_S,
        metavar="S",
        help=f"seconds to fetch one image URL, redirects included (default "
        f"{DEFAULT_FETCH_TIMEOUT_S:.0f})",
    )


def _lora_module(text: str) -> tuple[str, Path]:
    """One adapter: name=path, or vLLM's JSON '{"name": ..., "path": ...}'."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {exc.msg}") from None
        name, path = (value.get("name"), value.get("path")) if isinstance(value, dict) else (None,
                                                                                             None)
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path:
        raise argparse.ArgumentTypeError(
            f'expected name=path or {{"name": ..., "path": ...}}, got {text!r}'
        )
    return name.strip(), Path(path)


class _LoraModules(argparse.Action):
    """Each --lora-modules adds its adapters; a name given twice is an error."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        modules = (getattr(namespace, self.dest) or ()) + tuple(values)
        names = [name for name, _ in modules]
        if len(set(names)) < len(names):
            twice = sorted({name for name in names if names.count(name) > 1})
            parser.error(f"argument {option_string}: adapter name given twice: {', '.join(twice)}")
        setattr(namespace, self.dest, modules)


def _add_lora_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--lora-modules", type=_lora_module, nargs="+", action=_LoraModules,
        metavar="NAME=PATH",
        help='LoRA adapters (PEFT or mlx-lm directories) to load at start, each as name=path '
        'or \'{"name": ..., "path": ...}\'; a request whose `model` is a name is served with '
        "that adapter",
    )
    group.add_argument(
        "--max-loras", type=non_negative_int, metavar="N",
        help="room for N adapters at once, so that more can be loaded at run time with POST "
        "/v1/load_lora_adapter (default: as many as --lora-modules gives, 0 without it: none)",
    )
    group.add_argument(
        "--max-lora-rank", type=positive_int, metavar="R",
        help="largest adapter rank served (default 16)",
    )


def _api_keys(text: str | None) -> tuple[str, ...]:
    """Comma-separated keys, stripped; an empty one stays, for `HttpOptions` to refuse."""
    return () if text is None else tuple(key.strip() for key in text.split(","))


class _AddApiKeys(argparse.Action):
    """Each --api-key adds its keys; the first one replaces the keys from the environment."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        keys = getattr(namespace, self.dest)
        keys = () if keys is self.default else keys
        setattr(namespace, self.dest, keys + _api_keys(values))


def add_hardening_arguments(parser: argparse.ArgumentParser) -> None:
    """Who may call the server (keys, origins, hosts), then per-client limits and shutdown."""
    group = parser.add_argument_group("access, limits and shutdown")
    group.add_argument(
        "--api-key",
        dest="api_keys",
        action=_AddApiKeys,
        default=_api_keys(os.environ.get(API_KEY_ENV)),
        metavar="KEY[,KEY...]",
        help="require one of these keys (Authorization: Bearer, or x-api-key) on /v1/* routes; "
        "repeat the flag or separate keys by commas to give each client its own key. "
        f"/health and /metrics stay open (default: ${API_KEY_ENV}, read the same way, else "
        "no key)",
    )
    group.add_argument(
        "--prefix-cache-scope",
        choices=PREFIX_CACHE_SCOPES,
        default="key",
        help="key (default): each API key reuses only the prefix cache of its own requests, so "
        "no client learns from cached_tokens (or speed) what another sent; shared: all keys "
        "reuse each other's prefixes (for keys of one trusted owner)",
    )
    group.add_argument(
        "--no-report-cached-tokens",
        dest="report_cached_tokens",
        action="store_false",
        help="report 0 cached prompt tokens in every API's usage (hits still save the work)",
    )
    group.add_argument(
        "--allowed-origins",
        type=comma_list,
        default=(),
        metavar="ORIGINS",
        help="comma-separated browser origins allowed to call the API (CORS), e.g. "
        '"http://localhost:3000", or "*" for any (default: none, no CORS headers)',
    )
    group.add_argument(
        "--allowed-hosts",
        type=comma_list,
        default=(),
        metavar="HOSTS",
        help="comma-separated host names requests may be addressed to (the Host header), "
        'e.g. "mymac.local", or "*" for any (default: on a loopback address, only '
        "localhost, 127.0.0.1 and ::1, which stops DNS rebinding; elsewhere any)",
    )
    _add_limit_arguments(group)


def _add_limit_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--client-timeout",
        type=positive_seconds,
        default=DEFAULT_CLIENT_TIMEOUT_S,
        metavar="S",
        help="seconds a client may take to send a request's headers, then its body, and to "
        "take each piece of a response; slower ones are cut off "
        f"(default {DEFAULT_CLIENT_TIMEOUT_S:.0f})",
    )
    group.add_argument(
        "--min-request-priority",
        type=int,
        default=0,
        metavar="P",
        help="lowest `priority` a request may ask for under --scheduling-policy priority "
        "(lower goes first); the default 0 lets clients defer themselves but not jump ahead",
    )
    group.add_argument(
        "--max-request-body",
        type=parse_size,
        default=DEFAULT_MAX_REQUEST_BODY,
        help="larger request bodies get a 413 (default 8MiB)",
    )
    group.add_argument(
        "--max-queued-requests",
        type=positive_int,
        default=DEFAULT_MAX_QUEUED_REQUESTS,
        help="most requests waiting for their first token; more get a 429 with Retry-After "
        f"(default {DEFAULT_MAX_QUEUED_REQUESTS})",
    )
    group.add_argument(
        "--max-connections",
        type=positive_int,
        metavar="N",
        help="most open client connections; past it the longest-idle one is closed, or the "
        "newcomer gets a 503 when all are busy (default: half the open-file limit, which the "
        "server raises to its hard limit at start)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM, seconds to let running requests finish before aborting them "
        f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S:.0f})",
    )
    group.add_argument(
        "--log-prompts",
        action="store_true",
        help="log each request's prompt text (off by default: prompts may hold private data)",
    )
    group.add_argument(
        "--log-format", choices=["text", "json"], default="text", help="log line format"
    )
