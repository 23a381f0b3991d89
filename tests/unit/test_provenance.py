"""What a recipe's outputs say about the run that made them (``recipes._common.provenance``): a
journey over the outputs found no version, commit, host or date in serve's, plan's or profile's
files, and the input files (trace, plan, curves) recorded by path only."""

from __future__ import annotations

import datetime
import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

import moelayers
from recipes import _common
from recipes._common import provenance

ROOT = Path(__file__).resolve().parents[2]


def check_provenance(prov: dict, inputs: dict[str, Path]) -> None:
    """``prov`` names this moelayers and each of ``inputs`` (``{setting: file}``) by path and content."""
    assert prov["moelayers"] == moelayers.__version__ and prov["host"] and prov["torch"]
    assert datetime.datetime.fromisoformat(prov["date"]).tzinfo is not None  # UTC, with its offset
    assert set(prov["inputs"]) == set(inputs), prov["inputs"]
    for key, path in inputs.items():
        data = Path(path).read_bytes()
        assert prov["inputs"][key] == {"path": str(Path(path).resolve()), "bytes": len(data),
                                       "sha256": hashlib.sha256(data).hexdigest()}
    if shutil.which("git") and (ROOT / ".git").exists():
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        assert prov["commit"] == head.strip() and isinstance(prov["dirty"], bool)


def test_provenance_names_the_inputs_by_content(tmp_path):
    a, b = tmp_path / "trace.npz", tmp_path / "plan.npz"
    a.write_bytes(b"a" * 70_000_000)  # larger than one read block
    b.write_bytes(b"")
    prov = provenance({"trace.path": a, "plan.path": str(b), "curves.path": None, "other": ""})
    check_provenance(prov, {"trace.path": a, "plan.path": b})  # unset settings left out
    a.write_bytes(b"b" * 70_000_000)  # rewritten under the same name: told apart
    assert provenance({"trace.path": a})["inputs"]["trace.path"]["sha256"] != prov["inputs"]["trace.path"]["sha256"]


def test_an_installed_copy_inside_another_checkout_names_no_commit(tmp_path, monkeypatch):
    """moelayers installed into a virtualenv kept inside the user's own git project: that project's
    commit is not moelayers'."""
    if not shutil.which("git"):
        pytest.skip("needs git")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    site = tmp_path / "venv" / "site-packages" / "moelayers"
    site.mkdir(parents=True)
    monkeypatch.setattr(moelayers, "__file__", str(site / "__init__.py"))
    assert _common._source_commit() == {"commit": None, "dirty": None}


def test_a_git_archive_names_its_commit(tmp_path, monkeypatch):
    """A copy unpacked from ``git archive`` (a release tarball, the GPU machines' snapshots) recorded
    ``commit: null``: .git_archival.txt carries the commit (export-subst), ``dirty`` unknown."""
    if not shutil.which("git"):
        pytest.skip("needs git")
    repo = Path(_common.__file__).resolve().parents[1]
    if not (repo / ".git").exists():
        pytest.skip("needs the moelayers checkout")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    archive = subprocess.run(["git", "-C", str(repo), "archive", "HEAD", ".git_archival.txt", "moelayers/__init__.py"],
                             capture_output=True, check=True).stdout
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp_path, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))  # (3.10.12+)
    monkeypatch.setattr(moelayers, "__file__", str(tmp_path / "moelayers" / "__init__.py"))
    assert _common._source_commit() == {"commit": head, "dirty": None}
    (tmp_path / ".git_archival.txt").write_text("commit: $Format:%H$\n")  # a checkout's own, unexpanded
    assert _common._source_commit() == {"commit": None, "dirty": None}


def test_no_git_names_no_commit(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert _common._source_commit() == {"commit": None, "dirty": None}


def test_input_paths_through_a_symlink_are_read_and_recorded_as_the_system_resolves_them(tmp_path, monkeypatch):
    """``latest/../trace.npz`` with ``latest`` a symlink: a textual normalisation (a review) named
    another file than the one the system opens; the recipes keep the path as typed, and the
    provenance records the file it resolves to."""
    store = tmp_path / "store"
    (store / "runs").mkdir(parents=True)
    (store / "trace.npz").write_bytes(b"the real trace")  # what latest/../trace.npz opens
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "latest").symlink_to(store / "runs")
    monkeypatch.chdir(tmp_path / "work")
    typed = _common.absolute_path("latest/../trace.npz")
    assert Path(typed).read_bytes() == b"the real trace"
    assert provenance({"trace.path": typed})["inputs"]["trace.path"]["path"] == str((store / "trace.npz").resolve())


def test_an_unreadable_input_is_recorded_not_raised(tmp_path):
    """A file named but not read by the run, and gone by its end, failed the finished run (a review)."""
    rec = provenance({"planner.embeddings": tmp_path / "gone.npy"})["inputs"]["planner.embeddings"]
    assert rec["path"] == str((tmp_path / "gone.npy").resolve()) and rec["error"].startswith("FileNotFoundError")


def test_git_dir_of_another_repository_is_not_read(tmp_path, monkeypatch):
    """GIT_DIR set to another repository made _source_commit report that repository's commit."""
    if not shutil.which("git"):
        pytest.skip("needs git")
    other = tmp_path / "other"
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    subprocess.run(["git", "-C", str(other), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)
    theirs = subprocess.run(["git", "-C", str(other), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    assert _common._source_commit()["commit"] != theirs


def test_git_configuration_from_the_environment_is_kept(monkeypatch):
    """Dropping every GIT_* variable lost safe.directory given as GIT_CONFIG_* (CI, containers with a
    checkout of another owner): only the ones naming another repository are dropped (a second review)."""
    import subprocess as sp

    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(kwargs["env"])
        raise sp.SubprocessError("stop")

    monkeypatch.setattr(sp, "run", fake_run)
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/etc/ci.gitconfig")
    monkeypatch.setenv("GIT_DIR", "/elsewhere/.git")
    assert _common._source_commit() == {"commit": None, "dirty": None}
    assert seen and seen[0].get("GIT_CONFIG_COUNT") == "1" and seen[0].get("GIT_CONFIG_GLOBAL") and \
        "GIT_DIR" not in seen[0]
