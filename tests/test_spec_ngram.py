"""Speculative decoding's scheduler side: the vLLM config, n-gram drafts, draft-length policy."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.spec_decode.config import SpeculativeConfig
from scheduler.spec_decode.draft_length import DraftLength
from scheduler.spec_decode.ngram import NO_DRAFT, Draft, NgramProposer, SuffixIndex, pick_draft


def reference_draft(tokens: list[int], min_n: int, max_n: int, k: int,
                    own: bool = True) -> Draft:
    """The rule by brute force: longest n first, then the latest earlier occurrence; in the
    request's own history (`own`) the copy goes on past the end, token by token."""
    if k < 1:
        return NO_DRAFT
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens):
            continue
        tail = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == tail:
                if not own:
                    return Draft(tokens[end:end + k], n)
                grown = list(tokens)
                for i in range(k):
                    grown.append(grown[end + i])
                return Draft(grown[len(tokens):], n)
    return NO_DRAFT


# -- config -------------------------------------------------------------------------------------


def test_parses_the_vllm_ngram_spelling():
    cfg = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4, '
                                      '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    assert (cfg.method, cfg.num_speculative_tokens) == ("ngram", 4)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 5)


@pytest.mark.parametrize(("given_bounds", "resolved"), [
    ({}, (5, 5)),  # vLLM: neither given -> both 5
    ({"prompt_lookup_max": 4}, (4, 4)),  # one given -> the other copies it
    ({"prompt_lookup_min": 3}, (3, 3)),
])
def test_ngram_lookup_defaults_follow_vllm(given_bounds, resolved):
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                       **given_bounds})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == resolved


def test_suffix_defaults():
    cfg = SpeculativeConfig.from_json('{"method": "suffix"}')
    assert cfg.num_speculative_tokens == cfg.suffix_decoding_max_tree_depth == 24
    assert cfg.suffix_decoding_max_cached_requests == 10000
    assert cfg.suffix_decoding_max_spec_factor == 1.0
    assert cfg.suffix_decoding_min_token_prob == 0.1
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 6)
    only_max = SpeculativeConfig.from_dict({"method": "suffix", "prompt_lookup_max": 1})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (1, 1)


def test_model_methods_and_legacy_spellings():
    draft = SpeculativeConfig.from_json('{"method": "draft_model", "model": "/m/small", '
                                        '"num_speculative_tokens": 3}')
    assert (draft.method, draft.model) == ("draft_model", "/m/small")
    assert SpeculativeConfig.from_json('{"method": "mtp"}').num_speculative_tokens is None
    assert SpeculativeConfig.from_dict({"method": "qwen3_next_mtp"}).method == "mtp"
    assert SpeculativeConfig.from_dict({"model": "/m/small",
                                        "num_speculative_tokens": 2}).method == "draft_model"
    legacy = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2})
    assert (legacy.method, legacy.model) == ("ngram", None)
    assert SpeculativeConfig.from_dict({"method": "[ngram]",
                                        "num_speculative_tokens": 2}).method == "ngram"


def ngram_json(fields: str) -> str:
    return '{"method": "ngram", "num_speculative_tokens": 3, ' + fields + "}"


@pytest.mark.parametrize(("text", "named"), [
    ('{"method": "ngram",', "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"num_speculative_tokens": 3}', '"method"'),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "method 'eagle'"),
    ('{"method": 3}', "method must be a string"),
    (ngram_json('"draft_tensor_parallel_size": 1'), "draft_tensor_parallel_size"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": "5"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens"),
    (ngram_json('"prompt_lookup_min": 0'), "prompt_lookup_min"),
    (ngram_json('"prompt_lookup_max": 0'), "prompt_lookup_max"),
    (ngram_json('"prompt_lookup_min": 4, "prompt_lookup_max": 2'), "prompt_lookup_min"),
    (ngram_json('"model": "/m/small"'), "model"),
    (ngram_json('"suffix_decoding_max_tree_depth": 8'), "suffix_decoding_max_tree_depth"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "model"),
    ('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 3, '
     '"prompt_lookup_max": 3}', "prompt_lookup_max"),
    ('{"method": "mtp", "num_speculative_tokens": -1}', "num_speculative_tokens"),
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": 0}',
     "suffix_decoding_max_tree_depth"),
    ('{"method": "suffix", "suffix_decoding_max_cached_requests": -1}',
     "suffix_decoding_max_cached_requests"),
    ('{"method": "suffix", "suffix_decoding_max_spec_factor": -0.5}',
     "suffix_decoding_max_spec_factor"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}',
     "suffix_decoding_min_token_prob"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": "high"}',
     "suffix_decoding_min_token_prob"),
])
def test_bad_configs_name_the_field(text, named):
    with pytest.raises(ValueError, match="speculative-config") as err:
        SpeculativeConfig.from_json(text)
    assert named in str(err.value)


