"""A user's own Hydra configuration: a config dir with an experiment, own options and helper keys.
(A journey found misspelt keys in config files running silently with the defaults, Hydra's
``+experiment=NAME`` pattern and ``++KEY`` of the user's own keys refused, and
``compare.layer=NAME`` and ``--help`` seeing conf/'s options only.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import recipes._common as common
from recipes._serve_compare import baseline_layer

ROOT = Path(__file__).resolve().parents[2]
SMALL = ("progress: false\nplot: false\nparallel: {ep: 2}\ntrace: {num_sequences: 12, num_layers: 2, num_experts: 8, "
         "top_k: 2, vocab_size: 200, seq_len: [32, 48], tokens_per_step: 128}\n")


@pytest.fixture
def user_dir(tmp_path):
    conf = tmp_path / "myconf"
    (conf / "planner").mkdir(parents=True)
    (conf / "experiment").mkdir()
    (conf / "layer").mkdir()
    (conf / "myplan.yaml").write_text("defaults:\n  - plan\n  - _self_\n" + SMALL)
    (conf / "planner" / "mygem.yaml").write_text("name: gem\nmethd: plain\nrestart: 2\n")
    (conf / "experiment" / "quick.yaml").write_text("# @package _global_\nplanner: {restarts: 2}\nseed: 7\n")
    (conf / "withvars.yaml").write_text("defaults:\n  - plan\n  - _self_\n" + SMALL +
                                        "my: {restarts: 3}\nnotes: my own record\nplanner: {restarts: '${my.restarts}'}\n")
    (conf / "layer" / "mylayer.yaml").write_text("name: mine\ncls: moelayers.VanillaMoE\nkwargs: {dedup: false}\n")
    return conf


def _plan(conf: Path, run: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(ROOT / "recipes" / "plan.py"), "--config-dir", str(conf), *args,
                           f"hydra.run.dir={run}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_misspelt_keys_of_a_config_file_are_named(user_dir, tmp_path):
    proc = _plan(user_dir, tmp_path / "run", "--config-name", "myplan", "planner=mygem")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("warning: plan.py reads no key planner.methd (did you mean planner.method?), planner.restart (did you "
            "mean planner.restarts?) of the config, so the run ignores them") in proc.stderr, proc.stderr[-2000:]


def test_an_experiment_and_the_users_own_keys_are_taken(user_dir, tmp_path):
    proc = _plan(user_dir, tmp_path / "a", "--config-name", "myplan", "planner=gem", "+experiment=quick")
    assert proc.returncode == 0 and "reads no key" not in proc.stderr, proc.stderr[-2000:]
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert report["config"]["planner"]["restarts"] == 2 and report["config"]["seed"] == 7
    # my.restarts feeds planner.restarts (an interpolation reads it); notes is the user's, named in a warning
    proc = _plan(user_dir, tmp_path / "b", "--config-name", "withvars", "planner=gem", "++my.restarts=4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reads no key notes of the config" in proc.stderr and "my.restarts" not in proc.stderr, proc.stderr
    assert json.loads((tmp_path / "b" / "report.json").read_text())["config"]["planner"]["restarts"] == 4


def test_help_and_a_baseline_find_the_users_options(user_dir, tmp_path, monkeypatch):
    proc = _plan(user_dir, tmp_path / "h", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "planner: eplb, gem, linear, mygem, semantic" in proc.stdout, proc.stdout
    monkeypatch.setattr(common, "config_dirs", lambda: [str(user_dir), common.CONF_DIR])
    assert baseline_layer("mylayer", common.CONF_DIR)["kwargs"] == {"dedup": False}
    assert baseline_layer("vanilla", common.CONF_DIR)["name"] == "vanilla"
    with pytest.raises(FileNotFoundError, match=r"compare\.layer='nope': no nope\.yaml in .*myconf/layer or "
                                                r".*conf/layer; one of \['mylayer', 'semantic', 'vanilla', 'variability'\]"):
        baseline_layer("nope", common.CONF_DIR)
