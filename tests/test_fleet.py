"""Several models behind one server: which model a request's name picks, the catalog's
sources (flags, a models dir, a TOML file) and their errors, and the fleet's load and unload
decisions (least recently used idle model first, pins, a model count, idle TTLs)."""

from __future__ import annotations

import argparse
import asyncio
import threading

import pytest

from server.fleet.args import model_catalog
from server.fleet.catalog import ModelCatalog, ModelEntry, UnknownModel
from server.fleet.fleet import ModelFleet, ModelUnavailable, Planned
from server.launch import add_arguments

MiB = 1 << 20


def catalog(*entries: ModelEntry, **kwargs) -> ModelCatalog:
    return ModelCatalog({e.name: e for e in entries}, **kwargs)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_name_picks_a_model_then_an_alias_then_the_first_matching_pattern_then_the_default():
    models = catalog(
        ModelEntry("coder", "/m/coder", aliases=("gpt-5", "claude-*")),
        ModelEntry("small", "/m/small", aliases=("claude-*-haiku-*",)),
        ModelEntry("embed", "/m/embed"),
        aliases=(("claude-3-5-haiku-*", "small"), ("text-embedding-*", "embed")),
        default="coder",
    )  # fmt: skip
    assert models.resolve("small") == "small"
    assert models.resolve("gpt-5") == "coder"
    # Patterns in the order given: each model's own first, then --alias.
    assert models.resolve("claude-sonnet-4-5") == "coder"
    assert models.resolve("claude-3-5-haiku-20241022") == "coder"
    assert models.resolve("text-embedding-3-small") == "embed"
    assert models.resolve("llama3") == "coder"
    assert models.resolve(None) == "coder"
    assert models.names_of("small") == ["small", "claude-*-haiku-*", "claude-3-5-haiku-*"]


def test_without_a_default_an_unknown_name_is_refused_naming_the_models():
    models = catalog(ModelEntry("a", None), ModelEntry("b", "/m/b", aliases=("bee",)))
    assert models.resolve("bee") == "b"
    with pytest.raises(UnknownModel, match=r"model 'gpt-4o'.* it serves a, b"):
        models.resolve("gpt-4o")
    with pytest.raises(UnknownModel):
        catalog(ModelEntry("a", None), default="a").resolve("x", use_default=False)


@pytest.mark.parametrize(("entries", "kwargs", "error"), [
    ([ModelEntry("a*", None)], {}, "glob characters"),
    ([ModelEntry("a", None)], {"aliases": (("x", "b"),)}, "names model 'b', which is not"),
    ([ModelEntry("a", None), ModelEntry("b", None)], {"aliases": (("x", "a"), ("x", "b"))},
     "alias 'x' names two models"),
    ([ModelEntry("a", None), ModelEntry("b", None)], {"aliases": (("a", "b"),)},
     "also a model's name"),
    ([ModelEntry("a", None)], {"default": "b"}, "--default-model 'b' is not one"),
    ([ModelEntry("a", None)], {"max_loaded": 0}, "at least 1"),
])  # fmt: skip
def test_a_catalog_that_cannot_work_is_refused_at_start(entries, kwargs, error):
    with pytest.raises(ValueError, match=error):
        catalog(*entries, **kwargs)


def test_one_model_is_served_as_before_without_the_fleet_flags():
    assert model_catalog(parse("some/dir")) is None


