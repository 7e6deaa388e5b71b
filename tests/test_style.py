"""The code meets the style settings in pyproject.toml ([tool.ruff]: line length, imports, pyflakes)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_the_code_meets_the_ruff_settings_of_pyproject():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