def test_config_is_frozen():
    cfg = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2}')
    with pytest.raises(AttributeError):
        cfg.num_speculative_tokens = 5  # type: ignore[misc]


# -- proposals on one request's tokens -----------------------------------------------------------


def test_repeated_code_block_drafts_its_continuation():
    block = list(range(100, 140))
    history = [1, 2, 3] + block + [7, 8, 9] + block[:10]
    draft = NgramProposer(2, 4).propose(history, 5)
    assert draft == Draft(block[10:15], 4)


def test_no_match_drafts_nothing():
    assert NgramProposer(1, 3).propose([1, 2, 3, 4, 5], 4) == NO_DRAFT
    assert NgramProposer(1, 3).propose([], 4) == NO_DRAFT
    assert NgramProposer(1, 3).propose([7], 4) == NO_DRAFT


def test_the_tail_is_never_its_own_match():
    # the only occurrence of (1, 2, 3) is the tail itself
    assert NgramProposer(3, 3).propose([1, 2, 3], 4) == NO_DRAFT
    assert NgramProposer(1, 1).propose([1, 1], 4) == Draft([1, 1, 1, 1], 1)


def test_longest_n_wins_over_a_more_recent_shorter_match():
    tokens = [1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3]
    assert NgramProposer(2, 3).propose(tokens, 4) == Draft([9, 5, 2, 3], 3)
    assert NgramProposer(2, 2).propose(tokens, 4) == Draft([8, 1, 2, 3], 2)


def test_min_n_bounds_the_match():
    tokens = [5, 2, 3, 8, 6, 2, 3]  # only a 2-gram repeats
    assert NgramProposer(3, 4).propose(tokens, 3) == NO_DRAFT
    assert NgramProposer(2, 4).propose(tokens, 3) == Draft([8, 6, 2], 2)


def test_most_recent_occurrence_wins():
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    assert NgramProposer(2, 2).propose(tokens, 3) == Draft([8, 1, 2], 2)


def test_k_caps_the_draft_and_a_match_near_the_end_repeats_as_a_loop():
    tokens = list(range(20)) + [0, 1]
    proposer = NgramProposer(2, 2)
    assert proposer.propose(tokens, 3) == Draft([2, 3, 4], 2)
    assert proposer.propose(tokens, 0) == NO_DRAFT
    # past the history's end the copy goes on over itself: period = how far back the match is
    assert NgramProposer(2, 2).propose([1, 2, 3, 1, 2], 7) == Draft([3, 1, 2, 3, 1, 2, 3], 2)
    assert NgramProposer(2, 2).propose([4, 4, 4], 5) == Draft([4, 4, 4, 4, 4], 2)


def test_index_takes_only_growing_sampled_tokens():
    proposer = NgramProposer(1, 2)
    proposer.propose([1, 2, 3], 2)
    with pytest.raises(ValueError, match="shrank"):
        proposer.propose([1, 2], 2)
    with pytest.raises(ValueError, match="placeholder"):
        proposer.propose([1, 2, 3, -1], 2)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(3, 2)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=60),
       cuts=st.lists(st.integers(1, 8), min_size=1, max_size=30),
       min_n=st.integers(1, 3), extra_n=st.integers(0, 3), k=st.integers(0, 6))
