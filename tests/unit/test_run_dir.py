"""The recipes' run dir: held by one run at a time, written all or nothing, and Ctrl-C ends a run
with one line. (A helper's journey found two serve runs into one ``hydra.run.dir`` leaving one's
results.json beside the other's rank_load.png, and a Ctrl-C during the plot leaving a new
results.json beside the earlier run's plot, or a truncated PNG under its final name.)"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import recipes._outputs as common
from recipes._outputs import RUN_LOCK, claim_run_dir, commit_files

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "run_dir", lambda default=".": str(tmp_path / "run"))
    monkeypatch.setattr(common.atexit, "register", lambda *a: None)  # (released by the test itself)
    yield tmp_path / "run"
    common._release_run_dir(tmp_path / "run" / RUN_LOCK)


HOLD = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": "h", "recipe": "serve.py", "started": "then"}).encode(), 0)
print("held", flush=True)
time.sleep(60)
"""


def _holder(folder: Path) -> subprocess.Popen:
    """Another process holding ``folder``'s run lock, as a running recipe does."""
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder / RUN_LOCK)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_run_holds_its_run_dir_and_a_killed_one_holds_nothing(in_dir):
    holder = _holder(in_dir)
    try:
        with pytest.raises(RuntimeError, match=rf"another run \(serve.py, process {holder.pid} on h, started then\) is "
                                               r"writing into this run dir: wait for it to end, or give this run "
                                               r"another hydra.run.dir"):
            claim_run_dir("plan.py")
    finally:
        holder.kill()  # kill -9: its lock file stays, its lock goes
        holder.wait()
    assert (in_dir / RUN_LOCK).exists()
    assert claim_run_dir("plan.py") == str(in_dir)
    held = json.loads((in_dir / RUN_LOCK).read_text())
    assert held["pid"] == os.getpid() and held["recipe"] == "plan.py" and held["host"] == socket.gethostname()
    assert claim_run_dir("plan.py") == str(in_dir)  # this process again (a main called twice): fine
    common._release_run_dir(in_dir / RUN_LOCK)
    assert not (in_dir / RUN_LOCK).exists()


def test_a_sweeps_next_job_lets_the_last_ones_dir_go(in_dir, tmp_path, monkeypatch):
    """A -m sweep runs its jobs one after another in one process, which held every job's lock until
    the sweep ended: one open file per job (a sweep of about a thousand jobs would run out)."""
    jobs = [tmp_path / "sweep" / str(n) for n in range(3)]
    for job in jobs:
        monkeypatch.setattr(common, "run_dir", lambda default=".", job=job: str(job))
        assert claim_run_dir("serve.py") == str(job)
        assert list(common._HELD) == [str(job / RUN_LOCK)] and (job / RUN_LOCK).exists()
    assert [(job / RUN_LOCK).exists() for job in jobs] == [False, False, True]
    common._release_run_dir(jobs[-1] / RUN_LOCK)


def test_runs_starting_together_take_the_dir_once(in_dir, tmp_path):
    """Eight processes claiming one run dir at once (with the lock file a killed run left): one holds it."""
    in_dir.mkdir()
    (in_dir / RUN_LOCK).write_text('{"pid": 1, "host": "h", "recipe": "serve.py", "started": "then"}')
    script = tmp_path / "claim.py"
    script.write_text(f"""
import os, sys, time
sys.path.insert(0, {str(ROOT)!r})
import recipes._outputs as common
common.run_dir = lambda default=".": {str(in_dir)!r}
try:
    common.claim_run_dir("x.py")
except RuntimeError:
    print("refused", flush=True)
    sys.exit(0)
print("held", flush=True)
t0 = time.time()
while not os.path.exists({str(tmp_path / "done")!r}) and time.time() - t0 < 90:
    time.sleep(0.05)  # held until every other process has tried
""")
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True) for _ in range(8)]
    t0 = time.time()
    while sum(p.poll() is not None for p in procs) < 7 and time.time() - t0 < 90:
        time.sleep(0.1)
    (tmp_path / "done").touch()
    outcomes = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outcomes == ["held"] + ["refused"] * 7, outcomes
    assert not (in_dir / RUN_LOCK).exists()  # released at the holder's exit


def test_a_run_dir_that_cannot_be_locked_is_used_unheld_with_a_note(in_dir, monkeypatch, capsys):
    """A file system without locks (flock: ENOLCK / ENOSYS) stopped the recipe with a traceback."""
    def no_locks(fd, op):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(common.fcntl, "flock", no_locks)
    assert claim_run_dir("serve.py") == str(in_dir)
    assert "is not held for this run" in capsys.readouterr().err and str(in_dir / RUN_LOCK) not in common._HELD


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


