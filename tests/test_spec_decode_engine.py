"""Speculative decoding through the engine: the same outputs as without it, only faster.

Drafts are more query rows of the packed step; a rejected one drops whatever came after it. So
every request must come out exactly as without speculation — tokens, text, finish reason,
counts and logprobs — for greedy and seeded sampling, in mixed batches with chunked prefills,
under async scheduling (steps queued behind drafts whose fate is unknown), preemption, stop
strings met inside accepted drafts, and every attention family. Each test also checks that
drafts were accepted, so none passes by never drafting.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from engine_helpers import make_runner_and_scheduler
from scheduler_helpers import run_step
from tiny_models import build_tiny_model

from metal_engine.engine import LLMEngine
from metal_engine.engine_build import build_engine
from scheduler import SamplingParams
from scheduler.request import PENDING_TOKEN
from scheduler.spec_decode.config import SpeculativeConfig
from scheduler.spec_decode.drafter import Proposal

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                          prompt_lookup_max=3)
SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=6)


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: dict[str, SamplingParams],
        last: dict | None = None) -> dict[str, tuple]:
    """Every request's (token ids, text, finish reason, output count, logprobs); its last
    output goes into `last`, if given."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params[rid])
    results = {rid: ([], "", None, 0, []) for rid in prompts}
    last = {} if last is None else last
    while engine.has_unfinished_requests():
        for o in engine.step():
            last[o.request_id] = o
            ids, text, _, _, logprobs = results[o.request_id]
            results[o.request_id] = (ids + o.new_token_ids, text + o.new_text, o.finish_reason,
                                     o.num_output_tokens, logprobs + (o.logprobs or []))
    scheduler = engine.scheduler
    assert scheduler.pool.num_free_blocks == scheduler.config.num_blocks
    if scheduler.group("window") is not None:  # all back but the null block
        assert scheduler.group("window").num_free_blocks == scheduler.config.num_window_blocks - 1
    return results


def tiny_engine(path, tokenizer, speculative=None, async_scheduling=False, num_blocks=64,
                max_num_batched_tokens=24) -> LLMEngine:
    runner, scheduler = make_runner_and_scheduler(
        path, num_blocks=num_blocks, block_size=8,
        max_num_batched_tokens=max_num_batched_tokens, speculative=speculative)
    return LLMEngine(runner, scheduler, tokenizer, "tiny", async_scheduling=async_scheduling)


def accepted(engine: LLMEngine) -> int:
    return engine.scheduler.drafter.stats.num_accepted_tokens


# Tiny random models fall into loops within a few tokens: n-gram drafts then hit often.
LOOPY = [5, 9, 17, 5, 9, 17, 5, 9]
TINY_PROMPTS = {"loop": LOOPY, "long": [int(t) for t in range(3, 60)], "short": [7, 8],
                "mid": [40, 41, 42, 43, 40, 41, 42]}


def mixed_params(max_tokens=20, **fields) -> dict[str, SamplingParams]:
    """Each tiny prompt's params: greedy, or as `fields` say, with a stop token on one."""
    base = dict(max_tokens=max_tokens, ignore_eos=True, **{"temperature": 0.0, **fields})
    return {rid: SamplingParams(**base, stop_token_ids=[17] if rid == "short" else [])
            for rid in TINY_PROMPTS}


@pytest.fixture(scope="module")
def tiny_plain(tiny_llama, default_tokenizer):
    return run(tiny_engine(tiny_llama[1], default_tokenizer), TINY_PROMPTS, mixed_params())