def test_models_come_from_flags_a_models_dir_and_a_toml_file(tmp_path):
    models_dir = tmp_path / "models"
    for name in ("qwen", "smol"):
        (models_dir / name).mkdir(parents=True)
        (models_dir / name / "config.json").write_text("{}")
    (models_dir / "tiny.gguf").write_bytes(b"")
    (models_dir / "notes").mkdir()  # no config.json: not a model
    (tmp_path / "coder").mkdir()
    config = tmp_path / "models.toml"
    config.write_text(
        'default_model = "coder"\nmax_loaded_models = 2\nmodels_memory = "2GiB"\n'
        "idle_ttl = 600\n"
        '[models.coder]\npath = "coder"\naliases = ["claude-*"]\npin = true\n'
        'options = ["--max-model-len", "8192", "--kv-cache-memory", "1GiB"]\n'
        '[models.embed]\npath = "org/embedder"\nidle_ttl = 60\n'
    )  # fmt: skip
    args = parse("--models-dir", str(models_dir), "--models-config", str(config),
                 "--model", "big=/elsewhere/big", "--pin", "smol", "--alias", "gpt-*=big",
                 "--max-loaded-models", "3")  # fmt: skip
    models = model_catalog(args)
    assert list(models.entries) == ["big", "qwen", "smol", "tiny", "coder", "embed"]
    coder = models.entries["coder"]
    assert coder.reference == str(tmp_path / "coder")  # relative to the file
    assert (coder.pinned, coder.idle_ttl_s, coder.aliases) == (True, 600, ("claude-*",))
    assert models.entries["embed"].reference == "org/embedder"
    assert models.entries["embed"].idle_ttl_s == 60
    assert models.entries["smol"].pinned and not models.entries["qwen"].pinned
    assert (models.default, models.max_loaded, models.memory_bytes) == ("coder", 3, 2 << 30)
    assert models.resolve("gpt-4o") == "big" and models.resolve("claude-x") == "coder"


def test_a_models_own_options_apply_to_it_alone(tmp_path):
    from server.fleet.args import model_args

    args = parse("--model", "a=/m/a", "--model", "b=/m/b", "--max-num-seqs", "4")
    entry = ModelEntry("a", "/m/a", options=("--max-model-len", "512"))
    own = model_args(args, entry)
    assert (own.model_dir, own.max_model_len, own.max_num_seqs) == ("/m/a", 512, 4)
    assert args.max_model_len is None


def test_a_models_task_comes_from_its_options_else_from_the_servers(tmp_path):
    config = tmp_path / "models.toml"
    config.write_text('[models.r]\npath = "/m/r"\noptions = ["--task", "rerank"]\n')
    alone = model_catalog(parse("--model", "a=/m/a", "--models-config", str(config)))
    assert {name: e.task for name, e in alone.entries.items()} == {"a": "auto", "r": "rerank"}
    told = model_catalog(parse("--model", "a=/m/a", "--models-config", str(config),
                               "--task", "embed"))
    assert {name: e.task for name, e in told.entries.items()} == {"a": "embed", "r": "rerank"}


@pytest.mark.parametrize(("toml", "error"), [
    ('[models.a]\npath = "x"\ncolour = "red"\n', r"\[models.a\]: unknown key colour"),
    ('[models.a]\naliases = ["x"]\n', "needs path"),
    ('[models.a]\npath = "x"\noptions = ["--port", "9000"]\n', "port is the server's option"),
    ('[models.a]\npath = "x"\noptions = ["--max-model-len", "lots"]\n', "bad options"),
    ('[models.a]\npath = "x"\nidle_ttl = -1\n', "idle_ttl is a number of seconds"),
    ("models = 3\n", "give each model a"),
    ("[models.a\n", "not valid TOML"),
])  # fmt: skip
def test_a_bad_models_config_names_what_is_wrong(tmp_path, toml, error):
    config = tmp_path / "models.toml"
    config.write_text(toml)
    with pytest.raises(ValueError, match=error):
        model_catalog(parse("--models-config", str(config)))


def test_flags_naming_missing_models_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--pin 'c': no such model"):
        model_catalog(parse("--model", "a=/m/a", "--pin", "c"))
    with pytest.raises(ValueError, match="two models are named 'a'"):
        model_catalog(parse("--model", "a=/m/a", "--model", "a=/m/b"))
    with pytest.raises(ValueError, match="holds no model"):
        model_catalog(parse("--models-dir", str(tmp_path)))
    with pytest.raises(ValueError, match="adapters belong to one model"):
        model_catalog(parse("--model", "a=/m/a", "--lora-modules", "ft=/m/ft"))


# ---------------------------------------------------------------- load and unload decisions