def test_ctrl_c_between_the_moves_lets_them_finish_then_stops(tmp_path, monkeypatch):
    """A Ctrl-C between the moves of one commit left the new rank_load.png beside the old results.json
    (simulated by a journey): the moves now finish together, then the interrupt is raised."""
    import signal

    for name in ("rank_load.png", "results.json"):
        (tmp_path / name).write_text("old")
    real_replace, moved = os.replace, []

    def replace_then_interrupt(src, dst):
        real_replace(src, dst)
        moved.append(Path(dst).name)
        if len(moved) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # delivered now, between the two moves

    monkeypatch.setattr(common.os, "replace", replace_then_interrupt)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        commit_files(tmp_path, {"rank_load.png": lambda p: p.write_text("new"),
                                "results.json": lambda p: p.write_text("new")})
    assert moved == ["rank_load.png", "results.json"]
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"rank_load.png": "new", "results.json": "new"}
    assert signal.getsignal(signal.SIGINT) is before  # the handler put back


def test_sigterm_between_the_moves_is_delivered_after_them(tmp_path, monkeypatch):
    """torchrun answers a Ctrl-C with SIGTERM to its workers: a review split a commit with it. It is
    held like a Ctrl-C, then delivered to the handler set before (also when a move fails)."""
    import signal

    got = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(
        ("handled", [p.name for p in moved], [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")])))
    real_replace, moved = os.replace, []

    def replace_then_term(src, dst):
        real_replace(src, dst)
        moved.append(Path(dst))
        if len(moved) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        if fail and len(moved) == 2:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(common.os, "replace", replace_then_term)
    try:
        for fail in (False, True):  # (failing: the temporary files are removed before the signal is delivered)
            moved.clear()
            got.clear()
            writers = {name: (lambda p: p.write_text("new")) for name in ("a.json", "b.json", "c.json")}
            if fail:
                with pytest.raises(OSError, match="No space left"):
                    commit_files(tmp_path, writers)
            else:
                commit_files(tmp_path, writers)
            # once, after the moves and the clean-up (c.json's temporary file when the second move failed)
            assert got == [("handled", ["a.json", "b.json"] + ([] if fail else ["c.json"]), [])], (fail, got)
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("held", [True, False])
def test_a_killed_runs_temporary_files_are_removed_by_the_next_commit(in_dir, held):
    """A run killed while writing (SIGTERM, SIGKILL) left .results.json.*.tmp in the run dir for good
    (a review); the next run's commit into the dir it holds removes those written before it started,
    not others. Unheld (a second review: a live run's, on a server with a slower clock, looked
    dead), it removes none."""
    tmp_path = in_dir
    tmp_path.mkdir()
    if held:
        claim_run_dir("serve.py")
    dead = tmp_path / ".results.json.abc123.tmp"
    dead.write_text("half a file")
    os.utime(dead, (time.time() - 3600, time.time() - 3600))
    fresh = tmp_path / ".results.json.def456.tmp"  # (written after this process started: not a dead run's)
    fresh.write_text("another")
    other = tmp_path / ".notes.txt.abc.tmp"  # not one of the outputs
    other.write_text("x")
    os.utime(other, (time.time() - 3600, time.time() - 3600))
    nested = tmp_path / "..results.json.abc123.tmp.f00d.tmp"  # atomic_write's own temporary of a writer's file
    nested.write_text("half a file")
    os.utime(nested, (time.time() - 3600, time.time() - 3600))
    mine = tmp_path / "..results.jsonl.backup.tmp"  # a user's own file that only looks like one
    mine.write_text("keep")
    os.utime(mine, (time.time() - 3600, time.time() - 3600))
    commit_files(tmp_path, {"results.json": lambda p: p.write_text("{}")})
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != RUN_LOCK)
    assert left == sorted([".notes.txt.abc.tmp", fresh.name, "results.json", mine.name]
                          + ([] if held else [dead.name, nested.name]))


def test_commit_files_flushes_each_file_before_the_moves_and_the_folder_after(tmp_path, monkeypatch):
    """Outputs other than save_trace's were not fsynced: a crash just after a run could leave an
    empty results.json in place of an earlier run's. Each file's content is flushed before any move,
    the folder after the moves; an I/O error of the flush fails the set, naming the output."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", "dir" if stat.S_ISDIR(st.st_mode) else st.st_size))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("move", Path(dst).name))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    commit_files(tmp_path, {"plan.npz": lambda p: p.write_bytes(b"12345"), "report.json": lambda p: p.write_text("{}")})
    assert events == [("fsync", 5), ("fsync", 2), ("move", "plan.npz"), ("move", "report.json"), ("fsync", "dir")]

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(OSError, match=re.escape(f"{tmp_path / 'report.json'}: cannot write (Input/output error)")):
        commit_files(tmp_path, {"report.json": lambda p: p.write_text('{"new": 1}')})
    assert (tmp_path / "report.json").read_text() == "{}"  # the earlier run's file stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.npz", "report.json"]  # no temporary file


def test_a_failing_optional_plot_is_left_out_and_the_run_written(tmp_path, capsys):
    """A journey found a finished serve / plan run lost (exit 1, no results.json) when its plot
    failed (a broken matplotlib backend): plots are optional files, an earlier one removed."""
    (tmp_path / "rank_load.png").write_text("earlier plot")

    def plot(path):
        path.write_bytes(b"\x89PNG half")
        raise ValueError("Key backend: 'nosuchbackend' is not a valid value for backend")

    paths = commit_files(tmp_path, {"rank_load.png": plot, "results.json": lambda p: p.write_text("new")},
                         stale=("rank_load.png",), optional=("rank_load.png",))
    assert paths == [tmp_path / "results.json"] and (tmp_path / "results.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # no earlier plot, no temporary file
    err = capsys.readouterr().err
    assert f"warning: {tmp_path / 'rank_load.png'} not written (ValueError: Key backend" in err
    with pytest.raises(OSError, match="disk full"):  # a file that is not optional still fails the set
        commit_files(tmp_path, {"rank_load.png": plot, "results.json": _disk_full}, stale=("rank_load.png",),
                     optional=("rank_load.png",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    assert "not written" not in capsys.readouterr().err  # (nothing was: no word of "the other files")
    assert (tmp_path / "results.json").read_text() == "new"


def _disk_full(path):
    raise OSError("disk full")


@pytest.mark.timeout(120)
def test_serve_with_a_broken_plot_backend_writes_its_results(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="nosuchbackend")
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "serve.py"), "parallel.world_size=2",
                           f"hydra.run.dir={run}", "workload.num_requests=2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rank_load.png not written" in proc.stderr
    assert sorted(p.name for p in run.iterdir()) == ["results.json"]


@pytest.mark.timeout(120)
def test_serve_run_into_a_held_run_dir_is_refused_and_leaves_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text("the other run's\n")
    holder = _holder(run)
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "serve.py"), "parallel.world_size=2",
                               f"hydra.run.dir={run}", "workload.num_requests=2"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode != 0 and "is writing into this run dir" in proc.stderr, proc.stderr[-2000:]
    assert sorted(p.name for p in run.iterdir()) == [RUN_LOCK, "results.json"]
    assert (run / "results.json").read_text() == "the other run's\n"


BENCH_RECORD = {"device_name": "cpu", "tokens_per_rank": 16, "ms": 1.0}
SERVE_RESULTS, PLAN_REPORT = {"throughput_tok_s": 1.0, "lar": 0.5}, {"planner": "gem", "ep": 2}
PROFILE_CURVES = {"rows": [1, 2], "latency_s": [[1e-5, 2e-5]], "device_names": ["cpu"]}
PLAN_CURVES = {"rows": [1, 2], "latency_s": [[1e-5, 2e-5]]}  # plan's copy: no device names


def _write(folder: Path, files: dict) -> None:
    for name, content in files.items():
        if name.endswith(".npz"):
            np.savez(folder / name, **{k: np.asarray(v) for k, v in content.items()})
        else:
            (folder / name).write_text("x" if content is None else json.dumps(content))


@pytest.mark.parametrize("files, recipe, refused", [
    ({"results.json": SERVE_RESULTS, "rank_load.png": None}, "plan.py", "serve.py's results.json"),
    ({"report.json": PLAN_REPORT, "curves.npz": PLAN_CURVES}, "profile.py", "plan.py's report.json"),
    ({"curves.npz": PROFILE_CURVES, "curves.png": None}, "plan.py", "profile.py's curves.npz"),  # plan's copy would replace it
    ({"ours_t16.json": BENCH_RECORD, "bench.png": None}, "serve.py", "bench.py's bench.png, ours_t16.json"),
    ({"report.json": PLAN_REPORT, "curves.npz": PLAN_CURVES, "plan.png": None}, "plan.py", None),  # its own earlier run
    ({"ours_t16.json": BENCH_RECORD}, "bench.py", None),
    ({"notes.json": {"mine": 1}, "README": None}, "serve.py", None),  # files of no recipe are left alone
    ({"results.json": {"accuracy": 0.9}, "report.json": ["a", "list"]}, "plan.py", None),  # others' files of those names
    ({"curves.npz": PLAN_CURVES}, "profile.py", None),
])
def test_a_run_dir_holding_another_recipes_outputs_is_refused(in_dir, files, recipe, refused):
    """A journey ran plan.py, then bench.py into a serve run's dir (three runs' files side by side,
    with no note) and profile.py into a plan run's dir (profile's curves.npz replaced plan's, whose
    report could no longer be recomputed from the dir). A review found any results.json or
    report.json taken for a recipe's (refusing unrelated dirs): each is told by its first key."""
    in_dir.mkdir()
    _write(in_dir, files)
    before = {p.name: p.read_bytes() for p in in_dir.iterdir()}
    if refused:
        with pytest.raises(ValueError, match=f"holds the outputs of another recipe \\({refused}.*{recipe}'s files "
                                             "would mix"):
            claim_run_dir(recipe)
        assert {p.name: p.read_bytes() for p in in_dir.iterdir()} == before  # nothing taken or written
    else:
        claim_run_dir(recipe)


