"""Ours against a baseline in ``recipes/serve.py``: the ``compare`` block.

With ``compare.layer`` set, serve.py runs our configuration (``layer``, ``scheduler``) and the
baseline (``compare.layer``, ``compare.scheduler``) once per seed, in one launch of the ranks::

    python recipes/serve.py layer=semantic scheduler=semantic router=replay \\
        compare.layer=vanilla compare.scheduler=round_robin compare.seeds=3

Both sides of a seed serve the same requests (the seed draws the arrivals, lengths and the synthetic
trace; ``requests_digest`` in every run proves it), start from the same attention weights and run
on the same emulated hardware (``variability`` / ``emulation`` slow the ranks down for any layer).
Only the layer (and the scheduler) differ: a baseline named by ``compare.layer=NAME`` takes ours'
execution kwargs (dispatcher, dedup, NaN check, expert backend), and a semantic scheduler on the
baseline side reads ours' plan (``layer.plan_path`` / ``plan_train_fraction``). Within a seed the
order alternates (ours first on even seed indices, the baseline first on odd ones) so that drift of
a shared machine hits both sides alike.

``results.json`` holds our medians over the seeds at the top level (of :data:`MEDIAN_KEYS`, floats;
a run's other keys, its ``requests``, ``replans``, ``seed``, ... are in ``runs`` only; every key:
docs/outputs.md), ``baseline`` with the same keys, ``runs`` (``{"ours": [...], "baseline": [...]}``, every run's full
metrics with its ``seed``), ``seeds`` and ``comparison``: per compared metric the two medians, their
ratio and difference, whether ours is better and on how many seeds, plus the flags ``lar_higher``,
``a2a_bytes_lower``, ``tpot_p90_lower``, ... and ``same_requests``.

Medians need at least :data:`MIN_SEEDS` (3) seeds. Fewer are allowed (quick checks and the tests
use 2), but the run prints a warning before it starts and after, and ``results.json`` says
``"seeds_below_minimum": true`` with the warning in ``warnings``.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import numpy as np

from recipes._common import capacity_bound, print_grid, shared_execution_kwargs
from recipes._outputs import commit_files, warn, write_json
from recipes._plots import pyplot, save_png
from recipes._serve_workload import scheduler_name

# metrics reduced to medians over the seeds (plain numbers of a single run's results)
MEDIAN_KEYS = ("throughput_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "tpot_mean_s",
               "tpot_p90_s", "lar", "imbalance", "imbalance_step_mean", "bytes_sent", "rows_sent", "a2a_bytes",
               "a2a_dispatch_bytes", "a2a_combine_bytes", "a2a_rows", "num_requests", "finished_requests",
               "in_sample_requests", "output_tokens", "prompt_tokens", "steps", "elapsed_s", "emulated_expert_s",
               "unserved_requests", "unarrived_requests")
# (metric, which direction is better, flag in `comparison`)
COMPARED = (("lar", "higher", "lar_higher"), ("a2a_bytes", "lower", "a2a_bytes_lower"),
            ("tpot_p90_s", "lower", "tpot_p90_lower"), ("tpot_mean_s", "lower", "tpot_mean_lower"),
            ("throughput_tok_s", "higher", "throughput_higher"), ("ttft_p50_s", "lower", "ttft_p50_lower"),
            ("ttft_p99_s", "lower", "ttft_p99_lower"), ("imbalance", "lower", "imbalance_lower"),
            ("emulated_expert_s", "lower", "emulated_expert_lower"))
SIDES = ("ours", "baseline")
#: every file recipes/serve.py writes into its run dir, single run or comparison (the others are removed)
OUTPUTS = ("results.json", "rank_load.png", "compare.png")
#: the fewest seeds whose medians the comparison vouches for (fewer: ``seeds_below_minimum``)
MIN_SEEDS = 3


# ---------------------------------------------------------------------- config
def enabled(cfg: dict) -> bool:
    """Whether the config asks for a comparison (``compare.layer`` set)."""
    comp = cfg.get("compare")
    return isinstance(comp, dict) and comp.get("layer") is not None


def seeds(cfg: dict) -> list[int]:
    """``compare.seeds``: ``n`` -> ``seed, seed+1, ..., seed+n-1``; a list -> those seeds.

    Raises:
        ValueError: not a positive int or a non-empty list of distinct ints.
    """
    spec = cfg["compare"].get("seeds", 3)
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 1:
            raise ValueError(f"compare.seeds must be >= 1 (or a list of seeds), got {spec}")
        return [int(cfg["seed"]) + i for i in range(spec)]
    if (isinstance(spec, (list, tuple)) and spec and len(set(spec)) == len(spec)
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in spec)):
        return [int(s) for s in spec]
    raise ValueError(f"compare.seeds must be a positive int or a list of distinct ints >= 0, got {spec!r}")


def seeds_warning(cfg_or_seeds: dict | list[int]) -> str | None:
    """The warning for fewer than :data:`MIN_SEEDS` seeds (``None`` when there are enough)."""
    chosen = cfg_or_seeds if isinstance(cfg_or_seeds, list) else seeds(cfg_or_seeds)
    if len(chosen) >= MIN_SEEDS:
        return None
    return (f"compare.seeds gives {len(chosen)} seed(s) {chosen}: below the minimum of {MIN_SEEDS} for medians "
            f"over seeds; the comparison is indicative only (results.json: seeds_below_minimum=true)")


def baseline_layer(spec: Any, conf_dir: str, key: str = "compare.layer", root: dict | None = None) -> dict:
    """The baseline's layer config: the name of an option of the ``layer`` config group (conf/'s
    ``layer/NAME.yaml``, or of a user's ``--config-dir`` / ``hydra.searchpath`` folder inside a
    Hydra app, as ``layer=NAME`` finds it), or a dict like one (``key``: the setting that named it,
    for the errors). An option's interpolations of other keys (``${seed}``) resolve against ``root``,
    the run's resolved config, as they would in ``layer=NAME``.

    Raises:
        ValueError / FileNotFoundError: an unknown name or a dict without ``name`` and ``cls``.
    """
    if isinstance(spec, str):
        from omegaconf import OmegaConf

        from recipes._common import app_options, config_dirs, group_option

        dirs = config_dirs()
        option = (group_option("layer", spec) if os.path.realpath(conf_dir) in map(os.path.realpath, dirs)
                  else None)
        if option is None:  # (outside the app's folders: conf_dir's own)
            path = os.path.join(conf_dir, "layer", f"{spec}.yaml")
            option = OmegaConf.to_container(OmegaConf.load(path), resolve=False) if os.path.isfile(path) else None
        if option is None:
            names = app_options("layer")
            also = ", or a dict with name, cls" if key == "compare.layer" else ""  # bench.baseline takes names only
            where = " or ".join(os.path.join(d, "layer") for d in dirs)
            raise FileNotFoundError(f"{key}={spec!r}: no {spec}.yaml in {where}; one of {names}{also}")
        if root is not None:
            try:  # the run's settings beside it (values OmegaConf cannot hold: the option alone, below)
                holder = OmegaConf.create({**{k: v for k, v in root.items() if k != "layer"}, "layer": option})
            except Exception:  # noqa: BLE001
                holder = None
            if holder is not None:
                return OmegaConf.to_container(holder, resolve=True)["layer"]
        return OmegaConf.to_container(OmegaConf.create(option), resolve=True)
    if isinstance(spec, dict) and spec.get("name") and spec.get("cls"):
        return copy.deepcopy(spec)
    raise ValueError(f"{key} must be a layer name (conf/layer) or a dict with name and cls, got {spec!r}")


def pin_semantic_plan(sched: Any, cfg: dict) -> Any:
    """The baseline's scheduler, reading the semantic plan ours reads.

    A ``semantic`` scheduler finds its plan through the layer config (``layer.plan_path``,
    ``layer.plan_train_fraction``), which on the baseline side is the baseline's layer: pin ours'
    plan source into the scheduler itself (dict form) unless it names one already.
    """
    name = sched.get("name") if isinstance(sched, dict) else sched
    if name != "semantic":
        return sched
    pinned = dict(sched) if isinstance(sched, dict) else {"name": "semantic"}
    ours = cfg["scheduler"] if isinstance(cfg["scheduler"], dict) else {}
    for key in ("plan_path", "plan_train_fraction"):
        value = ours.get(key) if ours.get(key) is not None else cfg["layer"].get(key)
        if pinned.get(key) is None and value is not None:
            pinned[key] = value
    return pinned


def shared_step_budget(cfg: dict, layers: list[dict]) -> int | None:
    """The ``max_tokens_per_step`` both sides serve with, so that they batch the same requests
    alike: the one set, else the smaller ``capacity`` of the two layers (a side in capacity mode
    would otherwise batch less than the other; not one with ``beyond_capacity=exact``, which runs
    larger steps exact), else none."""
    if cfg.get("max_tokens_per_step") is not None:
        return int(cfg["max_tokens_per_step"])
    capacities = [c for c in (capacity_bound(layer.get("kwargs")) for layer in layers) if c is not None]
    return min(capacities, default=None)


def run_configs(cfg: dict, conf_dir: str) -> list[dict]:
    """The per-run configs, in run order: for each seed ours and the baseline (alternating which
    goes first). Each is ``cfg`` without ``compare``, with ``seed``, ``layer``, ``scheduler`` set and
    ``_side`` / ``_run_label`` (not echoed into results)."""
    comp = cfg["compare"]
    base_layer = baseline_layer(comp["layer"], conf_dir, root=cfg)
    if isinstance(comp["layer"], str):  # a named baseline executes like ours: only the layer differs
        base_layer["kwargs"] = {**(base_layer.get("kwargs") or {}), **shared_execution_kwargs(cfg["layer"])}
    base_sched = comp.get("scheduler") if comp.get("scheduler") is not None else cfg["scheduler"]
    base_sched = pin_semantic_plan(base_sched, cfg)
    budget = shared_step_budget(cfg, [cfg["layer"], base_layer])
    runs = []
    for i, seed in enumerate(seeds(cfg)):
        sides = [("ours", cfg["layer"], cfg["scheduler"]), ("baseline", base_layer, base_sched)]
        for side, layer, sched in (sides if i % 2 == 0 else sides[::-1]):
            run = {k: copy.deepcopy(v) for k, v in cfg.items() if k not in ("compare", "run_dir")}
            run.update(seed=seed, layer=copy.deepcopy(layer), scheduler=copy.deepcopy(sched), max_tokens_per_step=budget,
                       run_dir=cfg.get("run_dir"), _side=side, _run_label=f"{side} ({layer['name']}) seed {seed}")
            runs.append(run)
    return runs


# ---------------------------------------------------------------------- aggregation
def _num(v: Any) -> float:
    return float("nan") if v is None else float(v)


def medians(runs: list[dict]) -> dict:
    """``np.median`` over the runs of every :data:`MEDIAN_KEYS` metric, and per rank of ``rank_loads``."""
    out = {k: float(np.median([_num(r[k]) for r in runs])) for k in MEDIAN_KEYS if all(k in r for r in runs)}
    out["rank_loads"] = [float(np.median(col)) for col in zip(*(r["rank_loads"] for r in runs))]
    return out


def side_summary(runs: list[dict]) -> dict:
    """One side: medians plus what is common to its runs (layer, scheduler, world, model, notes)."""
    first = runs[0]
    out = medians(runs)
    out.update({k: first[k] for k in ("world_size", "layer", "router", "scheduler", "model")})
    out["seeds"] = [r["seed"] for r in runs]
    out["truncated"] = any(r.get("truncated", False) for r in runs)  # some run ended before every request finished
    out["notes"] = list(dict.fromkeys(n for r in runs for n in r["notes"]))
    return out


def _better(ours: float, base: float, direction: str) -> bool:
    """Whether ``ours`` beats ``base``; never on NaN (an inf, e.g. the TTFT of a request a truncated
    run never served, compares as it is: finite beats it)."""
    if math.isnan(ours) or math.isnan(base):
        return False
    return ours > base if direction == "higher" else ours < base


def comparison(runs: dict[str, list[dict]], ours: dict, base: dict) -> dict:
    """Per compared metric: both medians, ``ratio`` (ours / baseline), ``delta`` (ours - baseline),
    ``ours_better`` (on the medians) and ``seeds_ours_better`` (seed by seed); the flags of
    :data:`COMPARED` and ``same_requests`` (every seed served identical requests on both sides)."""
    base_by_seed = {r["seed"]: r for r in runs["baseline"]}
    pairs = [(r, base_by_seed[r["seed"]]) for r in runs["ours"]]
    metrics, flags = {}, {}
    for key, direction, flag in COMPARED:
        if key not in ours or key not in base:  # e.g. emulated_expert_s outside emulation.mode=curve
            continue
        o, b = ours[key], base[key]
        metrics[key] = {"ours": o, "baseline": b, "ratio": o / b if b else float("nan"), "delta": o - b,
                        "better": direction, "ours_better": _better(o, b, direction),
                        "seeds_ours_better": sum(_better(_num(ro[key]), _num(rb[key]), direction) for ro, rb in pairs),
                        "seeds": len(pairs)}
        flags[flag] = metrics[key]["ours_better"]
    same = all(ro["requests_digest"] == rb["requests_digest"] for ro, rb in pairs)
    return {**flags, "same_requests": same, "metrics": metrics}


def build_results(run_results: list[dict], cfg: dict, wall_s: float, origin: dict | None = None) -> dict:
    """The comparison's results dict (see the module docstring) from every run's results
    (``origin``: what started the run, written after the config: ``{"command":
    recipes._common.invocation(), "provenance": recipes._common.provenance(...)}``)."""
    runs = {side: sorted((dict(r) for r in run_results if r["side"] == side), key=lambda r: r["seed"])
            for side in SIDES}
    for side in SIDES:
        for r in runs[side]:
            r.pop("config", None)  # the top-level config, with this run's seed / layer / scheduler
    ours, base = side_summary(runs["ours"]), side_summary(runs["baseline"])
    echo = {k: v for k, v in cfg.items() if k != "run_dir" and not k.startswith("_")}
    warning = seeds_warning(ours["seeds"])
    return {**ours, "config": echo, **(origin or {}),
            "baseline": base, "seeds": ours["seeds"],
            "seeds_below_minimum": warning is not None, "warnings": [warning] if warning else [],
            "comparison": comparison(runs, ours, base),
            "compare": {"baseline_layer": runs["baseline"][0]["layer"], "baseline_scheduler": base["scheduler"],
                        "order": "per seed, ours first on even seed indices, the baseline first on odd ones"},
            "wall_s": wall_s, "runs": runs}


# ---------------------------------------------------------------------- output
#: how the serve recipe labels each metric of its results (tables and plots)
METRIC_LABELS = {
    "throughput_tok_s": "throughput (out tok/s)", "ttft_p50_s": "TTFT p50 (s)", "ttft_p99_s": "TTFT p99 (s)",
    "tpot_mean_s": "TPOT mean (s)", "tpot_p90_s": "TPOT p90 (s)", "emulated_expert_s": "emulated expert time (s)",
    "lar": "LAR", "a2a_bytes": "all-to-all bytes", "imbalance": "imbalance",
    "imbalance_step_mean": "imbalance (step mean)", "num_requests": "requests", "finished_requests": "finished requests",
    "unserved_requests": "unserved requests (TTFT inf)", "unarrived_requests": "requests due after the end",
    "output_tokens": "output tokens", "steps": "steps", "elapsed_s": "elapsed (s)",
}
#: the metrics of the comparison table (a key missing from a side's results is left out)
TABLE_ROWS = ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "tpot_p90_s", "lar", "a2a_bytes",
              "imbalance", "emulated_expert_s", "output_tokens", "steps", "elapsed_s")


def print_tables(res: dict) -> None:
    """Per-run key metrics, then the medians side by side with ratio and per-seed wins."""
    rows = []
    for seed in res["seeds"]:
        for side in SIDES:
            r = next(x for x in res["runs"][side] if x["seed"] == seed)
            rows.append([seed, f"{side} ({r['layer']})", r["throughput_tok_s"], r["ttft_p99_s"], r["tpot_mean_s"],
                         r["tpot_p90_s"], r["lar"], r["a2a_bytes"], len(r.get("replans") or [])])
    print_grid(["seed", "side", "out tok/s", "TTFT p99", "TPOT mean", "TPOT p90", "LAR", "a2a bytes",
                "re-plans (all layers, all EP groups)"], rows, title="runs")
    cmp_metrics = res["comparison"]["metrics"]
    rows = []
    for key in TABLE_ROWS:
        if key not in res or key not in res["baseline"]:
            continue
        label = METRIC_LABELS[key]
        m = cmp_metrics.get(key)
        ratio = res[key] / res["baseline"][key] if res["baseline"][key] else float("nan")
        wins = f"{m['seeds_ours_better']}/{m['seeds']} ({m['better']})" if m else ""
        rows.append([label, res[key], res["baseline"][key], ratio, wins])
    base = res["baseline"]
    title = (f"compare: {res['layer']} (scheduler={scheduler_name(res['scheduler'])}) vs {base['layer']} "
             f"(scheduler={scheduler_name(base['scheduler'])}), router={res['router']}, world={res['world_size']}, "
             f"seeds={res['seeds']}")
    print_grid(["metric (median)", f"ours: {res['layer']}", f"baseline: {base['layer']}", "ours/base",
                "seeds ours better"], rows, title=title)
    c = res["comparison"]
    print("comparison: " + ", ".join(f"{flag}={c[flag]}" for _, _, flag in COMPARED if flag in c)
          + f", same_requests={c['same_requests']}")


def plot_compare(res: dict, path: str) -> None:
    """Per-seed bars (and the median) of the key metrics, ours against the baseline."""
    plt = pyplot()

    panels = [(key, METRIC_LABELS[key]) for key in
              ("throughput_tok_s", "tpot_mean_s", "tpot_p90_s", "ttft_p99_s", "lar", "a2a_bytes")]
    labels = [str(s) for s in res["seeds"]] + ["median"]
    x = np.arange(len(labels))
    fig, axes = plt.subplots(2, 3, figsize=(12, 6), dpi=100)
    for ax, (key, title) in zip(axes.ravel(), panels):
        for j, side in enumerate(SIDES):
            summary = res if side == "ours" else res["baseline"]
            vals = [_num(r[key]) for r in res["runs"][side]] + [_num(summary[key])]
            ax.bar(x + (j - 0.5) * 0.4, vals, width=0.4, label=f"{side}: {summary['layer']}",
                   color=("tab:blue", "tab:gray")[j])
        ax.set_xticks(x, labels)
        ax.set_xlabel("seed")
        m = res["comparison"]["metrics"].get(key)
        ax.set_title(title + (f"  ({m['better']} is better)" if m else ""), fontsize=9)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"{res['layer']} vs {res['baseline']['layer']}, router={res['router']}, world {res['world_size']}")
    save_png(fig, path)


def plot_rank_load_sides(res: dict, path: str) -> None:
    """Activations received per rank per step, ours above the baseline, for the first seed
    (dashed lines: our re-plans)."""
    plt = pyplot()

    seed = res["seeds"][0]
    fig, axes = plt.subplots(2, 1, figsize=(8, 5.5), dpi=100, sharex=True)
    for ax, side in zip(axes, SIDES):
        r = next(x for x in res["runs"][side] if x["seed"] == seed)
        data = np.asarray(r["rank_load_per_step"], dtype=np.float64).reshape(len(r["rank_load_per_step"]), -1)
        for k in range(data.shape[1]):
            ax.plot(np.arange(1, data.shape[0] + 1), data[:, k], lw=1, label=f"rank {k}")
        for rp in r.get("replans") or []:
            ax.axvline(rp["step"], color="k", ls="--", lw=0.8)
        ax.set_ylabel("received")
        ax.set_title(f"{side}: {r['layer']} (seed {seed}, imbalance {r['imbalance']:.3f}, LAR {r['lar']:.3f})",
                     fontsize=9)
        if data.shape[1] <= 16:
            ax.legend(fontsize=7, ncol=min(8, data.shape[1]))
    axes[-1].set_xlabel("step")
    save_png(fig, path)


def as_written(res: dict, cfg: dict) -> dict:
    """``res`` as results.json holds it: with ``per_request=false`` without the per-request records
    (``requests`` of a single run, or of each of a comparison's runs); ``res`` itself otherwise."""
    if cfg.get("per_request", True):
        return res
    out = {key: value for key, value in res.items() if key != "requests"}
    if isinstance(res.get("runs"), dict):
        out["runs"] = {side: [as_written(run, cfg) for run in runs] for side, runs in res["runs"].items()}
    return out


def summarize(run_results: list[dict], cfg: dict, out_dir: str, wall_s: float, origin: dict | None = None) -> dict:
    """Build the results, write results.json, compare.png and rank_load.png, then print the tables
    (the files first: output that cannot be shown must not cost the runs' files)."""
    res = build_results(run_results, cfg, wall_s, origin)
    writers = {"compare.png": lambda p: plot_compare(res, p), "rank_load.png": lambda p: plot_rank_load_sides(res, p)} \
        if cfg.get("plot", True) else {}
    writers["results.json"] = lambda p: write_json(p, as_written(res, cfg))  # last: it marks a finished run
    paths = commit_files(out_dir, writers, stale=OUTPUTS, optional=("compare.png", "rank_load.png"))  # all or nothing
    for note in res["notes"]:
        print(f"note (ours): {note}")
    for note in res["baseline"]["notes"]:
        print(f"note (baseline): {note}")
    print_tables(res)
    for warning in res["warnings"]:
        warn(warning)
    print(f"results: {paths[-1]}  ({len(run_results)} runs, {wall_s:.1f} s)")
    for png in paths[:-1]:
        print(f"plot: {png}")
    return res
