"""``python recipes/X.py --help`` shows the recipe's own docstring above Hydra's config listing."""

from __future__ import annotations

import ast
import json
import os
import re
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
    # the config groups: those this recipe reads only (every group of conf/ was listed)
    listed = out.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    groups = [line.split(":")[0] for line in listed.splitlines()[2:] if ":" in line]
    text = path.read_text()
    expected = ast.literal_eval(text.split("\nCONFIG_GROUPS = ", 1)[1].split("\n", 1)[0])
    assert groups == sorted(expected), listed


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
    ("serve.py", "+planner=semantic", "does not read the planner config group"),
    ("plan.py", "+layer=semantic", "does not read the layer config group"),
    ("profile.py", "+bench=cpu_smoke", "does not read the bench config group"),
    ("serve.py", "+variability.curves.path=x.npz", None), ("plan.py", "+planner.restarts=3", None),
    ("serve.py", "+layer.placement_path=p.json", None), ("serve.py", "+layer.kwargs.anything=1", None),
    ("serve.py", "+workload.output_len.sigma=0.5", None), ("serve.py", "+scheduler.plan_path=p.npz", None),
    ("serve.py", "hydra.run.dir=/tmp/x", None), ("bench.py", "+hydra.job.chdir=true", None),
    ("serve.py", "+nonsense=1", r"serve.py reads no key nonsense\b.*the top-level keys are .*workload"),
    ("serve.py", "+workload.foo=1", r"key workload.foo\b.*the keys under workload are .*num_requests"),
    ("serve.py", "++parallel.foo=1", r"key parallel.foo\b.*world_size"),
    ("serve.py", "+layer.placment_path=p.json", r"key layer.placment_path\b.*placement_path"),
    ("plan.py", "+planner.restart=3", r"key planner.restart\b.*restarts"),
    ("bench.py", "+bench.shape.hiden_size=8", r"key bench.shape.hiden_size\b.*hidden_size"),
    ("bench.py", "+model=tiny", "does not read the model config group"),
    ("bench.py", "+variability=high", None),  # passed to check_config, which says why bench emulates none
    ("profile.py", "+profile.foo.bar=1", r"key profile.foo.bar\b.*the keys under profile are .*allow_large_cpu"),
    ("profile.py", "profile.allow_large_cpu=true", None),  # read (it is in the config: no + needed)
    ("bench.py", "+bench.shape.init_std=0.5", None), ("serve.py", "+compare.layer.kwargs.capacity=64", None),
    ("serve.py", "+compare.layer.plan_path=p.npz", None), ("serve.py", "+compare.scheduler.plan_path=p.npz", None),
    ("serve.py", "+compare.layer.foo=1", r"key compare.layer.foo\b.*the keys under compare.layer are .*kwargs"),
    ("serve.py", "+layer.kwarg.capacity=8", r"key layer.kwarg.capacity\b.*the keys under layer are .*kwargs"),
    ("serve.py", "+hydra/job_logging=disabled", None), ("serve.py", "+layer@compare.layer=vanilla", None),
    ("serve.py", "+layer@foo=vanilla", r"reads no key foo\b"), ("bench.py", "+layer@layer_typo=vanilla", "layer_typo"),
    ("serve.py", "+planner@foo=semantic", "does not read the planner config group"),
])
def test_an_override_the_recipe_would_ignore_is_refused(monkeypatch, recipe, override, refused):
    """Sweeps found `serve.py +planner=semantic` (a group it does not read) and `+planner.restart=3`
    (a misspelt key, added by Hydra and read by nothing) accepted and ignored."""
    _check_override(monkeypatch, recipe, override, refused, choices={})


