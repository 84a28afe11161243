"""`metal-serve bench serve`: arguments, and the run that prints, saves and plots results."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from server.bench.client import CHAT, ENDPOINTS
from server.bench.workloads import WORKLOADS

if TYPE_CHECKING:
    from server.bench.runner import RunResult
    from server.bench.serve_bench import ServeBenchConfig
    from server.dashboard.screenshot import DashboardScreenshot


def concurrency_list(text: str) -> tuple[int, ...]:
    """ "1,4,16" -> (1, 4, 16)."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1,4,16, got {text!r}"
        ) from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"concurrencies must be at least 1, got {text!r}")
    return values


def image_size(text: str) -> tuple[int, int]:
    """ "448x448" -> (448, 448): width, height."""
    width, x, height = text.lower().partition("x")
    if not (x and width.isdigit() and height.isdigit() and int(width) and int(height)):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT like 448x448, got {text!r}")
    return int(width), int(height)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    _add_target_arguments(parser.add_argument_group("server"))
    _add_workload_arguments(parser.add_argument_group("workload"))
    _add_load_arguments(parser.add_argument_group("load and results"))


def _add_target_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    group.add_argument("--endpoint", default=CHAT, choices=ENDPOINTS)
    group.add_argument(
        "--model",
        help="model name to send (default: the first of /v1/models); several, comma-separated "
        "(base,sql,chat), spread the requests over them in turn, e.g. over LoRA adapters",
    )
    group.add_argument(
        "--tokenizer",
        type=Path,
        help="local model dir whose tokenizer builds prompts and counts tokens "
        "(default: the converted default model)",
    )
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let answers end early (default: always generate --output-len tokens)",
    )
    group.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    group.add_argument(
        "--replica-url",
        action="append",
        default=[],
        metavar="URL",
        help="a metal-serve replica behind the --base-url router (repeat for each): reports "
        "its prefix-cache hits during the run (docs/router.md)",
    )


def _add_workload_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--workload", default="random", choices=WORKLOADS)
    group.add_argument(
        "--num-prompts", type=int, default=32, help="random, code-edit, vision: requests"
    )
    group.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="tokens of each prompt's unique part (shared-prefix: the suffix; agents: the task; "
        "code-edit: the file and instruction; vision: the question)",
    )
    group.add_argument("--output-len", type=int, default=64, help="tokens to generate")
    group.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random: spread lengths uniformly over [len*(1-r), len*(1+r)]",
    )
    group.add_argument("--num-groups", type=int, default=4, help="shared-prefix: groups")
    group.add_argument("--prompts-per-group", type=int, default=4, help="shared-prefix")
    group.add_argument(
        "--prefix-len", type=int, default=512, help="tokens of the shared system prompt"
    )
    group.add_argument("--sessions", type=int, default=4, help="agents: concurrent sessions")
    group.add_argument("--turns", type=int, default=3, help="agents: requests per session")
    group.add_argument("--tool-result-len", type=int, default=128, help="agents: tokens")
    group.add_argument(
        "--image-size",
        type=image_size,
        default=(448, 448),
        metavar="WxH",
        help="vision: each request's picture, in pixels (default 448x448)",
    )
    group.add_argument("--seed", type=int, default=0)


def _add_load_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--max-concurrency",
        type=concurrency_list,
        help="most requests (agents: sessions) in flight; a list like 1,4,16 runs each in turn",
    )
    group.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default inf: send all at once)",
    )
    group.add_argument("--num-warmups", type=int, default=1, help="untimed requests first")
    group.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="SLOs in ms for goodput, e.g. ttft:500 tpot:50 (metrics: ttft, tpot, e2el)",
    )
    group.add_argument("--result-json", type=Path, help="write metrics, config and records")
    group.add_argument(
        "--plot", type=Path, metavar="DIR", help="write PNGs (several --max-concurrency values)"
    )
    group.add_argument(
        "--dashboard-screenshot",
        type=Path,
        metavar="PNG",
        help="save the server's /dashboard (metal-serve only) during the run, from headless "
        "Chromium (needs playwright and chromium; docs/dashboard.md)",
    )
    group.add_argument(
        "--dashboard-screenshot-delay",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds into the run, and then once a request is running, to take it",
    )


