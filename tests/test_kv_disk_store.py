"""The on-disk KV block store: round trips, LRU bound, corruption, namespaces, shared dirs."""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import pytest

from metal_engine.cache.kv_cache import bytes_per_block
from metal_engine.kv_disk import directory as kv_disk_dir
from metal_engine.kv_disk import store as kv_disk_store
from metal_engine.kv_disk.directory import KVDiskDir
from metal_engine.kv_disk.keys import NamespaceKeys, load_secret
from metal_engine.kv_disk.store import BlockLayout, KVDiskStore, model_identity
from scheduler.prefix_hash import hash_block

LAYOUT = BlockLayout(((2, 8),) * 2, 4, "float16")
IDENTITY = "0123456789abcdef0123456789abcdef"
REPO_ROOT = Path(__file__).resolve().parents[1]


def block_hash(i: int) -> bytes:
    return hash_block(None, [i])


def payload(i: int, layout: BlockLayout = LAYOUT) -> bytes:
    return random.Random(i).randbytes(layout.payload_bytes)


def block_file(directory: Path, h: bytes, identity: str = IDENTITY) -> Path:
    """Where a store keeps block `h`: its name keyed by the directory's secret."""
    name = NamespaceKeys(load_secret(directory), identity).file_name(h)
    return directory / identity / name[:2] / f"{name}.kvb"


def block_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.kvb"))


def open_store(directory: Path, blocks: int = 100, layout: BlockLayout = LAYOUT,
               identity: str = IDENTITY) -> KVDiskStore:
    return KVDiskStore(KVDiskDir(directory, blocks * layout.file_bytes), identity, layout)


def filled_store(directory: Path, ids: list[int], blocks: int = 100) -> KVDiskStore:
    store = open_store(directory, blocks)
    for i in ids:
        store.save(block_hash(i), payload(i))
    return store


def stored_ids(store: KVDiskStore, candidates: range) -> list[int]:
    return [i for i in candidates if block_hash(i) in store]


# --- layout and identity ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_payload_bytes_matches_the_engine_pool(dtype):
    pools = ((2, 64), (1, 128), (2, 64))  # pools may differ in shape (Gemma 4)
    layout = BlockLayout(pools, 16, dtype)
    assert layout.payload_bytes == bytes_per_block(pools, 16, getattr(mx, dtype))


def test_layout_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="int3.*float32, float16, bfloat16, int8, int4"):
        BlockLayout(((1, 1),) * 1, 1, "int3")


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 96}')
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_identity_is_stable_and_ignores_where_the_model_lives(model_dir, tmp_path):
    moved = tmp_path / "elsewhere"
    shutil.copytree(model_dir, moved)  # copy2 keeps mtimes
    assert model_identity(model_dir, LAYOUT) == model_identity(model_dir, LAYOUT)
    assert model_identity(moved, LAYOUT) == model_identity(model_dir, LAYOUT)


def _edit_config(folder: Path) -> None:
    (folder / "config.json").write_text('{"hidden_size": 128}')


def _resize_weights(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"\0" * 65)


def _reconvert_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def _add_shard(folder: Path) -> None:
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 8)


@pytest.mark.parametrize("change", [_edit_config, _resize_weights, _reconvert_weights, _add_shard])
def test_identity_changes_with_the_model(model_dir, change):
    before = model_identity(model_dir, LAYOUT)
    change(model_dir)
    assert model_identity(model_dir, LAYOUT) != before


def test_identity_changes_with_the_layout(model_dir):
    other = BlockLayout(((2, 8),) * 2, 4, "float32")
    assert model_identity(model_dir, other) != model_identity(model_dir, LAYOUT)


def test_identities_are_separate_namespaces(tmp_path, model_dir):
    first = model_identity(model_dir, LAYOUT)
    store = open_store(tmp_path, identity=first)
    store.save(block_hash(1), payload(1))
    _edit_config(model_dir)
    second = model_identity(model_dir, LAYOUT)
    other = open_store(tmp_path, identity=second)
    assert block_hash(1) not in other and other.load(block_hash(1)) is None
    other.save(block_hash(1), payload(2))
    assert open_store(tmp_path, identity=first).load(block_hash(1)) == payload(1)
    assert open_store(tmp_path, identity=second).load(block_hash(1)) == payload(2)


# --- round trip and restart ------------------------------------------------------------------

