"""The secret of a `--kv-cache-dir`, and the two things it keys: block file names and MACs.

Without the secret, a listing of the directory names no block (a guessed prompt's block
hashes match no file name) and a file written into the directory fails verification (a miss,
never served). The secret is 32 random bytes in DIR/secret, created once with O_EXCL and mode
0600; every process that shares the directory reads the same file, and trusts it only if it
belongs to this user and no one else may read or write it.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from pathlib import Path

SECRET_FILE = "secret"
SECRET_BYTES = 32
MAC_SIZE = 16
# How long a reader waits for the process that just created the secret to write it.
SECRET_WAIT_S = 2.0


class NamespaceKeys:
    """Keyed file names and MACs of one namespace. Its key mixes in the namespace's identity,
    so a file copied in from another namespace (another model, an older layout) fails too."""

    def __init__(self, secret: bytes, identity: str) -> None:
        self._key = hashlib.blake2b(identity.encode(), key=secret, person=b"kv namespace").digest()

    def file_name(self, block_hash: bytes) -> str:
        """The stem of the block's file: a keyed hash, so its name says nothing of its tokens."""
        h = hashlib.blake2b(block_hash, key=self._key, digest_size=16, person=b"kv file name")
        return h.hexdigest()

    def mac(self, *parts: bytes | memoryview) -> bytes:
        h = hashlib.blake2b(key=self._key, digest_size=MAC_SIZE, person=b"kv block mac")
        for part in parts:
            h.update(part)
        return h.digest()


def load_secret(root: Path) -> bytes:
    """The directory's secret, created if it has none. Raises ValueError (what to do) if the
    file there is not one this user can trust, OSError if it cannot be created or read."""
    path = root / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _read_secret(path)
    secret = os.urandom(SECRET_BYTES)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)  # an empty secret would stop every later start
        raise
    return secret


def _read_secret(path: Path) -> bytes:
    deadline = time.monotonic() + SECRET_WAIT_S
    while True:
        # O_NOFOLLOW: a symlink planted here would hand us a secret someone else knows.
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            _check_private(path, os.fstat(f.fileno()))
            data = f.read(SECRET_BYTES + 1)
        if len(data) == SECRET_BYTES:
            return data
        if len(data) > SECRET_BYTES or time.monotonic() > deadline:
            raise ValueError(
                f"{path} is not a KV cache secret ({len(data)} bytes, expected {SECRET_BYTES}); "
                "delete it and restart (the blocks on disk then become misses)"
            )
        time.sleep(0.05)  # created by another process that has not written it yet


def _check_private(path: Path, st: os.stat_result) -> None:
    """Whoever can read the secret can forge blocks this server serves: only this user may."""
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file; delete it and restart")
    if st.st_uid != os.geteuid():
        raise ValueError(
            f"{path} belongs to uid {st.st_uid}, not this user ({os.geteuid()}), who could "
            "forge cache blocks with it: point --kv-cache-dir at a directory of your own"
        )
    if st.st_mode & 0o077:
        raise ValueError(
            f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}), who could "
            f"forge cache blocks with it: chmod 600 {path}"
        )