@pytest.mark.parametrize("speculative", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_outputs_equal_those_without_speculation(tiny_llama, default_tokenizer,
                                                        tiny_plain, speculative,
                                                        async_scheduling):
    engine = tiny_engine(tiny_llama[1], default_tokenizer, speculative, async_scheduling)
    assert run(engine, TINY_PROMPTS, mixed_params()) == tiny_plain
    assert accepted(engine) > 10


def test_async_steps_queue_behind_drafts_whose_fate_is_unknown(tiny_llama, default_tokenizer,
                                                               tiny_plain):
    """Some step fed a pending token together with new drafts (so it was queued before the
    drafts in flight were verified), and some such step was dropped for a rejection."""
    engine = tiny_engine(tiny_llama[1], default_tokenizer, NGRAM, async_scheduling=True)
    behind_drafts, launch = [], engine.runner.launch

    def spy(out, previous=None, context=None):
        behind_drafts.extend(s.request_id for s in out.scheduled
                             if s.draft_token_ids and s.token_ids[0] == PENDING_TOKEN)
        return launch(out, previous, context)

    engine.runner.launch = spy
    epochs = {}
    add = engine.scheduler.add_request

    def keep(request):
        epochs[request.request_id] = request
        add(request)

    engine.scheduler.add_request = keep
    assert run(engine, TINY_PROMPTS, mixed_params()) == tiny_plain
    assert behind_drafts
    assert any(r.token_epoch > 0 for r in epochs.values())  # rejected drafts were dropped


@pytest.mark.parametrize("family", ["mistral", "gemma3_text", "qwen3_moe", "glm4_moe"])
def test_every_attention_family_gives_the_same_greedy_tokens(family, default_tokenizer,
                                                             tmp_path):
    """Sliding windows (mistral, gemma3) and MoE routers (qwen3_moe, glm4_moe)."""
    build_tiny_model(family, tmp_path)
    plain = run(tiny_engine(tmp_path, default_tokenizer), TINY_PROMPTS, mixed_params())
    for async_scheduling in (False, True):
        engine = tiny_engine(tmp_path, default_tokenizer, NGRAM, async_scheduling)
        assert run(engine, TINY_PROMPTS, mixed_params()) == plain, async_scheduling
        assert accepted(engine) > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seeded_sampling_with_penalties_and_logprobs_is_unchanged(tiny_llama, default_tokenizer,
                                                                  async_scheduling):
    """A point-mass draft is accepted iff the sampler's own seeded draw equals it, so seeded
    requests write the same tokens; logprobs are reported for each accepted token. (A tiny
    random model's logits are nearly flat: low temperatures make its drafts likely.)"""
    params = mixed_params(temperature=0.05, top_p=0.9, seed=11, logprobs=2,
                          repetition_penalty=1.1)
    params["loop"] = SamplingParams(max_tokens=20, temperature=0.02, seed=3, logprobs=0,
                                    ignore_eos=True)  # no penalty: drafts behind pending
    plain = run(tiny_engine(tiny_llama[1], default_tokenizer), TINY_PROMPTS, params)
    engine = tiny_engine(tiny_llama[1], default_tokenizer, NGRAM, async_scheduling)
    speculated = run(engine, TINY_PROMPTS, params)
    assert accepted(engine) > 0
    for rid, (ids, text, reason, count, logprobs) in plain.items():
        s_ids, s_text, s_reason, s_count, s_logprobs = speculated[rid]
        assert (s_ids, s_text, s_reason, s_count) == (ids, text, reason, count), rid
        assert len(s_logprobs) == len(ids)
        for a, b in zip(logprobs, s_logprobs, strict=True):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_preemption_with_drafts_in_flight(tiny_llama, default_tokenizer):
    """A pool too small for everyone: requests are preempted and recomputed, drafts too."""
    prompts = {f"p{i}": [*LOOPY, 20 + i] * 3 for i in range(5)}
    params = {rid: SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
              for rid in prompts}
    plain = run(tiny_engine(tiny_llama[1], default_tokenizer, num_blocks=14), prompts, params)
    for async_scheduling in (False, True):
        engine = tiny_engine(tiny_llama[1], default_tokenizer, NGRAM, async_scheduling,
                             num_blocks=14)
        assert run(engine, prompts, params) == plain
        assert engine.scheduler.num_preemptions > 0
        assert accepted(engine) > 0


# ---- the default model: an agent asking for a file back --------------------------------------

FILE = '''def fetch_remote_nodes(client, limit=10):
    """Return up to `limit` nodes from the remote index."""
    nodes = []
    for page in client.pages():
        for node in page.nodes:
            if len(nodes) >= limit:
                return nodes
            nodes.append(node)
    return nodes
'''


@pytest.fixture(scope="module")
def default_engine_parts(default_model_dir, default_tokenizer):
    def chat(text):
        messages = [{"role": "user", "content": text}]
        return default_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)

    prompts = {
        "echo": chat(f"Repeat this file exactly, in a code block:\n\n{FILE}"),
        "rename": chat(f"Rename fetch_remote_nodes to list_nodes in:\n\n{FILE}"),
        "question": chat("What is the capital of France?"),
    }
    params = {rid: SamplingParams(max_tokens=48, temperature=0.0) for rid in prompts}
    # A stop string that the echo meets inside a run of accepted drafts.
    params["echo"] = SamplingParams(max_tokens=64, temperature=0.0, stop=["nodes.append"])
    return default_model_dir, prompts, params