def test_round_trip(tmp_path):
    store = filled_store(tmp_path, [1, 2])
    assert block_hash(1) in store and block_hash(3) not in store
    assert store.load(block_hash(1)) == payload(1)
    assert store.load(block_hash(2)) == payload(2)
    assert store.load(block_hash(3)) is None
    assert store.num_blocks == 2
    assert store.used_bytes == sum(p.stat().st_size for p in block_files(tmp_path))
    assert block_files(tmp_path) == sorted(block_file(tmp_path, block_hash(i)) for i in (1, 2))


def test_save_takes_a_memoryview_of_an_mlx_array(tmp_path):
    layout = BlockLayout(((2, 8),) * 2, 4, "bfloat16")
    shape = (2, len(layout.pools), layout.block_size, *layout.pools[0])
    kv = mx.random.normal(shape, key=mx.random.key(0)).astype(mx.bfloat16)
    store = open_store(tmp_path, layout=layout)
    store.save(block_hash(1), memoryview(kv))
    assert store.load(block_hash(1)) == bytes(memoryview(kv))
    assert store.load(block_hash(1)) != bytes(layout.payload_bytes)


def test_save_rejects_a_payload_of_the_wrong_size(tmp_path):
    with pytest.raises(ValueError, match=str(LAYOUT.payload_bytes)):
        open_store(tmp_path).save(block_hash(1), b"\0" * (LAYOUT.payload_bytes - 1))


def test_save_keeps_the_first_payload_of_a_hash(tmp_path):
    store = filled_store(tmp_path, [1])
    store.save(block_hash(1), payload(2))
    assert store.load(block_hash(1)) == payload(1)
    assert store.num_blocks == 1 and len(block_files(tmp_path)) == 1


def test_restart_finds_saved_blocks(tmp_path):
    filled_store(tmp_path, [1, 2, 3])
    store = open_store(tmp_path)
    assert stored_ids(store, range(10)) == [1, 2, 3]
    assert store.used_bytes == 3 * LAYOUT.file_bytes
    assert [store.load(block_hash(i)) for i in (1, 2, 3)] == [payload(i) for i in (1, 2, 3)]


def test_restart_indexes_only_block_files_where_they_belong(tmp_path):
    filled_store(tmp_path, [1])
    namespace = tmp_path / IDENTITY
    name = block_file(tmp_path, block_hash(2)).name
    misplaced = namespace / ("00" if name[:2] != "00" else "01") / name
    misplaced.parent.mkdir(exist_ok=True)
    shutil.copy(block_file(tmp_path, block_hash(1)), misplaced)
    notes = namespace / "00" / "notes.kvb"  # "00" holds no block where no name starts so
    notes.parent.mkdir(exist_ok=True)
    notes.write_text("not a hash")
    (namespace / "README").write_text("left by a user")
    store = open_store(tmp_path)
    assert store.num_blocks == 1 and store.load(block_hash(1)) == payload(1)
    assert misplaced.exists() and (namespace / "README").exists()


# --- LRU bound -------------------------------------------------------------------------------

def test_lru_evicts_least_recently_used_first(tmp_path):
    store = filled_store(tmp_path, [1, 2, 3], blocks=3)
    assert store.load(block_hash(1)) == payload(1)  # 2 is now the oldest
    store.save(block_hash(4), payload(4))
    assert stored_ids(store, range(10)) == [1, 3, 4]
    assert not block_file(tmp_path, block_hash(2)).exists()
    store.save(block_hash(5), payload(5))
    assert stored_ids(store, range(10)) == [1, 4, 5]
    assert store.used_bytes == 3 * LAYOUT.file_bytes <= store.disk.max_bytes
    assert len(block_files(tmp_path)) == 3


def test_lru_order_survives_restart(tmp_path):
    store = filled_store(tmp_path, [1, 2, 3], blocks=3)
    store.load(block_hash(2))
    store.load(block_hash(1))  # recency now: 3, 2, 1
    restarted = open_store(tmp_path, blocks=3)
    restarted.save(block_hash(4), payload(4))
    assert stored_ids(restarted, range(10)) == [1, 2, 4]
    restarted.save(block_hash(5), payload(5))
    assert stored_ids(restarted, range(10)) == [1, 4, 5]