def test_a_run_dir_that_cannot_be_written_is_refused_before_the_run(in_dir, monkeypatch):
    """A read-only run dir was taken for a file system without locks ("not held"), and the run
    failed at its very end on a temporary file's name (an environment journey)."""
    import errno

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(common.tempfile, "mkstemp", read_only)
    with pytest.raises(PermissionError, match=r"run dir cannot be written \(Read-only file system\): give a "
                                              r"hydra.run.dir this run can write into"):
        claim_run_dir("serve.py")


def test_a_run_dir_that_is_a_file_is_told_so(in_dir):
    in_dir.parent.mkdir(exist_ok=True)
    in_dir.write_text("a file")
    with pytest.raises(NotADirectoryError, match="the run dir is a file"):
        claim_run_dir("plan.py")


def test_a_long_output_names_dead_temporary_is_removed_too(in_dir):
    """Temporary names carry the first 64 bytes of the output's name: the clean-up looked for the
    whole name (a review)."""
    in_dir.mkdir()
    claim_run_dir("serve.py")
    name = "r" * 80 + ".json"
    commit_files(in_dir, {name: lambda p: p.write_text("1")})
    dead = next(iter(in_dir.glob(".r*.tmp")), None)
    assert dead is None  # (none left by a finished commit)
    dead = in_dir / f".{'r' * 64}.abc.tmp"
    dead.write_text("half")
    os.utime(dead, (time.time() - 3600, time.time() - 3600))
    commit_files(in_dir, {name: lambda p: p.write_text("2")})
    assert not dead.exists() and (in_dir / name).read_text() == "2"


