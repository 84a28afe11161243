"""The MSL emulator's compiler: found by platform, checked by compiling its headers once, and
a reason a skip or `metal-serve doctor` can show when none can build it."""

from __future__ import annotations

import stat
import sys

import pytest

from kernels_metal.emulator import build


@pytest.fixture
def fresh_check(monkeypatch, tmp_path):
    """A check of its own: nothing cached in memory or on disk."""
    monkeypatch.setenv("METAL_SERVE_MSL_EMU_CACHE", str(tmp_path / "cache"))
    build.unavailable_reason.cache_clear()
    yield
    build.unavailable_reason.cache_clear()


def fake_clang(tmp_path, stderr: str, status: int) -> str:
    path = tmp_path / "fake-clang"
    path.write_text(f"#!/bin/sh\necho '{stderr}' >&2\nexit {status}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_the_compiler_here_builds_the_headers(fresh_check, tmp_path):
    if build.find_clang() is None and sys.platform == "darwin":  # required elsewhere
        pytest.skip("no clang on this Mac: test_without_a_clang_the_reason_says_how_to_get_one")
    assert build.unavailable_reason() is None
    assert len(list((tmp_path / "cache").glob("probe-*.so"))) == 1


def test_a_clang_that_rejects_the_headers_is_named_with_its_error(fresh_check, tmp_path,
                                                                   monkeypatch):
    error = "msl_compat.h:21:9: error: __bf16 is not supported on this target"
    clang = fake_clang(tmp_path, error, 1)
    monkeypatch.setenv("METAL_SERVE_CLANG", clang)
    assert build.unavailable_reason() == (f"{clang} cannot compile the MSL emulator's headers: "
                                          f"{error}")
    assert not list((tmp_path / "cache").glob("probe-*.so"))  # asked again next time


def test_without_a_clang_the_reason_says_how_to_get_one(fresh_check, monkeypatch):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.delenv("METAL_SERVE_CLANG", raising=False)
    for platform, hint in (("linux", "apt-get install clang-19"),
                           ("darwin", "xcode-select --install")):
        monkeypatch.setattr(sys, "platform", platform)
        build.unavailable_reason.cache_clear()
        reason = build.unavailable_reason()
        assert reason.startswith("The MSL emulator needs ") and hint in reason
        assert reason.endswith("or set METAL_SERVE_CLANG")


def test_a_mac_takes_apples_clang_plus_plus_after_a_clang_19(monkeypatch):
    monkeypatch.delenv("METAL_SERVE_CLANG", raising=False)
    on_path = {"clang++": "/usr/bin/clang++", "clang": "/usr/bin/clang"}
    monkeypatch.setattr(build.shutil, "which", on_path.get)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert build.find_clang() == "/usr/bin/clang++"
    monkeypatch.setattr(sys, "platform", "linux")
    assert build.find_clang() == "/usr/bin/clang"
    on_path["clang-19"] = "/opt/llvm/bin/clang-19"
    assert build.find_clang() == "/opt/llvm/bin/clang-19"
