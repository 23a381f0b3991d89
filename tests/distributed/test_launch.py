"""The recipes' launcher: ``parallel.timeout_s`` bounds a rank's wait for the others in a
collective (a hung or dead peer), not the length of the run."""

import time

import pytest
import torch.distributed as dist

from recipes._common import launch


def _work_then_meet(rank: int, world: int, cfg: dict) -> int:
    time.sleep(cfg["work_s"][rank])
    dist.barrier()
    return rank


@pytest.mark.timeout(90)
def test_a_run_longer_than_timeout_s_finishes(tmp_path):
    """A journey found a healthy serve run killed at timeout_s ("a rank hung or died") with no
    results: the spawned runner took timeout_s as the limit on the whole run."""
    cfg = {"parallel": {"world_size": 2, "backend": "gloo", "timeout_s": 1.5}, "run_dir": str(tmp_path),
           "work_s": [4.0, 4.0]}  # both work longer than timeout_s, neither waits for the other
    assert launch(cfg, _work_then_meet) == 0


@pytest.mark.timeout(90)
def test_a_rank_that_waits_longer_than_timeout_s_fails_the_run(tmp_path):
    cfg = {"parallel": {"world_size": 2, "backend": "gloo", "timeout_s": 2}, "run_dir": str(tmp_path),
           "work_s": [0.0, 60.0]}  # rank 1 hangs: rank 0 waits in the barrier
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)distributed run failed:.*--- rank 0 ---.*[Tt]imed? ?out"):
        launch(cfg, _work_then_meet)
    assert time.monotonic() - t0 < 40  # not rank 1's 60 s


def _threads(rank: int, world: int) -> int:
    import torch

    return torch.get_num_threads()


@pytest.mark.timeout(120)
def test_ranks_take_their_threads_from_omp_num_threads(monkeypatch):
    """A journey found the ranks on one thread whatever OMP_NUM_THREADS said."""
    from moelayers.testing import run_distributed

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert run_distributed(_threads, 2) == [2, 2]


def _one_hangs_after_the_last_collective(rank: int, world: int, cfg: dict) -> int:
    dist.barrier()
    if rank == 1:
        time.sleep(60)
    return rank


@pytest.mark.timeout(90)
def test_a_rank_hung_after_its_peers_reported_fails_the_run(tmp_path):
    """A review found the launcher waiting forever for a rank hung outside any collective once the
    others had finished: after the first report the others get timeout_s."""
    cfg = {"parallel": {"world_size": 2, "backend": "gloo", "timeout_s": 2}, "run_dir": str(tmp_path)}
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"timed out after 2 s"):
        launch(cfg, _one_hangs_after_the_last_collective)
    assert time.monotonic() - t0 < 40


def _torchrun_serve(*args: str):
    """``torchrun --standalone --nproc_per_node=2 recipes/serve.py ARGS`` on the CPU (gloo), captured."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not on PATH")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", str(root / "recipes" / "serve.py"), *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=170)


@pytest.mark.timeout(180)
def test_a_refused_setting_under_torchrun_is_told_in_full_once(tmp_path):
    """A journey found every torchrun rank printing Hydra's whole error for one bad setting: rank 0
    tells it with its traceback, the others its message alone."""
    proc = _torchrun_serve("+layer.kwargs.capacity=0", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode != 0
    message = "layer.kwargs.capacity must be an integer >= 1, got 0"
    assert proc.stderr.count(f"\nValueError: {message}") == 1, proc.stderr[-3000:]  # rank 0's traceback, once
    assert f"rank 1 stopped before the run started: ValueError: {message}" in proc.stderr


@pytest.mark.timeout(180)
def test_cfg_under_torchrun_is_printed_once():
    """A review found --help and --cfg printed once per torchrun rank."""
    proc = _torchrun_serve("--cfg", "job")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("\nseed: ") + proc.stdout.startswith("seed: ") == 1, proc.stdout[-2000:]