class Loads:
    """What the fleet asked to load and unload; each model takes `sizes[name]` bytes."""

    def __init__(self, sizes: dict[str, int], failing: set[str] = frozenset()) -> None:
        self.sizes, self.failing = sizes, failing
        self.events: list[str] = []

    def plan(self, entry: ModelEntry) -> Planned:
        return Planned(self.sizes[entry.name])

    def load(self, entry: ModelEntry, planned: Planned) -> str:
        if entry.name in self.failing:
            raise OSError("weights.safetensors is corrupt")
        self.events.append(f"load {entry.name}")
        return entry.name

    def unload(self, model: str) -> None:
        self.events.append(f"unload {model}")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # every event a second apart: least recently used is well defined
        return self.now


def fleet_of(loads: Loads, memory: int, *entries: ModelEntry, **kwargs) -> ModelFleet:
    entries = entries or tuple(ModelEntry(name, None) for name in loads.sizes)
    return ModelFleet(catalog(*entries, **kwargs), memory, loads.plan, loads.load,
                      loads.unload, clock=Clock())


def run(coro):
    return asyncio.run(coro)


def test_a_model_loads_on_first_use_and_the_least_recently_used_idle_one_makes_room():
    loads = Loads({"a": 40 * MiB, "b": 40 * MiB, "c": 40 * MiB})

    async def scenario(fleet: ModelFleet) -> list:
        for name in ("a", "b", "a"):  # a used last: b is the least recently used
            await fleet.acquire(name)
            fleet.release(name)
        await fleet.acquire("c")
        fleet.release("c")
        return [(s.name, s.state) for s in fleet.status()]

    states = run(scenario(fleet_of(loads, 100 * MiB)))
    assert loads.events == ["load a", "load b", "unload b", "load c"]
    assert states == [("a", "loaded"), ("b", "unloaded"), ("c", "loaded")]


def test_busy_and_pinned_models_are_never_unloaded_to_make_room():
    loads = Loads({"a": 40 * MiB, "b": 40 * MiB, "c": 40 * MiB})
    entries = (ModelEntry("a", None, pinned=True), ModelEntry("b", None), ModelEntry("c", None))

    async def scenario(fleet: ModelFleet) -> None:
        await fleet.acquire("a")
        fleet.release("a")
        await fleet.acquire("b")  # still in flight
        with pytest.raises(ModelUnavailable, match=r"'c' needs 40.0 MiB.*a \(40.0 MiB, pinned\)"
                           r".*none is idle and unpinned") as refused:
            await fleet.acquire("c")
        assert refused.value.retry_after_s is not None
        fleet.release("b")
        await fleet.acquire("c")  # b is idle now

    run(scenario(fleet_of(loads, 100 * MiB, *entries)))
    assert loads.events == ["load a", "load b", "unload b", "load c"]


def test_max_loaded_models_counts_models_whatever_memory_is_left():
    loads = Loads({"a": MiB, "b": MiB, "c": MiB})

    async def scenario(fleet: ModelFleet) -> None:
        for name in ("a", "b", "c"):
            await fleet.acquire(name)
            fleet.release(name)

    run(scenario(fleet_of(loads, 100 * MiB, max_loaded=2)))
    assert loads.events == ["load a", "load b", "unload a", "load c"]


def test_a_model_larger_than_the_budget_or_failing_to_load_is_an_error_others_survive():
    loads = Loads({"big": 200 * MiB, "bad": MiB, "ok": MiB}, failing={"bad"})

    async def scenario(fleet: ModelFleet) -> list:
        await fleet.acquire("ok")
        with pytest.raises(ModelUnavailable, match=r"'big' needs 200.0 MiB.*more than the "
                           r"100.0 MiB the models may take together") as refused:
            await fleet.acquire("big")
        assert refused.value.retry_after_s is None
        with pytest.raises(ModelUnavailable, match="'bad' failed to load: .*corrupt"):
            await fleet.acquire("bad")
        return fleet.status()

    status = {s.name: s for s in run(scenario(fleet_of(loads, 100 * MiB)))}
    assert status["ok"].state == "loaded" and status["ok"].in_flight == 1
    assert status["bad"].state == "unloaded" and "corrupt" in status["bad"].last_error
    assert loads.events == ["load ok"]


