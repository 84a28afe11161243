"""`metal-serve bench soak` against a real metal-serve it starts: a short run in the default
test run, the 30-minute one (24 sessions, 20% of turns abandoned) under `pytest -m soak`."""

from __future__ import annotations

import os

import pytest

from server.bench.soak import SoakConfig, rss_bytes, rss_growth, run_soak, scrape


def test_rss_growth_compares_the_last_tenth_with_the_tenth_after_warm_up():
    samples = [(t, 100 + (10 if t >= 90 else 0)) for t in range(0, 101, 5)]
    assert rss_growth(samples, duration_s=100, warmup_s=10) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="too few memory samples"):
        rss_growth([(0, 100)], duration_s=100, warmup_s=10)


def test_scrape_reads_a_labelled_sample():
    text = '# HELP x\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    assert scrape(text, "vllm:kv_cache_usage_perc") == 0.25
    assert scrape(text, "vllm:num_requests_running") is None


def test_rss_of_this_process_is_plausible():
    assert 10 << 20 < rss_bytes(os.getpid()) < 64 << 30


@pytest.mark.slow
def test_a_short_soak_with_aborts_leaves_nothing_behind(default_model_dir, default_tokenizer,
                                                        tmp_path):  # fmt: skip
    config = SoakConfig(
        duration_s=15, sessions=4, abort_fraction=0.3, turns=3, system_len=128,
        tool_result_len=32, output_len=8, sample_every_s=0.5,
        serve_args=(str(default_model_dir), "--log-level", "warning"),
    )  # fmt: skip
    report = run_soak(config, tmp_path, default_tokenizer)
    assert report.errors == []
    assert report.completed > 0 and report.aborted > 0
    assert report.kv_usage_when_idle == 0.0  # every aborted request gave its blocks back
    assert report.rss_growth is not None and len(report.rss_samples) > 10


@pytest.mark.soak
def test_a_30_minute_soak_at_24_sessions(default_model_dir, default_tokenizer, tmp_path):
    config = SoakConfig(serve_args=(str(default_model_dir), "--log-level", "warning"))
    report = run_soak(config, tmp_path, default_tokenizer)
    assert report.verdicts(config) == dict.fromkeys(report.verdicts(config), True), report
