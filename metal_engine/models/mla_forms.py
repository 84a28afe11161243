"""Which form each request's rows of a step attend in, for multi-head latent attention
(models/mla.py): absorbed, over the latent pool as it is, or expanded, over the request's
context up-projected to per-head keys and values; the cheaper in multiply-adds.

A layer, per head, for a request's n rows over its L = c + n keys (c cached before the
step), with P = n c + n (n + 1) / 2 (row, key) pairs under the causal mask:

    absorbed   n r (nope + v)     each row's q_nope in through W_uk, its output out through W_uv
             + P (2 r + rope)     scores over latent and rope key, values over the latent
    expanded   L r (nope + v)     each key's latent up through kv_b_proj (nope key and value)
             + P (nope + rope + v)

(r = kv_lora_rank.) The up-projection of the n new keys costs what absorbing the n rows
costs; what the expanded form adds is the c cached keys', and what it saves is
2 r - nope - v per pair. So expanded is cheaper when

    c r (nope + v)  <  P (2 r - nope - v)

- always for a fresh prompt's chunk (c = 0) of two rows or more;
- over a long cached context (c >> n) once n > r (nope + v) / (2 r - nope - v): 170.7 rows
  at DeepSeek V3's shapes (r 512, nope 128, rope 64, v 128), 398.2 at GLM-4.7-Flash's (512,
  192, 64, 256), 153.6 at Mistral Small 4's (256, 64, 64, 128);
- never for a decode row (n = 1, c >= 1), nor a speculative step's few rows over a context.

At DeepSeek's shapes a fresh 512-row chunk costs 1.9x in the absorbed form what it costs
expanded. Single rows stay absorbed whatever the sums say: they are decode rows. The sums
count multiply-adds only; what the two forms took on the CPU backend is in docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kernels_metal.metadata import AttentionMetadata
from metal_engine.models.mla_config import MlaConfig


@dataclass(frozen=True)
class FormCosts:
    """Multiply-adds a layer spends per head in each form (see the module docstring)."""

    per_item: int  # one row absorbed in and out, or one key up-projected: r (nope + v)
    absorbed_pair: int  # one (row, key) pair absorbed: 2 r + rope
    expanded_pair: int  # expanded: nope + rope + v

    @classmethod
    def of(cls, mla: MlaConfig) -> FormCosts:
        rank, nope, rope, v = (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                               mla.v_head_dim)
        return cls(rank * (nope + v), 2 * rank + rope, nope + rope + v)

    def absorbed(self, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
        return rows * self.per_item + _pairs(rows, keys) * self.absorbed_pair

    def expanded(self, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
        return keys * self.per_item + _pairs(rows, keys) * self.expanded_pair

    def expands(self, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Per request (its rows and keys this step): whether it attends expanded."""
        rows, keys = np.asarray(rows, np.int64), np.asarray(keys, np.int64)
        return (rows > 1) & (self.expanded(rows, keys) < self.absorbed(rows, keys))


def _pairs(rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """(row, key) pairs the causal mask leaves to `rows` new rows over `keys` keys."""
    return rows * (keys - rows) + rows * (rows + 1) // 2


@dataclass(frozen=True)
class FormPlan:
    """A step's rows by form, made once a step and shared by its MLA layers.

    The layer's outputs come as the absorbed rows' (in packed order), then each expanded
    request's; `packed` puts them back in the step's order.
    """

    absorbed: AttentionMetadata | None  # the absorbed requests alone; None: there are none
    absorbed_rows: mx.array | None  # their packed rows; None: every row of the step
    expanded: tuple[tuple[int, slice], ...]  # (request, its packed rows), attended expanded
    row_order: mx.array | None  # output row -> packed row; None: already in order

    def packed(self, parts: list[mx.array]) -> mx.array:
        out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        return out if self.row_order is None else out[self.row_order]


def form_plan(meta: AttentionMetadata, costs: FormCosts) -> FormPlan:
    """The step's plan for layers of these costs, made by its first layer."""
    key = ("mla-forms", costs)
    if key not in meta.backend_plans:
        meta.backend_plans[key] = _build(meta, costs)
    return meta.backend_plans[key]


def _build(meta: AttentionMetadata, costs: FormCosts) -> FormPlan:
    cu = meta.cu_seqlens_q
    expands = costs.expands(np.diff(cu), meta.seq_lens)
    if not expands.any():
        return FormPlan(meta, None, (), None)
    expanded = tuple((int(r), slice(int(cu[r]), int(cu[r + 1])))
                     for r in np.flatnonzero(expands))
    kept = np.flatnonzero(~expands)
    rows = meta.rows_of(kept)
    order = np.concatenate([rows] + [np.arange(s.start, s.stop) for _, s in expanded])
    row_order = None
    if (order != np.arange(len(order))).any():
        row_order = np.empty_like(order)
        row_order[order] = np.arange(len(order))
        row_order = mx.array(row_order)
    if not len(kept):
        return FormPlan(None, None, expanded, row_order)
    return FormPlan(meta.of_requests(kept), mx.array(rows), expanded, row_order)