def test_a_large_json_in_the_run_dir_is_not_parsed(in_dir):
    """Every JSON file of the dir was parsed to find bench records: 11 s and 0.5 GB for a 57 MB file."""
    in_dir.mkdir()
    big = in_dir / "data.json"
    big.write_text("[" + ", ".join(["1.0"] * 3_000_000) + "]")
    start = time.monotonic()
    assert common.recipe_outputs_in(in_dir) == {}
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("recipe", ["serve.py", "plan.py", "profile.py", "bench.py"])
@pytest.mark.parametrize("marked", [True, False])
def test_a_bench_save_to_folder_is_refused_as_a_run_dir(in_dir, recipe, marked):
    """A folder that bench.save_to keeps records in, given as hydra.run.dir: a bench run removed every
    record as an earlier run's output (a review). A store written before the mark existed is told by
    its records of several runs (a second review)."""
    in_dir.mkdir()
    files = {"vanilla_t16.json": {**BENCH_RECORD, "date": "2026-11-22", "command": "a"},
             "vanilla_t64.json": {**BENCH_RECORD, "date": "2026-11-28", "command": "b"}}
    _write(in_dir, {**files, **({common.BENCH_STORE_MARK: None} if marked else {})})
    with pytest.raises(ValueError, match="is a bench.save_to folder, which keeps the records of every run"):
        claim_run_dir(recipe)


def test_a_json_starting_with_device_name_is_not_taken_for_a_bench_record(in_dir):
    """A user's gpu_info.json ({"device_name": ..., "driver": ...}) was removed by a bench run as an
    earlier run's record, and made the other recipes refuse the dir (a second review)."""
    in_dir.mkdir()
    _write(in_dir, {"gpu_info.json": {"device_name": "NVIDIA H200", "driver": "580"}})
    assert common.recipe_outputs_in(in_dir) == {} and not common.is_bench_record(in_dir / "gpu_info.json")