@pytest.mark.parametrize("recipe, override, choices, refused", [
    ("plan.py", "+planner.restarts=3", {"planner": "semantic"},
     r"plan.py with planner=semantic reads no key planner.restarts \(planner=gem reads it\).*choose that option"),
    ("plan.py", "+planner.restarts=3", {"planner": "gem"}, None),
    ("plan.py", "+planner.theta=0.3", {"planner": "eplb"}, r"planner=eplb reads no key planner.theta \(planner=semantic"),
    ("serve.py", "+layer.placement_path=p.json", {"layer": "semantic"}, None),  # check_config says why
    ("bench.py", "+layer.placement_path=p.json", {"layer": "semantic"}, None),  # check_config: serve.py reads it
    ("bench.py", "+layer.plan_train_fraction=0.3", {"layer": "vanilla"}, "with layer=vanilla reads no key"),
    ("bench.py", "++layer.plan_train_fraction=0.3", {"layer": "vanilla"}, "with layer=vanilla reads no key"),
    ("serve.py", "+layer.kwargs.window=4", {"layer": "vanilla"}, None),  # the layer's constructor checks kwargs
    ("serve.py", "+layer.plan_path=p.npz", {"layer": "vanilla"}, None),  # scheduler=semantic reads it: check_config
    ("serve.py", "+compare.layer.placement_path=p.json", {"layer": "semantic"}, None),  # any option's keys
    ("serve.py", "+layer.placment_path=p.json", {"layer": "vanilla"}, r"key layer.placment_path\b.*placement_path"),
    ("bench.py", "+layer.plan_train_fraction=0.3", {"layer": "variability"}, "layer=semantic reads it"),
])
def test_a_key_of_another_option_of_the_group_is_refused(monkeypatch, recipe, override, choices, refused):
    """A sweep found `+planner.restarts=3` accepted with planner=semantic, `+layer.plan_path=FILE` with
    layer=vanilla: the check took the keys of every option of a group, not the chosen one's."""
    _check_override(monkeypatch, recipe, override, refused, choices)


@pytest.mark.parametrize("override, refused", [
    ("++layer.plan_train_fraction=0.3", None),  # -m layer=semantic,vanilla: the semantic job reads it
    ("++layer.plan_train_fractoin=0.3", "reads no key"),  # a typo still is one
    ("+layer.plan_train_fraction=0.3", "with layer=vanilla reads no key"),  # + fails on the semantic job anyway
])
def test_a_sweep_sets_a_key_of_another_option_with_plus_plus(monkeypatch, override, refused):
    """A review found `bench.py -m layer=semantic,vanilla ++layer.plan_train_fraction=0.3` refused on
    its vanilla job; outside a sweep ``++`` is checked like ``+`` (a second review)."""
    from recipes import _common

    monkeypatch.setattr(_common, "in_sweep", lambda group: group == "layer")
    _check_override(monkeypatch, "bench.py", override, refused, {"layer": "vanilla"})


def _check_override(monkeypatch, recipe: str, override: str, refused: str | None, choices: dict) -> None:
    """The recipe's override check on the command line ``[override]`` with the group options
    ``choices`` (``{}``: none known, as outside Hydra): refused matching ``refused``, or passed."""
    from recipes import _common

    import importlib

    monkeypatch.setattr(_common, "invocation", lambda: {"argv": [], "overrides": [override]})
    monkeypatch.setattr(_common, "chosen_options", lambda: choices)
    module = importlib.import_module(f"recipes.{recipe[:-3]}")
    primary = {"serve.py": "config"}.get(recipe, recipe[:-3])
    args = (primary, module.CONFIG_GROUPS, getattr(module, "OPEN_KEYS", ()), getattr(module, "EXTRA_KEYS", ()),
            getattr(module, "MIRRORS", None))
    if refused:
        with pytest.raises(ValueError, match=re.escape(override) + ": .*" + refused):
            _common.refuse_unread_overrides(recipe, *args)
    else:
        _common.refuse_unread_overrides(recipe, *args)