def default_engine(model_dir, speculative=None, async_scheduling=False) -> LLMEngine:
    from metal_engine.config import EngineConfig

    return build_engine(EngineConfig(
        model_dir, kv_cache_memory=32 << 20, max_num_batched_tokens=64,
        speculative_config=speculative, async_scheduling=async_scheduling))


@pytest.fixture(scope="module")
def default_plain(default_engine_parts):
    model_dir, prompts, params = default_engine_parts
    return run(default_engine(model_dir), prompts, params)


@pytest.mark.parametrize(("speculative", "async_scheduling"),
                         [(NGRAM, False), (SUFFIX, True), ("itself", True)],
                         ids=["ngram-sync", "suffix-async", "draft-model-async"])
def test_the_default_model_echoes_a_file_the_same_with_most_drafts_accepted(
        default_engine_parts, default_plain, speculative, async_scheduling):
    """(The draft model here is the default model itself: the only checkpoint of its
    tokenizer at hand. Its greedy drafts are the target's own tokens.)"""
    model_dir, prompts, params = default_engine_parts
    if speculative == "itself":
        speculative = SpeculativeConfig(method="draft_model", model=str(model_dir),
                                        num_speculative_tokens=3)
    engine = default_engine(model_dir, speculative, async_scheduling)
    last = {}
    results = run(engine, prompts, params, last)
    assert results == default_plain
    echo_text, reason = results["echo"][1], results["echo"][2]
    assert reason == "stop" and "nodes.append" not in echo_text and "for node in" in echo_text
    echo = last["echo"]
    assert echo.num_accepted_tokens > 0.5 * echo.num_draft_tokens > 0
    stats = engine.scheduler.drafter.stats
    assert stats.num_draft_tokens == sum(o.num_draft_tokens for o in last.values())