def test_incremental_index_equals_a_scan_from_scratch(tokens, cuts, min_n, extra_n, k):
    max_n = min_n + extra_n
    proposer = NgramProposer(min_n, max_n)
    shared = SuffixIndex(min_n, max_n)
    size = 0
    for cut in cuts + [len(tokens)]:
        size = min(len(tokens), size + cut)
        prefix = tokens[:size]
        assert proposer.propose(prefix, k) == reference_draft(prefix, min_n, max_n, k)
        shared.update("only", prefix)  # one request's outputs: the same match, cut at the end
        assert shared.propose(prefix, k) == reference_draft(prefix, min_n, max_n, k, own=False)
    assert NgramProposer(min_n, max_n).propose(tokens, k) == proposer.propose(tokens, k)


# -- drafts from other requests ------------------------------------------------------------------


def test_a_request_drafts_what_another_request_wrote():
    code = list(range(500, 560))
    shared = SuffixIndex(2, 4)
    shared.update("a", [9] + code[:30])
    shared.update("a", [9] + code)  # only what is new is indexed
    shared.finish("a")
    b_tokens = [1, 2, 3] + code[:20]  # b's own history has never seen code[20:]
    assert NgramProposer(2, 4).propose(b_tokens, 5) == NO_DRAFT
    assert shared.propose(b_tokens, 5) == Draft(code[20:25], 4)


def num_finished(index: SuffixIndex) -> int:
    """Finished requests the index still drafts from."""
    return len(index._finished)


def num_entries(index: SuffixIndex) -> int:
    """N-grams the index holds, stale ones included."""
    return len(index._last_end)


def test_finished_requests_are_evicted_least_recently_used_first():
    shared = SuffixIndex(2, 2, max_cached_requests=2)
    for name, base in (("a", 100), ("b", 200)):
        shared.update(name, [base, base + 1, base + 2])
        shared.finish(name)
    assert shared.propose([100, 101], 1) == Draft([102], 2)  # a hit: a is now the newest use
    shared.update("c", [300, 301, 302])
    shared.finish("c")  # three finished, two kept: b goes
    assert num_finished(shared) == 2
    assert shared.propose([200, 201], 1) == NO_DRAFT
    assert shared.propose([100, 101], 1) == Draft([102], 2)
    assert shared.propose([300, 301], 1) == Draft([302], 2)


def test_the_token_budget_bounds_finished_requests_and_spares_running_ones():
    shared = SuffixIndex(1, 3, max_cached_tokens=100)
    for i in range(5):
        shared.update(f"done{i}", list(range(1000 * i, 1000 * i + 40)))
        shared.finish(f"done{i}")
        assert shared.num_tokens <= 100
    assert num_finished(shared) == 2
    shared.update("long", list(range(9000, 9150)))  # running, over the budget alone
    assert num_finished(shared) == 0
    assert shared.num_tokens == 150
    assert shared.propose([9000, 9001], 2) == Draft([9002, 9003], 2)


def test_evicted_entries_are_reclaimed_and_skipped_until_then():
    shared = SuffixIndex(1, 4, max_cached_requests=1)
    shared.update("old", list(range(5000)))
    shared.finish("old")
    shared.update("new", [7000, 7001])
    shared.finish("new")  # evicts old: its entries go a few hundred tokens per update
    assert shared.num_reclaiming_tokens > 0
    assert shared.propose([10, 11, 12], 3) == NO_DRAFT  # stale, never served
    for i in range(100):
        shared.update("live", list(range(8000, 8002 + i)))
    assert shared.num_reclaiming_tokens == 0
    fresh = SuffixIndex(1, 4)
    fresh.update("new", [7000, 7001])
    fresh.update("live", list(range(8000, 8101)))
    assert num_entries(shared) == num_entries(fresh)


def test_zero_cached_requests_keeps_only_running_ones():
    shared = SuffixIndex(2, 2, max_cached_requests=0)
    shared.update("a", [1, 2, 3])
    assert shared.propose([1, 2], 1) == Draft([3], 2)
    shared.finish("a")
    assert shared.propose([1, 2], 1) == NO_DRAFT
    shared.finish("never-seen")  # no-op