def test_restart_with_a_smaller_bound_keeps_the_most_recent(tmp_path):
    store = filled_store(tmp_path, [1, 2, 3, 4])
    store.load(block_hash(1))  # recency now: 2, 3, 4, 1
    smaller = open_store(tmp_path, blocks=2)
    assert stored_ids(smaller, range(10)) == [1, 4]
    assert smaller.used_bytes == 2 * LAYOUT.file_bytes
    assert len(block_files(tmp_path)) == 2


def test_bound_smaller_than_one_block_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=str(LAYOUT.file_bytes)):
        KVDiskStore(KVDiskDir(tmp_path, LAYOUT.file_bytes - 1), IDENTITY, LAYOUT)


# --- corruption ------------------------------------------------------------------------------

def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _append(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0")


def _flip_payload_byte(path: Path) -> None:
    _flip(path, kv_disk_store.HEADER.size + LAYOUT.payload_bytes // 2)


def _flip_checksum_byte(path: Path) -> None:
    _flip(path, kv_disk_store.HEADER.size - 1)


def _wrong_magic(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(b"XXXX" + data[4:])


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def assert_dropped(store: KVDiskStore, directory: Path, i: int) -> None:
    assert store.load(block_hash(i)) is None
    assert block_hash(i) not in store
    assert not block_file(directory, block_hash(i)).exists()


@pytest.mark.parametrize(
    "corrupt", [_truncate, _append, _flip_payload_byte, _flip_checksum_byte, _wrong_magic]
)
def test_corrupt_file_is_dropped_not_served(tmp_path, corrupt):
    store = filled_store(tmp_path, [1, 2])
    corrupt(block_file(tmp_path, block_hash(1)))
    assert_dropped(store, tmp_path, 1)
    assert store.num_blocks == 1 and store.used_bytes == LAYOUT.file_bytes
    assert store.load(block_hash(2)) == payload(2)


def test_any_flipped_byte_is_caught(tmp_path):
    store = filled_store(tmp_path, [1])
    path = block_file(tmp_path, block_hash(1))
    pristine = path.read_bytes()
    for offset in range(len(pristine)):
        _flip(path, offset)
        assert open_store(tmp_path).load(block_hash(1)) is None, f"byte {offset} went unnoticed"
        path.write_bytes(pristine)
    assert store.load(block_hash(1)) == payload(1)


def test_torn_file_is_dropped_at_startup(tmp_path):
    filled_store(tmp_path, [1, 2])
    _truncate(block_file(tmp_path, block_hash(1)))
    store = open_store(tmp_path)
    assert stored_ids(store, range(10)) == [2]
    assert not block_file(tmp_path, block_hash(1)).exists()


def test_other_format_version_is_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_disk_store, "FORMAT_VERSION", kv_disk_store.FORMAT_VERSION + 1)
    filled_store(tmp_path, [1])
    monkeypatch.undo()
    assert_dropped(open_store(tmp_path), tmp_path, 1)


def test_other_layout_of_the_same_size_is_dropped(tmp_path):
    swapped = BlockLayout(((4, 8),) * 2, 2, "float16")
    assert swapped.payload_bytes == LAYOUT.payload_bytes
    open_store(tmp_path, layout=swapped).save(block_hash(1), payload(1))
    assert_dropped(open_store(tmp_path), tmp_path, 1)


def test_block_file_under_another_hash_is_dropped(tmp_path):
    filled_store(tmp_path, [1])
    target = block_file(tmp_path, block_hash(2))
    target.parent.mkdir(exist_ok=True)
    shutil.copy(block_file(tmp_path, block_hash(1)), target)
    store = open_store(tmp_path)
    assert_dropped(store, tmp_path, 2)
    assert store.load(block_hash(1)) == payload(1)


# --- temp files and I/O trouble --------------------------------------------------------------

def _temp_file(directory: Path, age_s: float) -> Path:
    shard = directory / IDENTITY / "ab"
    shard.mkdir(parents=True, exist_ok=True)
    path = shard / f".ab{age_s:.0f}.partial.tmp"
    path.write_bytes(b"half a block")
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_startup_removes_crashed_writes_but_not_writes_in_flight(tmp_path):
    crashed = _temp_file(tmp_path, age_s=2 * kv_disk_dir.STALE_TEMP_SECONDS)
    in_flight = _temp_file(tmp_path, age_s=0)
    store = filled_store(tmp_path, [1])
    open_store(tmp_path)
    assert not crashed.exists() and in_flight.exists()
    assert store.load(block_hash(1)) == payload(1)


def test_failed_write_leaves_no_temp_file_and_warns_once(tmp_path, monkeypatch, caplog):
    store = open_store(tmp_path)

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv_disk_store.os, "replace", disk_full)
    with caplog.at_level(logging.WARNING, logger=kv_disk_store.__name__):
        store.save(block_hash(1), payload(1))
        store.save(block_hash(2), payload(2))
    assert len(caplog.records) == 1 and "No space left" in caplog.text
    assert store.num_blocks == 0 and store.used_bytes == 0
    assert [p for p in (tmp_path / IDENTITY).rglob("*") if p.is_file()] == []


def test_unwritable_shard_is_a_miss_not_an_error(tmp_path):
    store = open_store(tmp_path)
    shard = block_file(tmp_path, block_hash(1)).parent
    shard.write_bytes(b"a file where a directory should be")
    store.save(block_hash(1), payload(1))
    assert block_hash(1) not in store and store.load(block_hash(1)) is None
    # Another block's file, in another shard (names are keyed: 1 in 256 shares the first's).
    other = next(i for i in range(2, 100) if block_file(tmp_path, block_hash(i)).parent != shard)
    store.save(block_hash(other), payload(other))
    assert store.load(block_hash(other)) == payload(other)


def test_directory_under_a_file_is_a_config_error(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--kv-cache-dir"):
        open_store(blocker / "cache")


def test_namespace_this_user_cannot_write_is_a_config_error(tmp_path, monkeypatch):
    def permission_denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", permission_denied)  # as for a dir of another user
    with pytest.raises(ValueError, match="--kv-cache-dir"):
        open_store(tmp_path)


# --- a directory shared by processes ---------------------------------------------------------

def test_file_removed_by_another_process_is_a_miss_one_it_added_a_hit(tmp_path):
    mine = filled_store(tmp_path, [1, 2, 3], blocks=3)
    theirs = open_store(tmp_path, blocks=3)
    theirs.save(block_hash(4), payload(4))  # evicts 1, which `mine` still indexes
    assert mine.load(block_hash(1)) is None
    assert block_hash(1) not in mine and mine.num_blocks == 2
    block_file(tmp_path, block_hash(2)).unlink()
    mine.save(block_hash(5), payload(5))
    mine.save(block_hash(6), payload(6))  # evicts 2, already gone
    assert stored_ids(mine, range(10)) == [3, 4, 5, 6]  # 4: `theirs` saved it after we started
    assert [mine.load(block_hash(i)) for i in (3, 4, 5, 6)] == [payload(i) for i in (3, 4, 5, 6)]



def test_file_removed_between_read_and_refresh_is_served_then_forgotten(tmp_path, monkeypatch):
    store = filled_store(tmp_path, [1])

    def removed_by_another_process(path, ns, **kwargs):
        os.remove(path)
        raise FileNotFoundError(path)

    monkeypatch.setattr(kv_disk_store.os, "utime", removed_by_another_process)
    assert store.load(block_hash(1)) == payload(1)
    assert block_hash(1) not in store and store.used_bytes == 0

WORKER = textwrap.dedent("""
    import random, sys
    from pathlib import Path
    from metal_engine.kv_disk.directory import KVDiskDir
    from metal_engine.kv_disk.store import BlockLayout, KVDiskStore
    from scheduler.prefix_hash import hash_block

    layout = BlockLayout(((2, 8),) * 2, 4, "float16")
    store = KVDiskStore(KVDiskDir(Path(sys.argv[1]), 8 * layout.file_bytes), "shared", layout)
    rng = random.Random(int(sys.argv[2]))
    for _ in range(400):
        i = rng.randrange(24)
        h, expected = hash_block(None, [i]), random.Random(i).randbytes(layout.payload_bytes)
        if rng.random() < 0.5:
            store.save(h, expected)
        else:
            assert store.load(h) in (None, expected), i
""")


def test_processes_sharing_a_directory_never_crash_or_serve_wrong_data(tmp_path):
    workers = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), str(seed)], cwd=REPO_ROOT,
                         stderr=subprocess.PIPE, text=True)
        for seed in range(3)
    ]
    for worker in workers:
        _, stderr = worker.communicate(timeout=60)
        assert worker.returncode == 0, stderr
    assert open_store(tmp_path, identity="shared").num_blocks > 0