def test_plan_refuses_a_key_of_another_planner_under_hydra(tmp_path):
    """The chosen option comes from Hydra's runtime choices (planner=semantic on the command line)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "plan.py"), "planner=semantic", "+planner.restarts=3",
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and ("plan.py with planner=semantic reads no key planner.restarts (planner=gem reads it)"
                                     in proc.stderr), proc.stderr[-2000:]


def test_a_sweep_that_keeps_the_option_refuses_its_key_with_plus_plus(tmp_path):
    """A review found any -m run letting ++KEY of another option through (`-m seed=0,1` too): only a
    sweep over the key's group does."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "plan.py"), "-m", "seed=0", "planner=eplb",
                           "++planner.theta=0.3", f"hydra.sweep.dir={tmp_path}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "plan.py with planner=eplb reads no key planner.theta" in proc.stderr, \
        proc.stderr[-2000:]


def test_a_sweep_in_a_config_file_lets_plus_plus_through(tmp_path):
    """A sweep set in a config's ``hydra.sweeper.params`` (not on the command line) refused
    ``++planner.restarts`` on its eplb job: in_sweep read sys.argv only."""
    (tmp_path / "myplan.yaml").write_text(
        "defaults:\n  - plan\n  - _self_\n"
        "trace: {num_sequences: 8, num_layers: 2, num_experts: 8, top_k: 2, seq_len: 64, tokens_per_step: 128}\n"
        "plot: false\nprogress: false\nhydra:\n  sweeper:\n    params:\n      planner: eplb,gem\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "plan.py"), "--config-dir", str(tmp_path),
                           "--config-name", "myplan", "-m", "++planner.restarts=2", f"hydra.sweep.dir={tmp_path}/out"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = [json.loads((tmp_path / "out" / str(i) / "report.json").read_text()) for i in (0, 1)]
    assert [r["config"]["planner"]["name"] for r in reports] == ["eplb", "gem"]
    # planner=eplb on the command line replaces the config's sweep: one eplb job, which reads no restarts
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "plan.py"), "--config-dir", str(tmp_path),
                           "--config-name", "myplan", "-m", "planner=eplb", "++planner.restarts=2",
                           f"hydra.sweep.dir={tmp_path}/one"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "plan.py with planner=eplb reads no key planner.restarts" in proc.stderr, \
        proc.stderr[-2000:]


def test_serve_refuses_a_planner_group_before_any_rank_starts(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "serve.py"), "+planner=semantic",
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "serve.py does not read the planner config group" in proc.stderr, proc.stderr[-2000:]


def test_a_misspelt_layer_kwarg_names_the_ones_the_layer_takes():
    """A fresh-eyes journey found `+layer.kwargs.capcity=8` answered with Python's bare "unexpected
    keyword argument": the error lists the keywords the layer class takes."""
    import torch

    import moelayers as ml
    from recipes._common import check_layer_settings

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    build = lambda **kw: ml.SemanticMoE(cfg, ml.ParallelGroups.single(), device=torch.device("meta"), **kw)  # noqa: E731
    with pytest.raises(TypeError, match=r"layer.kwargs: .*'capcity' \(SemanticMoE takes .*\bcapacity\b.*\bmode\b"):
        check_layer_settings(build, {"capcity": 8}, "layer.kwargs", ml.SemanticMoE)
    check_layer_settings(build, {"capacity": 8}, "layer.kwargs", ml.SemanticMoE)


@pytest.mark.parametrize("key", ["trace.path", "layer.plan_path", "compare.layer.placement_path", "bench.save_to"])
def test_an_empty_path_is_refused(key):
    """`trace.path=$TRACE` with TRACE unset planned a synthetic trace and exited 0 (an environment
    journey): an empty path read as "not given". It is refused; null still means not given."""
    from recipes._common import refuse_empty_paths

    d: dict = {}
    node = d
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = " "
    with pytest.raises(ValueError, match=rf"{re.escape(key)} is empty \(' '\): give a path, or null"):
        refuse_empty_paths(d)
    node[last] = None
    refuse_empty_paths(d)


@pytest.mark.parametrize("recipe, override", [("plan.py", "trace.path="), ("serve.py", "layer.placement_path=")])
def test_an_empty_path_on_the_command_line_is_refused_before_the_run(tmp_path, recipe, override):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / recipe), override, f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and f"{override[:-1]} is empty" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