@pytest.mark.timeout(120)
def test_bench_save_to_the_run_dir_is_refused(tmp_path):
    """``bench.save_to`` set to the run dir: the second run removed the first one's record as an
    earlier run's output, from the folder meant to keep records of every configuration."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "vanilla_t16.json").write_text(json.dumps(BENCH_RECORD))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "bench.py"), f"hydra.run.dir={run}",
                           f"bench.save_to={run}/.", "bench.tokens_per_rank=[16]", "plot=false"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode != 0 and "is this run's dir (hydra.run.dir)" in proc.stderr, proc.stderr[-2000:]
    assert json.loads((run / "vanilla_t16.json").read_text()) == BENCH_RECORD


@pytest.mark.timeout(150)
@pytest.mark.parametrize("recipe, args, output", [
    ("serve.py", ["workload.num_requests=2", "progress=false"], "results.json"),
    ("serve.py", ["workload.num_requests=2"], "results.json"),  # with its bar, on stderr, into the same pipe
    ("bench.py", ["bench.tokens_per_rank=[16]"], "vanilla_cpu_smoke_t16_ws2_*.json"),  # printed by a spawned rank
])
def test_a_reader_that_goes_away_costs_the_run_nothing(tmp_path, recipe, args, output):
    """`serve.py ... | true` printed its table before writing its files and died on BrokenPipeError
    with nothing written (an environment journey); a review found `bench.py | head` (rank 0's lines
    come from a spawned rank) and `2>&1 | head` (stderr) failing the same way. The files come first,
    and output to a reader that went away is dropped, in every process."""
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "recipes" / recipe), "parallel.world_size=2",
                             f"hydra.run.dir={run}", "plot=false", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc.stdout.close()  # the reader of both streams is gone before the first line
    assert proc.wait(timeout=140) == 0
    assert list(run.glob(output)), sorted(p.name for p in run.iterdir())


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


def test_a_full_disk_is_told_with_the_file(in_dir, monkeypatch):
    """ENOSPC named no file ("[Errno 28] No space left on device"), and a move failing part-way left a
    mixed run dir without saying so (a journey on storage that misbehaves)."""
    import errno

    in_dir.mkdir()
    claim_run_dir("serve.py")

    def full(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match=r"run/results\.json: cannot write \(No space left on device\)"):
        commit_files(in_dir, {"results.json": full})
    commit_files(in_dir, {"a.png": lambda p: p.write_text("old"), "results.json": lambda p: p.write_text("old")})
    real, calls = os.replace, []

    def second_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", second_fails)
    with pytest.raises(OSError, match=r"results\.json: cannot move this run's file in \(Input/output error\); this "
                                      r"run's a\.png moved in already: rerun"):
        commit_files(in_dir, {"a.png": lambda p: p.write_text("new"), "results.json": lambda p: p.write_text("new")})
    assert sorted(p.name for p in in_dir.iterdir() if p.name != RUN_LOCK) == ["a.png", "results.json"]
    calls[:] = ["(counted)"]  # the first move fails, after an earlier output this run does not write was removed
    with pytest.raises(OSError, match=r"nothing of this run moved in, the earlier a\.png removed"):
        commit_files(in_dir, {"x.json": lambda p: p.write_text("1"), "results.json": lambda p: p.write_text("new")},
                     stale=("a.png",))

    def reads_a_missing_file(path):  # another file's error is its own, not the output's
        open(in_dir / "no-such-input.txt").read()

    monkeypatch.setattr(os, "replace", real)
    with pytest.raises(FileNotFoundError, match="no-such-input.txt"):
        commit_files(in_dir, {"results.json": reads_a_missing_file})


def test_a_full_disk_at_the_start_leaves_no_lock_file(in_dir, monkeypatch):
    import errno

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match=rf"run: cannot write {re.escape(RUN_LOCK)} there \(No space left on device\)"):
        claim_run_dir("serve.py")
    assert not (in_dir / RUN_LOCK).exists() and str(in_dir / RUN_LOCK) not in common._HELD


def test_a_lock_file_that_cannot_be_removed_at_the_end_is_let_go(in_dir, monkeypatch):
    """A read-only remount ended a finished run with a traceback from the atexit callback."""
    import errno

    in_dir.mkdir()
    claim_run_dir("serve.py")
    lock = in_dir / RUN_LOCK

    def read_only(self, missing_ok=False):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(Path, "unlink", read_only)
    common._release_run_dir(lock)
    assert str(lock) not in common._HELD
