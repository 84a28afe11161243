"""The cache directory against other local users who can list or write it: keyed names say
nothing of prompts, a block written without the secret is refused, the scan follows no
symlink and skips what it cannot read, and one size bound covers every namespace."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest
from test_kv_disk_store import (
    IDENTITY,
    LAYOUT,
    block_file,
    block_files,
    block_hash,
    filled_store,
    open_store,
    payload,
    stored_ids,
)

from metal_engine.kv_disk import keys as kv_disk_keys
from metal_engine.kv_disk.directory import KVDiskDir
from metal_engine.kv_disk.keys import NamespaceKeys, load_secret
from metal_engine.kv_disk.store import KVDiskStore
from scheduler.prefix_hash import extend_block_hashes


def pin_prompt(pin: int) -> list[int]:
    """Token ids of a prompt with a 4-digit PIN in its third block (LAYOUT's blocks are 4)."""
    return [101, 102, 103, 104, 105, 106, 107, 108, *map(ord, f"{pin:04d}"), 109, 110, 111, 112]


def block_hashes(tokens: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, LAYOUT.block_size, len(tokens))
    return hashes


def distinct_shards(directory: Path, count: int) -> list[int]:
    """Block ids whose files land in `count` different shard directories."""
    ids, shards = [], set()
    for i in range(1, 10_000):
        shard = block_file(directory, block_hash(i)).parent.name
        if shard not in shards:
            ids.append(i)
            shards.add(shard)
        if len(ids) == count:
            return ids
    raise AssertionError("no distinct shards")


# --- what a listing tells -------------------------------------------------------------------


def test_a_listing_names_no_block_of_a_guessed_prompt(tmp_path):
    cache = tmp_path / "kv"
    store = open_store(cache)
    for h in block_hashes(pin_prompt(4821)):
        store.save(h, payload(1))
    listed = {p.name.removesuffix(".kvb") for p in cache.rglob("*")}
    guessed = {h.hex() for pin in range(10_000) for h in block_hashes(pin_prompt(pin))}
    assert not listed & guessed  # not the PIN's block, not even the prompt's common prefix
    keys = NamespaceKeys(load_secret(cache), IDENTITY)
    with_secret = {keys.file_name(h) for h in block_hashes(pin_prompt(4821))}
    assert with_secret <= listed  # what names a file is the secret, and only that


def test_the_directory_is_private_to_this_user(tmp_path):
    old_umask = os.umask(0o022)  # what most shells give
    try:
        cache = tmp_path / "kv"
        filled_store(cache, [1])
    finally:
        os.umask(old_umask)
    path = block_file(cache, block_hash(1))
    for directory in (cache, cache / IDENTITY, path.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    for file in (cache / "secret", path):
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file


# --- the secret ------------------------------------------------------------------------------


def test_processes_starting_together_share_one_secret(tmp_path):
    secrets, barrier = [], threading.Barrier(8)

    def start() -> None:
        barrier.wait()
        secrets.append(load_secret(tmp_path))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(secrets) == 8 and len(set(secrets)) == 1
    assert len(secrets[0]) == kv_disk_keys.SECRET_BYTES
    assert (tmp_path / "secret").read_bytes() == secrets[0]


def _open_to_others(secret: Path) -> None:
    secret.chmod(0o644)


def _a_symlink(secret: Path) -> None:
    elsewhere = secret.parent.parent / "known-secret"
    elsewhere.write_bytes(b"k" * kv_disk_keys.SECRET_BYTES)
    secret.unlink()
    secret.symlink_to(elsewhere)


def _empty(secret: Path) -> None:
    secret.write_bytes(b"")  # a crash between creating and writing it


@pytest.mark.parametrize(
    ("spoil", "fix"),
    [(_open_to_others, "chmod 600"), (_a_symlink, "--kv-cache-dir"), (_empty, "delete it")],
)
def test_a_secret_this_user_cannot_trust_stops_the_start(tmp_path, monkeypatch, spoil, fix):
    monkeypatch.setattr(kv_disk_keys, "SECRET_WAIT_S", 0.1)
    cache = tmp_path / "kv"
    filled_store(cache, [1])
    spoil(cache / "secret")
    with pytest.raises(ValueError, match=fix):
        open_store(cache)


def test_a_secret_of_another_user_stops_the_start(tmp_path, monkeypatch):
    filled_store(tmp_path, [1])
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(tmp_path / "secret").st_uid + 1)
    with pytest.raises(ValueError, match="belongs to uid"):
        open_store(tmp_path)


# --- planted blocks --------------------------------------------------------------------------


def test_a_block_planted_without_the_secret_is_refused(tmp_path, caplog):
    """Someone who can write the directory runs the same model over a directory of their own,
    and copies what it wrote for a prompt over every file of ours, and beside them."""
    victim, attacker = tmp_path / "victim", tmp_path / "attacker"
    store = filled_store(victim, [1])
    filled_store(attacker, [2]).save(block_hash(1), payload(666))
    for forged in block_files(attacker):
        for target in block_files(victim):
            shutil.copy(forged, target)
        planted = victim / forged.relative_to(attacker)
        planted.parent.mkdir(exist_ok=True)
        shutil.copy(forged, planted)
    assert store.load(block_hash(1)) is None
    assert "not written with this directory's secret" in caplog.text
    restarted = open_store(victim)
    assert [restarted.load(block_hash(i)) for i in (1, 2)] == [None, None]
    assert not block_file(victim, block_hash(1)).exists()  # dropped, not kept for later


# --- symlinks and unreadable directories -----------------------------------------------------


def test_the_scan_follows_no_symlink(tmp_path):
    cache, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    first_run = open_store(cache)
    kept, linked_shard, linked_file = distinct_shards(cache, 3)
    first_run.save(block_hash(kept), payload(kept))
    # A shard that links outside, to what a scan deletes: a crashed write and a torn block.
    crashed = outside / ".crashed.tmp"
    crashed.write_bytes(b"someone's file")
    os.utime(crashed, (time.time() - 3600,) * 2)
    torn = outside / block_file(cache, block_hash(linked_shard)).name
    torn.write_bytes(b"someone's file")
    block_file(cache, block_hash(linked_shard)).parent.symlink_to(outside)
    # A block file that links to a file of a block's size outside.
    target = outside / "notes"
    target.write_bytes(b"n" * LAYOUT.file_bytes)
    link = block_file(cache, block_hash(linked_file))
    link.parent.mkdir()
    link.symlink_to(target)

    store = open_store(cache)
    assert crashed.read_bytes() == torn.read_bytes() == b"someone's file"
    assert store.num_blocks == 1 and stored_ids(store, range(1, 10_000)) == [kept]
    assert store.load(block_hash(linked_file)) is None
    assert target.read_bytes() == b"n" * LAYOUT.file_bytes


@pytest.mark.parametrize("locked", ["shard", "namespace"])
def test_a_directory_the_scan_cannot_read_is_logged_and_skipped(
    tmp_path, monkeypatch, caplog, locked
):
    """As a chmod 000 directory would be for another user (tests may run as root)."""
    first, second = distinct_shards(tmp_path, 2)
    filled_store(tmp_path, [first, second])
    path = block_file(tmp_path, block_hash(first)).parent
    path = path if locked == "shard" else path.parent
    for name in ("scandir", "listdir"):
        real = getattr(os, name)

        def denied(arg=".", real=real):
            if Path(os.fsdecode(arg)) == path:
                raise PermissionError(13, "Permission denied", str(arg))
            return real(arg)

        monkeypatch.setattr(os, name, denied)
    with caplog.at_level(logging.WARNING):
        store = open_store(tmp_path)
    assert str(path) in caplog.text
    assert store.num_blocks == (1 if locked == "shard" else 0)
    if locked == "shard":
        assert store.load(block_hash(second)) == payload(second)


def test_a_file_where_the_namespace_goes_is_a_config_error(tmp_path):
    (tmp_path / IDENTITY).write_text("not a folder")
    with pytest.raises(ValueError, match="--kv-cache-dir"):
        open_store(tmp_path)


# --- one bound over the directory ------------------------------------------------------------


def test_one_bound_covers_every_namespace_stale_ones_included(tmp_path):
    """Four runs, each of another model (or layout), under a bound of 3 blocks."""
    for run in range(4):
        store = open_store(tmp_path, blocks=3, identity=f"model-{run}")
        for i in range(3):
            store.save(block_hash(10 * run + i), payload(i))
    assert len(block_files(tmp_path)) == 3
    assert stored_ids(store, range(40)) == [30, 31, 32]


def test_a_smaller_bound_evicts_a_stale_namespace_first(tmp_path):
    filled_store(tmp_path, [1, 2])
    newer = open_store(tmp_path, identity="another-model")
    newer.save(block_hash(3), payload(3))
    restarted = open_store(tmp_path, blocks=1, identity="another-model")
    assert block_files(tmp_path) == [block_file(tmp_path, block_hash(3), "another-model")]
    assert restarted.load(block_hash(3)) == payload(3)


def test_the_stores_of_one_directory_share_its_lru(tmp_path):
    disk = KVDiskDir(tmp_path, 3 * LAYOUT.file_bytes)
    blocks, window = KVDiskStore(disk, "blocks", LAYOUT), KVDiskStore(disk, "window", LAYOUT)
    blocks.save(block_hash(1), payload(1))
    window.save(block_hash(2), payload(2))
    blocks.save(block_hash(3), payload(3))
    assert blocks.load(block_hash(1)) == payload(1)  # recency now: 2, 3, 1
    window.save(block_hash(4), payload(4))
    assert stored_ids(blocks, range(10)) == [1, 3] and stored_ids(window, range(10)) == [4]
    assert disk.used_bytes == blocks.used_bytes + window.used_bytes == 3 * LAYOUT.file_bytes
