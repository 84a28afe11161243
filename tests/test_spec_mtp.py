"""Speculative decoding's `mtp` method: drafts from the checkpoint's multi-token-prediction head.

transformers drops `mtp.*` on load and has no forward for it, so the head's reference is
composed here from transformers' own classes as vLLM's Qwen3.5 / Qwen3-Next MTP models compose
them: the family's full-attention decoder layer, its norm and rotary embedding, the model's
embedding and head, fed the model's final hidden states. Each tiny checkpoint gets a head as
published checkpoints carry one (per-expert tensors for MoE), then goes through `convert`.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from test_spec_decode_engine import LOOPY, TINY_PROMPTS, hybrid_engine, mixed_params, run
from tiny_models import VOCAB, build_tiny_model

from metal_engine.cache.kv_cache import KVCache
from metal_engine.drafting.mtp import load_mtp_head
from metal_engine.engine import LLMEngine
from metal_engine.engine_build import build_engine
from metal_engine.input_batch import build_step_inputs
from metal_engine.loading.weights import load_model
from scheduler import SamplingParams
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.spec_decode.config import SpeculativeConfig

FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"]
FULL_ATTENTION_LAYER = 1  # in every tiny hybrid config
MTP = SpeculativeConfig(method="mtp")


class Reference:
    """The head in PyTorch beside the model it drafts for."""

    def __init__(self, model, seed: int = 1) -> None:
        torch.manual_seed(seed)
        hidden, norm = model.config.hidden_size, type(model.model.norm)
        self.model = model
        self.layer = copy.deepcopy(model.model.layers[FULL_ATTENTION_LAYER])
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.norms = {name: norm(hidden, eps=model.config.rms_norm_eps)
                      for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
        with torch.no_grad():  # off the model's layer, norms off 1
            for module in (self.layer, *self.norms.values()):
                for parameter in module.parameters():
                    parameter.add_(0.05 * torch.randn_like(parameter))

    def tensors(self) -> dict[str, np.ndarray]:
        """The head's weights under the checkpoint's names, experts one tensor each."""
        named = {f"layers.0.{n}": t for n, t in self.layer.state_dict().items()}
        named["fc.weight"] = self.fc.weight
        named.update({f"{name}.weight": n.weight for name, n in self.norms.items()})
        return {f"mtp.{n}": t.detach().numpy().copy() for n, t in per_expert(named).items()}

    def logits(self, ids: list[int]) -> np.ndarray:
        """`[len(ids) - 1, V]`: row p predicts the token at p + 2 from position p."""
        tokens = torch.tensor([ids])
        captured = {}  # the rope tables and causal mask of a full-attention layer
        hook = self.model.model.layers[FULL_ATTENTION_LAYER].register_forward_pre_hook(
            lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True)
        with torch.no_grad():
            self.model.model(tokens[:, :-1])
            hook.remove()
            hidden = self.model.model(tokens).last_hidden_state[:, :-1]
            embeds = self.model.model.embed_tokens(tokens[:, 1:])
            x = self.fc(torch.cat([self.norms["pre_fc_norm_embedding"](embeds),
                                   self.norms["pre_fc_norm_hidden"](hidden)], dim=-1))
            kwargs = {k: v for k, v in captured.items()
                      if k not in ("cache", "past_key_values", "use_cache")}
            out = self.layer(x, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            return self.model.lm_head(self.norms["norm"](out))[0].numpy()


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert parameters as the per-expert tensors checkpoints hold."""
    out = {}
    for name, tensor in tensors.items():
        block, fused, proj = name.partition(".experts.")
        if not fused:
            out[name] = tensor
            continue
        for e in range(tensor.shape[0]):
            if proj == "gate_up_proj":  # [E, 2I, H], gate rows first
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{block}.experts.{e}.gate_proj.weight"] = gate
                out[f"{block}.experts.{e}.up_proj.weight"] = up
            else:
                out[f"{block}.experts.{e}.down_proj.weight"] = tensor[e]
    return out


