"""`MoELayerBase`: the five-step forward every strategy layer shares.

::

    x [T, H] (+ token_ids [T])
      1 route     TopKRouter       -> topk_ids [T, K], topk_weights [T, K]
      2 plan      self.plan()      -> Routes (the only step a strategy owns)
      3 dispatch  Dispatcher       -> rows per local slot
      4 compute   GroupedExperts   -> expert outputs
      5 combine   Dispatcher       -> y [T, H], caller's token order
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from moelayers._autograd import in_backward
from moelayers._compile import cached_tensor, eager_under_compile
from moelayers._warnings import warn_caller
from moelayers.config import PARAMS_DTYPES, MoEConfig
from moelayers.dispatch import AllGatherDispatcher, AllToAllDispatcher, LocalFirstPolicy, ReplicaPolicy, Routes
from moelayers.dispatch.base import Dispatcher, cached_arange, checked_plan, routes_from_placement
from moelayers.dispatch.flags import (
    BAD_INPUT, DISPATCH_AUTOGRAD, ORDER_SHIFT, PAYLOAD_NAMES, RECORDS_AUTOGRAD, REPLICA_AUTOGRAD, BackwardOrderError,
    SettingsDiffer, check_exchanged, merge_flags, raise_if_flagged, raise_if_placements_differ, settings_differences,
)
from moelayers.dispatch.comm import all_gather_flat
from moelayers.experts import GroupedExperts
from moelayers.groups import ParallelGroups, backend_device, collective_device
from moelayers.kernels import HAVE_TRITON, TRITON_INSTALL_HINT, use_triton
from moelayers.layers.deferred import DeferredFlags
from moelayers.layers.inflight import InFlightGraphs
from moelayers.layers.moves import Staging, move_expert_weights
from moelayers.layers.replay import ForcedForRecompute
from moelayers.layers.turns import one_at_a_time
from moelayers.layers.weights import LayerWeights, placement_record
from moelayers.metrics import MoEStats
from moelayers.placement import ExpertPlacement
from moelayers.router import TopKRouter, autocast_on

DISPATCHERS = ("alltoall", "allgather")


def layer_kwargs(layer_cls: type) -> set[str]:
    """Keyword names ``layer_cls(config, groups, **kw)`` accepts, following ``**kwargs`` up the MRO
    (the megatron adapter sorts a spec's arguments with it; the recipes name them when one is misspelt)."""
    names: set[str] = set()
    for klass in layer_cls.__mro__:
        if klass in (nn.Module, object):
            break
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        names.update(p.name for p in params
                     if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))
        if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
            break
    return names - {"config", "groups"}


def _check_layer_number(value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0):
        raise ValueError(f"layer_number must be None or an int >= 0 (the layer's place in the model, the same on "
                         f"every rank), got {value!r}")
    return None if value is None else int(value)


def _check_capacity(capacity: Any) -> tuple[int, ...] | None:
    """``capacity`` as the ascending tuple of its distinct sizes (``None``: exact mode)."""
    if capacity is None:
        return None
    if isinstance(capacity, torch.Tensor) or type(capacity).__module__ == "numpy":  # an array of sizes
        capacity = capacity.tolist()
    listed = isinstance(capacity, Sequence) and not isinstance(capacity, (str, bytes))
    sizes = list(capacity) if listed else [capacity]
    bad = [i for i, c in enumerate(sizes) if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 1]
    if not sizes or bad:
        what = f"capacity[{bad[0]}] = {sizes[bad[0]]!r}" if listed and bad else f"got {capacity!r}"
        raise ValueError(f"capacity must be None, an int >= 1 (tokens per rank) or a non-empty list or tuple of them "
                         f"(the sizes a forward may be padded to): {what}")
    return tuple(sorted({int(c) for c in sizes}))


def _check_forced_type(topk_ids: Any) -> None:
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype == torch.bool or topk_ids.is_floating_point() \
            or topk_ids.is_complex():
        raise TypeError(f"forced routing must be an integer tensor of expert ids, got "
                        f"{topk_ids.dtype if isinstance(topk_ids, torch.Tensor) else type(topk_ids).__name__}")


