"""Emulated GPU variability: make identical GPUs (or CPU processes) behave like slower ones.

GEM (``VariabilityAwareMoE``) places experts so that every GPU *finishes* at the same time given its
own latency curve. To show the effect on identical hardware, :func:`emulate_variability` stretches
step 4 (the grouped-expert compute) of any moelayers layer on this rank. It hooks the layer's
``experts`` module (no change to the layer class), so a baseline and a GEM layer run on the same
slowed-down "hardware". Two modes:

- ``'measured'`` (default): time this rank's grouped-expert compute (CUDA: events, and a
  synchronize after it, only while emulation is on; CPU: ``perf_counter``) and add busy work of
  ``(s - 1) x`` that time, ``s`` = this rank's slowdown factor. Faithful on GPUs; on a tiny CPU model
  the compute is microseconds and drowned by Python and gloo overheads.
- ``'curve'``: pad the compute to ``time_scale * C_rank(rows)`` seconds, ``rows`` = activations
  this rank computes, ``C_rank`` = this rank's curve from ``moelayers.planning.gem.LatencyCurves``
  (the curves the planner uses). Makes the effect visible on CPU, where measured compute is tiny.

Waiting is a busy spin (``wait='spin'``, the default of ``'measured'``: busy work) or ``time.sleep``
(``wait='sleep'``, the default of ``'curve'``: leaves the core to other processes when ranks share
few CPU cores).

Presets (``variability=high|moderate|low|none``), slowdown ``s_r`` of rank ``r`` of ``R``:
``high``: ``1/0.88`` on rank 0, 1.0 elsewhere; ``moderate``: evenly spaced from ``1/0.88`` (rank 0)
to 1.0 (rank ``R-1``); ``low`` and ``none``: 1.0 everywhere.

:class:`VariabilitySettings` reads the recipes' ``variability`` / ``emulation`` config.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from moelayers.planning.gem import PRESETS, SLOW_FACTOR, preset_scale

__all__ = ["VARIABILITY_PRESETS", "HIGH_SLOWDOWN", "slowdown_preset", "curve_latency", "emulate_variability",
           "VariabilityEmulator", "VariabilitySettings"]

VARIABILITY_PRESETS = PRESETS  # the planner's presets (one definition: moelayers.planning.gem)
HIGH_SLOWDOWN = SLOW_FACTOR
MODES = ("measured", "curve")
WAITS = ("auto", "spin", "sleep")


def slowdown_preset(name: str, num_ranks: int) -> list[float]:
    """Per-rank slowdown factors ``[R]`` of a preset (see the module docstring).

    Raises:
        ValueError: unknown preset or ``num_ranks < 1``.
    """
    if name not in VARIABILITY_PRESETS:
        raise ValueError(f"variability must be one of {VARIABILITY_PRESETS}, got {name!r}")
    return [float(v) for v in preset_scale(name, num_ranks)]


def preset_curves(name: str, num_ranks: int) -> Any:
    """``LatencyCurves.preset(name, num_ranks)`` from ``moelayers.planning.gem`` (imported lazily)."""
    from moelayers.planning.gem import LatencyCurves

    return LatencyCurves.preset(name, num_ranks)


def load_curves(path: str) -> Any:
    """Latency curves written by the profiler (``LatencyCurves.load``)."""
    from moelayers.planning.gem import LatencyCurves

    return LatencyCurves.load(path)


def curve_latency(curves: Any, rank: int, num_ranks: int, rows: int) -> float:
    """``C_rank(rows)`` in seconds: ``curves`` maps rows per rank ``[..., R]`` to seconds ``[..., R]``."""
    rank_rows = np.zeros(num_ranks, dtype=np.float64)
    rank_rows[rank] = rows
    out = np.asarray(curves(rank_rows), dtype=np.float64)
    if out.shape != (num_ranks,):
        raise ValueError(f"curves returned shape {out.shape} for rows of shape ({num_ranks},)")
    return float(out[rank])


def _finite(value: Any, name: str, low: float, *, inclusive: bool) -> float:
    """``value`` as a float, or a ValueError naming ``name`` unless it is finite and above ``low``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number < low or (number == low and not inclusive):
        raise ValueError(f"{name} must be a finite number {'>=' if inclusive else '>'} {low:g}, got {value!r}")
    return number


