"""Full KV blocks on disk, keyed by block hash, so a restarted server can reload them; and,
for hybrid models, recurrent-state checkpoints keyed the same way, in a namespace of their own.

    DIR/<identity>/<name[:2]>/<name>.kvb    one file per block: header, then payload
                                            name: the block hash keyed by DIR's secret

    header (little-endian, HEADER.size bytes, every field checked on load):
        magic | format version | dtype code | three sizes from the layout
        | payload length | MAC (keyed blake2b of the fields before it, block hash, payload)
    payload: K and V of every pool, as the caller packed them (payload_bytes long); for a
        checkpoint, each layer's conv state then recurrent state

The identity names the model, weights and layout, so a changed model never sees another's K/V.
A file that fails any check is deleted and reported as a miss: the cache is an optimization,
never a source of wrong tokens. Names and MACs are keyed by the directory's secret
(kv_disk.keys), so a file written without it fails too; the bound and scan are kv_disk.directory's.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import struct
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kernels_metal.kv_quant import kv_quant_of
from metal_engine.kv_disk.directory import TEMP_SUFFIX, FileKey, KVDiskDir
from metal_engine.kv_disk.keys import MAC_SIZE, NamespaceKeys

log = logging.getLogger(__name__)

# 3: names and MACs keyed by the directory's secret (2's files are a stale namespace).
FORMAT_VERSION = 3
MAGIC = b"MSKV"
HEADER = struct.Struct(f"<4sHHIIIQ{MAC_SIZE}s")

DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "int8": 4, "int4": 5}
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
STATE_DTYPES = tuple(DTYPE_SIZES)


@dataclass(frozen=True)
class BlockLayout:
    """What one block's payload holds; part of the cache identity and of every file header.
    `pools`: (kv_heads, head_dim) of each KV pool (see metal_engine.cache.kv_cache)."""

    pools: tuple[tuple[int, int], ...]
    block_size: int
    dtype: str
    values: bool = True  # False: the pools hold keys only (MLA's latent rows)

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
        """K and V (or K only) of every pool: block_size * the bytes of a token's row per
        pool (its values, or a quantized pool's codes and scales), twice with values."""
        parts = 2 if self.values else 1
        if self.dtype in DTYPE_SIZES:
            return parts * self.block_size * self.slot_features * DTYPE_SIZES[self.dtype]
        quant = kv_quant_of(self.dtype)
        return parts * self.block_size * sum(heads * quant.bytes_per_row(dim)
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


def model_identity(model_dir: Path, layout: Layout, kind: str | None = None) -> str:
    """Hex digest naming the cache namespace of this model, its weights and the block layout,
    and of `kind`, a cache group beside the anchor (None: the anchor's blocks, "blocks" or
    MLA's "latent": their layouts tell them apart, so the namespace stays as it always was).

    Weights count by name, size and mtime (hashing GBs would slow startup): a reconverted model
    gets new mtimes and so a fresh namespace. A copy that keeps mtimes keeps its cache.
    """
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"metal-serve kv cache v{FORMAT_VERSION}\0".encode())
    h.update(repr(sorted(asdict(layout).items())).encode())
    if kind is not None:  # two groups' blocks may have one layout (Gemma's window and full)
        h.update(f"\0{kind}".encode())
    h.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        st = path.stat()
        h.update(f"\0{path.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


class KVDiskStore:
    """One namespace of a cache directory: the blocks (or checkpoints) of one model identity
    and layout, saved and loaded by hash. The directory (`disk`) holds the index and the
    bound, shared by every store of this process; a hash that misses it is looked for as a
    file, so a block another process added since is found (a prefill server's, for a decode
    server)."""

    def __init__(self, disk: KVDiskDir, identity: str, layout: Layout) -> None:
        if disk.max_bytes < layout.file_bytes:
            raise ValueError(
                f"KV disk cache size {disk.max_bytes} bytes cannot hold one block "
                f"({layout.file_bytes} bytes); give it at least that, or turn it off"
            )
        self.disk, self.identity, self.layout = disk, identity, layout
        self.root = disk.namespace(identity)
        self._keys = NamespaceKeys(disk.secret, identity)
        disk.remove_other_sizes(identity, layout.file_bytes)

    def __contains__(self, block_hash: bytes) -> bool:
        key = self._key(block_hash)
        if key in self.disk:
            return True
        try:  # one lstat, for a hash that misses the index; a symlink is not a block
            st = os.lstat(self.disk.path(key))
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != self.layout.file_bytes:
            return False  # being replaced, or not a block to read
        self.disk.add(key, st.st_size)
        return True

    @property
    def num_blocks(self) -> int:
        return self.disk.usage(self.identity)[0]

    @property
    def used_bytes(self) -> int:
        return self.disk.usage(self.identity)[1]

    def save(self, block_hash: bytes, payload: bytes | memoryview) -> None:
        """Write the block unless present, evicting LRU files first. I/O errors only log."""
        key = self._key(block_hash)
        if key in self.disk:
            return
        data = memoryview(payload).cast("B")
        if data.nbytes != self.layout.payload_bytes:
            raise ValueError(
                f"payload is {data.nbytes} bytes; this layout's blocks are "
                f"{self.layout.payload_bytes}"
            )
        self.disk.make_room(self.layout.file_bytes)
        try:
            self._write(self.disk.path(key), block_hash, data)
        except OSError as err:
            self.disk.warn_once("could not write a KV block to %s (%s); continuing without it",
                                self.root, err)
            return
        self.disk.add(key, self.layout.file_bytes)

    def load(self, block_hash: bytes) -> bytes | None:
        """The block's payload, or None. A file that fails a check is deleted; a hit is MRU."""
        key = self._key(block_hash)
        if key not in self.disk:
            return None
        path = self.disk.path(key)
        try:
            payload, problem = self._read_checked(path, block_hash)
        except OSError as err:
            self.disk.forget(key)
            if not isinstance(err, FileNotFoundError):  # not found: another process evicted it
                self.disk.warn_once("could not read KV cache file %s (%s)", path, err)
            return None
        if payload is None:
            log.warning("dropping KV cache file %s: %s", path, problem)
            self.disk.remove(key)
            return None
        self.disk.touch(key)
        return payload

    def _key(self, block_hash: bytes) -> FileKey:
        return self.identity, self._keys.file_name(block_hash)

    def _header(self, block_hash: bytes, payload: memoryview) -> bytes:
        layout = self.layout
        fields = HEADER.pack(
            MAGIC, FORMAT_VERSION, DTYPE_CODES[layout.dtype], *layout.header_sizes(),
            layout.payload_bytes, bytes(MAC_SIZE),
        )[:-MAC_SIZE]
        return fields + self._keys.mac(fields, block_hash, payload)

    def _write(self, path: Path, block_hash: bytes, payload: memoryview) -> None:
        """Write to a temp file (0600) beside the target, then rename: readers see all or
        nothing."""
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=TEMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self._header(block_hash, payload))
                f.write(payload)
            os.utime(tmp, ns=(self.disk.next_stamp(),) * 2)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _read_checked(self, path: Path, block_hash: bytes) -> tuple[bytes | None, str]:
        """(payload, "") if the file is whole and this directory's, else (None, why)."""
        # No symlink is followed; O_NONBLOCK: a FIFO put in a file's place must not hang us.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size != self.layout.file_bytes:
                return None, f"{st.st_size} bytes, expected {self.layout.file_bytes}"
            header = f.read(HEADER.size)
            payload = f.read(self.layout.payload_bytes)
        expected = self._header(block_hash, memoryview(payload))
        if header[:4] != MAGIC:
            return None, "not a KV block file"
        if header[:-MAC_SIZE] != expected[:-MAC_SIZE]:
            return None, "written by another format version or block layout"
        if not hmac.compare_digest(header[-MAC_SIZE:], expected[-MAC_SIZE:]):
            return None, "MAC mismatch: corrupted, or not written with this directory's secret"
        return payload, ""
