"""docs/outputs.md names every key the recipes write (a journey found dozens documented nowhere):
the recipe tests pass their outputs to :func:`assert_documented`, so a new key fails until the page
describes it."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "outputs.md"
#: keys whose values are described as a whole (the resolved config echoes conf/; a comparison's
#: per-run records are a single run's, checked by the single-run tests; a profiler trace is torch's)
_OPAQUE = {"config", "layer_kwargs", "baseline_kwargs", "model", "scheduler", "runs", "per_layer", "inputs"}


def _documented() -> set[str]:
    """Every name inside a code span of the page (`key`, `{"argv", "overrides"}`, `shape.H`)."""
    spans = re.findall(r"`([^`]+)`", DOC.read_text())
    return {name for span in spans for name in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span)}


def undocumented(obj, path: str = "") -> list[str]:
    """Key paths of ``obj`` (nested dicts, and the first record of each list of dicts) whose last
    name docs/outputs.md does not give in backticks."""
    names, out = _documented(), []

    def walk(node, where):
        if isinstance(node, dict):
            for key, value in node.items():
                here = f"{where}.{key}" if where else str(key)
                if str(key) not in names and not str(key).startswith("expert_rank_"):
                    out.append(here)
                if str(key) not in _OPAQUE:
                    walk(value, here)
        elif isinstance(node, list) and node and isinstance(node[0], dict):
            walk(node[0], f"{where}[0]")

    walk(obj, path)
    return out


def assert_documented(obj) -> None:
    missing = undocumented(obj)
    assert not missing, f"docs/outputs.md does not describe {missing}"


def test_the_check_finds_an_undocumented_key():
    assert undocumented({"lar": 1.0, "requests": [{"ttft_s": 1.0, "no_such_key_anywhere": 2}]}) == \
        ["requests[0].no_such_key_anywhere"]
