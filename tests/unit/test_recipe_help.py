"""``python recipes/X.py --help`` shows the recipe's own docstring above Hydra's config listing."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("recipe", ["serve", "plan", "bench", "profile"])
def test_help_shows_the_recipe_docstring(recipe):
    path = ROOT / "recipes" / f"{recipe}.py"
    first_line = ast.get_docstring(ast.parse(path.read_text())).splitlines()[0]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(first_line), out.stdout[:300]
    assert "== Config ==" in out.stdout and "is powered by Hydra" not in out.stdout


def test_a_dollar_in_the_docstring_survives_hydras_template(monkeypatch):
    """Hydra fills the help template with string.Template: a bare "$" there raised ValueError."""
    import string
    import types

    from recipes._common import _recipe_doc

    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__doc__="Costs $5 per $HOST.\n"))
    assert string.Template(_recipe_doc() + "$CONFIG").substitute(CONFIG="cfg") == "Costs $5 per $HOST.\ncfg"


def test_default_run_dirs_are_per_process_but_shared_by_torchrun_ranks(monkeypatch):
    """Two runs started in one second shared (and mixed) one run dir; microseconds split them. A
    review found torchrun's ranks then made one dir each: under torchrun the stamp stays in seconds."""
    import re

    from recipes._common import _run_stamp

    for key in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert re.fullmatch(r"\d\d-\d\d-\d\d-\d{6}", _run_stamp())
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert re.fullmatch(r"\d\d-\d\d-\d\d", _run_stamp())
