"""One generation request as the scheduler tracks it: token ids and counters, no tensors."""

from __future__ import annotations

import enum
import itertools
from typing import Literal

from scheduler.media import PromptMedia
from scheduler.pooling_params import PoolingParams
from scheduler.sampling_params import SamplingParams

# "error": the request failed on its own (its grammar broke while generating); the others ran on.
FinishReason = Literal["stop", "length", "abort", "error"]

_epochs = itertools.count(1)

# Stands for an output token that a step still in flight is sampling (async scheduling).
PENDING_TOKEN = -1
# Stands for a draft that the step's drafter on the device (draft model, MTP head) proposes.
DRAFT_TOKEN = -2


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Request:
    """Token ids of prompt + output, and how many of them have K/V in the cache.

    `num_computed_tokens` counts tokens whose K/V are written; the next step feeds
    `all_token_ids[num_computed_tokens:]` (or a chunk of it). A request samples in a step
    exactly when that step brings it to `num_tokens`; a pooling request (`pooling` set) pools
    its prompt's hidden states in that step instead, and ends with it.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_index: int = 0,
        priority: int = 0,
        cache_salt: str | None = None,
        media: PromptMedia | None = None,
        pooling: PoolingParams | None = None,
        lora_name: str | None = None,
        lora_key: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.arrival_index = arrival_index
        self.priority = priority
        self.cache_salt = cache_salt  # prompts share cached blocks only under the same salt
        self.media = media  # its prompt's images, if any
        self.pooling = pooling
        self.lora_name = lora_name  # the LoRA adapter it is served with (None: the base)
        self.lora_key = lora_key  # that adapter's weights' fingerprint, which its blocks take
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        # Its KV blocks, a block per block of tokens (the anchor cache group's table; the
        # other groups keep theirs, see scheduler.cache_groups).
        self.block_ids: list[int] = []
        self.block_table_epoch = 0  # new whenever block_ids starts over (each admission)
        # Prefix caching: hashes of full blocks of `all_token_ids` (content, salt and adapter
        # only, so they stay valid across preemption); how many leading `block_ids` are
        # registered in the pool; prompt tokens found cached at admission.
        self.block_hashes: list[bytes] = []
        self.num_hashed_blocks = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0  # times the scheduler took its blocks back
        # Outputs a step in flight has yet to settle, always the last ones: tokens it is
        # sampling (PENDING_TOKEN) and drafts it verifies (taken as accepted until it says
        # otherwise). `token_epoch` changes whenever such drafts are dropped: a step scheduled
        # before then fed tokens that are no longer this request's, and its share is ignored.
        self.num_unknown_outputs = 0
        self.token_epoch = 0
        self.num_draft_tokens = 0  # drafted and verified so far
        self.num_accepted_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def has_pending_output(self) -> bool:
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PENDING_TOKEN

    def start_block_table(self, block_ids: list[int]) -> None:
        """Replace the block table, under an epoch no other table in this process has had."""
        self.block_ids = block_ids
        self.block_table_epoch = next(_epochs)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_pending(self, draft_token_ids: list[int] = ()) -> None:
        """A step was launched that samples this request's next token, after verifying
        `draft_token_ids`: they become outputs, taken as accepted, then a pending token."""
        for token_id in (*draft_token_ids, PENDING_TOKEN):
            self.append_output(token_id)
        self.num_unknown_outputs += len(draft_token_ids) + 1

    def resolve_output(self, index: int, token_id: int) -> None:
        """Replace the pending output token at `index` by the sampled one."""
        assert self.output_token_ids[index] == PENDING_TOKEN, "output already resolved"
        self.output_token_ids[index] = token_id
        self.all_token_ids[self.num_prompt_tokens + index] = token_id
        self.num_unknown_outputs -= 1

    def drop_pending_outputs(self) -> None:
        """Forget trailing outputs still being sampled or verified: the request ends before
        them."""
        self.truncate_outputs(self.num_output_tokens - self.num_unknown_outputs)

    @property
    def num_known_tokens(self) -> int:
        """Prompt and outputs up to the first one a step in flight has yet to settle."""
        return self.num_tokens - self.num_unknown_outputs

    def truncate_outputs(self, num_outputs: int) -> None:
        """Keep the first `num_outputs` outputs (the rest were rejected drafts or came after
        the request's end)."""
        before = self.num_output_tokens
        del self.output_token_ids[num_outputs:]
        del self.all_token_ids[self.num_prompt_tokens + num_outputs :]
        self.num_unknown_outputs = max(0, self.num_unknown_outputs - (before - num_outputs))

    def verify_outputs(self, index: int, token_ids: list[int], num_drafts: int) -> bool:
        """A step verified the `num_drafts` drafts taken as outputs `index ..` and emitted
        `token_ids` (the accepted drafts, then its own token) there. Return whether drafts
        were rejected: the outputs after them are dropped and the epoch moves on."""
        num_accepted = len(token_ids) - 1
        end = index + num_accepted
        for offset, token_id in enumerate(token_ids[:-1]):  # the drafts, known only now if a
            self.output_token_ids[index + offset] = token_id  # draft model proposed them
            self.all_token_ids[self.num_prompt_tokens + index + offset] = token_id
        rejected = num_accepted < num_drafts
        if rejected:
            self.truncate_outputs(end)
            self.num_unknown_outputs = 0  # the accepted drafts are settled
            self.append_output(token_ids[-1])
            self.token_epoch += 1
        else:
            self.num_unknown_outputs -= num_drafts
            self.resolve_output(end, token_ids[-1])
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        return rejected

    def reached_length(self, max_model_len: int) -> bool:
        """Whether the outputs so far (pending ones too) leave no room for another token."""
        return self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len
