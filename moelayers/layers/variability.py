"""`VariabilityAwareMoE` (GEM): place experts so that every GPU finishes at the same time.

GPUs of one model differ in speed (GEM measures up to ~12% between nominally identical parts).
The layer records the expert loads it serves, and a GEM search (``moelayers.planning.gem``) picks
the expert -> rank assignment minimising the predicted step time ``max_r C_r(rows_r)`` under
each rank's latency curve ``C_r``. The new placement is applied while serving by moving expert
weights point-to-point between the ranks that exchange experts (``apply_placement``, transactional:
see :mod:`moelayers.layers.moves`). Routing, dispatch and expert math are the base's: outputs
equal the dense reference before and after a move.

Load recording: after each forward, this rank's per-step logical expert counts ``[E]`` go into a
ring buffer of ``window`` steps (on the layer's device, no host sync). Re-planning sums the buffer
over the expert-parallel ranks (one all_reduce of ``[window, E]``), plans on rank 0 and broadcasts
the result, so every rank applies the same placement. The window, the step count and the re-plan
schedule are not part of ``state_dict()`` (the placement and weights are): a resumed layer starts a
new window.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable

import torch
import torch.distributed as dist

from moelayers._autograd import in_backward
from moelayers._compile import eager_under_compile
from moelayers._warnings import warn_caller
from moelayers.config import MoEConfig
from moelayers.groups import ParallelGroups, collective_device
from moelayers.layers.base import MoELayerBase
from moelayers.layers.moves import PlacementMoveError, PlacementRejected, holds_gradients
from moelayers.layers.turns import one_at_a_time
from moelayers.placement import ExpertPlacement

Planner = Callable[..., Any]  # (loads [steps, E], curves, *, restarts, seed) -> expert_rank [E]
#: A due re-plan that has waited this many windows of forwards for autograd graphs warns once: a
#: model served with autograd on and its outputs kept. Pipelined training (all micro-batches'
#: forwards before their backwards) waits up to its micro-batches per step, usually less.
_GRAPH_WAIT_WARNING = 4


class VariabilityAwareMoE(MoELayerBase):
    """Expert-parallel MoE layer that re-places its experts for heterogeneous GPU speeds (GEM).

    Args:
        config, groups, placement: as every layer (placement default: linear).
        curves: latency curves of the ranks (``moelayers.planning.gem.LatencyCurves`` for
            ``ep_size`` ranks, checked here); default ``LatencyCurves.preset(variability, ep_size)``,
            built on first use.
        variability: preset for the default curves: ``'high' | 'moderate' | 'low' | 'none'`` (given
            ``curves`` take its place).
        window: steps of expert loads kept for planning.
        auto_replan: re-plan once when the window first fills, then every ``replan_every`` steps
            (if set), at the end of that forward. An automatic re-plan that fails (the planner, or
            an aborted move: every rank learns it together) does not cost the forward its output: a
            ``RuntimeWarning`` says why, the old placement keeps serving, and the re-plan is tried
            again ``window`` steps later. When autograd records the forward (the input or
            the weights require grad), the re-plan waits for the start of the next forward instead:
            moving weights in place would break the backward of the graph that saved them. (In
            training, set ``layer.replan_optimizer = optimizer``: the moves then carry its per-slot
            state, Adam's moments, with the weights; without it the first automatic move warns.)
        replan_every: steps between automatic re-plans after the first (needs ``auto_replan``).
        planner: ``planner(loads [steps, E], curves, *, restarts, seed) -> expert_rank [E]``, run on
            rank 0 only (default: ``moelayers.planning.gem.plan_gem``); ``loads`` is a float64 numpy
            array, ``expert_rank`` any integer array or tensor.
        restarts, plan_seed: passed to the planner as ``restarts`` and ``seed`` (an int ``>= 0``).
        min_gain: move only when the new placement's predicted time on the planning window
            (``moelayers.planning.gem.score`` of the loads under the curves) is at least this share
            below the current placement's, e.g. ``0.01``: no weights moved for a 0.1 % gain when
            re-planning every few steps. ``None`` (default): apply the planner's placement (a
            placement with every expert on the rank that holds it now moves nothing); with the
            default planner only where it is predicted faster on the window, by any margin (not on
            a tie, e.g. a window without loads or below one tile on every rank, where GEM's pick is
            arbitrary, nor where it would be slower: its search may miss the current placement).
            A planner of your own is always applied.
            Scores need a placement with one replica per expert and ``LatencyCurves``; with
            ``min_gain`` set, a re-plan whose gain cannot be scored keeps the placement.
        record_loads: keep the load window (forwards replayed from a CUDA graph too: the graph
            outputs the routing). A move drops the captured graph; the next forward captures anew.
            With ``capacity``, each forward then reads the exchanged flags (one host sync, even with
            ``check_finite=False``), so that a forward one rank refuses raises on every rank and the
            windows stay in step.
        slowdown: emulated variability (measured mode of :func:`moelayers.emulation.emulate_variability`):
            this rank's factor ``s >= 1``, or one factor per expert-parallel rank ``[R]``; ``None``: none.
            It slows the hardware down; the planner still uses ``curves``.
        **kwargs: the rest of :class:`MoELayerBase`'s arguments (dispatcher, device, seed, ...).

    Attributes:
        num_replans: re-plans made by :meth:`replan` (whether or not they moved weights).
        num_moves: re-plans that moved weights.
        last_replan: ``{"score_current", "score_new", "gain", "moved"}`` of the last re-plan
            (seconds summed over the window's steps; scores ``None`` where they could not be
            computed), the same on every rank; ``None`` before the first.
        steps: forwards recorded so far.

    Example:
        >>> layer = VariabilityAwareMoE(cfg, groups, variability="high", window=16, auto_replan=True)
        >>> with torch.no_grad():                # serving: no autograd graph holds the weights
        ...     y = layer(x)                    # every rank, every step; re-plans after 16 steps
        >>> layer.apply_placement(placement)    # or move explicitly (every rank, same placement)

    Under autograd (training) a due re-plan waits until, on every rank, no recorded graph is alive
    without its backward (:meth:`graphs_in_flight`) and the expert weights hold no gradients (a move would
    leave them with the slots; ``zero_grad(set_to_none=True)`` after the optimizer step clears
    them, so accumulation over micro-batches is never split by a move). Serving with autograd on
    keeps the last outputs' graphs alive, so the move keeps waiting: after ``window`` such forwards
    a ``RuntimeWarning`` says so (serve under ``torch.no_grad()`` / ``torch.inference_mode()``, or
    call :meth:`forget_graphs`); so does a move that waits for gradients ``zero_grad(set_to_none=False)``
    left as zeros. To train with ``auto_replan=True``, set ``layer.replan_optimizer = optimizer``:
    automatic moves then carry its per-slot state (Adam's moments) with the weights; without it,
    the first automatic move in training warns that the state stayed with the slots.
    """

    # the layer's attributes, declared for type checkers (set in __init__)
    curves: Any  # LatencyCurves, or what a custom planner takes (None: the preset, built on first use)
    variability: str
    window: int
    auto_replan: bool
    replan_every: int | None
    min_gain: float | None
    steps: int
    num_replans: int
    num_moves: int

    #: a deep copy watches none of the original's autograd graphs (its weights are in none of them),
    #: is in none of its optimizers (``replan_optimizer``) and has not trained (the base's: a frozen
    #: reference model's re-plans do not warn about optimizer state); it keeps the load window and
    #: the step count
    _fresh_on_copy = {**MoELayerBase._fresh_on_copy, "replan_optimizer": lambda: None, "_warned_zeros": lambda: False}

    # normal tensors even when built under torch.inference_mode() (see MoELayerBase.__init__)
    @torch.inference_mode(False)
    def __init__(
        self,
        config: MoEConfig,
        groups: ParallelGroups,
        *,
        placement: ExpertPlacement | None = None,
        curves: Any = None,
        variability: str = "none",
        window: int = 16,
        replan_every: int | None = None,
        auto_replan: bool = False,
        planner: Planner | None = None,
        restarts: int = 8,
        plan_seed: int = 0,
        min_gain: float | None = None,
        record_loads: bool = True,
        slowdown: float | list[float] | None = None,
        **kwargs: Any,
    ):
        from moelayers.emulation import VARIABILITY_PRESETS

        for name, value in (("auto_replan", auto_replan), ("record_loads", record_loads)):
            if not isinstance(value, bool):  # a config's string 'off' would be truthy
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if variability not in VARIABILITY_PRESETS:
            raise ValueError(f"variability must be one of {VARIABILITY_PRESETS}, got {variability!r}")
        for name, v in (("window", window), ("restarts", restarts)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if replan_every is not None:
            if isinstance(replan_every, bool) or not isinstance(replan_every, numbers.Integral) or replan_every < 1:
                raise ValueError(f"replan_every must be a positive int or None, got {replan_every!r}")
            if not auto_replan:
                raise ValueError("replan_every needs auto_replan=True")
        if auto_replan and not record_loads:
            raise ValueError("auto_replan needs record_loads=True (it plans from the recorded window)")
        if min_gain is not None and (isinstance(min_gain, bool) or not isinstance(min_gain, numbers.Real)
                                     or not 0.0 <= float(min_gain) < 1.0):
            raise ValueError(f"min_gain must be None or a number in [0, 1), got {min_gain!r}")
        if planner is not None and not callable(planner):
            raise TypeError(f"planner must be callable, got {type(planner).__name__}")
        if isinstance(plan_seed, bool) or not isinstance(plan_seed, numbers.Integral) or plan_seed < 0:
            raise ValueError(f"plan_seed must be an int >= 0, got {plan_seed!r}")
        if auto_replan and planner is None and config.num_experts % groups.ep_size:
            raise ValueError(f"auto_replan with the default GEM planner needs num_experts ({config.num_experts}) "
                             f"divisible by the expert-parallel ranks ({groups.ep_size}): it places equal experts "
                             f"per rank, so every re-plan would fail; pass a planner that handles it")
        if curves is not None and hasattr(curves, "check_ranks"):  # LatencyCurves: here, not at the first re-plan
            curves.check_ranks(groups.ep_size)
        elif curves is not None and planner is None:  # (a string or a path failed at every re-plan, as a warning)
            raise TypeError(f"curves must be a moelayers.planning.gem.LatencyCurves for the default GEM planner "
                            f"(LatencyCurves.load(path) reads recipes/profile.py's file; variability='high' etc. "
                            f"picks a preset), got {type(curves).__name__}")
        factor = _slowdown_factor(slowdown, groups) if slowdown is not None else None  # on every rank, before any collective
        super().__init__(config, groups, placement=placement, **kwargs)
        self.curves, self.variability = curves, variability
        self.window, self.auto_replan = int(window), auto_replan
        self.replan_every = None if replan_every is None else int(replan_every)
        self.planner, self.restarts, self.plan_seed = planner, int(restarts), int(plan_seed)
        self._curves_given = curves is not None
        self._retry_at: int | None = None  # step of the next try after a failed automatic re-plan
        self.min_gain = None if min_gain is None else float(min_gain)
        self.record_loads = record_loads
        self.steps, self.num_replans, self.num_moves = 0, 0, 0
        self._replan_pending, self._waited = False, 0  # forwards a due re-plan has waited for graphs
        #: the torch optimizer whose per-slot state (Adam's moments) automatic re-plans move with the
        #: weights (training with ``auto_replan=True``; ``replan(optimizer=)`` for explicit ones)
        self.replan_optimizer: torch.optim.Optimizer | None = None
        self._warned_zeros = False
        self._in_forward = False  # inside forward(): a refusal there has run the deferred re-plan already
        self.last_replan: dict | None = None
        self.register_buffer("_loads", torch.zeros(window, config.num_experts, dtype=torch.int64,
                                                   device=self.router.weight.device), persistent=False)
        self._redigest()  # with the settings above (_agreed_settings)
        self.slowdown = slowdown  # as given, the same on every rank (this rank's factor: self.emulator.factor)
        self.emulator = None  # a rank at full speed (factor 1.0) gets none: nothing to stretch, no timing syncs
        if factor is not None and factor != 1.0:
            from moelayers.emulation import emulate_variability

            self.emulator = emulate_variability(self, factor)

    def _agreed_settings(self) -> tuple:
        """When the layer re-plans and whether it moves: ranks that record other windows or re-plan
        at other steps wait for each other in the re-plan's collectives. (The planner, its curves,
        restarts and seed are read on rank 0 alone, which sends the plan.)"""
        return tuple((name, getattr(self, name, None))
                     for name in ("window", "auto_replan", "replan_every", "record_loads", "min_gain"))

    # ------------------------------------------------------------------ forward + load recording
    @eager_under_compile  # eager under torch.compile, as MoELayerBase.forward (its step count made a recompile per step)
    @one_at_a_time  # threads take turns (moelayers/layers/turns.py)
    def forward(self, x: torch.Tensor, *, token_ids: torch.Tensor | None = None,
                topk_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The base forward, then record this step's expert loads (and re-plan when due).

        Args:
            x: ``[T, H]``, ``[S, B, H]`` or ``[B, S, H]``; token_ids: optional, ``[T]`` or laid out
                like ``x``; topk_ids: optional forced routing (see :meth:`MoELayerBase.forward`).

        Returns:
            ``y`` with the shape of ``x``.
        """
        if in_backward():  # activation checkpointing recomputing a forward: its step is recorded, and no
            return super().forward(x, token_ids=token_ids, topk_ids=topk_ids)  # move may run inside the backward
        self._run_pending_replan()
        self._in_forward = True
        try:
            y = super().forward(x, token_ids=token_ids, topk_ids=topk_ids)
        finally:
            self._in_forward = False
        if self.record_loads:
            self._record(self.last_topk_ids)
            if self._replan_due():  # the ranks wait together: a re-plan is a collective
                if self._any_rank(y.requires_grad or self.graphs_in_flight() > 0 or self._holds_grads()):
                    self._replan_pending = True
                else:
                    self._auto_replan()
        return y

    def _flags_read_always(self) -> bool:
        """Recording loads, the ranks must stay in step (the window's steps and the re-plans are
        collectives): a forward one rank refuses or overflows raises on every rank, also with
        ``capacity`` and ``check_finite=False``."""
        return self.record_loads

    def _run_pending_replan(self) -> None:
        """Run a deferred re-plan (a collective) once no recorded graph holds the weights and no
        gradient waits; every forward starts with it, refused ones included."""
        if not self._replan_pending:
            return
        alive = self.graphs_in_flight()
        held = not alive and self._holds_grads()  # (this rank's: no collective behind the short cut)
        if not self._any_rank(alive > 0 or held):  # one small all-reduce per forward while it waits
            self._replan_pending, self._waited = False, 0
            self._auto_replan()
        else:
            self._waited += 1
            if self._waited == _GRAPH_WAIT_WARNING * self.window and alive:  # (pipelined micro-batches wait less)
                warn_caller(
                    f"{self._label()}: a due re-plan has waited {self._waited} forwards for autograd graphs "
                    f"({alive} alive) to be back-propagated or dropped; when serving, run the model under "
                    "torch.no_grad() or torch.inference_mode() (or call forget_graphs() on every rank)",
                    RuntimeWarning)
            elif self._waited >= self.window and not self._warned_zeros and self._grads_are_zeros():
                # (nonzero gradients: micro-batches accumulating, the move comes after zero_grad; zeros right
                # after zero_grad(set_to_none=False): checked with one host sync per forward from then on)
                self._warned_zeros = True
                warn_caller(
                    f"{self._label()}: a due re-plan has waited {self._waited} forwards for the expert "
                    "gradients to be cleared, and they hold zeros: zero_grad(set_to_none=False) leaves them, and a "
                    "move waits for zero_grad(set_to_none=True) (torch's default), which it would otherwise leave "
                    "with the slots", RuntimeWarning)

    def _refuse_in_step(self, exc: Exception) -> None:
        """The base refusal; called from outside :meth:`forward` (the megatron adapter refusing its
        own input), it first runs a deferred re-plan, as the other ranks' forwards do."""
        if not self._in_forward and not in_backward():  # (a refused recomputation: no move inside a backward)
            self._run_pending_replan()
        super()._refuse_in_step(exc)

    def _auto_replan(self) -> None:
        """:meth:`replan`, where a failure (raised on every rank together) warns instead of costing
        the forward its output, and schedules another try ``window`` steps later."""
        try:
            self.replan(optimizer=self.replan_optimizer)  # (trained weights moved without it warn: _moments_hint)
            self._retry_at = None
        except PlacementMoveError as exc:  # (on every rank: a filter that turns it into an error raises on all)
            self._retry_at = self.steps + self.window
            warn_caller(f"{self._label()}: the automatic re-plan failed ({exc}); tried again in "
                        f"{self.window} steps", RuntimeWarning)
        except BaseException:  # anything else (KeyboardInterrupt, a planner's bug) reaches the caller, and the
            # re-plan is tried again a window later as after a failure (it was never tried again)
            self._retry_at = self.steps + self.window
            raise

    def _grads_are_zeros(self) -> bool:
        """Whether the expert weights hold ``.grad`` tensors that are all zeros (one host sync).
        Not with megatron's ``main_grad``: it holds zeros on a rank whose experts got no rows while
        another rank holds gradients."""
        w13, w2 = self.experts.w13, self.experts.w2
        if any(getattr(w, "main_grad", None) is not None for w in (w13, w2)):
            return False
        grads = [w.grad for w in (w13, w2) if w.grad is not None]
        return bool(grads) and not any(bool(g.any()) for g in grads)

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of the expert-parallel group (one small all-reduce): the
        ranks decide together whether a due re-plan runs now, since one rank's graph or gradients
        (kept alive a step longer, or grad mode on some ranks only) would otherwise let the others
        start the move's collectives alone."""
        if self.groups.ep is None or self.groups.ep_size == 1:
            return bool(flag)
        t = torch.tensor([int(bool(flag))], device=collective_device(self.groups.ep))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.groups.ep)
        return bool(t.item())

    def _holds_grads(self) -> bool:
        """Whether this rank's expert weights hold gradients
        (:func:`~moelayers.layers.moves.holds_gradients`; no collective). megatron's ``main_grad``
        holds zeros on a rank whose experts got no rows while another's hold gradients: the callers
        combine every rank's answer in :meth:`_any_rank`."""
        return holds_gradients(self.experts.w13, self.experts.w2)

    @torch.no_grad()
    def _record(self, topk_ids: torch.Tensor) -> None:
        row = self._loads[self.steps % self.window]
        row.zero_()
        ids = topk_ids.reshape(-1).to(device=row.device, dtype=torch.int64)
        row.index_add_(0, ids, torch.ones_like(ids))
        self.steps += 1

    def _replan_due(self) -> bool:
        if not self.auto_replan or self.steps < self.window:
            return False
        if self.steps == self.window or self.steps == self._retry_at:
            return True
        return self.replan_every is not None and (self.steps - self.window) % self.replan_every == 0

    @one_at_a_time
    def reset_loads(self) -> None:
        """Forget the recorded window (``steps`` back to 0), e.g. after warm-up forwards that did
        not serve real requests; the next re-plan is due when the window has filled again."""
        self._loads.zero_()
        self.steps = 0
        self._replan_pending, self._retry_at, self._waited = False, None, 0

    def window_loads(self) -> torch.Tensor:
        """This rank's recorded loads ``[min(steps, window), E]`` (int64, CPU), oldest step first."""
        n = min(self.steps, self.window)
        order = [(self.steps - n + i) % self.window for i in range(n)]
        return self._loads[order].cpu()

    def global_window_loads(self) -> torch.Tensor:
        """The window summed over the expert-parallel ranks ``[min(steps, window), E]`` (int64, CPU).

        A collective over ``groups.ep`` (one all_reduce of ``[window, E]``): call it on every rank.
        """
        n = min(self.steps, self.window)
        order = [(self.steps - n + i) % self.window for i in range(n)]
        loads = self._loads.clone()
        if self.groups.ep is not None:
            loads = loads.to(collective_device(self.groups.ep))
            dist.all_reduce(loads, group=self.groups.ep)
        return loads[order].cpu()

    # ------------------------------------------------------------------ planning
    def latency_curves(self) -> Any:
        """The curves the planner uses (the preset's unless given)."""
        if self.curves is None:
            from moelayers.planning.gem import LatencyCurves

            self.curves = LatencyCurves.preset(self.variability, self.groups.ep_size)
        return self.curves

    def _moments_hint(self) -> str:
        return ("set layer.replan_optimizer = optimizer for the automatic re-plans, and pass optimizer= to replan / "
                "apply_placement (or moelayers.checkpoint.load_placement_state_dict), to move it with them")

    @one_at_a_time
    def replan(self, loads: torch.Tensor | None = None, *, optimizer: torch.optim.Optimizer | None = None
               ) -> ExpertPlacement:
        """Plan a placement on rank 0, broadcast it and apply it on every rank (a collective).

        Args:
            loads: ``[steps, E]`` global expert loads; default: the recorded window summed over
                ranks (a collective). Pass them on every rank or on none (rank 0's are planned on).
            optimizer: in training, the torch optimizer whose per-slot state moves with the
                weights (see :meth:`apply_placement`).

        Returns:
            The placement now serving (the same on every rank).

        Raises:
            ValueError: ``loads`` passed on some ranks only (raised on every rank; a rank without
                them would wait in the window's all-reduce).
            PlacementRejected: rank 0's ``loads`` are not a ``[steps >= 1, E]`` tensor of numbers,
                or the window is empty (a ``ValueError`` and a ``PlacementMoveError``, raised on
                every rank with rank 0's reason; nothing planned, nothing moved).
            PlacementMoveError: the planner failed on rank 0 (raised on every rank), or the move
                was aborted; the old placement keeps serving.
        """
        e, r = self.config.num_experts, self.groups.ep_size
        if self.groups.ep is not None:  # one small all-reduce: were the loads passed on every rank, or on none?
            given = torch.tensor([int(loads is None), int(loads is not None)], device=collective_device(self.groups.ep))
            dist.all_reduce(given, op=dist.ReduceOp.MAX, group=self.groups.ep)
            if int(given.sum()) == 2:
                raise ValueError("replan: loads were passed on some expert-parallel ranks only; pass them on every "
                                 "rank (rank 0's are planned on) or on none (the recorded window)")
        if loads is None:
            loads = self.global_window_loads()
        # rank 0 -> all: [ok, expert_rank (E), score_current, score_new (float64 bits)]
        msg = torch.zeros(e + 3, dtype=torch.int64)  # msg[0]: 1 planned, 0 the planner failed, -1 bad loads
        cause = None
        if self.groups.ep_rank == 0:
            checking_loads = True
            try:
                if not isinstance(loads, torch.Tensor):
                    raise TypeError(f"loads must be a torch.Tensor [steps, {e}], got {type(loads).__name__}")
                if loads.dtype == torch.bool or loads.is_complex():
                    raise TypeError(f"loads must be numbers of rows [steps, {e}], got dtype {loads.dtype}")
                if loads.dim() == 2 and loads.shape[1] == e and loads.shape[0] == 0:
                    raise ValueError("no expert loads recorded yet (the load window is empty): run forwards "
                                     "first, or pass loads=[steps, E]")
                if loads.dim() != 2 or loads.shape[1] != e or loads.shape[0] < 1:
                    raise ValueError(f"loads must be [steps >= 1, {e}], got {list(loads.shape)}")
                checking_loads = False
                planner, curves = self.planner, self.latency_curves()
                if planner is None:
                    from moelayers.planning.gem import plan_gem as planner
                if hasattr(curves, "check_ranks"):  # LatencyCurves: curves for exactly R ranks
                    curves.check_ranks(r)
                x = loads.cpu().to(torch.float64).numpy()
                expert_rank = torch.as_tensor(planner(x, curves, restarts=self.restarts, seed=self.plan_seed))
                if expert_rank.is_floating_point() or expert_rank.is_complex() or expert_rank.dtype == torch.bool:
                    raise TypeError(f"the planner returned ranks of dtype {expert_rank.dtype}: integer ranks expected "
                                    f"(they were truncated)")
                expert_rank = expert_rank.to(torch.int64).reshape(-1).cpu()
                if expert_rank.numel() != e or int(expert_rank.min()) < 0 or int(expert_rank.max()) >= r:
                    raise ValueError(f"the planner returned {expert_rank.tolist()}: expected [{e}] ranks in [0, {r})")
                # e.g. more experts on a rank than it has slots: fail here, as a planner failure on every rank
                ExpertPlacement.from_expert_rank(expert_rank, num_ranks=r, slots_per_rank=self.placement.slots_per_rank)
                msg[0], msg[1:e + 1] = 1, expert_rank
                msg[e + 1:] = torch.tensor(self._window_scores(x, curves, expert_rank), dtype=torch.float64).view(torch.int64)
            except Exception as exc:  # noqa: BLE001 - broadcast as a failure, raised on every rank below
                cause = exc
                msg[0] = -1 if checking_loads else 0
        if self.groups.ep is not None:
            msg = msg.to(collective_device(self.groups.ep))
            dist.broadcast(msg, src=dist.get_global_rank(self.groups.ep, 0), group=self.groups.ep)
            msg = msg.cpu()
        if int(msg[0]) != 1:  # every rank learns rank 0's reason (this path is taken by all together)
            reason = [None if cause is None else f"{type(cause).__name__}: {cause}"]
            if self.groups.ep is not None:
                dist.broadcast_object_list(reason, src=dist.get_global_rank(self.groups.ep, 0), group=self.groups.ep)
            if int(msg[0]) == -1:
                raise PlacementRejected(f"replan: rank 0's loads were refused ({reason[0]}); nothing was planned",
                                        [0], "plan") from cause
            raise PlacementMoveError(f"re-planning failed on rank 0 ({reason[0]}); the old placement keeps serving",
                                     [0], "plan") from cause
        new = ExpertPlacement.from_expert_rank(msg[1:e + 1], num_ranks=r, slots_per_rank=self.placement.slots_per_rank)
        s_cur, s_new = (None if v != v else v for v in msg[e + 1:].clone().view(torch.float64).tolist())  # NaN: none
        gain = None if s_cur is None or s_new is None or s_cur <= 0 else 1.0 - s_new / s_cur
        # with min_gain, a gain that cannot be scored (a placement with replicas) keeps the placement
        # the same experts on the same ranks in another slot order is no move worth paying for
        same_ranks = self.placement.max_replicas == 1 and torch.equal(self.placement.expert_rank(), new.expert_rank())
        if same_ranks:
            move = False
        elif self.min_gain is None:  # the default planner's placement, only where it is predicted faster
            move = gain is None or gain > 0.0 or self.planner is not None
        else:
            move = gain is not None and gain >= self.min_gain
        before = self.placement
        if move:
            self._move(new, optimizer)
            self.num_moves += 1
        self.num_replans += 1
        self.last_replan = {"score_current": s_cur, "score_new": s_new, "gain": gain, "moved": move}
        self._warn_if_moments_left(before, optimizer)  # (after the bookkeeping: a filter may make it an error)
        return self.placement

    def _window_scores(self, loads, curves, expert_rank: torch.Tensor) -> tuple[float, float]:
        """``(current, new)`` predicted seconds over the window's steps; NaN where not computable
        (a placement with replicas, or curves that are not ``LatencyCurves``)."""
        from moelayers.planning.gem import LatencyCurves, score

        if not isinstance(curves, LatencyCurves) or self.placement.max_replicas != 1:
            return float("nan"), float("nan")
        try:
            return score(self.placement.expert_rank().numpy(), loads, curves), score(expert_rank.numpy(), loads, curves)
        except ValueError:  # e.g. loads the curves cannot score: no prediction, the plan still stands
            return float("nan"), float("nan")

    def extra_repr(self) -> str:
        curves = f"curves={self.curves!r}" if self._curves_given else f"variability={self.variability}"
        return (super().extra_repr() + f", {curves}, window={self.window}, "
                f"auto_replan={self.auto_replan}, replan_every={self.replan_every}, min_gain={self.min_gain}")


def _slowdown_factor(slowdown: Any, groups: ParallelGroups) -> float:
    """This rank's emulated slowdown from one factor or one per expert-parallel rank (a list, tuple,
    array or tensor), every factor checked on every rank: a bad one refused by its own rank only
    would leave the others waiting in the next collective."""
    from moelayers.emulation import _finite

    if isinstance(slowdown, (list, tuple)) or getattr(slowdown, "ndim", 0) >= 1:
        factors = [float(f) if isinstance(f, torch.Tensor) else f for f in list(slowdown)]
        if len(factors) != groups.ep_size:
            raise ValueError(f"slowdown has {len(factors)} factors for {groups.ep_size} ranks")
        for rank, f in enumerate(factors):
            _finite(f, f"slowdown factor of rank {rank}", 1.0, inclusive=True)
        slowdown = factors[groups.ep_rank]
    return _finite(slowdown, "slowdown factor", 1.0, inclusive=True)