def run_serve(args: argparse.Namespace) -> int:
    """0 when every request completed, 1 when some failed, 2 for bad arguments."""
    import httpx

    from server.bench import router
    from server.bench.metrics import parse_slos
    from server.bench.report import format_run, format_sweep, write_result_json
    from server.bench.serve_bench import load_tokenizer, run_serve_bench

    try:
        config = _config(args, parse_slos(args.goodput))
        tokenizer = load_tokenizer(args.tokenizer)
        screenshot = _screenshot(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"metal-serve bench serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        before = router.snapshot(args.replica_url)
        if screenshot is not None:
            screenshot.start()
        runs = asyncio.run(run_serve_bench(config, tokenizer))
        replica_hits = router.since(args.replica_url, before)
    except (RuntimeError, httpx.HTTPError) as exc:  # the warm-up failed, or a replica's metrics
        print(f"metal-serve bench serve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if screenshot is not None and screenshot.is_alive():
            screenshot.stop()
            screenshot.join()
    for run in runs:
        print(format_run(f"{config.workload} @ {config.base_url}", run))
    if len(runs) > 1:
        print(format_sweep(runs))
    if args.replica_url:
        print(router.format_replica_hits(args.replica_url, replica_hits))
    if args.result_json is not None:
        write_result_json(args.result_json, config.to_json(), runs)
        print(f"results: {args.result_json}")
    if args.plot is not None:
        _plot(runs, args.plot, config.workload)
    if screenshot is not None and screenshot.error is not None:
        print(f"metal-serve bench serve: {screenshot.error}", file=sys.stderr)
        return 1
    if screenshot is not None:
        print(f"dashboard screenshot: {screenshot.path}")
    return 0 if all(run.metrics.failed == 0 for run in runs) else 1


def _screenshot(args: argparse.Namespace) -> DashboardScreenshot | None:
    """The --dashboard-screenshot taker, checked to have what it needs; None without it."""
    if args.dashboard_screenshot is None:
        return None
    from server.dashboard.screenshot import DashboardScreenshot

    if args.dashboard_screenshot_delay < 0:
        raise ValueError("--dashboard-screenshot-delay must be at least 0")
    screenshot = DashboardScreenshot(args.base_url, args.dashboard_screenshot,
                                     args.dashboard_screenshot_delay)  # fmt: skip
    screenshot.check()
    return screenshot


def _config(args: argparse.Namespace, slos_ms: dict[str, float]) -> ServeBenchConfig:
    from server.bench.serve_bench import ServeBenchConfig

    models = tuple(args.model.split(",")) if args.model is not None else ()
    model = models[0] if models else first_model(args.base_url)
    return ServeBenchConfig(
        base_url=args.base_url,
        workload=args.workload,
        endpoint=args.endpoint,
        model=model,
        models=models,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        max_concurrency=args.max_concurrency or (None,),
        request_rate=args.request_rate,
        num_groups=args.num_groups,
        prompts_per_group=args.prompts_per_group,
        prefix_len=args.prefix_len,
        sessions=args.sessions,
        turns=args.turns,
        tool_result_len=args.tool_result_len,
        image_size=args.image_size,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        num_warmups=args.num_warmups,
        timeout_s=args.request_timeout,
        slos_ms=slos_ms,
    )


def first_model(base_url: str) -> str | None:
    """The first id the server lists at /v1/models; None (send no name) if it lists none."""
    import httpx

    try:
        response = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=30.0)
        response.raise_for_status()
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise RuntimeError(
            f"could not list models at {base_url}/v1/models ({exc}); check --base-url, "
            "or pass --model"
        ) from exc
    return models[0]["id"] if models else None


def _plot(runs: list[RunResult], out_dir: Path, workload: str) -> None:
    if len(runs) < 2:
        print("--plot: give several --max-concurrency values (e.g. 1,4,16) to plot a sweep")
        return
    from server.bench.plots import plot_sweep

    try:
        paths = plot_sweep(runs, out_dir, f"{workload} workload")
    except RuntimeError as exc:
        print(f"metal-serve bench serve: {exc}", file=sys.stderr)
        return
    print("plots: " + ", ".join(str(p) for p in paths))