#: ``time.sleep`` overshoots by tens of microseconds: sleep waits end with this long a spin
SLEEP_MARGIN_S = 2e-4


def _wait(seconds: float, how: str) -> None:
    """Wait ``seconds``: spinning, or (``'sleep'``) sleeping all but the last ``SLEEP_MARGIN_S``, which
    are spun, so that the wait is as long as asked (a plain sleep added ~90 us to every wait)."""
    if seconds <= 0:
        return
    deadline = time.perf_counter() + seconds
    if how == "sleep" and seconds > SLEEP_MARGIN_S:
        time.sleep(seconds - SLEEP_MARGIN_S)
    while time.perf_counter() < deadline:
        pass


@dataclass
class VariabilityEmulator:
    """Handle of an emulation hooked on one layer's ``experts`` (see :func:`emulate_variability`).

    Attributes:
        calls: expert computes seen; compute_s: their measured time (measured mode; 0 in curve
            mode); added_s: seconds of emulated extra time in total; last_added_s: of the last call;
        last_rows: curve mode: the (token, expert) rows of the last call (the sum of its
            ``slot_counts``: padding rows of a fixed-capacity layer do not count).
    """

    mode: str
    rank: int
    num_ranks: int
    factor: float
    curves: Any = None
    time_scale: float = 1.0
    wait: str = "spin"
    calls: int = 0
    compute_s: float = 0.0
    added_s: float = 0.0
    last_added_s: float = 0.0
    last_rows: int = 0
    _handles: list = field(default_factory=list, repr=False)
    _start: Any = field(default=None, repr=False)
    _experts: Any = field(default=None, repr=False)  # the hooked module (its ``_emulator`` is this one)

    def _pre(self, module: nn.Module, args: tuple) -> None:
        x = args[0]
        if self.mode == "measured" and x.is_cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(x.device))  # x's device, whichever is current
        else:
            if x.is_cuda:  # curve mode: the clock starts when the work queued before the compute is done
                torch.cuda.current_stream(x.device).synchronize()
            self._start = time.perf_counter()

    def _post(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        x = args[0]
        if self.mode == "measured":
            if x.is_cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record(torch.cuda.current_stream(x.device))
                end.synchronize()
                elapsed = self._start.elapsed_time(end) / 1e3
            else:
                elapsed = time.perf_counter() - self._start
            extra = (self.factor - 1.0) * elapsed
            self.compute_s += elapsed
        else:
            if x.is_cuda:
                torch.cuda.current_stream(x.device).synchronize()
            # the rows routed here, not x's: a fixed-capacity layer pads x to the same size every step
            self.last_rows = int(args[1].sum()) if len(args) > 1 else int(x.shape[0])
            target = self.time_scale * curve_latency(self.curves, self.rank, self.num_ranks, self.last_rows)
            extra = target - (time.perf_counter() - self._start)
        extra = max(extra, 0.0)
        _wait(extra, self.wait)
        self.calls += 1
        self.added_s += extra
        self.last_added_s = extra

    def remove(self) -> None:
        """Unhook: the layer computes at its own speed again."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._experts is not None and getattr(self._experts, "_emulator", None) is self:
            self._experts._emulator = None
        self._experts = None


def emulate_variability(layer: nn.Module, factor: float | None = None, *, mode: str = "measured",
                        variability: str | None = None, curves: Any = None, time_scale: float = 1.0,
                        wait: str = "auto", rank: int | None = None, num_ranks: int | None = None
                        ) -> VariabilityEmulator:
    """Slow down step 4 (grouped-expert compute) of ``layer`` on this rank.

    Args:
        layer: any module with an ``experts`` submodule called as ``experts(x [N, H], slot_counts [S])``
            (every moelayers layer) and, unless ``rank``/``num_ranks`` are given, ``groups``.
        factor: measured mode: this rank's slowdown ``s >= 1`` (default: from ``variability``).
        mode: ``'measured'`` (extra ``(s - 1) x`` measured compute time) or ``'curve'`` (pad the
            compute to ``time_scale * C_rank(rows)``).
        variability: preset name (``high|moderate|low|none``) for the default factor or curves.
        curves: curve mode: a ``LatencyCurves`` (default: ``LatencyCurves.preset(variability, R)``).
        time_scale: curve mode: multiplies the curve latencies (e.g. to bring GPU-sized curves to the
            scale of a CPU run).
        wait: ``'spin'`` | ``'sleep'`` | ``'auto'`` (spin in measured mode, sleep in curve mode).
        rank, num_ranks: this rank and the expert-parallel size (default: ``layer.groups``).

    Returns:
        The :class:`VariabilityEmulator` (``.remove()`` unhooks it).

    Raises:
        TypeError: ``layer`` has no ``experts`` module (not a moelayers layer).
        ValueError: bad arguments, a layer that replays CUDA graphs (hooks cannot run there), or
            one slowed down already (the second emulation would time the first one's wait as
            compute and the factors would multiply): ``.remove()`` that one first.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if wait not in WAITS:
        raise ValueError(f"wait must be one of {WAITS}, got {wait!r}")
    experts = getattr(layer, "experts", None)
    if not isinstance(experts, nn.Module):
        raise TypeError(f"{type(layer).__name__} has no `experts` module to slow down")
    if getattr(layer, "cuda_graph", False):
        raise ValueError("variability emulation needs eager forwards: build the layer with cuda_graph=False")
    if getattr(experts, "_emulator", None) is not None:
        raise ValueError(f"{type(layer).__name__} is slowed down already ({experts._emulator.mode} mode, e.g. its "
                         f"own slowdown= or variability=): a second emulation would time the first one's wait as "
                         f"compute and multiply the factors; remove() the first one, or slow the layer down once")
    if rank is None or num_ranks is None:
        groups = getattr(layer, "groups", None)
        if groups is None:
            raise ValueError("pass rank= and num_ranks= for a layer without `groups`")
        rank = groups.ep_rank if rank is None else rank
        num_ranks = groups.ep_size if num_ranks is None else num_ranks
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is outside [0, {num_ranks})")
    time_scale = _finite(time_scale, "time_scale", 0.0, inclusive=False)
    if mode == "measured":
        if factor is None:
            if variability is None:
                raise ValueError("measured mode needs factor= or variability=")
            factor = slowdown_preset(variability, num_ranks)[rank]
        factor = _finite(factor, "slowdown factor", 1.0, inclusive=True)
    else:
        if factor is not None:
            raise ValueError("curve mode takes its times from curves=, not factor=")
        if curves is None:
            if variability is None:
                raise ValueError("curve mode needs curves= or variability=")
            curves = preset_curves(variability, num_ranks)
        curve_latency(curves, rank, num_ranks, 1)  # curves for another number of ranks fail here, not in a forward
        factor = 1.0
    wait = ("spin" if mode == "measured" else "sleep") if wait == "auto" else wait
    emu = VariabilityEmulator(mode, rank, num_ranks, float(factor), curves, float(time_scale), wait)
    emu._handles = [experts.register_forward_pre_hook(emu._pre), experts.register_forward_hook(emu._post)]
    emu._experts, experts._emulator = experts, emu  # one emulation per layer (checked above)
    return emu


def _curves_path(var: dict) -> str | None:
    """``variability.curves.path`` of a ``variability`` dict (``None``: no curves), its keys checked."""
    unknown = set(var) - {"name", "curves"}
    if unknown:
        raise ValueError(f"unknown variability key(s) {sorted(unknown)}: use name, curves")
    curves = var.get("curves")
    if curves is None:
        return None
    if not isinstance(curves, dict) or set(curves) != {"path"}:
        raise ValueError(f"variability.curves must be a dict with the one key `path`, got {curves!r}")
    path = curves["path"]
    if path is not None and not isinstance(path, str):
        raise ValueError(f"variability.curves.path must be a file name or null, got {path!r}")
    return path or None


@dataclass
class VariabilitySettings:
    """The recipes' variability settings.

    Config (both keys optional)::

        variability: high            # a preset name, or {name: high, curves: {path: curves.npz}}
                                     # (on the command line: curves.path=F or +variability.curves.path=F)
        emulation:                   # slow the ranks down accordingly (any layer)
          mode: measured             # measured | curve | off (YAML's boolean ``off``, False, too)
          time_scale: 1.0            # curve mode: multiplies the curve latencies
          wait: auto                 # auto | spin | sleep

    Attributes:
        name: preset name; curves_path: profiled curves (``LatencyCurves.load``) or ``None``;
        mode, time_scale, wait: of the emulation (``mode='off'``: none);
        given: whether the config set ``variability`` at all.
    """

    name: str = "none"
    curves_path: str | None = None
    mode: str = "measured"
    time_scale: float = 1.0
    wait: str = "auto"
    given: bool = False

    @classmethod
    def from_config(cls, cfg: dict) -> "VariabilitySettings":
        """From a recipe config dict (keys ``variability`` and ``emulation``).

        Raises:
            ValueError: unknown preset, mode or wait, or a malformed entry.
        """
        given = cfg.get("variability") is not None
        var = cfg.get("variability") or "none"
        if isinstance(var, str):
            name, path = var, None
        elif isinstance(var, dict):
            name, path = var.get("name") or "none", _curves_path(var)
        else:
            raise ValueError(f"variability must be a preset name or a dict with `name`, got {var!r}")
        emu = cfg.get("emulation")
        if emu is False or emu == "off":  # `emulation: off` (YAML 1.1 reads off as False): no emulation
            emu = {"mode": "off"}
        emu = {} if emu is None else emu
        if not isinstance(emu, dict):
            raise ValueError(f"emulation must be a dict (mode, time_scale, wait) or off, got {emu!r}")
        unknown = set(emu) - {"mode", "time_scale", "wait"}
        if unknown:
            raise ValueError(f"unknown emulation key(s) {sorted(unknown)}: use mode, time_scale, wait")
        mode = emu.get("mode", "measured")
        mode = "off" if mode is False else mode  # YAML 1.1 (OmegaConf, Hydra) reads `mode: off` as False
        time_scale = _finite(emu.get("time_scale", 1.0), "emulation.time_scale", 0.0, inclusive=False)
        out = cls(str(name), path, str(mode), time_scale, str(emu.get("wait", "auto")), given)
        if out.name not in VARIABILITY_PRESETS:
            key = "variability.name" if isinstance(var, dict) else "variability"
            raise ValueError(f"{key} must be one of the presets {VARIABILITY_PRESETS}, got {out.name!r}; for "
                             f"measured curves give variability.curves.path=FILE (recipes/profile.py's curves.npz)")
        if out.mode not in MODES + ("off",):
            raise ValueError(f"emulation.mode must be measured, curve or off, got {mode!r}")
        if out.wait not in WAITS:
            raise ValueError(f"emulation.wait must be one of {WAITS}, got {out.wait!r}")
        if out.time_scale != 1.0 and out.mode != "curve":  # it scales the curves' latencies only
            raise ValueError(f"emulation.time_scale={out.time_scale:g} scales the latency curves of "
                             f"emulation.mode=curve; with emulation.mode={out.mode} it does nothing: add "
                             "emulation.mode=curve, or drop it")
        return out

    def curves(self, num_ranks: int) -> Any:
        """The latency curves: loaded from ``curves_path``, else the preset's."""
        return load_curves(self.curves_path) if self.curves_path else preset_curves(self.name, num_ranks)

    def layer_config(self, layer_cfg: dict, num_ranks: int) -> dict:
        """``layer_cfg`` (``cls``, ``kwargs``) with ``variability`` (and ``curves`` when profiled) added
        to the kwargs of a layer class that takes them; other layers, or no ``variability`` in the
        config, leave it unchanged.

        Raises:
            ValueError: the layer's kwargs name a different ``variability`` than the config.
        """
        import importlib

        mod, _, name = layer_cfg["cls"].rpartition(".")
        params = inspect.signature(getattr(importlib.import_module(mod), name)).parameters
        kwargs = dict(layer_cfg.get("kwargs") or {})
        if kwargs.get("slowdown") is not None and self.slows(num_ranks):
            raise ValueError(f"layer.kwargs.slowdown={kwargs['slowdown']} and the config's emulation "
                             f"(variability={self.name}, emulation.mode={self.mode}) would both slow the experts "
                             f"down, the second timing the first one's wait as compute (the factors multiply): use "
                             f"one, e.g. drop layer.kwargs.slowdown, or set emulation.mode=off")
        if not self.given or "variability" not in params:
            return layer_cfg
        if kwargs.get("variability", self.name) != self.name:
            raise ValueError(f"layer.kwargs.variability={kwargs['variability']!r} contradicts "
                             f"variability={self.name!r}")
        kwargs["variability"] = self.name
        if self.curves_path:
            kwargs["curves"] = self.curves(num_ranks)
        return dict(layer_cfg, kwargs=kwargs)

    def slows(self, num_ranks: int) -> bool:
        """Whether :meth:`apply` hooks an emulation on some rank of ``num_ranks``: curve mode, or
        measured mode with a preset that slows a rank (``variability=none`` or ``low`` does not)."""
        if self.mode == "curve":
            return True
        return self.mode == "measured" and any(f != 1.0 for f in slowdown_preset(self.name, num_ranks))

    def describe(self, num_ranks: int) -> str | None:
        """What the emulation does on the ``num_ranks`` ranks, for a run's notes (``None``: nothing)."""
        if self.mode == "off":
            return None
        if self.mode == "measured":
            factors = slowdown_preset(self.name, num_ranks)
            slowed = {r: f for r, f in enumerate(factors) if f != 1.0}
            if not slowed:
                return None
            shown = ", ".join(f"rank {r} x{f:.3f}" for r, f in slowed.items())
            return (f"emulated variability={self.name} (measured mode): expert compute stretched on expert-parallel "
                    f"{shown} (of every expert-parallel group)")
        source = f"the profiled curves {self.curves_path}" if self.curves_path else f"variability={self.name}"
        return (f"emulated variability (curve mode): every rank's expert time padded to {self.time_scale:g} x its "
                f"latency curve, from {source}")

    def apply(self, layers: Sequence[nn.Module]) -> list[VariabilityEmulator]:
        """Hook the emulation on every layer (none when ``mode='off'``, or in measured mode when this
        rank's slowdown is 1)."""
        if self.mode == "off" or not layers:
            return []
        groups = layers[0].groups
        own = [type(layer).__name__ for layer in layers if getattr(layer, "slowdown", None) is not None]
        if own and self.slows(groups.ep_size):  # (decided alike on every rank: a refusal on some would hang)
            raise ValueError(f"{own[0]} slows itself down already (its slowdown=): the config's emulation "
                             f"(variability={self.name}, emulation.mode={self.mode}) would time that wait as compute "
                             f"and multiply the factors; use one")
        if self.mode == "measured":
            factor = slowdown_preset(self.name, groups.ep_size)[groups.ep_rank]
            if factor == 1.0:
                return []
            return [emulate_variability(layer, factor, wait=self.wait) for layer in layers]
        curves = self.curves(groups.ep_size)
        return [emulate_variability(layer, mode="curve", curves=curves, time_scale=self.time_scale, wait=self.wait)
                for layer in layers]
