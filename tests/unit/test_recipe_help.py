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


@pytest.mark.parametrize("recipe, override, refused", [
    ("serve.py", "+planner=semantic", True), ("plan.py", "+layer=semantic", True),
    ("profile.py", "+bench=cpu_smoke", True), ("serve.py", "+variability.curves.path=x.npz", False),
    ("plan.py", "+planner.restarts=3", False), ("serve.py", "+nonsense=1", False),
])
def test_a_config_group_the_recipe_does_not_read_is_refused(monkeypatch, recipe, override, refused):
    """A sweep found `serve.py +planner=semantic` (and the like) accepted and ignored."""
    from recipes import _common

    monkeypatch.setattr(_common, "invocation", lambda: {"argv": [], "overrides": [override]})
    groups = {"serve.py": ("model", "layer", "parallel", "workload", "router", "variability"),
              "plan.py": ("planner", "variability"), "profile.py": ("parallel", "profile")}[recipe]
    if refused:
        with pytest.raises(ValueError, match=rf"\{override}: {recipe} does not read the .* config group"):
            _common.refuse_other_groups(groups, recipe)
    else:
        _common.refuse_other_groups(groups, recipe)


def test_serve_refuses_a_planner_group_before_any_rank_starts(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "serve.py"), "+planner=semantic",
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "serve.py does not read the planner config group" in proc.stderr, proc.stderr[-2000:]
