"""recipes/profile.py end to end on CPU (2 gloo processes, tiny shape): a loadable curves file."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_profile_writes_curves(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "profile.py"), "profile=cpu_smoke",
                           f"hydra.run.dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out / "curves.npz", allow_pickle=False) as d:
        rows, lat = d["rows"], d["latency_s"]
        assert rows.tolist() == [1, 16, 32, 48, 64, 96, 128]
        assert lat.shape == (2, len(rows)) and (lat > 0).all()
    assert "largest max/min between GPUs" in proc.stdout


def test_sample_rows():
    import importlib.util

    sys.path.insert(0, str(ROOT / "recipes"))
    spec = importlib.util.spec_from_file_location("profile_recipe", ROOT / "recipes" / "profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sample_rows = mod.sample_rows

    assert sample_rows(128, 512, 1024, 3000) == [1, 128, 256, 384, 512, 1536, 2560]
    with pytest.raises(ValueError, match="bad sampling"):
        sample_rows(0, 512, 1024, 3000)
