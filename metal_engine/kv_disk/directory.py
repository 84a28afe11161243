"""A `--kv-cache-dir` as a whole: its secret, and one LRU of every file in every namespace
under one size bound.

    DIR/secret                                  the key of names and MACs (kv_disk.keys)
    DIR/<namespace>/<name[:2]>/<name>.kvb       a block file (kv_disk.store); name: keyed hash

A namespace holds one model identity's blocks of one layout. The index of files, their sizes
and their recency lives only here, so the bound covers namespaces no running model opens (an
older model's, an older format's): those go when they are least recently used.

The scan follows no symlink and skips (and logs) what it cannot read: another user who can
write the directory must not make it read or delete files elsewhere, or stop a start.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

from metal_engine.kv_disk.keys import load_secret

log = logging.getLogger(__name__)

BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
# A temp file this old is a crashed write, not another process's write in flight.
STALE_TEMP_SECONDS = 60.0

FileKey = tuple[str, str]  # (namespace, file name stem)


class KVDiskDir:
    """The files of a cache directory, least recently used first, at most `max_bytes` in all.

    Several processes may share a directory: each bounds what it knows of (its scan, what it
    wrote, what a store found by its file since); a file another one removed is forgotten when
    found missing. Stores add, touch and remove their files through it.
    """

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = Path(directory), max_bytes
        self.secret = _prepare_root(self.root)
        self.used_bytes = 0
        self._lru: OrderedDict[FileKey, int] = OrderedDict()  # file -> size
        self._last_stamp_ns = 0
        self._warned = False
        self._scan()
        self.make_room(0)

    def namespace(self, identity: str) -> Path:
        """The namespace's directory, created private to this user if absent."""
        path = self.root / identity
        try:
            path.mkdir(mode=0o700, exist_ok=True)
        except OSError as err:
            raise ValueError(
                f"--kv-cache-dir {self.root} cannot hold the cache's folder {path} ({err}); "
                "remove what is in its way, or point --kv-cache-dir elsewhere"
            ) from err
        return path

    def path(self, key: FileKey) -> Path:
        namespace, name = key
        return self.root / namespace / name[:2] / (name + BLOCK_SUFFIX)

    def __contains__(self, key: FileKey) -> bool:
        return key in self._lru

    def usage(self, namespace: str) -> tuple[int, int]:
        """(files, bytes) the index holds of one namespace."""
        sizes = [size for (ns, _), size in self._lru.items() if ns == namespace]
        return len(sizes), sum(sizes)

    def add(self, key: FileKey, size: int) -> None:
        """Index a file as most recently used (one this process wrote or just found). Room is
        made at the next `make_room`."""
        self.forget(key)
        self._lru[key] = size
        self.used_bytes += size

    def touch(self, key: FileKey) -> None:
        """Make a file most recently used, in the index and in its mtime (the order a restart
        scans back)."""
        self._lru.move_to_end(key)
        path = self.path(key)
        try:
            os.utime(path, ns=(self.next_stamp(),) * 2, follow_symlinks=False)
        except FileNotFoundError:
            self.forget(key)  # evicted by another process after the read
        except OSError as err:
            self.warn_once("could not refresh KV cache file %s (%s)", path, err)

    def forget(self, key: FileKey) -> None:
        self.used_bytes -= self._lru.pop(key, 0)

    def remove(self, key: FileKey) -> None:
        self.forget(key)
        self._unlink(self.path(key))

    def remove_other_sizes(self, namespace: str, size: int) -> None:
        """Remove the namespace's files that are not `size` bytes (torn, or another layout's)."""
        for key in [k for k, s in self._lru.items() if k[0] == namespace and s != size]:
            self.remove(key)

    def make_room(self, nbytes: int) -> None:
        """Evict least recently used files, of any namespace, until `nbytes` more fit."""
        while self._lru and self.used_bytes + nbytes > self.max_bytes:
            self.remove(next(iter(self._lru)))

    def next_stamp(self) -> int:
        # Strictly increasing: coarse filesystem clocks would otherwise tie, and lose LRU order.
        self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
        return self._last_stamp_ns

    def warn_once(self, message: str, *args: object) -> None:
        if not self._warned:
            self._warned = True
            log.warning(message, *args)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            self.warn_once("could not delete KV cache file %s (%s)", path, err)

    def _scan(self) -> None:
        """Index every namespace's block files, oldest mtime first; remove crashed writes."""
        found: list[tuple[int, FileKey, int]] = []
        for namespace in _subdirs(self.root):
            for shard in _subdirs(namespace):
                if len(shard.name) == 2:
                    for entry in _files(shard):
                        found += self._scan_entry(namespace.name, shard, entry)
        for stamp, key, size in sorted(found):
            self.add(key, size)
            self._last_stamp_ns = max(self._last_stamp_ns, stamp)

    def _scan_entry(
        self, namespace: str, shard: Path, entry: os.DirEntry
    ) -> list[tuple[int, FileKey, int]]:
        """[(mtime ns, key, size)] for a block file, [] for anything else."""
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            return []  # gone, or not ours to look at
        if entry.name.endswith(TEMP_SUFFIX):
            if time.time() - st.st_mtime > STALE_TEMP_SECONDS:
                self._unlink(shard / entry.name)
            return []
        name = _parse_block_name(entry.name)
        if name is None or name[:2] != shard.name:
            return []  # not ours: leave it alone
        return [(st.st_mtime_ns, (namespace, name), st.st_size)]


def _prepare_root(root: Path) -> bytes:
    """Create the directory (0700), prove it readable and writable, and return its secret;
    or raise a ValueError saying how to fix it."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.listdir(root)
        fd, probe = tempfile.mkstemp(dir=root, prefix=".probe.", suffix=TEMP_SUFFIX)
        os.close(fd)
        os.unlink(probe)
        return load_secret(root)
    except OSError as err:
        raise ValueError(
            f"--kv-cache-dir {root} is not a directory this user can read and write ({err}); "
            "point it at a directory this user can create and write, or leave it unset"
        ) from err


def _parse_block_name(name: str) -> str | None:
    """The stem of a block file name (lowercase hex, as `KVDiskDir.path` spells it), or None."""
    stem = name.removesuffix(BLOCK_SUFFIX)
    if stem == name or len(stem) < 2 or stem.strip("0123456789abcdef"):
        return None
    return stem


def _subdirs(path: Path) -> list[Path]:
    return [path / e.name for e in _listing(path) if e.is_dir(follow_symlinks=False)]


def _files(path: Path) -> list[os.DirEntry]:
    return [e for e in _listing(path) if e.is_file(follow_symlinks=False)]


def _listing(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []
    except OSError as err:
        log.warning("KV disk cache: skipping %s, which cannot be read (%s)", path, err)
        return []
