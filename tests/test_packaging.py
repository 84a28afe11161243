"""The dependency set resolves for the Mac (MLX with Metal) and for Linux (MLX's CPU build)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def resolve_for(platform: str) -> set[str]:
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    result = subprocess.run(
        [uv, "pip", "compile", "pyproject.toml", "--extra", "dev", "--quiet",
         "--python-platform", platform, "--python-version", "3.12", "--no-python-downloads"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "MACOSX_DEPLOYMENT_TARGET": "14.0"},
    )
    assert result.returncode == 0, result.stderr
    return {
        line.split("==")[0] for line in result.stdout.splitlines()
        if "==" in line and not line.startswith(" ")
    }


@pytest.mark.parametrize(
    "platform, wanted, unwanted",
    [
        ("aarch64-apple-darwin", {"mlx", "mlx-metal", "torch"}, {"mlx-cpu"}),
        ("x86_64-manylinux_2_35", {"mlx", "mlx-cpu", "torch"}, {"mlx-metal"}),
    ],
)
def test_dependencies_resolve_per_platform(platform, wanted, unwanted):
    packages = resolve_for(platform)
    assert wanted <= packages, wanted - packages
    assert not unwanted & packages
