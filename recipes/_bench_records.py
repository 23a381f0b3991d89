"""``recipes/bench.py``'s records: the table it prints, each record's file name and settings digest,
and writing them (into the run dir all or nothing, with ``bench.png``, and into ``bench.save_to``
without overwriting a record of other settings)."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from moelayers.files import atomic_write
from recipes._common import plan_fraction_setting, print_grid
from recipes._outputs import BENCH_STORE_MARK, commit_files, is_bench_record, write_json
from recipes._plots import plot_bench


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"



def print_results(records: list[dict]) -> None:
    head = ("shape", "tokens/rank", "ours ms", "peer ms", "ours/peer")
    with_base = any(r.get("baseline") for r in records)
    if with_base:
        head += (f"{records[0]['baseline']} ms", "ours/baseline", "LAR ours", "LAR baseline")
    rows = []
    for r in records:
        row = (r["shape_name"], str(r["tokens_per_rank"]), f"{r['ms']:.3f}",
               "-" if r["peer_ms"] is None else f"{r['peer_ms']:.3f}",
               "-" if r["ratio"] is None else f"{r['ratio']:.3f}")
        if with_base:
            row += (f"{r['baseline_ms']:.3f}", f"{r['vs_baseline']:.3f}", f"{r['layer_stats']['lar']:.3f}",
                    f"{r['baseline_stats']['lar']:.3f}")
        rows.append(row)
    r0 = records[0]
    print(f"\nbench: layer={r0['layer']} vs {r0['peer'] or 'no peer'}; {r0['device_name']}, world {r0['world_size']} "
          f"(ep {r0['ep']}), "
          f"{r0['dtype']}, median of {r0['iters']} {'training steps (forward + backward)' if r0.get('train') else 'forwards'} "
          f"(max over ranks), router={r0['router']}")
    print_grid(head, rows, left_first=False)
    if r0.get("peer_note"):
        print(f"note: {r0['peer_note']}")
    for note in r0.get("notes") or []:
        print(f"note: {note}")


HEAD_KEYS = ("device_name", "world_size", "ep", "layer", "shape", "tokens_per_rank", "ms", "peer", "peer_ms", "ratio",
             "date", "command", "dtype", "iters")


def order_record(r: dict, date: str, command: str) -> dict:
    """The JSON record: the documented keys first, then the details."""
    r = {**r, "date": date, "command": command,
         "ratio": r["ms"] / r["peer_ms"] if r.get("peer_ms") else None}
    return {**{k: r[k] for k in HEAD_KEYS}, **{k: v for k, v in r.items() if k not in HEAD_KEYS}}


def save_records(records: list[dict], out_dir: str, save_to: str | None, plot: bool = False) -> list[str]:
    """Write the records into ``out_dir`` all or nothing (an earlier run's ``bench.png`` goes with
    them: never beside other records), then ``bench.png`` with ``plot`` (a plot that fails leaves
    the records, which took the device time, and a warning), then copy the records into
    ``save_to``; returns the paths written."""
    names = []
    for r in records:
        slug = device_slug(r["device_name"])
        mode = "_graph" if str(r.get("mode", "")).startswith("cuda_graph") else ""
        # another dispatcher (or no de-duplication) is another measurement: a name of its own, not the default run's
        mode += {"eager (all-gather)": "_allgather",
                 "eager (exact all-to-all-v, no de-duplication)": "_nodedup"}.get(str(r.get("mode")), "")
        # ep < world (parallel.ep) times another layout: a name of its own, not the ep = world run's
        ep = f"_ep{r['ep']}" if r["ep"] != r["world_size"] else ""
        # so do another dtype than the device's default, a router scoring in another dtype and replayed
        # routing: one configuration's record must not overwrite another's in bench.save_to
        default = "bfloat16" if r.get("backend") == "nccl" else "float32"
        ep += f"_{r['dtype']}" if r.get("dtype", default) != default else ""
        ep += f"_router-{r['router_dtype']}" if r.get("router_dtype") else ""
        ep += _setting_suffix(r)
        names.append(f"{r['layer']}{mode}_{r['shape_name']}_t{r['tokens_per_rank']}_ws{r['world_size']}{ep}_{slug}.json")
    writers = {name: (lambda path, r=r: write_json(path, r)) for name, r in zip(names, records)}
    paths = [str(p) for p in commit_files(out_dir, writers, stale=("bench.png",))]
    if plot:  # a plot that fails leaves the records (which took the device time) and a warning
        paths += [str(p) for p in commit_files(out_dir, {"bench.png": lambda path: plot_bench(records, path)},
                                               optional=("bench.png",))]
    if save_to:  # after every record is in the run dir; each written atomically, as there
        mark = Path(save_to) / BENCH_STORE_MARK  # (a run dir there, which would remove records, is refused)
        copied: list[str] = []
        try:
            mark.parent.mkdir(parents=True, exist_ok=True)
            if not mark.exists():  # first: a folder with some records copied is marked as a store too
                atomic_write(mark, lambda f: f.write(b"This folder keeps recipes/bench.py records (bench.save_to): "
                                                     b"the recipes refuse it as a run dir (hydra.run.dir).\n"))
            for name, r in zip(names, records):
                copied.append(str(write_json(_unclaimed(save_to, name, r), r)))
        except OSError as exc:
            if exc.errno is None:
                raise
            left = names[len(copied):]
            raise OSError(exc.errno, f"{exc.strerror or exc}: bench.save_to={save_to}: {len(copied)} of "
                                     f"{len(names)} records copied; every record is in the run dir {out_dir}, the "
                                     f"ones not copied: {', '.join(left)}") from exc
        paths += copied
    return paths


#: a record's fields that say what was measured (resolved: ``dtype`` float32, not ``auto``)
_SETTING_FIELDS = ("dtype", "router_dtype", "ep", "backend", "warmup", "iters", "mode", "train", "layer",
                   "layer_kwargs", "baseline", "baseline_kwargs", "check_finite", "peer", "router", "plan_based")
#: the scheme of ``settings_digest`` (a record of another scheme, or none, is compared on its fields)
SETTINGS_DIGEST_VERSION = 2
#: those a record from before digests holds too: compared when the one in ``bench.save_to`` has no digest
_LEGACY_FIELDS = ("shape", "dtype", "warmup", "iters", "mode", "router", "peer", "baseline")


def _norm_path(path: object) -> str | None:
    """The file a path names, resolved (symlinks and ``..`` as the system follows them)."""
    return None if not path else os.path.realpath(str(path))


def settings_digest(record: dict, d: dict) -> str:
    """12 hex digits over what a record measured beyond its file name's parts, as resolved (the
    shape's every field, the dtype ``auto`` chose, the expert-parallel size, the baseline and the
    peer it got, the replayed trace as built, normalised file paths, ``seed``,
    ``bench.inference_mode``, the plan's train fraction): two records of one name and one digest
    measured the same configuration."""
    import json

    tr = record.get("trace") or {}
    layer = d.get("layer") or {}
    keep = {k: record.get(k) for k in _SETTING_FIELDS}
    keep.update(
        shape=d["bench"].get("shape"), seed=d.get("seed"), inference_mode=d["bench"].get("inference_mode", True),
        cls=layer.get("cls"), plan_path=_norm_path(record.get("plan_path")),
        plan_train_fraction=(plan_fraction_setting(layer.get("plan_train_fraction"), "layer.plan_train_fraction")
                             if record.get("plan_based") else None),
        trace=None if not tr else {"layer": tr.get("layer"), "path": _norm_path(tr.get("path")),
                                   "source": None if tr.get("path") else tr.get("source"),  # (sized by the run)
                                   "vocab_size": None if tr.get("path") else (d.get("trace") or {}).get("vocab_size")})
    return hashlib.sha1(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _unclaimed(folder: str, name: str, record: dict) -> str:
    """``folder/name``, unless it holds a record of another configuration (another
    ``settings_digest`` of this :data:`SETTINGS_DIGEST_VERSION`; for a record from before digests
    (or of another scheme), another value of one of
    :data:`_LEGACY_FIELDS` or of its trace's source): then ``name`` with ``_cfg-`` and the digest's
    first 6 hex digits added, so that neither record is lost (said on stdout)."""
    import json

    path = os.path.join(folder, name)
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return path  # nothing there (or not a record): write
    mine = record.get("settings_digest")
    current = isinstance(old, dict) and old.get("settings_digest_version") == SETTINGS_DIGEST_VERSION
    other = old.get("settings_digest") if current else None
    if other is not None:
        same = other == mine
    else:
        source = [(r.get("trace") or {}).get("source") for r in (old, record)] if isinstance(old, dict) else [0, 1]
        same = isinstance(old, dict) and source[0] == source[1] and all(
            old.get(k) == record.get(k) for k in _LEGACY_FIELDS)
    if same:
        return path  # a new measurement of the same configuration replaces the old one
    stem, ext = os.path.splitext(name)
    alt = os.path.join(folder, f"{stem}_cfg-{str(mine)[:6]}{ext}")
    print(f"note: {path} holds a record of other settings (shape, seed, layer or trace settings): this one goes "
          f"to {alt}")
    return alt


def remove_earlier_outputs(run_dir: str, started: float, written: list[str] = ()) -> list[str]:
    """Remove the records and profiler traces that an earlier run left in this run dir
    (``hydra.run.dir`` reused: files last written more than a second before ``started``, and not
    ``written`` by this run), so that the dir never mixes two runs' files, as the other recipes'
    run dirs; each one is named on stdout. Other files are left alone."""
    removed, mine = [], {os.path.abspath(p) for p in written}
    for path in sorted(Path(run_dir).glob("*.json")):
        if os.path.abspath(path) in mine or path.stat().st_mtime >= started - 1.0:  # (clock and mtime may differ)
            continue
        if (path.name.startswith("profile_") and path.name.endswith("_rank0.json")) or is_bench_record(path):
            path.unlink(missing_ok=True)
            removed.append(str(path))
            print(f"note: removed {path}, an earlier run's output that this run does not write")
    return removed


def _file_tag(path: str) -> str:
    """A file as a name part: its stem (letters, digits, ``.``, ``_``, ``-`` only) and 6 hex digits of
    its resolved path's hash, so that two files of one stem in other folders keep two records."""
    real = os.path.realpath(str(path))
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.splitext(os.path.basename(real))[0]).strip("-") or "file"
    return f"{stem}-{hashlib.sha1(real.encode()).hexdigest()[:6]}"


def _setting_suffix(r: dict) -> str:
    """The record name's parts for settings that change the measurement but not the layer's name:
    replayed routing (a plan-built layer always replays), a trace file and its layer (other than 0), a plan file, the NaN check,
    a training step,
    an expert backend other than ``auto`` and a baseline other than the layer's default one."""
    tag = "_replay" if r.get("router") == "replay" and not r.get("plan_based") else ""
    if (r.get("trace") or {}).get("path"):
        tag += f"_trace-{_file_tag(r['trace']['path'])}"
    if (r.get("trace") or {}).get("layer"):  # another layer of the same trace: another record
        tag += f"_layer{r['trace']['layer']}"
    if r.get("plan_path"):
        tag += f"_plan-{_file_tag(r['plan_path'])}"
    tag += "_checkfinite" if r.get("check_finite") else ""
    tag += "_train" if r.get("train") else ""
    backend = (r.get("layer_kwargs") or {}).get("expert_backend")
    tag += f"_{backend}" if backend not in (None, "auto") else ""
    if r.get("baseline") != ("vanilla" if r.get("plan_based") else None):
        tag += f"_vs-{r.get('baseline') or 'none'}"
    return tag