def test_pick_draft_prefers_the_longest_match_then_the_first():
    own, other = Draft([1, 2, 3], 2), Draft([4, 5, 6, 7], 3)
    assert pick_draft([own, other]) == other
    assert pick_draft([own, Draft([9], 2)]) == own
    assert pick_draft([NO_DRAFT, NO_DRAFT]) == NO_DRAFT
    assert pick_draft([]) == NO_DRAFT
    # vLLM's suffix caps: spec factor * match length, and match + draft within the depth
    assert pick_draft([other], max_spec_factor=1.0) == Draft([4, 5, 6], 3)
    assert pick_draft([other], max_spec_factor=0.0) == NO_DRAFT
    assert pick_draft([other], max_depth=5) == Draft([4, 5], 3)
    assert pick_draft([other], max_depth=3) == NO_DRAFT


# -- draft length --------------------------------------------------------------------------------


def run(policy: DraftLength, history, accept, steps: int, rows: int = 1) -> list[int]:
    """k per step when `accept(k)` of k drafted tokens are accepted."""
    ks = []
    for _ in range(steps):
        k = policy.choose(history, num_rows=rows, num_drafting=1)
        policy.record(history, k, accept(k))
        ks.append(k)
    return ks


def test_k_shrinks_to_zero_when_nothing_is_accepted_and_only_probes_after():
    policy = DraftLength(max_draft=5, token_budget=512, probe_every=8)
    history = policy.new_history()
    ks = run(policy, history, lambda k: 0, steps=40)
    assert ks[0] > 1
    first_zero = ks.index(0)
    assert ks[:first_zero] == sorted(ks[:first_zero], reverse=True)
    assert set(ks[first_zero:]) == {0, 1}  # one-token probes only
    gaps = [i for i, k in enumerate(ks) if i > first_zero and k == 1]
    assert gaps and all(b - a == 9 for a, b in zip(gaps, gaps[1:], strict=False))


def test_k_grows_back_when_drafts_hit():
    policy = DraftLength(max_draft=5, token_budget=512, probe_every=4)
    history = policy.new_history()
    run(policy, history, lambda k: 0, steps=30)
    assert policy.choose(history, num_rows=1, num_drafting=1) in (0, 1)
    ks = run(policy, history, lambda k: k, steps=15)
    assert ks[-1] == 5
    assert ks == sorted(ks)


def test_k_shrinks_under_load_and_is_zero_when_saturated():
    policy = DraftLength(max_draft=8, token_budget=4096, saturation_rows=64)
    history = policy.new_history()
    run(policy, history, lambda k: max(0, k - 1), steps=30)  # most drafts mostly accepted
    ks = [policy.choose(history, num_rows=rows, num_drafting=1)
          for rows in (1, 16, 32, 48, 60, 64, 500)]
    assert ks[0] >= 3
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[4]
    assert ks[-2:] == [0, 0]
    history.steps_without_draft = 100  # a probe is due, but not in a saturated step
    assert policy.choose(history, num_rows=64, num_drafting=1) == 0


def test_drafts_fit_the_spare_token_budget():
    policy = DraftLength(max_draft=5, token_budget=100, saturation_rows=1000)
    history = policy.new_history()
    assert policy.choose(history, num_rows=1, num_drafting=1) >= 3
    assert policy.choose(history, num_rows=90, num_drafting=5) == 2
    assert policy.choose(history, num_rows=100, num_drafting=5) == 0


def test_rate_counts_the_rejected_position_as_tried():
    policy = DraftLength(max_draft=5, token_budget=512, ewma_weight=1.0)
    history = policy.new_history()
    policy.record(history, 4, 2)  # positions 1, 2 accepted, 3 rejected, 4 never tried
    assert history.rate == pytest.approx(2 / 3)
    policy.record(history, 3, 3)
    assert history.rate == 1.0
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        policy.record(history, 2, 3)
    with pytest.raises(ValueError, match="ewma_weight"):
        DraftLength(max_draft=5, token_budget=512, ewma_weight=0.0)


def test_spec_decode_does_not_import_mlx():
    code = ("import sys, scheduler.spec_decode.config, scheduler.spec_decode.ngram, "
            "scheduler.spec_decode.draft_length; print('mlx' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"