def test_concurrent_requests_for_an_unloaded_model_share_one_load():
    loads = Loads({"a": MiB})

    async def scenario(fleet: ModelFleet) -> list:
        return await asyncio.gather(*(fleet.acquire("a") for _ in range(5)))

    assert run(scenario(fleet_of(loads, 100 * MiB))) == ["a"] * 5
    assert loads.events == ["load a"]


def test_a_load_blocks_neither_the_event_loop_nor_requests_for_loaded_models():
    """While one model's load blocks (its thread waits on an event), a heartbeat on the event
    loop beats and a request for a loaded model gets it; the load ends once let go."""
    started, let_go = threading.Event(), threading.Event()
    order: list[str] = []

    class BlockingLoads(Loads):
        def load(self, entry: ModelEntry, planned: Planned) -> str:
            if entry.name == "slow":
                started.set()
                let_go.wait(5)  # on the event loop this would stall it for the whole wait
                order.append("slow loaded")
            return super().load(entry, planned)

    async def heartbeat() -> None:
        for _ in range(5):
            await asyncio.sleep(0.01)
        order.append("heartbeat")

    async def scenario(fleet: ModelFleet) -> None:
        await fleet.acquire("fast")
        fleet.release("fast")
        loading = asyncio.create_task(fleet.acquire("slow"))
        try:
            while not started.is_set() and not loading.done():
                await asyncio.sleep(0.001)
            await heartbeat()
            assert await fleet.acquire("fast") == "fast"
            order.append("fast acquired")
            assert {s.name: s.state for s in fleet.status()}["slow"] == "loading"
        finally:
            let_go.set()
        assert await loading == "slow"

    run(scenario(fleet_of(BlockingLoads({"fast": MiB, "slow": MiB}), 100 * MiB)))
    assert order == ["heartbeat", "fast acquired", "slow loaded"]


def test_an_idle_model_past_its_ttl_is_unloaded_and_a_busy_or_pinned_one_is_not():
    loads = Loads({"a": MiB, "b": MiB, "c": MiB})
    entries = (ModelEntry("a", None, idle_ttl_s=5), ModelEntry("b", None, idle_ttl_s=5),
               ModelEntry("c", None, idle_ttl_s=5, pinned=True))

    async def scenario(fleet: ModelFleet) -> list:
        for name in ("a", "b", "c"):
            await fleet.acquire(name)
        fleet.release("a")
        fleet.release("c")
        fleet._clock.now += 60
        await fleet.unload_expired()
        return [(s.name, s.state) for s in fleet.status()]

    states = run(scenario(fleet_of(loads, 100 * MiB, *entries)))
    assert states == [("a", "unloaded"), ("b", "loaded"), ("c", "loaded")]


def test_an_admin_unload_waits_for_no_request_and_then_frees_the_model():
    loads = Loads({"a": MiB})

    async def scenario(fleet: ModelFleet) -> None:
        await fleet.acquire("a")
        with pytest.raises(ModelUnavailable, match="1 requests in flight"):
            await fleet.unload("a")
        fleet.release("a")
        assert await fleet.unload("a") is True
        assert await fleet.unload("a") is False

    run(scenario(fleet_of(loads, 100 * MiB)))
    assert loads.events == ["load a", "unload a"]



def test_a_dry_run_plans_each_model_of_several(tmp_path, capsys):
    from tiny_models import build_tiny_model

    from server.cli import main

    build_tiny_model("llama", tmp_path / "tiny")
    code = main(["serve", "--model", f"a={tmp_path / 'tiny'}", "--model",
                 f"b={tmp_path / 'tiny'}", "--kv-cache-memory", "2MiB", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("KV budget: 2.0 MiB (--kv-cache-memory)") == 2
    assert out.index("model 'a':") < out.index("model 'b':")