class MoELayerBase(LayerWeights, nn.Module):
    """Shared constructor, placement and forward template of the moelayers layers (their weights'
    init, loading, checks and ``state_dict``: :class:`~moelayers.layers.weights.LayerWeights`).

    Args:
        config: the MoE block.
        groups: process groups; the layer's experts are spread over ``groups.ep``.
        placement: expert placement over the ``groups.ep_size`` ranks (default: linear).
        dispatcher: ``'alltoall'`` (default) or ``'allgather'``.
        dedup: all-to-all only: send a token once per destination rank.
        replica_policy: picks a replica per (token, expert) (default :class:`LocalFirstPolicy`).
        device: where the weights live (default: torch's default device where one is set
            (``torch.set_default_device``, ``with torch.device(...)``); else CUDA's current device when
            the expert-parallel group uses NCCL, or with one expert-parallel rank when
            ``groups.backend`` is NCCL; else CPU).
        seed: the default initialisation draws each logical expert from its own generator seeded
            by ``(seed, expert id)``, so that replicas agree and every rank builds the same model.
        check_finite: raise on NaN/inf router logits, on every rank. Only on those: an overflow
            inside the experts (float16) gives inf/NaN output rows, as the reference does.

            * ``True``: the forward raises. With ``capacity``, or on one expert-parallel rank,
              reading the flags costs a host sync per forward.
            * ``False``: no check.
            * ``'deferred'``: the flags are copied to the host behind the forward, without a sync.
              The layer reads them when its next forward starts. That forward raises the error of
              the one before it (whose output was returned already), on every rank, before its
              exchange. Each layer raises only its own error. :func:`moelayers.check_pending`
              reads what the last forwards of a model's layers left: call it after the last
              forward of a generation, and after catching such an error.

            Where ``'deferred'`` defers: on one expert-parallel rank, in every inference forward
            (padded to a capacity or exact); on several, with two or more capacities or
            ``beyond_capacity='exact'``. A forward that must read the flags at once still does (a
            refused input, forced routing, an overflow, a capacity-mode forward's new placement).
            With several ranks, their vote on each forward's size tells every rank when one
            must, and all then raise in that forward. A rank raising alone would leave the others
            waiting in the next layer's exchange.

            Elsewhere ``'deferred'`` acts as ``True``:

            * without ``capacity`` on several ranks (the flags come with the split sizes, at no
              extra sync);
            * in a forward recording autograd;
            * with one capacity and several ranks;
            * where capacity mode reads the flags after every forward anyway (see
              :meth:`_raise_on_flags`): a custom replica policy or ``plan()``,
              ``VariabilityAwareMoE`` recording loads, ``SemanticMoE.forward_tp``.

            ``'deferred'`` is meant for serving and rollouts: train with ``True``. A reentrant
            activation checkpoint's first pass runs under ``no_grad``. Where the layer's input
            requires grad, that pass checks at once. An input made inside the checkpointed region
            defers as in an evaluation: the error then comes from the backward's recomputation,
            and again at the next forward.
        expert_backend: ``'auto'`` | ``'grouped_mm'`` | ``'loop'`` (see :class:`GroupedExperts`).
        capacity: all-to-all only: the tokens per rank a forward is padded to (static shapes; see
            ``AllToAllDispatcher``). An int, or a sequence of ints (e.g. ``(16, 64, 256, 1024)``;
            any order, duplicates dropped). With one int and ``beyond_capacity='raise'`` the
            exchange makes no host sync. With several sizes, each forward is padded to the
            smallest that holds the most tokens of any expert-parallel rank. With several ranks,
            they agree on that size in one small all-gather per forward, a host sync. The
            all-gather also compares the ranks' settings: ranks built with other sizes raise
            ``ValueError`` together. For more tokens than the largest size, see
            ``beyond_capacity``. Afterwards ``capacity`` is the largest size and ``capacities``
            all of them, ascending. ``last_capacity`` is the size the last forward ran at:
            ``None`` before the first forward and after an exact one.
        beyond_capacity: what a forward with more tokens than the largest capacity on any rank
            does: ``'raise'`` a ``ValueError`` on every rank (default), or ``'exact'``: run the
            exact all-to-all-v forward on every rank (no padding, no graph; ``last_capacity`` is
            then ``None``), for batches that rarely exceed the sizes (a long prefill). With one
            capacity and several ranks, ``'exact'`` costs that all-gather too (a host sync per
            forward). Build every rank alike. A rank with one capacity and ``'raise'`` makes no
            all-gather, so beside ranks with ``'exact'`` or several sizes it hangs.
        cuda_graph: with ``capacity``, on CUDA and without autograd, capture the whole forward in a
            CUDA graph on first use and replay it (every rank must take this path together). With
            several capacities there is one graph per capacity. Each is captured the first time a
            forward runs at its size, after three eager warm-up forwards, so that forward is slow.
            A layer's graphs share one memory pool, which holds about the memory of its largest
            size's forward. :func:`moelayers.share_graph_pool` shares one pool between layers. Needs
            what a capture allows, checked on every rank before the first one: the experts on
            ``torch._grouped_mm``'s fast path (bf16 on compute capability 9.x/10.x, ``H`` and ``F``
            multiples of 8, ``expert_backend`` not ``'loop'``) and the Triton kernels (installed, not
            disabled by ``MOELAYERS_DISABLE_TRITON=1``); otherwise the forward raises ``ValueError``.
        layer_number: the layer's place in the model (an int >= 0, the same on every rank; the
            megatron adapter sets megatron's ``layer_number``, ``TinyDecoder`` a block's index). It
            joins the digest the expert-parallel ranks compare in every exchange, so ranks that call
            their layers in different orders raise ``ValueError`` together instead of exchanging the
            rows of different layers (in capacity mode with ``check_finite=False`` only on the first
            forward after the digest changed: see :meth:`_raise_on_flags`). ``None`` (default): not
            checked, and two layers alike in every setting are then indistinguishable.

    Default initialisation: router and expert weights ``~ N(0, config.init_std)``.
    """

    # the layer's attributes, declared for type checkers (set in __init__)
    config: MoEConfig  # the layer's own copy
    groups: ParallelGroups
    placement: ExpertPlacement  # this layer's current placement (apply_placement changes it)
    seed: int
    cuda_graph: bool
    dedup: bool
    dispatcher_name: str
    replica_policy: ReplicaPolicy
    router: TopKRouter
    experts: GroupedExperts

    moe_layer_marker = True  # found by moelayers.trace.TraceRecorder
    _layer_number: int | None = None  # (a layer pickled before layer_number existed has none)
    _trained = False  # (nor these, before the moves of trained weights warned: apply_placement)
    _warned_moments = False
    _order_taken = 0  # the backwards' order digest the running forward took (see _order_flag)
    _check_deferred = False  # (nor these, before check_finite='deferred' existed)
    _reentrant_first_pass = False  # the forward running: a reentrant checkpoint's first pass (forward sets it)
    _deferred: DeferredFlags | None = None

    #: what a forward records on the layer: always plain values or tensors, never a parameter, buffer or
    #: submodule, so they are set as on any object (see ``__setattr__``)
    _FORWARD_STATE = frozenset({"_forced_ids", "_replay_key", "_reentrant_first_pass", "_trained", "_order_taken",
                                "last_topk_ids", "last_token_ids", "last_stats", "last_capacity", "dispatcher"})

    def __setattr__(self, name: str, value: Any) -> None:
        """``nn.Module.__setattr__``, except for the names in :attr:`_FORWARD_STATE`, which are set as
        on any object. Its checks for parameters, buffers and submodules would find none there, and
        they cost about 1 us a name on the host (``isinstance`` through ``Parameter``'s metaclass); a
        forward sets ten such names."""
        if name in self._FORWARD_STATE:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    # normal tensors even when built under torch.inference_mode(): the layer updates its weights, tables
    # and buffers in place (moves, loads, load recording) outside it too
    @torch.inference_mode(False)
    def __init__(
        self,
        config: MoEConfig,
        groups: ParallelGroups,
        *,
        placement: ExpertPlacement | None = None,
        dispatcher: str = "alltoall",
        dedup: bool = True,
        replica_policy: ReplicaPolicy | None = None,
        device: torch.device | str | None = None,
        seed: int = 0,
        check_finite: bool | str = True,
        expert_backend: str = "auto",
        capacity: int | Sequence[int] | None = None,
        cuda_graph: bool = False,
        layer_number: int | None = None,
        beyond_capacity: str = "raise",
    ):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        if not isinstance(groups, ParallelGroups):
            raise TypeError(f"groups must be a ParallelGroups, got {type(groups).__name__}")
        for name, value in (("dedup", dedup), ("cuda_graph", cuda_graph)):
            if not isinstance(value, bool):  # a config's string 'off' would be truthy
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if not isinstance(check_finite, bool) and check_finite != "deferred":
            raise TypeError(f"check_finite must be True, False or 'deferred', got {check_finite!r}")
        if placement is not None and not isinstance(placement, ExpertPlacement):  # (a table: "ambiguous" from bool())
            raise TypeError(f"placement must be an ExpertPlacement (ExpertPlacement.from_phy2log(table, num_experts) "
                            f"for a [ranks, slots] table), got {type(placement).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"seed must be an int >= 0 (the same on every rank: it draws the default weights), "
                             f"got {seed!r}")
        seed = int(seed)
        self._layer_number = _check_layer_number(layer_number)
        if placement is None:
            if config.num_experts % groups.ep_size:
                raise ValueError(
                    f"the default (linear) placement needs num_experts ({config.num_experts}) divisible by the "
                    f"{groups.ep_size} expert-parallel ranks; pass a placement that spreads them unevenly, e.g. "
                    f"placement=ExpertPlacement.from_expert_rank(torch.arange({config.num_experts}) % "
                    f"{groups.ep_size}, num_ranks={groups.ep_size}) (ranks may hold different numbers of experts, "
                    f"or none)")
            placement = ExpertPlacement.linear(config.num_experts, groups.ep_size)
        self._check_placement(placement, config, groups)
        if dispatcher not in DISPATCHERS:
            hint = ("; DeepEP's dispatcher is not part of this version of moelayers (its all-to-all dispatcher "
                    "serves the same layouts)") if str(dispatcher).lower().replace("_", "") == "deepep" else ""
            raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}{hint}")
        self._capacities = _check_capacity(capacity)
        if capacity is not None and (dispatcher != "alltoall" or not dedup):
            raise ValueError("capacity needs dispatcher='alltoall' with dedup=True")
        if cuda_graph and capacity is None:
            raise ValueError("cuda_graph=True needs a fixed capacity (tokens per rank)")
        if beyond_capacity not in ("raise", "exact"):
            raise ValueError(f"beyond_capacity must be 'raise' or 'exact', got {beyond_capacity!r}")
        if beyond_capacity == "exact" and capacity is None:
            raise ValueError("beyond_capacity='exact' needs a capacity (without one every forward is exact)")
        self.cuda_graph, self.beyond_capacity = cuda_graph, beyond_capacity
        self._graphed: dict[int, Any] = {}  # capacity -> its captured CUDA graph (GraphedForward)
        #: the memory pool the layer's CUDA graphs are captured into, shared with other layers
        #: (:func:`moelayers.share_graph_pool`); ``None``: one of its own, shared by its capacities' graphs
        self.graph_pool: tuple | None = None
        self._own_pool: tuple | None = None  # made at the first capture without graph_pool, dropped with the graphs
        # the layer's own copies: a caller editing its placement or config afterwards cannot
        # desynchronise the layer (replace() validates again)
        config = config.replace()
        self.config, self.groups, self.placement, self.seed = config, groups, placement.copy(), seed
        # what state_dict() saves (see get_extra_state)
        self._placement_rec = placement_record(self.placement, groups.ep_rank)
        if replica_policy is not None and not callable(replica_policy):
            raise TypeError(f"replica_policy must be callable (topk_ids, placement, rank) -> physical slots, "
                            f"got {type(replica_policy).__name__}")
        self.replica_policy = replica_policy if replica_policy is not None else LocalFirstPolicy()
        self.dedup = dedup
        self.dispatcher_name = dispatcher
        device = torch.device(device) if device is not None else _default_device(groups)
        self._check_deferred = check_finite == "deferred"  # capacity mode: flags read at the next forward
        self._deferred = DeferredFlags()  # what the last forward left for the next one to read
        # (reset_parameters draws the router's weights)
        self.router = TopKRouter(config, device=device, check_finite=check_finite is not False, init=False)
        self.experts = GroupedExperts(
            placement.slots_per_rank, config.hidden_size, config.ffn_hidden_size,
            dtype=config.params_dtype, device=device, backend=expert_backend, init=False,
        )
        self.experts.tie_replicas(self.placement, groups.ep_rank, groups.ep)
        self.dispatcher: Dispatcher  # with several capacities: the last forward's size's (a move rebuilds it)
        self._new_dispatchers()
        self.last_stats: MoEStats | None = None
        self.last_topk_ids: torch.Tensor | None = None
        self.last_token_ids: torch.Tensor | None = None
        self.last_capacity: int | None = None  # capacity mode: the size the last forward was padded to
        self._forced_ids: torch.Tensor | None = None
        self._forced_for_recompute = ForcedForRecompute()  # for activation checkpointing (layers/replay.py)
        self._graphs = InFlightGraphs()  # recorded forwards awaiting their backward: a move waits (layers/inflight.py)
        self._trained = False  # a forward ran under autograd: a move without the optimizer warns (apply_placement)
        self._warned_moments = False
        self._order_sent: torch.Tensor | None = None  # the flag of _order_flag, and the value it holds
        self._order_value = 0
        # the tensor a wrapper was given, to key the next forward's routing by for checkpointing when the
        # layer's own input is made from it in the wrapper (the megatron adapter's unpadded rows)
        self._replay_key: torch.Tensor | None = None
        self._bad_input = False  # this forward stands in for a refused input (see _refuse_in_step)
        # capacity mode compares the ranks' placements on the next forward (see _raise_on_flags)
        self._placement_unchecked = True
        self._flags_before_load: dict[str, tuple[int, dict]] = {}  # name -> (storage, flags), see _after_load
        self._staging_fault_hook: Callable[[Staging], None] | None = None  # tests: a fault while moving weights
        self.register_load_state_dict_post_hook(MoELayerBase._after_load)
        self.reset_parameters()

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _check_placement(placement: ExpertPlacement, config: MoEConfig, groups: ParallelGroups) -> None:
        if not isinstance(placement, ExpertPlacement):
            raise TypeError(f"placement must be an ExpertPlacement, got {type(placement).__name__}")
        if placement.num_experts != config.num_experts:
            raise ValueError(f"placement is for {placement.num_experts} experts, config has {config.num_experts}")
        if placement.num_ranks != groups.ep_size:
            raise ValueError(f"placement spans {placement.num_ranks} ranks, the expert-parallel group has {groups.ep_size}")
        placement.validate()  # also catches a phy2log edited in place after the placement was built

    @property
    def capacity(self) -> int | None:
        """The most tokens per rank a forward takes (the largest of :attr:`capacities`; ``None``:
        exact mode). Set at construction."""
        return None if self._capacities is None else self._capacities[-1]

    @property
    def capacities(self) -> tuple[int, ...] | None:
        """The sizes forwards are padded to, ascending (``None``: exact mode). Set at construction."""
        return self._capacities

    def _make_dispatcher(self, capacity: int | None = -1) -> Dispatcher:
        """A dispatcher for the layer's placement and settings; ``capacity``: a fixed-size one for
        forwards padded to it (default: the largest capacity, where the layer has one), ``None``
        an exact one (``beyond_capacity='exact'``). The layer keeps one per capacity in
        ``_dispatchers`` (each holds the flags and counts of its own forwards, which its CUDA graph
        writes on replay): :meth:`_new_dispatchers` drops them."""
        g, p = self.groups, self.placement
        if self.dispatcher_name == "allgather":
            return AllGatherDispatcher(g.ep, g.ep_size, g.ep_rank, p.slots_per_rank, placement_digest=self._digest())
        return AllToAllDispatcher(g.ep, g.ep_size, g.ep_rank, p.slots_per_rank, dedup=self.dedup,
                                  capacity=self.capacity if capacity == -1 else capacity,
                                  placement_digest=self._digest())

    def _new_dispatchers(self) -> None:
        """Build the dispatcher afresh (for a new placement or digest): ``dispatcher``, and, with
        several capacities, the others when their forwards first run."""
        self.dispatcher = self._make_dispatcher()
        self._dispatchers = {self.capacity: self.dispatcher}

    def _redigest(self) -> None:
        """Send the digest of the current :meth:`_settings` from the next forward on (every
        capacity's dispatcher)."""
        digest = self._digest()
        for d in self._dispatchers.values():
            d.placement_digest = digest

    def _digest(self) -> int:
        """62-bit digest the ranks compare with every exchange: of :meth:`_settings`, as built."""
        return int.from_bytes(hashlib.blake2b(repr(self._settings()).encode(), digest_size=8).digest(), "little") >> 2

    def _settings(self) -> tuple[tuple[str, Any], ...]:
        """``(name, value)`` of everything the expert-parallel ranks must share: the placement (its
        digest), the settings that decide how the payload is laid out (a rank built with another
        ``dedup`` or ``top_k`` would read the others' rows with its own layout), the rest of the
        config (another ``ffn_hidden_size`` or ``norm_topk_prob`` on one rank served another model),
        the layer's :meth:`_agreed_settings` and its ``layer_number``."""
        c = self.config
        payload = ((("dedup", self.dedup), ("capacity", self.capacities), ("beyond_capacity", self.beyond_capacity))
                   if self.dispatcher_name == "alltoall" else ())
        if self.capacities is not None:  # where some ranks reading the flags and others not would hang
            payload += (("check_finite", "deferred" if self._check_deferred else self.router.check_finite),)
        config = tuple((f"config.{f.name}", getattr(c, f.name)) for f in dataclasses.fields(c) if f.name != "params_dtype")
        return (("placement", self.placement.digest()), ("dispatcher", self.dispatcher_name), *payload, *config,
                *self._agreed_settings(), ("layer_number", self._layer_number))

    def _name_differences(self, exc: SettingsDiffer) -> SettingsDiffer:
        """``exc`` with the settings that differ between the ranks named (which, on which ranks, and
        what to do), gathered in one more collective: every rank raised ``exc`` in the same exchange
        (``exc.together``), so every rank runs it (a rank of an older moelayers, which does not,
        leaves the others waiting for it: keep one version across the ranks). ``exc`` itself when
        nothing named differs or the gather fails."""
        mine = dict(self._settings(), **{"placement": self.placement.phy2log.tolist(), "layer class": type(self).__name__})
        mine.update(zip(PAYLOAD_NAMES, self.dispatcher.payload))
        everyone: list[Any] = [None] * self.groups.ep_size
        try:
            dist.all_gather_object(everyone, mine, group=self.groups.ep)
            named = settings_differences(everyone)
        except Exception:  # (the error to report is exc; a failure here must not hide it)
            return exc
        return exc.named(named) if named else exc

    @property
    def layer_number(self) -> int | None:
        """The layer's place in the model (``None``: not given); part of :meth:`_digest`. Set it on
        every rank alike (a model numbering its layers after building them, as megatron's
        ``set_layer_number`` does); a captured CUDA graph is dropped and captured again."""
        return self._layer_number

    @layer_number.setter
    def layer_number(self, value: int | None) -> None:
        value = _check_layer_number(value)
        if value != self._layer_number:
            self.release_graphs()  # its exchange sends the digest it was captured with
            self._layer_number = value
            self._redigest()
            self._placement_unchecked = True  # capacity mode: compared on the next forward

    def _label(self) -> str:
        """The layer in messages: its class, and its ``layer_number`` where it has one."""
        return type(self).__name__ + ("" if self._layer_number is None else f" (layer {self._layer_number})")

    def _agreed_settings(self) -> tuple[tuple[str, Any], ...]:
        """``(name, value)`` of settings of a subclass that every expert-parallel rank must share
        (e.g. when it re-plans: ranks re-planning at different steps wait for each other in the
        re-plan's collectives); part of :meth:`_settings`. Read while ``__init__`` builds the
        dispatcher too: use defaults."""
        return ()

    def _adopt_placement(self, placement: ExpertPlacement) -> None:
        """Serve with ``placement`` from now on (the expert weights are already laid out in it):
        drop the captured graph and rebuild the dispatcher (subclasses drop what they derived)."""
        self.release_graphs()
        self.placement = placement.copy()  # the layer's own: the caller may edit or reuse theirs
        self._placement_unchecked = True
        record = placement_record(self.placement, self.groups.ep_rank)
        if self._placement_rec.shape == record.shape:  # in place: see get_extra_state
            self._placement_rec.copy_(record)
        else:
            self._placement_rec = record
        self.experts.tie_replicas(self.placement, self.groups.ep_rank, self.groups.ep)
        self._new_dispatchers()

    @one_at_a_time
    def apply_placement(self, placement: ExpertPlacement, *, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Move expert weights to ``placement`` while serving (a collective over ``groups.ep``: every
        rank calls it with the same placement).

        Transactional: validated and voted on before any transfer, staged, voted on again, then
        committed on every rank of ``groups.ep`` or on none (see
        :func:`moelayers.layers.moves.move_expert_weights`; with several expert-parallel groups, each
        group's move is its own transaction: after a failure in one, the groups serve different
        placements, which ``reduce_expert_grads`` refuses).
        Outputs are unchanged: each logical expert's weights move with it; the router stays in
        logical order (in bfloat16 up to a rounding of the tokens whose experts come to share a rank
        or part: bf16 partial sums are combined in bf16). At most one layer's expert weights of extra memory (only changing slots).
        In training, move between optimizer steps: expert weights that hold gradients are refused
        (``zero_grad(set_to_none=True)`` first; megatron's DDP: a zero ``main_grad``). Pass the
        torch ``optimizer`` to move its per-slot state (Adam's moments) with the weights, in the same
        transaction (and as much extra memory again per state); megatron's optimizers (fp32 master
        weights) are not moved.

        Args:
            placement: the new placement (the same on every rank).
            optimizer: a torch optimizer over the expert weights (every rank one with the same states).
                Without one, the first move of trained expert weights (a forward ran under autograd)
                warns once per layer (``RuntimeWarning``): an optimizer's per-slot state would stay
                with the slots.

        Raises:
            moelayers.PlacementRejected: bad input on some rank (wrong experts/ranks/slots, invalid,
                expert weights holding gradients, or different placements across ranks); raised on
                every rank before any transfer. A ``ValueError`` and a ``PlacementMoveError``.
            moelayers.PlacementMoveError: a failure while staging on some rank; raised on every
                rank, the old placement serving (a ``RuntimeError``).
        """
        before = self.placement
        self._move(placement, optimizer)
        self._warn_if_moments_left(before, optimizer)

    @one_at_a_time
    def _move(self, placement: ExpertPlacement, optimizer: torch.optim.Optimizer | None) -> None:
        """:meth:`apply_placement`'s move, without its warning: for callers whose transaction goes on
        after it (a move undone in another group, a re-plan's bookkeeping), which warn at its end."""
        move_expert_weights(self, placement, fault_hook=self._staging_fault_hook, optimizer=optimizer)

    def _warn_if_moments_left(self, before: ExpertPlacement, optimizer: torch.optim.Optimizer | None) -> None:
        """After a move from ``before`` (on every rank of the group: each warns, so that a filter making
        it an error raises on all): warn once per layer where trained expert weights moved without the
        optimizer, whose per-slot state then belongs to other experts."""
        if (optimizer is None and self.placement != before and self._trained and not self._warned_moments
                and (self.experts.w13.requires_grad or self.experts.w2.requires_grad)):
            self._warned_moments = True
            warn_caller(f"{self._label()}: expert weights that trained moved to another placement without the "
                        "optimizer's per-slot state, which stays with the slots (Adam's moments now belong to other "
                        f"experts): {self._moments_hint()}. Nothing to do if no optimizer holds these weights "
                        "(warned once per layer)", RuntimeWarning)

    def _moments_hint(self) -> str:
        """How to move an optimizer's state with the weights, for the warning of :meth:`apply_placement`."""
        return ("pass optimizer= to apply_placement (or to moelayers.checkpoint.load_placement_state_dict) to move it "
                "with them (a torch optimizer; megatron's, with fp32 master weights, cannot move: move such layers "
                "between runs, through a checkpoint)")

    # ------------------------------------------------------------------ forward
    def graphs_in_flight(self) -> int:
        """Forwards that autograd recorded whose graph is still alive and whose backward has not
        yet reached their output.

        Such a graph saved the expert weights: :meth:`apply_placement` refuses to move them until
        it is back-propagated or freed (a graph dropped without a backward stops counting once it
        is freed), on every rank. ``VariabilityAwareMoE``'s automatic re-plans wait for it instead
        (gradient accumulation and pipelined micro-batches included; the ranks decide together).
        A reentrant activation checkpoint's first pass records no graph (its recomputation reads
        the weights as they are then). A graph kept with ``retain_graph=True`` (or
        ``create_graph=True``) counts as done after its first backward.
        """
        return self._graphs.count()

    @one_at_a_time
    def forget_graphs(self) -> None:
        """Declare every recorded forward's graph gone (e.g. kept alive but never to be
        back-propagated): a move is accepted again. Call it on every rank."""
        self._graphs.clear()

    @one_at_a_time
    def force_routing(self, topk_ids: torch.Tensor | None) -> None:
        """Use these ``[T, K]`` (or, for ``[S, B, H]`` input, ``[S, B, K]``) logical experts (e.g.
        replayed from a trace) in the next forward;
        weights come from this router's scores of them. Ids outside ``[0, E)`` make that forward
        raise ``ValueError`` on every rank (after the exchange: no rank hangs; in capacity mode with
        ``check_finite=False``, on every rank that forced its routing, see :meth:`forward`). An id repeated
        within a row applies that expert twice, as ``moelayers.reference`` does (no check here, to
        keep replay free of host syncs; ``RoutingTrace`` refuses repeats when a trace is built).
        The forward uses them up, even one that raises; ``None`` drops ids still pending (forced for
        a step that raised before it reached this layer).

        Raises:
            TypeError: ``topk_ids`` is not an integer tensor (bool and float ids are refused).
            ValueError: ``topk_ids`` is not ``[..., K]`` with this layer's ``top_k`` (the forward
                checks its rows against its input).
        """
        if topk_ids is None:
            self._forced_ids = None
            return
        _check_forced_type(topk_ids)
        if topk_ids.dim() not in (2, 3) or topk_ids.shape[-1] != self.config.top_k:
            raise ValueError(f"force_routing takes [T, {self.config.top_k}] (or [S, B, {self.config.top_k}]) expert "
                             f"ids, got {list(topk_ids.shape)}")
        self._forced_ids = topk_ids

    # eager under torch.compile (one graph break, the model around it compiles): its host syncs and
    # data-dependent shapes would break the graph 16-23 times and recompile per load pattern, and inductor
    # drops writes into the all-to-all buffer (views of another dtype)
    @eager_under_compile
    @one_at_a_time  # threads take turns (moelayers/layers/turns.py)
    def forward(self, x: torch.Tensor, *, token_ids: torch.Tensor | None = None,
                topk_ids: torch.Tensor | None = None) -> torch.Tensor:
        """MoE forward.

        Args:
            x: ``[T, H]``, ``[S, B, H]`` or ``[B, S, H]`` hidden states (tokens are independent: any
                leading layout) in ``params_dtype`` on the layer's device (or in autocast's dtype while
                ``torch.autocast`` is on: cast to ``params_dtype``).
            token_ids: optional ``[T]`` token ids, or shaped like ``x`` without its last dimension
                (``[S, B]`` for ``[S, B, H]``, ``[B, S]`` for ``[B, S, H]``).
            topk_ids: optional forced routing of this forward (as :meth:`force_routing`, but an
                argument: activation checkpointing hands it to the recomputation with ``x``, so a
                checkpointed block may make the layer's input itself; like ``x``, it must not be
                changed in place before the backward). Not with ids pending from :meth:`force_routing`.

        Returns:
            ``y`` with the shape of ``x``.

        Raises:
            TypeError, ValueError: input of the wrong shape, dtype or device, token ids or forced
                routing not laid out like ``x``, ``topk_ids`` given while ``force_routing`` ids are
                pending. With several expert-parallel ranks this rank first
                takes part in the forward's exchange with no tokens, so the other ranks raise
                ``ValueError`` too instead of waiting for it (see :meth:`_refuse_in_step`).
            ValueError: NaN/inf router logits (``check_finite``) or forced ids outside ``[0, E)`` on
                any rank; more tokens than ``capacity`` on any rank; a forward that records autograd on
                some ranks only (their backward would wait for the others forever); ranks serving
                different placements or settings (``moelayers.dispatch.flags.SettingsDiffer``, naming
                what differs on which ranks; in capacity mode with ``check_finite=False``: checked on
                the first forward after the layer was built, loaded from a state dict or moved); ranks
                that back-propagated its forwards in different orders (``BackwardOrderError``). In
                capacity mode (``capacity`` set, the CUDA-graph path) the flags are read without a
                host sync only on ranks that
                need them: with ``check_finite=False``, a rank that neither forced its routing nor
                overflowed nor was refused returns its output while the others raise (every rank
                that forces routing, as trace replay does, raises together; a
                ``VariabilityAwareMoE`` recording loads always reads the flags: all its ranks raise;
                with several ranks voting on the size of each forward, every rank reads them when
                one of these must). With ``check_finite='deferred'`` in effect, what the flags of a
                forward say (NaN/inf logits, ranks' settings) is raised as a ``ValueError`` by the
                next forward, before its exchange, on every rank.
        """
        recompute = in_backward()  # activation checkpointing re-running a forward inside the backward
        pending = None
        if not recompute:  # (a recomputation leaves ids forced for the next forward where they are)
            pending, self._forced_ids = self._forced_ids, None  # used by this forward only, even one that raises
        key, self._replay_key = (x if self._replay_key is None else self._replay_key), None
        forced = pending if topk_ids is None else topk_ids
        try:
            if topk_ids is not None:
                _check_forced_type(topk_ids)
                if pending is not None:
                    raise ValueError("topk_ids given to a forward for which force_routing ids are pending: pass one")
            x2, token_ids = self._check_input(x, token_ids)
            if recompute and topk_ids is None:  # routed as the forward it recomputes, found by its input
                forced = self._routing_recomputed(key)
            # what checkpointing may recompute: a forward recording autograd, or a reentrant checkpoint's
            # first pass (under no_grad, on an input that requires grad); never capacity mode. Kept once the
            # forward has run: a refused one has nothing to recompute, and would make its input ambiguous
            recomputable = (not recompute and topk_ids is None and self.capacity is None
                            and (torch.is_grad_enabled() or key.requires_grad))
            routed_as = forced  # as given: kept for a recomputation
            forced = self._forced_rows(forced, x, x2)
            if self.capacity is not None and self._records_autograd(x2):
                raise ValueError("capacity mode is inference-only: run it under torch.no_grad()/inference_mode(), "
                                 "or build the layer without capacity for training")
            if self.cuda_graph and x2.is_cuda and forced is not None:  # here: the other ranks learn it in the exchange
                raise ValueError("cuda_graph layers do not take forced routing; build the layer with cuda_graph=False")
        except Exception as exc:  # whatever this rank's input raised: the other ranks must learn it
            if self.groups.ep_size == 1:
                raise
            self._keeping_order(self._refuse_in_step, exc)  # raises
        self._reentrant_first_pass = key.requires_grad and not torch.is_grad_enabled()  # (see _defers_alone)
        if self.capacity is not None:
            return self._keeping_order(self._forward_capacity, x2, token_ids, forced).view(x.shape)
        if not recompute:  # one rank's deferred flag word (_defers_alone), from its previous forward
            self._read_deferred()
        y, routed = self._keeping_order(self._forward_steps, x2, token_ids, forced)
        self._trained = self._trained or y.requires_grad  # (a reentrant checkpoint's first pass: in its recompute)
        if recomputable:
            self._forced_for_recompute.keep(key, routed_as)
        elif (routed_as is not None and not recompute and topk_ids is None  # (e.g. forced on an input made under
              and not torch.is_inference_mode_enabled()):  # no_grad in a reentrant checkpoint: its recomputation is
            self._forced_for_recompute.active = True  # refused; a rollout under inference_mode is none)
        if not recompute:  # the record of the forward the caller ran, not of its recomputation
            self.last_topk_ids, self.last_token_ids = routed, token_ids
            self.last_stats = self.dispatcher.last_stats
            self.last_stats._num_experts = self.config.num_experts
            if y.requires_grad:  # autograd saved the weights: a move waits until this graph's backward has run
                self._graphs.watch(y)
        if y.shape == x.shape:
            return y
        # a module that returns a view makes FSDP warn (an in-place op on it drops FSDP's backward hook):
        # in training, [S, B, H] output is a tensor of its own (one copy; serving keeps the view)
        return y.view(x.shape).clone() if torch.is_grad_enabled() and y.requires_grad else y.view(x.shape)

    def _routing_recomputed(self, key: torch.Tensor) -> torch.Tensor | None:
        """The forced routing of the forward that activation checkpointing recomputes, found by its
        input ``key`` (``None``: it was routed by the router)."""
        found, forced = self._forced_for_recompute.find(key)
        if not found and self._forced_for_recompute.active:
            raise ValueError(
                "activation checkpointing is recomputing a forward of a layer that has forced its routing "
                "(force_routing), from an input the layer was not given (a tensor made inside the checkpointed "
                "region), so whether and how that forward was forced cannot be told, and routing it by the router "
                "could give other experts' gradients. Pass the ids in the checkpointed function, layer(x, "
                "topk_ids=ids), checkpoint a function that hands the layer its input as given, or keep the layer "
                "outside the checkpointed region (with megatron-core: recompute_granularity='selective' with 'moe' "
                "in recompute_modules, not 'full'). A forced forward under torch.no_grad() counts too (an "
                "evaluation or replay): run those under torch.inference_mode(), which does not")
        return forced

    def _forced_rows(self, forced: torch.Tensor | None, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor | None:
        """Forced routing as ``[T, K]`` rows of ``x2`` (``[S, B, K]`` for an ``[S, B, H]`` input, as
        the reference takes it), or ``ValueError`` for another shape."""
        if forced is None:
            return None
        if forced.dim() == 3 and x.dim() == 3 and forced.shape[:2] == x.shape[:2]:
            forced = forced.reshape(-1, forced.shape[-1])
        if tuple(forced.shape) != (x2.shape[0], self.config.top_k):
            raise ValueError(f"forced routing has shape {list(forced.shape)}, "
                             f"expected [{x2.shape[0]}, {self.config.top_k}]")
        return forced

    def _keeping_order(self, step: Callable, *args):
        """``step(*args)``; if it raises (on every rank alike: a refusal, ranks calling their layers in
        different orders, ...), the order of the backwards it took (:meth:`_order_flag`) is put back
        for the next forward to report: taken by a forward that failed on some ranks' layers and not
        on the others', it made the next forwards raise a false "back-propagated in different
        orders". Not when that order itself disagreed (the gradients are wrong already). Ranks that
        serve different settings raise an error that names them (:meth:`_name_differences`)."""
        self._order_taken = 0
        try:
            return step(*args)
        except BackwardOrderError:
            raise
        except SettingsDiffer as exc:
            self._graphs.restore_order(self._order_taken)
            if not exc.together or self.groups.ep_size == 1:
                raise
            raise self._name_differences(exc) from None
        except BaseException:
            self._graphs.restore_order(self._order_taken)
            raise

    def _records_autograd(self, x2: torch.Tensor) -> bool:
        """Whether autograd would record a forward on ``x2``: the input or any weight (router or
        experts: a frozen router with trainable experts too) requires grad, with grad enabled."""
        return torch.is_grad_enabled() and (x2.requires_grad or self.router.weight.requires_grad
                                            or self.experts.w13.requires_grad or self.experts.w2.requires_grad)

    @one_at_a_time
    def refuse_input(self, exc: Exception) -> NoReturn:
        """Raise ``exc``, a caller's refusal of this rank's input to the forward that every
        expert-parallel rank is about to run (e.g. a model's check of its token ids), after taking
        part in that forward's exchange with no tokens: the other ranks raise ``ValueError`` there
        instead of waiting for this one. Call it where this rank would have called the layer.
        Routing pending from :meth:`force_routing` is dropped, as the forward drops it on the other
        ranks (it was for that forward)."""
        if not in_backward():
            self._forced_ids = None
        if self.groups.ep_size > 1:
            self._keeping_order(self._refuse_in_step, exc)  # raises (the order of backwards it took put back)
        raise exc

    def _refuse_in_step(self, exc: Exception) -> NoReturn:
        """Raise ``exc`` for this rank's bad input, but only after taking part in the forward's
        exchange with no tokens and the ``BAD_INPUT`` flag: the other expert-parallel ranks learn
        it with their split sizes and raise too, instead of waiting for this rank forever (with
        ``capacity`` and ``check_finite=False`` they make no host sync to learn it, and go on)."""
        if self.router.weight.device.type == "meta":  # no exchange without storage (every rank's layer, as built)
            raise exc
        try:  # the previous forward's deferred flags: every rank raises them here, before the exchange
            self._read_deferred()
        except ValueError:  # this rank raises its own error, with that report as its context
            raise exc  # noqa: B904 (implicitly chained: the report shows above the error)
        empty = self.router.weight.new_empty(0, self.config.hidden_size)
        self._bad_input = True
        try:
            with torch.no_grad():  # a stand-in: nothing to differentiate (and capacity mode refuses autograd)
                if self.capacity is not None:
                    self._forward_capacity(empty, None, None)
                else:
                    self._forward_steps(empty, None, None)
        except SettingsDiffer as differ:  # (capacity mode's size vote compares the settings before any flag)
            if differ.together:  # the other ranks name the differences in one more collective: join it
                self._name_differences(differ)
        except ValueError:
            pass  # the exchanged flag: this rank raises its own, more precise error
        finally:
            self._bad_input = False
        raise exc

    def _order_flag(self, device: torch.device) -> torch.Tensor | None:
        """The digest of the backwards run since the previous forward (:class:`InFlightGraphs`) in
        the flags' ``ORDER_SHIFT`` bits, as a 0-dim int32 on ``device`` that a fill updates (no copy
        from the host, no sync); ``None`` when no backward ran."""
        self._order_taken = self._graphs.take_order()  # put back if this forward raises (see forward)
        order = self._order_taken << ORDER_SHIFT
        if not order and not self._order_value:
            return None
        if self._order_sent is None or self._order_sent.device != device:
            with torch.inference_mode(False):  # (made in a rollout, it is filled in training later)
                self._order_sent, self._order_value = torch.zeros((), dtype=torch.int32, device=device), 0
        if order != self._order_value:
            self._order_sent.fill_(order)
            self._order_value = order
        return self._order_sent if order else None

    def _forward_steps(self, x2, token_ids, forced, num_valid=None, flag=None):
        """The five steps on ``x2 [T, H]``; with ``num_valid``, rows from there on are padding.
        ``flag``: a ``[]`` int32 device tensor merged into the routing flags (the CUDA graph's input
        that says whether this rank refused its input); without it, ``_bad_input`` says so."""
        topk_ids, topk_weights = self.router(x2, forced, defer_check=True)  # 1 route
        if type(self).plan is MoELayerBase.plan:                           # 2 plan
            routes = self.plan(topk_ids, topk_weights, token_ids)
        else:  # an override's routes, checked without a sync (an error on one rank alone would hang the others)
            routes = checked_plan(self.plan, type(self).__name__, topk_ids, topk_weights, token_ids, self.placement)
        routes.nonfinite = self._routing_flags(x2, routes, flag)
        if num_valid is None and routes.nonfinite is not None and self._defers_alone(x2, forced is not None):
            self._deferred_record(routes.nonfinite.view(1, 1))  # read at the next forward (no sync now)
            routes.nonfinite = None
        if num_valid is not None:  # capacity mode: rows from num_valid on are padding
            padding = cached_arange(x2.shape[0], x2.device) >= num_valid
            routes.dest_rank = routes.dest_rank.masked_fill(padding[:, None], -1)
            routes.overflow = num_valid > x2.shape[0]  # more tokens than the capacity: told to every rank
        try:
            received = self.dispatcher.dispatch(x2, routes)               # 3 dispatch
        except ValueError:  # the exchanged flags: this rank tells its own broken routes, the cause its code's error
            if routes.refusal is not None:
                raise routes.refusal  # noqa: B904 (the flags' error stays as its context)
            raise
        expert_out = self.experts(received.expert_input, received.slot_counts)  # 4 compute
        received.expert_input = None  # not read by the combine: freed before it (autograd keeps what it saved)
        y = self.dispatcher.combine(expert_out, received)                 # 5 combine
        if routes.refusal is not None:  # (capacity mode reads the flags later, or not at all)
            raise routes.refusal
        return y, topk_ids

    def _routing_flags(self, x2: torch.Tensor, routes: Routes, flag: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's flag word for the exchange (``moelayers.dispatch.flags``): the routes' own
        (the replica policy's, ``check_routes``'), the router's (NaN/inf logits, forced ids out of
        range), a refused input (``flag`` or ``_bad_input``), the exchanges its backward will run
        (every rank must run the same ones) and the order of the backwards since the previous
        forward. A ``[]`` int device tensor, or ``None`` when nothing is set (no ops)."""
        flags = merge_flags(routes.nonfinite, self.router.last_flags)
        if flag is not None:
            flags = merge_flags(flags, flag)
        elif self._bad_input:
            flags = merge_flags(flags, _constant(BAD_INPUT, x2.device))
        autograd = 0
        if self._records_autograd(x2):
            autograd |= RECORDS_AUTOGRAD
        if torch.is_grad_enabled() and (x2.requires_grad or routes.weights.requires_grad):
            autograd |= DISPATCH_AUTOGRAD  # (the dispatchers' condition for a differentiable exchange)
        if self.experts.sums_replica_grads():
            autograd |= REPLICA_AUTOGRAD
        if autograd:
            flags = merge_flags(flags, _constant(autograd, x2.device))
        order = self._order_flag(x2.device)  # the backwards run since the previous forward, compared across ranks
        return flags if order is None else merge_flags(flags, order)

    def _forward_capacity(self, x2, token_ids, forced):
        """Fixed-capacity forward: pad to the capacity that holds the rows (:meth:`_capacity_for`),
        eager or replayed from that capacity's CUDA graph."""
        self._read_deferred()  # the previous forward's flags, before any collective of this one
        t = x2.shape[0]
        c, most, read_now = self._capacity_for(t, forced is not None)
        if most > c and self.beyond_capacity == "exact":  # (every rank knows most: _capacity_for)
            return self._forward_beyond(x2, token_ids, forced)
        self.dispatcher = self._dispatcher_for(c)
        if t > c:  # take part in the exchange with the first c tokens and a flag (no rank hangs), then raise
            x2 = x2[:c]
            forced = None if forced is None else forced[:c]
            token_ids = None if token_ids is None else token_ids[:c]
        n = x2.shape[0]
        # a refusal (_bad_input) replays the graph too, with its flag set: capture (warm-up forwards)
        # and replay run the same collectives on every rank, whichever rank refused its input
        graphed = self.cuda_graph and x2.is_cuda and forced is None and not self._records_autograd(x2)
        if graphed:
            graph = self._graphed.get(c)
            if graph is None:
                self._check_capturable(x2)
                from moelayers.layers.graphs import GraphedForward

                def padded(xp, num_valid, flag):
                    return self._forward_steps(xp, None, None, num_valid, flag)  # (y, topk_ids)

                if self.graph_pool is None and self._own_pool is None:
                    self._own_pool = torch.cuda.graph_pool_handle()
                graph = self._graphed[c] = GraphedForward(padded, c, self.config.hidden_size, x2.dtype, x2.device,
                                                          pool=self.graph_pool or self._own_pool)
            y, topk_ids = graph(x2, num_valid=t, flag=BAD_INPUT if self._bad_input else 0)
            # the routing of this forward, a copy of the graph's static output (which the next replay of
            # any graph in its pool may overwrite): last_topk_ids, and the expert loads that merge_stats /
            # reduce compute later
            topk_ids = topk_ids.clone()
            counts = self.dispatcher.fixed_counts.clone()
            stats = MoEStats.deferred(self.groups.ep_rank, counts[0], counts[1], self.dispatcher.fixed_bytes,
                                      topk_ids)
        else:
            xp = torch.nn.functional.pad(x2, (0, 0, 0, c - n))
            fp = None if forced is None else torch.nn.functional.pad(forced, (0, 0, 0, c - n))
            tp = None if token_ids is None else torch.nn.functional.pad(token_ids, (0, c - n))
            y, topk_ids = self._forward_steps(xp, tp, fp, torch.full((), t, dtype=torch.int64, device=x2.device))
            y, topk_ids = y[:n], topk_ids[:n]
            stats = self.dispatcher.last_stats
            stats._topk_ids = topk_ids
        # a refused forward leaves the last good one's stats and routing
        self._raise_on_flags(t, forced is not None, most, read_now)
        stats._num_experts = self.config.num_experts
        self.last_stats, self.last_topk_ids, self.last_token_ids = stats, topk_ids, token_ids
        self.last_capacity = c
        return y

    def _dispatcher_for(self, c: int | None) -> Dispatcher:
        """The dispatcher of forwards padded to ``c`` (``None``: exact ones), made on first use."""
        d = self._dispatchers.get(c)
        if d is None:
            d = self._dispatchers[c] = self._make_dispatcher(c)
        return d

    def _forward_beyond(self, x2, token_ids, forced):
        """``beyond_capacity='exact'``: a forward with more tokens than the largest capacity on some
        rank runs exact on every rank (the all-to-all-v and its host sync, no padding, no graph)."""
        self.dispatcher = self._dispatcher_for(None)
        y, topk_ids = self._forward_steps(x2, token_ids, forced)
        stats = self.dispatcher.last_stats
        stats._num_experts = self.config.num_experts
        self.last_stats, self.last_topk_ids, self.last_token_ids = stats, topk_ids, token_ids
        self.last_capacity = None
        return y

    def _votes(self) -> bool:
        """Whether every capacity-mode forward starts with the ranks' size vote (:meth:`_capacity_for`):
        several expert-parallel ranks, with several capacities or ``beyond_capacity='exact'``."""
        return self.groups.ep_size > 1 and (len(self.capacities) > 1 or self.beyond_capacity == "exact")

    def _capacity_for(self, t: int, forced: bool) -> tuple[int, int, bool]:
        """``(capacity, most, read_now)``: the capacity a forward of ``t`` rows on this rank runs at,
        the smallest of ``capacities`` that holds ``most``, the most rows of any expert-parallel rank
        (their collectives must match; with several ranks and several capacities or
        ``beyond_capacity='exact'``, one small all-gather and a host sync find it: otherwise
        ``most`` is ``t``), else the largest (the forward then raises, :meth:`_raise_on_flags`, or
        runs exact, :meth:`_forward_beyond`). ``read_now``: some rank must read the exchanged flags
        after this forward for a reason of its own (:meth:`_reads_flags_now`; ``forced``: this
        rank's routing was forced), learnt in that all-gather (else ``False``): every rank then
        reads them, so that with ``check_finite='deferred'`` all raise in the same forward.

        Raises:
            SettingsDiffer: on every rank, where the ranks' settings differ (their digests travel
                with the row counts).
        """
        caps, most, read_now = self.capacities, t, False
        if self._votes():
            # with the digest of the ranks' settings: ranks built with other sizes would pick others, and
            # exchange buffers of different sizes (a hang, or gloo aborting the process)
            mine = torch.tensor([t, self.dispatcher.placement_digest, int(self._reads_flags_now(forced))],
                                dtype=torch.int64)
            votes = mine.new_empty(3 * self.groups.ep_size).to(collective_device(self.groups.ep))
            all_gather_flat(votes, mine.to(votes.device), group=self.groups.ep)
            rows, digests, needs = votes.view(-1, 3).t().tolist()
            raise_if_placements_differ(digests, together=True)
            most, read_now = max(rows), any(needs)
        return next((c for c in caps if c >= most), caps[-1]), most, read_now

    def _check_capturable(self, x2: torch.Tensor) -> None:
        """Before the first capture: raise ``ValueError`` on every expert-parallel rank when any of
        them cannot capture its forward (one small all-reduce, once per capture): a rank raising
        alone would leave the others waiting in the capture's collectives."""
        problem = None
        if not self.experts.sync_free(x2):
            problem = ("cuda_graph=True needs the grouped-GEMM experts without host syncs (torch._grouped_mm's fast "
                       "path: bf16 on compute capability 9.x or 10.x, H and F multiples of 8, expert_backend not "
                       f"'loop'); these are {x2.dtype} on {x2.device}: use cuda_graph=False")
        elif not use_triton(x2):
            problem = ("cuda_graph=True needs the Triton kernels (their torch references read counts on the host, "
                       "which a CUDA graph cannot capture), and " + (
                           "MOELAYERS_DISABLE_TRITON=1 turns them off" if HAVE_TRITON
                           else TRITON_INSTALL_HINT.rstrip(".")) + "; or use cuda_graph=False")
        if self.groups.ep_size > 1:
            vote = torch.tensor([int(problem is not None)], dtype=torch.int32, device=x2.device)
            dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.groups.ep)
            if problem is None and vote.item():
                problem = ("cuda_graph=True: another expert-parallel rank cannot capture the CUDA graph (see its "
                           "error); every rank must meet the same conditions (GPU, dtype, Triton)")
        if problem is not None:
            raise ValueError(problem)

    def _flags_read_always(self) -> bool:
        """Whether every capacity-mode forward reads the exchanged flags (one host sync), whatever
        ``check_finite`` says: a layer that runs collectives of its own after the forward must not
        have one rank raise while the others go on into them (``VariabilityAwareMoE``)."""
        return False

    def _reads_flags_now(self, forced: bool, *, placement: bool = True) -> bool:
        """Whether this rank reads the exchanged flags right after a capacity-mode forward for a
        reason of its own, whatever ``check_finite`` says (see :meth:`_raise_on_flags`).
        ``placement=False``: not for a new placement (one rank has none to compare)."""
        return (forced or self._bad_input or type(self.replica_policy) is not LocalFirstPolicy
                or type(self).plan is not MoELayerBase.plan or self._flags_read_always()
                or (placement and self._placement_unchecked))

    def _defers_alone(self, x2: torch.Tensor, forced: bool) -> bool:
        """Whether ``check_finite='deferred'`` defers in this exact forward on one expert-parallel
        rank (without ``capacity``, or beyond its largest size). It does in an inference forward with
        the router's own routing: its flag word (the NaN check) is read at the layer's next forward
        instead of at once, as capacity mode does. (With several ranks the flags come with the split
        sizes, at no extra sync.) A reentrant activation checkpoint's first pass does not defer: it
        runs under ``no_grad`` on an input that requires grad, and that is training."""
        return (self._check_deferred and self.router.check_finite and self.groups.ep_size == 1
                and not self._records_autograd(x2) and not self._reentrant_first_pass
                and not self._reads_flags_now(forced, placement=False))

    def _defers_check(self) -> bool:
        """``check_finite='deferred'`` in effect: one expert-parallel rank, or ranks that vote on the
        size of every forward (:meth:`_votes`), whose vote tells them whether any of them must read
        the flags at once. Otherwise a rank raising for its own input or overflow while the others
        go on would leave them waiting in the next layer's exchange: the check is then immediate."""
        return self._check_deferred and self.router.check_finite and (self.groups.ep_size == 1 or self._votes())

    def _raise_on_flags(self, t: int, forced: bool, most: int, read_now: bool = False) -> None:
        """Capacity mode: raise on every rank when any rank had NaN/inf logits, forced expert ids out
        of range, more than ``capacity`` tokens or another placement (the flags and placement digests
        came with the exchange). One host sync, made when the NaN check is on, the routing was forced,
        the replica policy or ``plan()`` is a custom one (whose routes the dispatcher checks), this
        rank overflowed or refused its input, the layer asks for it (:meth:`_flags_read_always`), or
        its placement is new (the first forward after the layer was built, loaded from a state dict
        or moved: ranks that loaded checkpoints of different placements raise together);
        otherwise (``check_finite=False`` and the router's own routing) only an overflowing rank
        itself raises, and the placements are not compared again. ``most``: the most rows of any
        rank where :meth:`_capacity_for` learnt it (else ``t``): every rank then knows an overflow.
        ``read_now``: some rank reads them for its own reason (learnt there too). With
        ``check_finite='deferred'`` in effect (:meth:`_defers_check`) the NaN check makes no sync:
        the flags are copied to the host and read when the next forward starts (:meth:`_read_deferred`)."""
        defers = self._defers_check()
        if not ((self.router.check_finite and not defers) or read_now or max(t, most) > self.capacity
                or self._reads_flags_now(forced)):
            if defers:
                self._deferred_record(self.dispatcher.header)
            return
        header = self.dispatcher.header.tolist()  # [R][flag word, overflow, digest's two halves]
        # (not together: ranks with nothing to check go on)
        _check_header(header)
        self._placement_unchecked = False
        bad = [i for i, h in enumerate(header) if h[1]]
        if bad:
            here = f" ({t} tokens on this rank)" if t > self.capacity else ""
            sizes = f" (its largest of {list(self.capacities)})" if len(self.capacities) > 1 else ""
            raise ValueError(f"more tokens than the layer's capacity of {self.capacity}{sizes} per rank on "
                             f"expert-parallel rank(s) {bad}{here}; every row counts, padding included: split the "
                             f"batch, build the layer with a larger capacity, or with beyond_capacity='exact' (an "
                             f"exact forward for such batches)")

    def _deferred_record(self, header: torch.Tensor) -> None:
        """Start copying ``header`` (``[R, 4]``, or ``[1, 1]``: one rank's flag word alone) to the
        host, for :meth:`_read_deferred` at the next forward."""
        if self._deferred is None:  # (a layer unpickled from before the deferred check)
            self._deferred = DeferredFlags()
        self._deferred.record(header)

    def _read_deferred(self) -> None:
        """``check_finite='deferred'``: raise what the flags of the forward before this one say (on
        every rank alike: they were exchanged), waiting for their copy to the host if it is not done."""
        header = None if self._deferred is None else self._deferred.take()
        if header is None:
            return
        try:
            _check_header(header)
        except ValueError as exc:  # (each layer raises its own: moelayers.check_pending(model) reads them all)
            # the error itself (a BackwardOrderError stays one), told as the last forward's
            exc.args = (f"{self._label()}: its last forward, whose output was returned already (check_finite="
                        f"'deferred' reads a forward's flags at the layer's next forward; the model's other "
                        f"layers may hold that step's too: moelayers.check_pending(model) reads them all): {exc}",)
            raise

    @one_at_a_time
    def check_pending(self) -> None:
        """Raise what the deferred NaN check (``check_finite='deferred'``) found in the last
        forward, as its next forward would; waits for that forward (a host sync). Call it on every
        expert-parallel rank, e.g. after the last forward of a generation
        (:func:`moelayers.check_pending` does for every layer of a model). A no-op when nothing is
        pending.

        Raises:
            ValueError: NaN/inf router logits or another flagged problem on some rank, or ranks
                with different settings, in the last forward.
        """
        self._read_deferred()

    @one_at_a_time
    def release_graphs(self) -> None:
        """Drop the captured CUDA graphs (call on every rank before destroying the process group)."""
        for graph in self._graphed.values():
            graph.release()  # waits for the graph's own device, not the current one
        self._graphed, self._own_pool = {}, None

    def plan(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, token_ids: torch.Tensor | None) -> Routes:
        """Step 2: a physical slot per (token, k). The base maps through ``self.placement``, choosing
        among an expert's replicas with ``self.replica_policy``.

        The one step a strategy overrides (the others stay the base's). An override returns
        :class:`~moelayers.dispatch.Routes` with ``dest_rank`` and ``dest_slot`` integer ``[T, K]``
        strided tensors on ``topk_ids``' device that send every ``(token, k)`` to a slot holding
        ``topk_ids[t, k]`` (one of ``self.placement.log2phy[e, :logcnt[e]]``: physical slot ``p`` is
        slot ``p % S`` of rank ``p // S``), and float ``weights`` ``[T, K]`` (usually ``topk_weights``).
        It gets its own copy of ``topk_ids``; routing to other experts is the router's business. Its
        routes are checked on the device without a host sync, and an override that raises, returns
        anything else or routes a token to a slot without its expert makes every expert-parallel
        rank raise ``ValueError`` after the exchange (on the rank whose override broke, one that says
        what it did, caused by its exception), never a hang or a silently different output.

        Args:
            topk_ids: ``[T, K]`` int64 logical experts the router chose.
            topk_weights: ``[T, K]`` their weights, in the hidden states' dtype.
            token_ids: ``[T]`` token ids of the forward, or ``None``.

        Returns:
            The routes of this rank's tokens.
        """
        return routes_from_placement(topk_ids, topk_weights, self.placement, self.groups.ep_rank, self.replica_policy)

    def _check_input(self, x: torch.Tensor, token_ids: torch.Tensor | None, name: str = "x"
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg = self.config
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() not in (2, 3) or x.shape[-1] != cfg.hidden_size:
            raise ValueError(f"{name} must be [T, {cfg.hidden_size}], [S, B, {cfg.hidden_size}] or [B, S, {cfg.hidden_size}], "
                             f"got {list(x.shape)}")
        x = self._from_autocast(x, name)
        if x.device != self.router.weight.device:
            hint = (": it was built on the meta device; call to_empty(device=...) and load or reset its weights first"
                    if self.router.weight.device.type == "meta" and x.device.type != "meta" else "")
            raise TypeError(f"{name} is on {x.device}, the layer is on {self.router.weight.device}{hint}")
        x2 = x if x.dim() == 2 else x.reshape(-1, cfg.hidden_size)  # (a reshape of [T, H] is a view alike)
        if token_ids is not None:
            if not isinstance(token_ids, torch.Tensor) or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
                raise TypeError("token_ids must be an integer tensor")
            if token_ids.numel() != x2.shape[0] or (token_ids.dim() > 1 and token_ids.shape != x.shape[:-1]):
                raise ValueError(f"token_ids must be [{x2.shape[0]}] or shaped like x without its last dimension "
                                 f"{list(x.shape[:-1])}, got {list(token_ids.shape)} (e.g. [B, S] ids for [S, B, H] "
                                 "hidden states would pair tokens with the wrong rows)")
            if token_ids.device != x.device:  # (a sync or a crash later, on this rank only)
                raise TypeError(f"token_ids are on {token_ids.device}, {name} on {x.device}")
            token_ids = token_ids.reshape(-1)
        return x2, token_ids

    def _from_autocast(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x`` in ``params_dtype``: as it is, or cast from autocast's dtype while ``torch.autocast`` is
        on (the output of an ``nn.Linear`` before the layer, which autocast computed in bf16).

        Raises:
            TypeError: any other dtype."""
        want = self.config.params_dtype
        if x.dtype == want:  # the latency path: nothing else read
            return x
        held = {p.dtype for module in (self.router, self.experts) for p in module.parameters()}  # (not prune's
        # stale computed weight)
        if held != {want}:  # e.g. layer.experts.to(bf16): only the layer's own .to() keeps the config in step
            raise TypeError(f"the layer's weights are {sorted(map(str, held))} but its config says {want}: cast the "
                            "whole layer (layer.to(dtype)), not one of its submodules")
        if autocast_on(x):
            if x.dtype == torch.get_autocast_dtype(x.device.type):
                return x.to(want)
            raise TypeError(f"{name} has dtype {x.dtype}, the layer computes in {want} (and takes "
                            f"{torch.get_autocast_dtype(x.device.type)} under the torch.autocast that is on)")
        if x.dtype in PARAMS_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}, the layer computes in {want}: cast {name} "
                            f"({name}.to({want})) or the layer (layer.to({x.dtype}))")
        integer = not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)
        raise TypeError(f"{name} has dtype {x.dtype}, the layer computes in {want}: cast {name} ({name}.to({want}))"
                        + (f"; {name} is the hidden states (token ids go as token_ids=)" if integer else ""))

    def extra_repr(self) -> str:
        c = self.config
        return (f"E={c.num_experts}, K={c.top_k}, H={c.hidden_size}, F={c.ffn_hidden_size}, ep={self.groups.ep_size}, "
                f"slots_per_rank={self.placement.slots_per_rank}, dispatcher={self.dispatcher_name}, dedup={self.dedup}")


_CONSTANTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _check_header(header: list[list[int]]) -> None:
    """Raise what capacity mode's exchanged header says (one ``[flag word, overflow, digest's low and
    high 31 bits]`` per rank; :func:`~moelayers.dispatch.flags.check_exchanged`; not the overflow), or
    one rank's ``[[flag word]]`` (the deferred check without capacity)."""
    if len(header[0]) == 1:  # one rank's word: no exchange, no digests
        raise_if_flagged([header[0][0]])
        return
    check_exchanged([h[0] for h in header], [h[2] | (h[3] << 31) for h in header])


def _constant(value: int, device: torch.device) -> torch.Tensor:
    """A 0-dim int32 ``value`` on ``device``, made once (no host-to-device copy per forward)."""
    def make() -> torch.Tensor:
        with torch.inference_mode(False):
            return torch.tensor(value, dtype=torch.int32, device=device)

    return cached_tensor(_CONSTANTS, (value, torch.device(device)), make)


def _default_device(groups: ParallelGroups) -> torch.device:
    """torch's default device where it is set (``with torch.device("meta")``, ``set_default_device``);
    else CUDA's current device when the expert-parallel group uses NCCL, or, with one expert-parallel
    rank (no group), when the groups were built over an NCCL world (``groups.backend``); else CPU."""
    chosen = torch.get_default_device()
    if chosen.type != "cpu":
        return chosen
    if groups.ep is None:  # torchrun --nproc_per_node=1 with NCCL and from_world(): the GPU too
        return backend_device(groups.backend)
    return collective_device(groups.ep)
