"""The step contract: what the scheduler hands the runner each step and what a step did.

    SchedulerOutput    the step: each scheduled request's share (`ScheduledRequest`: its
                       tokens, its ids in each cache group, the `TokenHistory` of one
                       admitted that samples from its history), the requests finished since
                       the last step, and the step's plans: moves to and from the KV tier
                       (`KVTransferPlan`), copies between recurrent-state slots
                       (`StatePlan`) and the vision encoder's work (`EncoderPlan`)
    RequestUpdate      what one step did to one request

Plain data, imported by both sides; it imports no scheduler machinery. A prompt's images
(`PromptMedia`, scheduler.media) reach the runner through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.media import ImageSpan, PromptMedia
from scheduler.pooling_params import PoolingParams
from scheduler.prefix_hash import BlockHash
from scheduler.request import FinishReason, Request
from scheduler.sampling_params import SamplingParams
from scheduler.spec_decode.stats import DraftSource

# A cache group's name (scheduler.cache_groups), under which its data moves to and from the
# tier and its ids reach the runner: "blocks" (the KV blocks of every token; "latent" for
# multi-head latent attention, whose blocks hold one latent row a token), "window" (a
# sliding-window group's blocks), "states" (recurrent-state slots), "encoder" (the vision
# encoder's outputs, by image; no ids).
CacheKind = str


@dataclass
class TierMoves:
    """One kind's moves in a step: (id in memory, hash) saved and loaded, hashes read."""

    saves: list[tuple[int, BlockHash]] = field(default_factory=list)
    loads: list[tuple[int, BlockHash]] = field(default_factory=list)
    reads: list[BlockHash] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.saves or self.loads or self.reads)


@dataclass
class KVTransferPlan:
    """One step's moves between memory and the tier, per cache kind. Plain data."""

    moves: dict[CacheKind, TierMoves] = field(default_factory=dict)

    def of(self, kind: CacheKind) -> TierMoves:
        moves = self.moves.get(kind)
        if moves is None:
            moves = self.moves[kind] = TierMoves()
        return moves

    @property
    def is_empty(self) -> bool:
        return all(moves.is_empty for moves in self.moves.values())


@dataclass
class StatePlan:
    """One step's copies between state slots, for the runner. Plain data.

    `restores` run before the step's forward (checkpoint -> a request's live slot),
    `saves` after it (live slot -> checkpoint), each as (source slot, target slot).
    """

    restores: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.restores or self.saves)


@dataclass
class EncoderPlan:
    """One step's work for the vision encoder's cache (scheduler.cache_groups.encoder_cache),
    for the runner: before the forward, drop the `free` content hashes' features, then
    encode the `encode` images (the step's chunks read them). Plain data."""

    encode: list[ImageSpan] = field(default_factory=list)
    free: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TokenHistory:
    """What a request that samples from its history (penalties, min_tokens, a grammar) has
    seen when it is admitted: the runner keeps it from there, adding what it samples."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    The step feeds `token_ids` at positions `start_position ..` and writes their K/V into
    the slots of `block_ids`; it samples the next token iff `samples`, or, for a pooling
    request (`pooling` set in each of its shares), pools its prompt iff `pools`. The last
    `len(draft_token_ids)` of `token_ids` are drafts: the step verifies them and samples
    after the ones it accepts.
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    block_table_epoch: int  # changes when the request's blocks were replaced, not appended to
    samples: bool
    params: SamplingParams
    num_output_tokens: int
    # Its ids in the cache groups beside its KV blocks, by kind: a sliding-window group's
    # block table ("window", null entries out of the window), its recurrent-state slot
    # ("states", one id).
    group_ids: dict[CacheKind, list[int]] = field(default_factory=dict)
    draft_token_ids: list[int] = field(default_factory=list)
    draft_source: DraftSource | None = None  # what drafted them, for the counters
    token_epoch: int = 0  # the request's when scheduled (see Request.token_epoch)
    # Set in the step that admits a request whose sampling reads its history (not basic).
    history: TokenHistory | None = None
    # Set in the step that admits a request whose prompt has images: the runner keeps it.
    media: PromptMedia | None = None
    pooling: PoolingParams | None = None
    pools: bool = False
    lora_name: str | None = None  # the LoRA adapter its rows are computed with (None: base)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    # Moves between the pool and the KV tier past it, for the connector's runner side.
    kv_plan: KVTransferPlan = field(default_factory=KVTransferPlan)
    # Copies between recurrent-state slots around the step (hybrid models).
    state_plan: StatePlan = field(default_factory=StatePlan)
    # The vision encoder's work in the step and what its cache drops (models that read images).
    encoder_plan: EncoderPlan = field(default_factory=EncoderPlan)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RequestUpdate:
    """What one step did to one request: tokens appended and, at the end, why it stopped
    (scheduler.stopping): with the stop string that ended it, or what failed ("error")."""

    request: Request
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_output_tokens: int  # the request's outputs up to and including these
    num_draft_tokens: int = 0  # drafts the step verified (len(new_token_ids) - 1 accepted)
    stop_string: str | None = None
    error: str | None = None