def build_with_head(family: str, root: Path) -> tuple[Reference, Path]:
    """A tiny checkpoint of `family` with an MTP head, converted; and the head's reference."""
    from convert import convert_model

    source = root / "hf"
    reference = Reference(build_tiny_model(family, source))
    weights = load_file(source / "model.safetensors")
    save_file({**weights, **reference.tensors()}, str(source / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return reference, convert_model(source, root / "converted", progress=False)


@pytest.fixture(scope="module", params=FAMILIES)
def with_head(request, tmp_path_factory):
    return build_with_head(request.param, tmp_path_factory.mktemp(request.param))


def test_the_head_computes_its_reference(with_head):
    """From the model's hidden states and the next tokens, through its own paged K/V."""
    reference, path = with_head
    ids = [*LOOPY, 40, 41, 42, 3, 77, 12, 5, 9]
    target = load_model(path, mx.float32)
    head = load_mtp_head(path, target, mx.float32)
    with torch.no_grad():
        hidden = reference.model.model(torch.tensor([ids])).last_hidden_state[0, :-1].numpy()
    item = ScheduledRequest(request_id="r", token_ids=[0] * (len(ids) - 1), start_position=0,
                            block_ids=[0, 1], block_table_epoch=0, samples=False,
                            params=SamplingParams(), num_output_tokens=0, draft_token_ids=[],
                            token_epoch=0)
    step = build_step_inputs(SchedulerOutput([item]), 8)
    out = head(target.model.embed(mx.array(ids[1:])), mx.array(hidden),
               mx.array(step.positions), step.attention, KVCache([head.pool_shape()], 4, 8,
                                                                 mx.float32))
    np.testing.assert_allclose(np.array(target.logits(out)), reference.logits(ids),
                               atol=1e-4, rtol=1e-4)


def mtp_engine(path, tokenizer, speculative=MTP, async_scheduling=False) -> LLMEngine:
    return hybrid_engine(path, tokenizer, speculative, async_scheduling)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_each_first_draft_comes_from_the_heads_distribution(with_head, default_tokenizer,
                                                            async_scheduling):
    """Sampled requests in mixed batches draft two tokens a step. Every first draft is drawn
    from q = softmax(logits / T) of the head at the position before the fed token, with the
    hidden state kept from the step before and the head's K/V from the follow passes: q equals
    the reference's over the request's final tokens, under async scheduling too (fed tokens
    pending; a hybrid request with drafts in flight sits out a step, so no step is dropped). A
    second round resumes the prompts from the prefix cache: one fed just after its cached
    blocks has no hidden state kept before it, and drafts the fed token (a point mass) without
    touching the head's K/V there. (Drafts of steps dropped after a rejection are not
    checked: their tokens are not the request's.)"""
    reference, path = with_head
    engine = mtp_engine(path, default_tokenizer, replace(MTP, num_speculative_tokens=2),
                        async_scheduling)
    temperature, drawn, fed = 0.8, [], []
    draft = engine.runner.draft.draft

    def spy(out, *args):
        drafts = draft(out, *args)
        fed.append({s.request_id: s.start_position for s in out.scheduled})
        if drafts is not None:
            drafting = [s for s in out.scheduled if s.draft_token_ids]
            first = np.cumsum([0] + [len(s.draft_token_ids) for s in drafting[:-1]])
            probs = np.array(drafts.probs)
            drawn.extend((len(fed) - 1, s.request_id, s.start_position, probs[row])
                         for s, row in zip(drafting, first, strict=True))
        return drafts

    engine.runner.draft.draft = spy
    params = {rid: SamplingParams(max_tokens=16, temperature=temperature, seed=i,
                                  ignore_eos=True) for i, rid in enumerate(TINY_PROMPTS)}
    last = {}
    results = run(engine, TINY_PROMPTS, params, last)
    again = run(engine, {f"{rid}-again": ids for rid, ids in TINY_PROMPTS.items()},
                {f"{rid}-again": p for rid, p in params.items()}, last)
    tokens = {rid: [*TINY_PROMPTS[rid.removesuffix("-again")], *r[0]]
              for rid, r in {**results, **again}.items()}
    expected = {rid: torch.softmax(torch.tensor(reference.logits(ids)) / temperature,
                                   dim=-1).numpy() for rid, ids in tokens.items()}
    # An attention-only model's request (DeepSeek's) goes on under async scheduling while its
    # drafts are in flight; a step launched so on drafts then rejected is dropped, and a later
    # one feeds an earlier position: its drafts drew from tokens that are not the request's.
    # (A hybrid request recomputes from the position it fed, never before it.)
    seen = [(rid, position, q) for step, rid, position, q in drawn
            if not any(later.get(rid, position) < position for later in fed[step + 1 :])]
    blind = 0
    for rid, position, q in seen:
        if position - 1 < last[rid].num_cached_tokens:  # no hidden state kept before it
            np.testing.assert_array_equal(q, np.eye(VOCAB)[tokens[rid][position]])
            blind += 1
        else:
            np.testing.assert_allclose(q, expected[rid][position - 1], atol=1e-4, err_msg=rid)
    assert len(seen) > 30 and blind > 0
    assert engine.scheduler.drafter.stats.num_accepted_tokens > 10


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mtp_gives_the_same_greedy_tokens(with_head, default_tokenizer, async_scheduling):
    """Three drafts a step; hybrid rejections roll the recurrent state back."""
    _, path = with_head
    prompts = {**TINY_PROMPTS, "resent": [*LOOPY, 7, *LOOPY]}
    params = {**mixed_params(max_tokens=24), "resent": mixed_params(max_tokens=24)["loop"]}
    plain = run(hybrid_engine(path, default_tokenizer), prompts, params)
    engine = mtp_engine(path, default_tokenizer, replace(MTP, num_speculative_tokens=3),
                        async_scheduling)
    assert run(engine, prompts, params) == plain
    assert engine.scheduler.drafter.stats.num_draft_tokens > 30


def from_config(model_dir: Path, spec: SpeculativeConfig | None = MTP) -> LLMEngine:
    from metal_engine.config import EngineConfig

    return build_engine(EngineConfig(model_dir, kv_cache_memory=8 << 20,
                                              speculative_config=spec))


def with_tokenizer(model_dir: Path, tokenizer, out: Path) -> Path:
    shutil.copytree(model_dir, out)
    tokenizer.save_pretrained(out)
    return out


def test_the_engine_serves_a_models_own_head(with_head, default_tokenizer, tmp_path):
    """One draft a step by default, its K/V in a pool beside the model's."""
    path = with_tokenizer(with_head[1], default_tokenizer, tmp_path / "model")
    params = mixed_params()
    plain = run(from_config(path, None), TINY_PROMPTS, params)
    drafted = from_config(path)
    assert run(drafted, TINY_PROMPTS, params) == plain
    assert drafted.scheduler.config.speculative.num_speculative_tokens == 1
    assert drafted.scheduler.drafter.stats.num_draft_tokens > 10


def test_a_model_without_a_head_is_refused_naming_what_to_do(tiny_hybrid, default_tokenizer,
                                                             tiny_llama_with_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="llama has none: use ngram, suffix or draft_model"):
        from_config(tiny_llama_with_tokenizer)
    headless = with_tokenizer(tiny_hybrid[1], default_tokenizer, tmp_path / "headless")
    with pytest.raises(ValueError, match="no multi-token-prediction head .* convert the original"):
        from_config(headless)


def test_the_memory_plan_counts_the_heads_weights(with_head):
    """What `serve` plans with before loading: the head's bytes as loaded."""
    from metal_engine.config import EngineConfig
    from metal_engine.loading.weight_bytes import drafter_weight_bytes
    from metal_engine.loading.weights import parameter_bytes

    _, path = with_head
    head = load_mtp_head(path, load_model(path, mx.float32), mx.float32)
    config = EngineConfig(path, speculative_config=MTP)
    assert drafter_weight_bytes(config, mx.float32) == parameter_bytes(head) > 0