def test_the_openai_api_answers_the_same_with_n_seeds_and_streamed_logprobs(
        tiny_llama_with_tokenizer):
    """A real server, the official client: `n` seeded choices, and a streamed answer with
    logprobs, are the same with and without speculation."""
    import openai
    from server_helpers import running_app

    from metal_engine.config import EngineConfig
    from server.app import build_app
    from server.async_engine import AsyncEngine

    def answers(speculative):
        engine = build_engine(EngineConfig(tiny_llama_with_tokenizer,
                                                    kv_cache_memory=8 << 20,
                                                    speculative_config=speculative))
        with running_app(build_app(AsyncEngine(engine), "tiny")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            several = client.completions.create(model="tiny", prompt=LOOPY, max_tokens=16, n=3,
                                                temperature=0.03, seed=5)
            stream = client.completions.create(model="tiny", prompt=LOOPY, max_tokens=16,
                                               temperature=0, logprobs=2, stream=True)
            chunks = [(c.choices[0].text, c.choices[0].logprobs.tokens if c.choices[0].logprobs
                       else None) for c in stream if c.choices]
        accepted = engine.scheduler.drafter.stats.num_accepted_tokens if speculative else None
        return [c.text for c in several.choices], "".join(t for t, _ in chunks), \
            [tok for _, toks in chunks if toks for tok in toks], accepted

    *plain, _ = answers(None)
    *speculated, accepted = answers(NGRAM)
    assert speculated == plain
    # 16 tokens, all of no text here (ids the tokenizer holds as special): the last one is
    # not reported, however the stream grouped them
    assert accepted > 0 and len(plain[2]) == 15


# ---- hybrid models: recurrent state put back after a rejection ---------------------------------


def hybrid_engine(path, tokenizer, speculative=None, async_scheduling=False,
                  enable_prefix_caching=True) -> LLMEngine:
    runner, scheduler = make_runner_and_scheduler(
        path, num_blocks=64, block_size=8, max_num_batched_tokens=24,
        enable_prefix_caching=enable_prefix_caching, state_checkpoint_interval=2,
        speculative=speculative)
    return LLMEngine(runner, scheduler, tokenizer, "tiny", async_scheduling=async_scheduling)


@pytest.mark.parametrize("enable_prefix_caching", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_hybrid_model_gives_the_same_greedy_tokens(tiny_hybrid, default_tokenizer,
                                                     async_scheduling, enable_prefix_caching):
    """Gated DeltaNet layers: a rejection copies the snapshot back and recomputes the accepted
    drafts; checkpoints (every 2 blocks, and decode ones) never hold a rejected draft, so a
    second round over the same prompts, resuming from them, gives the same tokens too."""
    path = tiny_hybrid[1]
    # "resent" is 2 blocks and a token: resent, it resumes from a checkpoint and drafts at once
    prompts = {**TINY_PROMPTS, "resent": [*LOOPY, 7, *LOOPY]}
    params = {**mixed_params(max_tokens=24), "resent": mixed_params(max_tokens=24)["loop"]}
    plain = run(hybrid_engine(path, default_tokenizer,
                              enable_prefix_caching=enable_prefix_caching), prompts, params)
    engine = hybrid_engine(path, default_tokenizer, NGRAM, async_scheduling,
                           enable_prefix_caching)
    assert run(engine, prompts, params) == plain
    again = {f"{rid}-again": ids for rid, ids in prompts.items()}
    second = run(engine, again, {f"{rid}-again": p for rid, p in params.items()})
    assert {rid.removesuffix("-again"): r for rid, r in second.items()} == plain
    assert accepted(engine) > 0
    states = engine.scheduler.group("states")
    assert states.num_free_slots == engine.scheduler.config.num_state_slots


def test_other_hybrid_families_give_the_same_greedy_tokens(default_tokenizer, tmp_path):
    from convert import convert_model

    for family in ("qwen3_5_moe_text", "qwen3_next"):
        source = tmp_path / family
        build_tiny_model(family, source)
        path = convert_model(source, tmp_path / f"{family}-converted", progress=False)
        plain = run(hybrid_engine(path, default_tokenizer), TINY_PROMPTS, mixed_params())
        engine = hybrid_engine(path, default_tokenizer, NGRAM, async_scheduling=True)
        assert run(engine, TINY_PROMPTS, mixed_params()) == plain, family
        assert accepted(engine) > 0, family


def test_a_grammar_request_drafts_within_its_grammar(default_engine_parts):
    """The bitmask of each verified row is the grammar's after the drafts before it, so a
    draft the grammar refuses is never accepted and the JSON comes out as without drafts."""
    import json

    from scheduler.sampling_params import StructuredOutput

    model_dir, _, _ = default_engine_parts
    record = {"name": "fetch_remote_nodes", "limit": 10, "tags": ["remote", "index", "nodes"]}
    schema = json.dumps({"type": "object", "properties": {
        "name": {"type": "string"}, "limit": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "limit", "tags"], "additionalProperties": False})
    plain_engine = default_engine(model_dir)
    tokenizer = plain_engine.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this JSON exactly: {json.dumps(record)}"}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    params = {"json": SamplingParams(max_tokens=48, temperature=0.0,
                                     structured=StructuredOutput(schema))}
    plain = run(plain_engine, {"json": prompt}, params)
    engine = default_engine(model_dir, NGRAM)
    last = {}
    assert run(engine, {"json": prompt}, params, last) == plain
    assert json.loads(plain["json"][1]).keys() == record.keys()
    assert last["json"].num_accepted_tokens > 0


# ---- a draft model: its K/V beside the pool, its drafts on the device -------------------------

