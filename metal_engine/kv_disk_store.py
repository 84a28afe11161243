"""Full KV blocks on disk, keyed by block hash, so a restarted server can reload them; and,
for hybrid models, recurrent-state checkpoints keyed the same way, in a namespace of their own.

    directory/<identity>/<hash[:2]>/<hash>.kvb      one file per block: header, then payload

    header (little-endian, HEADER.size bytes, every field checked on load):
        magic | format version | dtype code | three sizes from the layout
        | payload length | blake2b(block hash + payload)
    payload: K and V of every pool, as the caller packed them (payload_bytes long); for a
        checkpoint, each layer's conv state then recurrent state

The identity names the model, weights and layout, so a changed model never sees another's K/V.
A file that fails any check is deleted and reported as a miss: the cache is an optimization,
never a source of wrong tokens.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

from kernels_metal.kv_quant import kv_quant_of

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
MAGIC = b"MSKV"
HEADER = struct.Struct("<4sHHIIIQ16s")
CHECKSUM_SIZE = 16
BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
# A temp file this old is a crashed write, not another process's write in flight.
STALE_TEMP_SECONDS = 60.0

DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "int8": 4, "int4": 5}
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
STATE_DTYPES = tuple(DTYPE_SIZES)


@dataclass(frozen=True)
class BlockLayout:
    """What one block's payload holds; part of the cache identity and of every file header.
    `pools`: (kv_heads, head_dim) of each KV pool (see metal_engine.kv_cache)."""

    pools: tuple[tuple[int, int], ...]
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(
                f"KV dtype {self.dtype!r} is not supported; supported: {', '.join(DTYPE_CODES)}"
            )
        if not self.pools:
            raise ValueError("a block layout needs at least one pool")
        if self.block_size < 1 or min(min(shape) for shape in self.pools) < 1:
            raise ValueError(f"block size and pool shapes must be at least 1, got block size "
                             f"{self.block_size} and pools {self.pools}")

    @property
    def slot_features(self) -> int:
        """K (or V) values one token holds over every pool."""
        return sum(heads * dim for heads, dim in self.pools)

    @property
    def payload_bytes(self) -> int:
        """K and V of every pool: 2 * block_size * the bytes of a token's row per pool
        (its values, or a quantized pool's codes and scales)."""
        if self.dtype in DTYPE_SIZES:
            return 2 * self.block_size * self.slot_features * DTYPE_SIZES[self.dtype]
        quant = kv_quant_of(self.dtype)
        return 2 * self.block_size * sum(heads * quant.bytes_per_row(dim)
                                         for heads, dim in self.pools)

    @property
    def file_bytes(self) -> int:
        return HEADER.size + self.payload_bytes

    def header_sizes(self) -> tuple[int, int, int]:
        return len(self.pools), self.block_size, self.slot_features


@dataclass(frozen=True)
class StateLayout:
    """What one recurrent-state checkpoint's payload holds: per layer a conv state of
    `conv_values` values in `dtype`, then a float32 recurrent state of `recurrent_values`."""

    num_layers: int
    conv_values: int
    recurrent_values: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in STATE_DTYPES:
            raise ValueError(
                f"state dtype {self.dtype!r} is not supported; supported: {', '.join(STATE_DTYPES)}"
            )

    @property
    def payload_bytes(self) -> int:
        layer = self.conv_values * DTYPE_SIZES[self.dtype] + self.recurrent_values * 4
        return self.num_layers * layer

    @property
    def file_bytes(self) -> int:
        return HEADER.size + self.payload_bytes

    def header_sizes(self) -> tuple[int, int, int]:
        return self.num_layers, self.conv_values, self.recurrent_values


Layout = BlockLayout | StateLayout


def model_identity(model_dir: Path, layout: Layout, kind: str = "blocks") -> str:
    """Hex digest naming the cache namespace of this model, its weights and the block layout.

    Weights count by name, size and mtime (hashing GBs would slow startup): a reconverted model
    gets new mtimes and so a fresh namespace. A copy that keeps mtimes keeps its cache.
    """
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"metal-serve kv cache v{FORMAT_VERSION}\0".encode())
    h.update(repr(sorted(asdict(layout).items())).encode())
    if kind != "blocks":  # two groups' blocks may have one layout (Gemma's window and full)
        h.update(f"\0{kind}".encode())
    h.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        stat = path.stat()
        h.update(f"\0{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return h.hexdigest()


class KVDiskStore:
    """A size-bounded LRU of block files in one namespace directory.

    The in-memory index of hashes is built at startup by scanning the namespace; LRU order
    lives in file mtimes, so it survives restarts. Several processes may share a directory: each
    bounds what it knows of, a file another one removed is a miss, and a block another one
    added since is found by its file (a prefill server handing blocks to a decode server).
    """

    def __init__(self, directory: Path, identity: str, layout: Layout,
                 max_bytes: int) -> None:
        if max_bytes < layout.file_bytes:
            raise ValueError(
                f"KV disk cache size {max_bytes} bytes cannot hold one block "
                f"({layout.file_bytes} bytes); give it at least that, or turn it off"
            )
        self.layout, self.max_bytes = layout, max_bytes
        self.root = Path(directory) / identity
        _prepare_root(Path(directory), self.root)
        self._index: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._last_stamp_ns = 0
        self._warned = False
        self._scan()
        self._make_room(0)

    def __contains__(self, block_hash: bytes) -> bool:
        if block_hash in self._index:
            return True
        try:  # one stat, for a hash that misses the index
            size = self._path(block_hash).stat().st_size
        except OSError:
            return False
        if size != self.layout.file_bytes:
            return False  # being replaced, or another layout's: not a block to read
        self._index[block_hash] = None  # room is made at this process's next save
        return True

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.layout.file_bytes

    def save(self, block_hash: bytes, payload: bytes | memoryview) -> None:
        """Write the block unless present, evicting LRU files first. I/O errors only log."""
        if block_hash in self._index:
            return
        data = memoryview(payload).cast("B")
        if data.nbytes != self.layout.payload_bytes:
            raise ValueError(
                f"payload is {data.nbytes} bytes; this layout's blocks are "
                f"{self.layout.payload_bytes}"
            )
        self._make_room(self.layout.file_bytes)
        try:
            self._write(block_hash, data)
        except OSError as err:
            self._warn_once("could not write a KV block to %s (%s); continuing without it",
                            self.root, err)
            return
        self._index[block_hash] = None

    def load(self, block_hash: bytes) -> bytes | None:
        """The block's payload, or None. A file that fails a check is deleted; a hit is MRU."""
        if block_hash not in self._index:
            return None
        path = self._path(block_hash)
        try:
            payload, problem = self._read_checked(path, block_hash)
        except OSError as err:
            self._forget(block_hash)
            if not isinstance(err, FileNotFoundError):  # not found: another process evicted it
                self._warn_once("could not read KV cache file %s (%s)", path, err)
            return None
        if payload is None:
            log.warning("dropping KV cache file %s: %s", path, problem)
            self._forget(block_hash)
            self._remove(path)
            return None
        self._touch(block_hash, path)
        return payload

    def _path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.root / name[:2] / (name + BLOCK_SUFFIX)

    def _header(self, block_hash: bytes, payload: memoryview) -> bytes:
        layout = self.layout
        return HEADER.pack(
            MAGIC, FORMAT_VERSION, DTYPE_CODES[layout.dtype], *layout.header_sizes(),
            layout.payload_bytes, _checksum(block_hash, payload),
        )

    def _write(self, block_hash: bytes, payload: memoryview) -> None:
        """Write to a temp file beside the target, then rename: readers see all or nothing."""
        path = self._path(block_hash)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=TEMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self._header(block_hash, payload))
                f.write(payload)
            os.utime(tmp, ns=(self._next_stamp(),) * 2)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _read_checked(self, path: Path, block_hash: bytes) -> tuple[bytes | None, str]:
        """(payload, "") if the file is whole and matches this store, else (None, why)."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != self.layout.file_bytes:
                return None, f"{size} bytes, expected {self.layout.file_bytes}"
            header = f.read(HEADER.size)
            payload = f.read(self.layout.payload_bytes)
        expected = self._header(block_hash, memoryview(payload))
        if header[:4] != MAGIC:
            return None, "not a KV block file"
        if header[:-CHECKSUM_SIZE] != expected[:-CHECKSUM_SIZE]:
            return None, "written by another format version or block layout"
        if header[-CHECKSUM_SIZE:] != expected[-CHECKSUM_SIZE:]:
            return None, "checksum mismatch"
        return payload, ""

    def _touch(self, block_hash: bytes, path: Path) -> None:
        """Make the block most recently used, in memory and in the file's mtime."""
        self._index.move_to_end(block_hash)
        try:
            os.utime(path, ns=(self._next_stamp(),) * 2)
        except FileNotFoundError:
            self._forget(block_hash)  # evicted by another process after the read
        except OSError as err:
            self._warn_once("could not refresh KV cache file %s (%s)", path, err)

    def _make_room(self, nbytes: int) -> None:
        while self._index and self.used_bytes + nbytes > self.max_bytes:
            oldest = next(iter(self._index))
            self._forget(oldest)
            self._remove(self._path(oldest))

    def _forget(self, block_hash: bytes) -> None:
        self._index.pop(block_hash, None)

    def _remove(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            self._warn_once("could not delete KV cache file %s (%s)", path, err)

    def _next_stamp(self) -> int:
        # Strictly increasing: coarse filesystem clocks would otherwise tie, and lose LRU order.
        self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
        return self._last_stamp_ns

    def _warn_once(self, message: str, *args: object) -> None:
        if not self._warned:
            self._warned = True
            log.warning(message, *args)

    def _scan(self) -> None:
        """Index the namespace's block files, oldest mtime first; drop torn and stale files."""
        found: list[tuple[int, bytes]] = []
        for shard in _subdirs(self.root):
            for entry in _entries(shard):
                found += self._scan_entry(shard, entry)
        for stamp, block_hash in sorted(found):
            self._index[block_hash] = None
            self._last_stamp_ns = max(self._last_stamp_ns, stamp)

    def _scan_entry(self, shard: Path, entry: os.DirEntry) -> list[tuple[int, bytes]]:
        """[(mtime ns, hash)] for a usable block file, [] for anything else; removes debris."""
        try:
            stat = entry.stat()
        except FileNotFoundError:
            return []
        path = shard / entry.name
        if entry.name.endswith(TEMP_SUFFIX):
            if time.time() - stat.st_mtime > STALE_TEMP_SECONDS:
                self._remove(path)
            return []
        block_hash = _parse_block_name(entry.name)
        if block_hash is None or block_hash.hex()[:2] != shard.name:
            return []  # not ours: leave it alone
        if stat.st_size != self.layout.file_bytes:
            self._remove(path)  # torn, or another layout's file
            return []
        return [(stat.st_mtime_ns, block_hash)]


def _prepare_root(directory: Path, root: Path) -> None:
    """Create the namespace dir and prove it writable, or raise a ValueError saying how to fix."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=".probe.", suffix=TEMP_SUFFIX)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(
            f"--kv-cache-dir {directory} is not a writable directory ({err}); "
            "point it at a directory this user can create and write, or leave it unset"
        ) from err


def _checksum(block_hash: bytes, payload: memoryview) -> bytes:
    # The hash is mixed in so a block file under another block's name fails too.
    h = hashlib.blake2b(block_hash, digest_size=CHECKSUM_SIZE)
    h.update(payload)
    return h.digest()


def _parse_block_name(name: str) -> bytes | None:
    """The block hash a file name spells (as `_path` writes it), or None if it is not one."""
    stem = name.removesuffix(BLOCK_SUFFIX)
    if stem == name or not stem:
        return None
    try:
        block_hash = bytes.fromhex(stem)
    except ValueError:
        return None
    return block_hash if block_hash.hex() == stem else None


def _subdirs(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if len(p.name) == 2 and p.is_dir()]


def _entries(shard: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(shard) as it:
            return [e for e in it if e.is_file()]
    except FileNotFoundError:
        return []
