"""The server's default, `--speculative-config auto`, against `off`: the same outputs for every
family of model (each tiny one, converted), with greedy, seeded, penalized and logprob
requests in one batch.

Engines are built as the server builds them (`build_engine` from an EngineConfig), so `auto`
is resolved per model dir: prompt lookup for dense, sliding-window, MoE and hybrid models, the
checkpoint's MTP head where it carries one. Whether a step drafts depends on the step times
measured here, so each test checks only that some step drafted, not how many.
"""

from __future__ import annotations

import pytest
from test_spec_decode_engine import TINY_PROMPTS, run
from test_spec_mtp import build_with_head, with_tokenizer
from tiny_models import TINY_MODELS, build_tiny_model
from tiny_vision import image_processor

from convert import convert_model
from metal_engine.config import EngineConfig
from metal_engine.drafting.auto import has_mtp_head, resolve_speculative
from metal_engine.engine_build import build_engine
from scheduler import SamplingParams
from scheduler.spec_decode.config import SpeculativeConfig

AUTO = SpeculativeConfig.from_text("auto")


def mixed_params() -> dict[str, SamplingParams]:
    """Greedy, seeded with logprobs, seeded with penalties, greedy with a stop token."""
    common = dict(max_tokens=24, ignore_eos=True)
    return {
        "loop": SamplingParams(temperature=0.0, **common),
        "long": SamplingParams(temperature=0.7, seed=3, logprobs=2, **common),
        "mid": SamplingParams(temperature=0.05, seed=11, repetition_penalty=1.1, **common),
        "short": SamplingParams(temperature=0.0, stop_token_ids=[17], **common),
    }


def engine(model_dir, speculative, async_scheduling):
    return build_engine(EngineConfig(model_dir, kv_cache_memory=8 << 20, max_num_batched_tokens=24,
                                     speculative_config=speculative,
                                     async_scheduling=async_scheduling))


def assert_same(plain: dict, drafted: dict) -> None:
    for rid, (ids, text, reason, count, logprobs) in plain.items():
        d_ids, d_text, d_reason, d_count, d_logprobs = drafted[rid]
        assert (d_ids, d_text, d_reason, d_count) == (ids, text, reason, count), rid
        assert [lp.token_id for lp in d_logprobs] == [lp.token_id for lp in logprobs], rid
        assert [lp.logprob for lp in d_logprobs] == pytest.approx(
            [lp.logprob for lp in logprobs], abs=1e-4)


def check_default_matches_off(model_dir, method: str) -> None:
    assert resolve_speculative(EngineConfig(model_dir, speculative_config=AUTO)
                               ).speculative_config.method == method
    plain = run(engine(model_dir, None, False), TINY_PROMPTS, mixed_params())
    for async_scheduling in (False, True):
        drafting = engine(model_dir, AUTO, async_scheduling)
        assert_same(plain, run(drafting, TINY_PROMPTS, mixed_params()))
        assert drafting.scheduler.drafter.stats.num_draft_tokens > 0, async_scheduling


@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_every_familys_tiny_model_answers_the_same_by_default(family, default_tokenizer,
                                                              tmp_path):
    """Dense, sliding-window, MoE, MLA, sparse-attention and hybrid families alike, converted
    as users convert them."""
    build_tiny_model(family, tmp_path / "hf")
    if family.startswith("qwen3_vl"):  # a vision-language checkpoint: its tower's processor
        image_processor().save_pretrained(tmp_path / "hf")
    converted = convert_model(tmp_path / "hf", tmp_path / "converted", progress=False)
    path = with_tokenizer(converted, default_tokenizer, tmp_path / "model")
    check_default_matches_off(path, "mtp" if has_mtp_head(path) else "suffix")


def test_a_hybrid_model_answers_the_same_by_default(tiny_hybrid, default_tokenizer, tmp_path):
    assert not has_mtp_head(tiny_hybrid[1])
    check_default_matches_off(with_tokenizer(tiny_hybrid[1], default_tokenizer,
                                             tmp_path / "model"), "suffix")


def test_a_checkpoint_with_an_mtp_head_drafts_with_it_by_default(default_tokenizer, tmp_path):
    _, converted = build_with_head("qwen3_5_text", tmp_path)
    path = with_tokenizer(converted, default_tokenizer, tmp_path / "model")
    assert has_mtp_head(path)
    check_default_matches_off(path, "mtp")
