"""Multi-head latent attention's two forms (metal_engine/models/mla_forms.py): which one the
FLOPs pick at the published shapes, and a step whose requests attend some absorbed, some
expanded, out of packed order, exact against transformers (over a float pool) and against
the absorbed form alone (over an int8 one)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import make_runner_and_scheduler
from test_model_parity import TOL, random_ids, run_logits, torch_logits

from kernels_metal.metadata import AttentionMetadata
from metal_engine.models.mla_config import MlaConfig
from metal_engine.models.mla_forms import FormCosts, form_plan
from metal_engine.models.ops_user import use_ops
from scheduler import Request, SamplingParams

DEEPSEEK_V3 = MlaConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, q_lora_rank=1536)
GLM_4_7_FLASH = MlaConfig(kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
                          v_head_dim=256)


def test_the_flops_pick_the_expanded_form_for_long_chunks_only():
    costs = FormCosts.of(DEEPSEEK_V3)
    rows = np.array([512, 2, 1, 1, 4, 170, 171, 512])
    cached = np.array([0, 0, 0, 5000, 5000, 100_000, 100_000, 8192])
    assert costs.expands(rows, rows + cached).tolist() == [
        True, True,  # a fresh prompt's chunk
        False, False, False,  # decode rows, a speculative step's rows
        False, True,  # past 170.7 rows over a long context
        True]  # fmt: skip
    fresh = np.array([512])
    assert costs.absorbed(fresh, fresh) / costs.expanded(fresh, fresh) == pytest.approx(1.92,
                                                                                      abs=0.01)
    glm = FormCosts.of(GLM_4_7_FLASH)
    assert glm.expands([398, 399], [10**7 + 398, 10**7 + 399]).tolist() == [False, True]


def metadata(q_lens: list[int], seq_lens: list[int], block_size: int = 4) -> AttentionMetadata:
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tables = np.arange(len(q_lens) * 8, dtype=np.int32).reshape(len(q_lens), 8)
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(q_lens, seq_lens, strict=True)])
    owners = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = tables[owners, positions // block_size] * block_size + positions % block_size
    return AttentionMetadata(cu, np.array(seq_lens, np.int32), tables, slots.astype(np.int64),
                             block_size)


def test_a_plan_puts_each_forms_rows_back_in_packed_order():
    # A fresh chunk, a decode row, a chunk over a long cache, another fresh chunk.
    meta = metadata([6, 1, 3, 5], [6, 20, 30, 5])
    plan = form_plan(meta, FormCosts.of(DEEPSEEK_V3))
    assert [(r, (s.start, s.stop)) for r, s in plan.expanded] == [(0, (0, 6)), (3, (10, 15))]
    assert np.array(plan.absorbed_rows).tolist() == [6, 7, 8, 9]
    absorbed = plan.absorbed
    assert absorbed.cu_seqlens_q.tolist() == [0, 1, 4] and absorbed.seq_lens.tolist() == [20, 30]
    assert (absorbed.block_tables == meta.block_tables[[1, 2]]).all()
    assert absorbed.slot_mapping.tolist() == meta.slot_mapping[6:10].tolist()
    assert absorbed.positions.tolist() == meta.positions[6:10].tolist()
    rows = mx.arange(15)[:, None]
    parts = [rows[plan.absorbed_rows]] + [rows[s] for _, s in plan.expanded]
    assert np.array(plan.packed(parts)).ravel().tolist() == list(range(15))
    assert form_plan(meta, FormCosts.of(DEEPSEEK_V3)) is plan  # one a step


class FormCalls:
    """The model's ops, noting which requests each step attends expanded and how many rows
    it attends absorbed."""

    def __init__(self, ops) -> None:
        self._ops = ops
        self.expanded: set[int] = set()
        self.absorbed_rows: set[int] = set()

    def __getattr__(self, name: str):
        return getattr(self._ops, name)

    def gather_context(self, pool, meta, request, dtype):
        self.expanded.add(request)
        return self._ops.gather_context(pool, meta, request, dtype)

    def latent_attention(self, q, pool, rank, meta, scale):
        self.absorbed_rows.add(q.shape[0])
        return self._ops.latent_attention(q, pool, rank, meta, scale)

    def step_taken(self) -> tuple[list[int], list[int]]:
        taken = sorted(self.expanded), sorted(self.absorbed_rows)
        self.expanded, self.absorbed_rows = set(), set()
        return taken


PROMPTS = {"a": 40, "b": 24, "c": 12}  # lengths
# Rows per request and step, and what the tiny config's sums make of them (request index:
# expanded; rows of the rest: absorbed together).
STEPS = [
    ({"a": 10, "b": 1, "c": 12}, ([0, 2], [1])),  # fresh chunks around a single row
    ({"a": 4, "b": 5}, ([], [9])),  # short chunks over what is cached
    ({"a": 26, "b": 18}, ([0, 1], [])),  # long chunks over a short cache
]


def run_steps(runner, scheduler, prompts: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """Feed `prompts` as STEPS says; each prompt's logits of every position, and which form
    each step took (checked against STEPS)."""
    requests = {rid: Request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0))
                for rid, ids in prompts.items()}
    for request in requests.values():
        scheduler.add_request(request)
    logits: dict[str, list[np.ndarray]] = {rid: [] for rid in prompts}
    for rows, taken in STEPS:
        out = scheduler.schedule()
        out.scheduled = [s for s in out.scheduled if s.request_id in rows]
        for s in out.scheduled:
            s.token_ids, s.samples = s.token_ids[: rows[s.request_id]], False
        step = np.array(runner.forward_logits(out).astype(mx.float32))
        assert runner.model.model.layers[0].self_attn.ops.step_taken() == taken
        for s, part in zip(out.scheduled, np.split(step, np.cumsum(
                [len(s.token_ids) for s in out.scheduled])[:-1]), strict=True):
            logits[s.request_id].append(part)
            requests[s.request_id].num_computed_tokens += len(s.token_ids)
    return {rid: np.concatenate(parts) for rid, parts in logits.items()}


def runner_noting_forms(path, **kwargs):
    runner, scheduler = make_runner_and_scheduler(path, block_size=8, **kwargs)
    model = runner.model
    use_ops(model, FormCalls(model.model.layers[0].self_attn.ops))
    return runner, scheduler


def test_a_step_of_both_forms_matches_transformers(tiny_deepseek):
    model, path = tiny_deepseek
    prompts = {rid: random_ids(i, n) for i, (rid, n) in enumerate(PROMPTS.items())}
    got = run_steps(*runner_noting_forms(path), prompts)
    for rid, ids in prompts.items():
        np.testing.assert_allclose(got[rid], torch_logits(model, ids), atol=TOL, rtol=TOL)


def test_over_an_int8_pool_both_forms_read_the_same_latents(tiny_deepseek):
    from kernels_metal.kv_quant import KVQuant

    _, path = tiny_deepseek
    prompts = {rid: random_ids(i, n) for i, (rid, n) in enumerate(PROMPTS.items())}
    got = run_steps(*runner_noting_forms(path, kv_quant=KVQuant(8)), prompts)
    for rid, ids in prompts.items():
        runner, scheduler = make_runner_and_scheduler(path, block_size=8, kv_quant=KVQuant(8))
        for layer in runner.model.model.layers:  # expanded never cheaper: every row absorbed
            layer.self_attn.form_costs = FormCosts(per_item=1, absorbed_pair=0, expanded_pair=1)
        absorbed = run_logits(runner, scheduler, rid, ids, chunk=len(ids))
        # Latents a float rounding apart may take neighbouring int8 codes (4.6e-4 here, on
        # one prompt); int8 itself moves these logits by 5e-3 to 1e-2 from the float pool's.
        np.testing.assert_allclose(got[rid], absorbed, atol=1e-3, rtol=0)
