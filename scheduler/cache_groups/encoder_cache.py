"""The encoder cache group: the vision tower's outputs by image content hash, counted in
embedding rows (one per image placeholder token), in plain ints.

The runner keeps the features (metal_engine.vision.encoder_cache); this group decides what
sits there. An image is encoded in the step whose chunk first reaches its tokens, and stays
while a running request has more of its tokens to compute (a chunk may cut through it); after
that it is cached, least recently used out first, for the same picture in another request:

    prompt:   [ text ][ image a: 6 rows ][ text ][ image b: 9 rows ][ text ]
    step 1:   [------ chunk --------]                                 encode a (held)
    step 2:                          [------ chunk ------]            a freeable, encode b

Two budgets bound it (vLLM's encoder budget): the rows the cache holds (`num_rows`, from the
memory plan) and the rows the tower encodes in one step (`step_rows`). A chunk that reaches an
image the cache lacks and cannot take now ends before the image; one that starts inside it
waits (0 tokens). A cached image a chunk reads stays through the step: no encode evicts it,
and a chunk ends before one whose room the images it encodes first would take. An image
larger than a budget is encoded alone, over it, when nothing else
is held or encoded in the step. For a text model whose image tokens see each other
(`whole_images`), no chunk ends inside an image: one that would ends before it, one that
starts at or inside it takes it to its end.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from scheduler.cache_groups.group import CacheGroup
from scheduler.media import whole_image_chunk
from scheduler.output import EncoderPlan

if TYPE_CHECKING:
    from scheduler.media import ImageSpan
    from scheduler.output import SchedulerOutput
    from scheduler.request import Request


class EncoderCacheGroup(CacheGroup):
    kind = "encoder"

    def __init__(self, num_rows: int, step_rows: int, whole_images: bool = False) -> None:
        if num_rows < 1 or step_rows < 1:
            raise ValueError(f"an encoder cache group needs rows to hold and to encode, got "
                             f"{num_rows} and {step_rows}")
        self.num_rows, self.step_rows, self.whole_images = num_rows, step_rows, whole_images
        self._rows: OrderedDict[str, int] = OrderedDict()  # content hash -> rows, LRU first
        self._users: dict[str, set[str]] = {}  # content hash -> requests still reading it
        self._in_step: set[str] = set()  # read by the step being composed: kept through it
        self._step_left = step_rows
        self.plan = EncoderPlan()
        self.num_encoded = 0  # images scheduled for the tower
        self.num_hits = 0  # images a chunk found cached

    # -- each step -----------------------------------------------------------------------------

    def cut(self, request: Request, start: int, num_new: int) -> int:
        """The chunk's tokens up to the first image the cache lacks and cannot take in this
        step (0 if the chunk starts inside it), or up to a cached one it could keep only by
        leaving out an image before it, with whole images where the model needs them.
        Changes nothing."""
        if request.media is None:
            return num_new
        if self.whole_images:
            num_new = whole_image_chunk(request.media, start, num_new)
        step_left, free = self._step_left, self.num_rows - self._kept_rows()
        seen: set[str] = set()
        for image in request.media.overlapping(start, start + num_new):
            key = image.content_hash
            if key in seen or (key in self._rows and self._kept(key)):
                continue
            seen.add(key)
            if key in self._rows:  # cached: read by the chunk, no encode makes way for it
                if self._rows[key] > free and image.offset > start:
                    return image.offset - start  # the images before it take its room
                free -= self._rows[key]
                continue
            alone = step_left == self.step_rows and free == self.num_rows  # over a budget
            if image.length > min(step_left, free) and not alone:
                return max(image.offset - start, 0)
            step_left, free = step_left - image.length, free - image.length
        return num_new

    def scheduled(self, request: Request, num_new: int) -> None:
        """Plan the tower for the chunk's images the cache lacks (making room by evicting the
        least recently used that nothing reads), and hold those the request reads again in a
        later chunk."""
        if request.media is None:
            return
        start = request.num_computed_tokens
        end = start + num_new
        images = request.media.overlapping(start, end)
        missing = self._missing(request, start, num_new)
        self.num_hits += len({i.content_hash for i in images}) - len(missing)
        self._in_step.update(i.content_hash for i in images)  # first: no eviction takes them
        for image in missing:
            self._evict_for(image.length)
            self._rows[image.content_hash] = image.length
            self.plan.encode.append(image)
            self._step_left -= image.length
            self.num_encoded += 1
        for image in images:
            self._rows.move_to_end(image.content_hash)
            users = self._users.setdefault(image.content_hash, set())
            if image.end > end:
                users.add(request.request_id)
            else:
                users.discard(request.request_id)

    def release(self, request: Request) -> None:
        """The request reads none of its images any more (they stay cached)."""
        if request.media is None:
            return
        for image in request.media.images:
            self._users.get(image.content_hash, set()).discard(request.request_id)

    # -- the step's plan and the group's contents ----------------------------------------------

    def take_plan(self, out: SchedulerOutput) -> None:
        """Hand the step its encodes and evictions; the next step has a budget of its own."""
        out.encoder_plan, self.plan = self.plan, EncoderPlan()
        self._step_left, self._in_step = self.step_rows, set()

    def usage(self) -> tuple[int, int]:
        """(rows cached, rows in all)."""
        return sum(self._rows.values()), self.num_rows

    def _missing(self, request: Request, start: int, num_new: int) -> list[ImageSpan]:
        """The chunk's images the cache lacks, each picture once, in prompt order."""
        missing: dict[str, ImageSpan] = {}
        for image in request.media.overlapping(start, start + num_new):
            if image.content_hash not in self._rows:
                missing.setdefault(image.content_hash, image)
        return list(missing.values())

    def _kept(self, key: str) -> bool:
        """Whether an entry must stay: a running request reads it later, or this step does."""
        return bool(self._users.get(key)) or key in self._in_step

    def _kept_rows(self) -> int:
        return sum(rows for key, rows in self._rows.items() if self._kept(key))

    def _evict_for(self, rows: int) -> None:
        """Evict entries nothing keeps, least recently used first, until `rows` more fit (or
        none is left: an image over the budget is cached alone)."""
        used = sum(self._rows.values())
        for key in [k for k in self._rows if not self._kept(k)]:
            if used + rows <= self.num_rows:
                break
            used -= self._rows.pop(key)
            self._users.pop(key, None)
            self.plan.free.append(key)
