"""`metal-serve bench`: the CLI wiring, plots, server processes, peers and the compare page."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from test_bench import RECORDS  # the metric tests' hand-checked records

from server.bench import llama_server
from server.bench.compare_doc import BEGIN, END, PeerResult, write_doc
from server.bench.metrics import compute_metrics
from server.bench.peers import Peer, install, peers, server_command
from server.bench.runner import RunResult
from server.bench.server_process import free_port, running_server
from server.cli import main


def test_help_stays_light():
    probe = (
        "import sys; from server.cli import build_parser; build_parser(); "
        "print(any(m.startswith('server.bench') or m == 'httpx' for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("command", ["serve", "compare"])
def test_bench_subcommands_are_wired(command):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", command, "--help"])
    assert exit_info.value.code == 0


def test_bad_bench_arguments_exit_2(capsys):
    assert (
        main(["bench", "serve", "--base-url", "http://x", "--model", "m", "--goodput", "speed:1"])
        == 2
    )
    assert "unknown goodput metric" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--base-url", "http://x", "--max-concurrency", "1,x"])


def test_compare_runs_only_the_workloads_asked_for(capsys):
    from server.bench.compare import add_compare_arguments, workloads

    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    args = parser.parse_args(["--workloads", "agents", "--sessions", "8", "--output-len", "48"])
    assert list(workloads(args)) == ["agents"] and workloads(args)["agents"]["sessions"] == 8
    assert list(workloads(parser.parse_args([]))) == ["single", "concurrent-16", "long-8064",
                                                      "agents"]
    long = workloads(parser.parse_args(["--workloads", "long", "--long-input-len", "4000"]))
    assert long == {"long-4000": dict(workload="random", num_prompts=2, input_len=4000,
                                      max_concurrency=(1,))}
    assert main(["bench", "compare", "--workloads", "agents,speed"]) == 2
    assert "unknown workloads ['speed']" in capsys.readouterr().err


def test_missing_matplotlib_names_the_install(monkeypatch):
    from server.bench.plots import pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match=r"pip install 'metal-serve\[bench\]'"):
        pyplot()


def test_sweep_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from server.bench.plots import plot_sweep

    runs = [RunResult(c, float("inf"), compute_metrics(RECORDS, c), ()) for c in (1, 4)]
    paths = plot_sweep(runs, tmp_path, "random")
    assert [p.name for p in paths] == ["ttft_vs_concurrency.png", "throughput_vs_concurrency.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)


def test_server_process_waits_for_health_and_stops(tmp_path):
    (tmp_path / "health").write_text("ok")
    port = free_port()
    command = [sys.executable, "-m", "http.server", str(port), "--directory", str(tmp_path)]
    url = f"http://127.0.0.1:{port}"
    with running_server(command, url, tmp_path / "logs" / "s.log", timeout_s=30) as process:
        assert process.poll() is None
    assert process.poll() is not None


def test_server_process_that_exits_reports_its_log(tmp_path):
    command = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    with (
        pytest.raises(RuntimeError, match="exited with code 3(.|\\n)*no model here"),
        running_server(command, "http://127.0.0.1:9", tmp_path / "s.log", timeout_s=30),
    ):
        pass


def test_missing_peer_without_install_is_skipped_with_a_reason(tmp_path):
    peer = Peer("nothing", ("nothing-at-all",), "nothing_at_all", None)
    installed = install(peer, tmp_path, timeout_s=1, allow_install=False)
    assert installed.executable is None and "not installed under" in installed.error


def test_compare_doc_replaces_only_its_section(tmp_path, monkeypatch):
    import server.bench.compare_doc as compare_doc

    monkeypatch.setattr(compare_doc, "_plots", lambda *args: [])
    (tmp_path / "benchmarks.md").write_text(f"# Bench\n\nHand-written.\n\n{BEGIN}\nold\n{END}\n")
    run = RunResult(16, float("inf"), compute_metrics(RECORDS, 2.0), tuple(RECORDS))
    results = [
        PeerResult("metal-serve", "0.1.0", None, 3.0, {"concurrent-16": run}),
        PeerResult("llama-cpp-python", None, 1600.0, error="pip install took more than 25 min"),
    ]
    fields = dict(workload="random", num_prompts=16, input_len=128, max_concurrency=(16,))
    write_doc(tmp_path, results, {}, {"concurrent-16": fields}, 64)
    page = (tmp_path / "benchmarks.md").read_text()
    assert page.startswith("# Bench\n\nHand-written.\n") and "old" not in page
    assert ("| metal-serve | 3 | 1 | 2.0 | 4.5 | 1.50 | 200.0 | 200.0 | 280.0 | 298.0 | 75.0 "
            "| 75.0 | 100.0 | 198.0 | 400.0 |") in page
    assert "| llama-cpp-python | - | 26.7 min | - | pip install took more than 25 min |" in page
    # The model line names what each peer of this run served, and no other peer.
    assert ("metal-serve a float32 MLX conversion of the Q4_1 GGUF, llama-cpp-python the "
            "Q4_1 GGUF itself.") in page and "mlx-lm" not in page


def test_llama_server_is_skipped_with_a_reason_until_built(tmp_path):
    installed = install(peers()["llama-server"], tmp_path, timeout_s=1, allow_install=False)
    assert installed.executable is None and "not built under" in installed.error


def test_a_built_llama_server_serves_the_float32_gguf(tmp_path):
    root = tmp_path / "llama-server"
    llama_server.binary(root).parent.mkdir(parents=True)
    llama_server.binary(root).touch()
    (root / "install.json").write_text('{"version": "0.3.36"}')
    (root / "model.F32.gguf").touch()  # made before: llama-quantize is not run again
    installed = install(peers()["llama-server"], tmp_path, timeout_s=1, allow_install=False)
    assert installed.version == "llama.cpp of llama-cpp-python 0.3.36"
    command = server_command(peers()["llama-server"], installed.executable, tmp_path,
                             tmp_path / "model.gguf", 8123, None)
    assert command[:3] == [str(llama_server.binary(root)), "-m", str(root / "model.F32.gguf")]
    assert command[-2:] == ["--port", "8123"] and "-np" in command


def test_compare_rounds_alternate_the_peers_and_report_the_median(tmp_path, monkeypatch):
    """Peers take turns (reversed every other round) at each round's prompts; each reports
    its median round, and the page lists every round with metal-serve's rate over the
    peer's."""
    import dataclasses

    import server.bench.compare as compare
    import server.bench.compare_doc as compare_doc
    import server.bench.serve_bench as serve_bench

    order = []
    rates = {"http://ours": iter([10.0, 30.0, 20.0]), "http://theirs": iter([20.0] * 3)}

    async def bench(config, tokenizer):
        order.append((config.base_url, config.seed))
        metrics = dataclasses.replace(compute_metrics(RECORDS, 2.0),
                                      output_throughput=next(rates[config.base_url]))
        return [RunResult(1, float("inf"), metrics, ())]

    urls = iter(rates)
    monkeypatch.setattr(compare, "_start", lambda peer, *args: compare._Server(
        peer, next(urls), "1", None, 1.0))
    monkeypatch.setattr(serve_bench, "run_serve_bench", bench)
    monkeypatch.setattr(serve_bench, "load_tokenizer", lambda model_dir: None)
    monkeypatch.setattr(compare_doc, "_plots", lambda *args: [])
    parser = argparse.ArgumentParser()
    compare.add_compare_arguments(parser)
    args = parser.parse_args(["--rounds", "3", "--workloads", "single", "--work-dir",
                              str(tmp_path)])
    chosen = [peers()["metal-serve"], peers()["llama-server"]]
    results = compare._bench_peers(chosen, tmp_path, tmp_path, args)
    # Each round has prompts of its own (a seed), the same for both peers.
    assert order == [("http://ours", 0), ("http://theirs", 0), ("http://theirs", 1),
                     ("http://ours", 1), ("http://ours", 2), ("http://theirs", 2)]
    ours, _ = results
    assert ours.rounds["single"] == [10.0, 30.0, 20.0]
    assert ours.runs["single"].metrics.output_throughput == 20.0  # the median round
    write_doc(tmp_path, results, {}, compare.workloads(args), 64)
    page = (tmp_path / "benchmarks.md").read_text()
    assert "| metal-serve | 10.0 | 30.0 | 20.0 | 20.0 |" in page
    assert "| metal-serve / llama-server | 0.50 | 1.50 | 1.00 | 1.00 |" in page
