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
    (conf / "layer" / "seeded.yaml").write_text("name: seeded\ncls: moelayers.VariabilityAwareMoE\n"
                                                "kwargs: {plan_seed: '${seed}'}\n")
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
                                                r".*conf/layer; one of \['mylayer', 'seeded', 'semantic', 'vanilla', 'variability'\]"):
        baseline_layer("nope", common.CONF_DIR)


def test_the_keys_interpolations_read_are_found():
    """Relative ${.n}, a resolver's arguments and the hydra node's references were missed: their keys
    were named as unread, and ++ of them refused."""
    cfg = {"my": {"n": 4, "tag": "a"}, "workload": {"n": 2, "num_requests": "${.n}", "rate": "${..my.n}"},
           "seed": "${oc.select:my.seed-x,8}", "run": ["${my.tag}"]}
    assert {"workload.n", "my.n", "my.seed-x", "my.tag"} <= common.referenced_keys(cfg)


def test_a_misspelt_key_at_the_wrong_level_gets_the_key_it_resembles():
    keys = {"workload", "workload.num_requests", "workload.rate", "seed"}
    assert common._near("num_request", keys) == " (did you mean workload.num_requests?)"
    assert common._near("workload.rat", keys) == " (did you mean workload.rate?)"
    assert common._near("zzz", keys) == ""


def test_a_typo_beside_a_key_set_on_the_command_line_is_still_named():
    keys = {"planner", "planner.restarts", "planner.name"}
    tree = {"planner": {"name": "gem", "restarts": 3, "restart": 2}}
    assert common.unread_config_keys(tree, keys, skip=["planner.restarts"]) == ["planner.restart"]
    assert common.unread_config_keys(tree, keys, skip=["planner"]) == []


def test_a_run_dir_named_by_a_key_of_ones_own(user_dir, tmp_path):
    """${tag} read by hydra.run.dir alone was named as unread, and ++tag= refused."""
    (user_dir / "tagged.yaml").write_text("defaults:\n  - plan\n  - _self_\n" + SMALL + "tag: small\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "plan.py"), "--config-dir", str(user_dir),
                           "--config-name", "tagged", "planner=eplb", "++tag=big", f"hydra.run.dir={tmp_path}/" + "${tag}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "reads no key" not in proc.stderr, proc.stderr[-2000:]
    assert (tmp_path / "big" / "report.json").is_file()


def test_a_bench_baseline_of_ones_own(user_dir, tmp_path):
    """bench.baseline=NAME of a --config-dir layer passed the checks and failed in the spawned ranks,
    which do not know Hydra's search path; an option reading ${seed} failed to resolve alone."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "bench.py"), "--config-dir", str(user_dir),
                           "bench.baseline=seeded", "bench.tokens_per_rank=[8]", "bench.iters=1", "bench.warmup=0",
                           "plot=false", f"hydra.run.dir={tmp_path}/b"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "baseline seeded" in proc.stdout, proc.stdout[-2000:]


def test_a_removed_section_is_named(user_dir, tmp_path):
    """``~trace`` ended in a bare ``KeyError: 'trace'``."""
    proc = _plan(user_dir, tmp_path / "r", "~trace")
    assert proc.returncode != 0 and "ValueError: plan.py needs the config's trace (removed with ~KEY" in proc.stderr, \
        proc.stderr[-2000:]
