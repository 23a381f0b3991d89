"""The recipes' run dir: held by one run at a time, written all or nothing, and Ctrl-C ends a run
with one line. (A helper's journey found two serve runs into one ``hydra.run.dir`` leaving one's
results.json beside the other's rank_load.png, and a Ctrl-C during the plot leaving a new
results.json beside the earlier run's plot, or a truncated PNG under its final name.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import recipes._common as common
from recipes._common import RUN_LOCK, claim_run_dir, commit_files

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "run_dir", lambda default=".": str(tmp_path / "run"))
    monkeypatch.setattr(common.atexit, "register", lambda *a: None)  # (the test process lives on)
    return tmp_path / "run"


def _lock(folder: Path, **holder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RUN_LOCK).write_text(json.dumps({"host": socket.gethostname(), "recipe": "serve.py",
                                               "started": "2026-11-28T10:00:00", **holder}))


def test_a_live_run_holds_its_run_dir(in_dir):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _lock(in_dir, pid=sleeper.pid)
        with pytest.raises(RuntimeError, match=rf"another run \(serve.py, process {sleeper.pid} on .*\) is writing "
                                               r"into this run dir: wait for it to end, or give this run another "
                                               r"hydra.run.dir \(if no such run is going on, delete .*lock\)"):
            claim_run_dir("plan.py")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert claim_run_dir("plan.py") == str(in_dir)  # its process is gone: taken over
    held = json.loads((in_dir / RUN_LOCK).read_text())
    assert held["pid"] == os.getpid() and held["recipe"] == "plan.py"
    assert claim_run_dir("plan.py") == str(in_dir)  # this process again (a main called twice): fine


def test_a_lock_of_another_host_is_respected_and_a_half_written_one_only_while_fresh(in_dir):
    _lock(in_dir, pid=1, host="elsewhere")
    with pytest.raises(RuntimeError, match="on elsewhere"):
        claim_run_dir("serve.py")
    (in_dir / RUN_LOCK).write_text("{")  # created, not yet written
    with pytest.raises(RuntimeError, match="another run"):
        claim_run_dir("serve.py")
    old = time.time() - 60
    os.utime(in_dir / RUN_LOCK, (old, old))
    assert claim_run_dir("serve.py") == str(in_dir)


def test_release_removes_only_this_runs_lock(tmp_path):
    me = {"pid": os.getpid(), "host": "h", "recipe": "serve.py", "started": "x"}
    lock = tmp_path / RUN_LOCK
    lock.write_text(json.dumps(me))
    common._release_run_dir(lock, me)
    assert not lock.exists()
    lock.write_text(json.dumps(dict(me, pid=1)))  # taken over by another run meanwhile
    common._release_run_dir(lock, me)
    assert lock.exists()


def test_run_recipe_ends_on_ctrl_c_with_one_line(capsys):
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_:
        common.run_recipe(interrupted)
    assert exit_.value.code == 130
    assert "interrupted: files this run had not finished were not written" in capsys.readouterr().err


def test_commit_files_keeps_the_earlier_set_when_a_writer_fails(tmp_path):
    (tmp_path / "results.json").write_text("earlier")
    (tmp_path / "rank_load.png").write_text("earlier plot")

    def plot(path):
        path.write_bytes(b"\x89PNG half")
        raise KeyboardInterrupt  # Ctrl-C while drawing

    with pytest.raises(KeyboardInterrupt):
        commit_files(tmp_path, {"rank_load.png": plot, "results.json": lambda p: p.write_text("new")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_load.png", "results.json"]  # no temporary file
    assert (tmp_path / "results.json").read_text() == "earlier"
    assert (tmp_path / "rank_load.png").read_text() == "earlier plot"


@pytest.mark.timeout(120)
def test_serve_run_into_a_held_run_dir_is_refused_and_leaves_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text("the other run's\n")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock(run, pid=sleeper.pid)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "serve.py"), "parallel.world_size=2",
                               f"hydra.run.dir={run}", "workload.num_requests=2"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert proc.returncode != 0 and "is writing into this run dir" in proc.stderr, proc.stderr[-2000:]
    assert sorted(p.name for p in run.iterdir()) == [RUN_LOCK, "results.json"]
    assert (run / "results.json").read_text() == "the other run's\n"


def _sleep_forever(rank, world):
    time.sleep(60)


@pytest.mark.timeout(60)
def test_run_distributed_stops_its_ranks_at_once_on_ctrl_c():
    """Ctrl-C to the launching process alone waited 5 s per rank before killing them."""
    from moelayers.testing import run_distributed

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(8)  # (the ranks take a few seconds to start)
    t0 = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_distributed(_sleep_forever, 2, timeout=50)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert time.perf_counter() - t0 < 8 + 3