DRAFT_MODEL = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=3)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """A smaller tiny Llama of the same vocabulary, with other weights than the target's."""
    path = tmp_path_factory.mktemp("tiny-draft")
    build_tiny_model("llama", path, num_hidden_layers=1)
    return path


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("draft", ["itself", "smaller"])
def test_a_draft_model_gives_the_same_greedy_tokens(tiny_llama, default_tokenizer, tiny_plain,
                                                    tiny_draft, draft, async_scheduling):
    """Drafting for itself, the target's drafts are its own greedy tokens: all accepted. A
    different draft is mostly rejected. Either way the outputs are the target's."""
    runner, scheduler = make_runner_and_scheduler(
        tiny_llama[1], num_blocks=64, block_size=8, max_num_batched_tokens=24,
        speculative=DRAFT_MODEL,
        draft_dir=tiny_llama[1] if draft == "itself" else tiny_draft)
    engine = LLMEngine(runner, scheduler, default_tokenizer, "tiny",
                       async_scheduling=async_scheduling)
    assert run(engine, TINY_PROMPTS, mixed_params()) == tiny_plain
    stats = scheduler.drafter.stats
    assert stats.num_draft_tokens > 20
    if draft == "itself":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_the_engine_loads_a_draft_model_of_the_same_tokenizer(tiny_llama_with_tokenizer,
                                                              tiny_draft, tmp_path):
    from metal_engine.config import EngineConfig

    def engine(model=None):
        spec = None if model is None else replace(DRAFT_MODEL, model=str(model))
        return build_engine(EngineConfig(tiny_llama_with_tokenizer,
                                                  kv_cache_memory=8 << 20,
                                                  speculative_config=spec))

    params = mixed_params()
    plain = run(engine(), TINY_PROMPTS, params)
    drafted = engine(tiny_llama_with_tokenizer)
    assert run(drafted, TINY_PROMPTS, params) == plain
    assert drafted.scheduler.drafter.stats.num_accepted_tokens > 0
    with pytest.raises(ValueError, match="tokenizer differs"):
        engine(tiny_draft)  # same vocabulary size, another tokenizer
    with pytest.raises(ValueError, match="not a model directory"):
        engine(tmp_path)


# ---- sampled: the output distribution is the target's -----------------------------------------


@pytest.mark.parametrize("drafter", ["point-mass", "draft-model"])
def test_sampled_tokens_follow_the_target_distribution(tiny_llama, tiny_draft, drafter):
    """10k requests of one prompt at temperature tau draft two tokens in their first step (the
    prompt's first block is cached, so that step feeds one prompt token and the drafts): the
    target's two likeliest (point masses), or a smaller model's draws from its own q. The
    empirical joint of their first two outputs — the second from the draft's row or, after a
    rejection, from the next step — matches p(t0) p(t1 | t0) from transformers by a
    chi-square test. tau gives the likeliest first token probability ~0.5."""
    import dataclasses

    import mlx.core as mx
    import numpy as np
    import torch
    from test_rejection_sampler import assert_distributed_as

    from scheduler import Request

    model, path = tiny_llama
    prompt = [5, 9, 17, 33, 3, 70, 71, 12, 40]  # a full block of 8, then the token fed
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].double().numpy()
        nexts = model(torch.tensor([[*prompt, t] for t in range(128)])).logits[:, -1].double()
    tau = 1.0
    for _ in range(200):  # until the likeliest first token has probability ~0.5
        p0 = np.exp((first - first.max()) / tau)
        p0 /= p0.sum()
        tau *= 1.02 if p0.max() > 0.5 else 0.98
    p1 = torch.softmax(nexts / tau, dim=-1).numpy()
    top0 = int(first.argmax())
    drafts = [top0, int(p1[top0].argmax())]

    own_model = drafter == "draft-model"
    runner, scheduler = make_runner_and_scheduler(
        path, num_blocks=512, block_size=8, max_num_seqs=64, max_num_batched_tokens=256,
        speculative=replace(DRAFT_MODEL, num_speculative_tokens=2) if own_model else
        SpeculativeConfig(method="ngram", num_speculative_tokens=2),
        draft_dir=tiny_draft if own_model else None)
    drafter = scheduler.drafter
    if not own_model:
        drafter.propose = lambda request, k: Proposal(
            drafts[:k] if not request.output_token_ids else [], "ngram")
    drafter.length = dataclasses.replace(drafter.length, saturation_rows=10**6, min_gain=1e-9,
                                         prior=0.99)
    mx.random.seed(7)
    params = SamplingParams(max_tokens=3, temperature=tau, ignore_eos=True)

    def generate(requests):
        for request in requests:
            scheduler.add_request(request)
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            run_step(runner, scheduler, out)

    generate([Request("warm", prompt, params)])  # caches the prompt's first block
    drafter.stats = type(drafter.stats)()
    requests = [Request(f"s{i}", prompt, params) for i in range(10_000)]
    generate(requests)
    stats = drafter.stats
    assert stats.num_drafts >= 10_000  # every request verified two drafts (a draft model's
    assert stats.num_draft_tokens >= 20_000  # requests may draft again after a rejection)
    assert 0.05 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.95
    pairs = np.array([r.output_token_ids[0] * 128 + r.output_token_ids[1] for r in requests])
    assert_distributed_as(pairs, (p0[:, None] * p1).reshape(-1))
