"""docs/outputs.md names every key the recipes write (a journey found dozens documented nowhere):
the recipe tests pass their outputs to :func:`assert_documented`, so a new key fails until the page
describes it."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "outputs.md"
#: keys whose values are described as a whole (the resolved config echoes conf/; a comparison's
#: per-run records are a single run's, checked by the single-run tests; a profiler trace is torch's;
#: capacity_forwards is keyed by the sizes themselves)
_OPAQUE = {"config", "layer_kwargs", "baseline_kwargs", "model", "scheduler", "runs", "per_layer", "inputs",
           "capacity_forwards"}


def _documented(section: str) -> set[str]:
    """Every name inside a code span (`key`, `{"argv", "overrides"}`, `shape.H`) of the page's
    opening part (what every recipe writes: config, command, provenance) and of its ``## `` sections
    whose title starts with ``section`` (a bench record's keys must be described for bench.py)."""
    parts = re.split(r"^## ", DOC.read_text(), flags=re.M)
    text = parts[0] + "".join(p for p in parts[1:] if p.startswith(section))
    assert text != parts[0], f"docs/outputs.md has no section starting with {section!r}"
    spans = re.findall(r"`([^`]+)`", text)
    return {name for span in spans for name in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span)}


def undocumented(obj, section: str) -> list[str]:
    """Key paths of ``obj`` (nested dicts, and the first record of each list of dicts) whose last
    name the page's opening part and ``section`` do not give in backticks."""
    names, out = _documented(section), []

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

    walk(obj, "")
    return out


def assert_documented(obj, section: str) -> None:
    """Every key of ``obj`` described in docs/outputs.md's sections titled ``section...``
    (``"serve.py: `results.json` (single"``, ``"serve.py: `results.json` of a comparison"``,
    ``"plan.py"``, ``"profile.py"``, ``"bench.py"``)."""
    missing = undocumented(obj, section)
    assert not missing, f"docs/outputs.md ({section}) does not describe {missing}"


def test_the_check_finds_an_undocumented_key():
    serve = "serve.py: `results.json` (single"
    assert undocumented({"lar": 1.0, "requests": [{"ttft_s": 1.0, "no_such_key_anywhere": 2}]}, serve) == \
        ["requests[0].no_such_key_anywhere"]
    # a key of another recipe's file does not count (a review: serve's keys passed in a bench record)
    assert undocumented({"ms": 1.0, "steps": 3, "requests_digest": "x"}, "bench.py") == ["steps", "requests_digest"]
