"""What every dispatcher shares: the routes it is given, replica choice, and the receive side.

A dispatcher does steps 3 and 5 of the forward (``MoELayerBase.forward``; docs/architecture.md): ``dispatch`` delivers tokens to
the ranks and slots of their experts, sorted by local slot; ``combine`` brings the expert outputs
back, weighted and summed, in the caller's token order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from moelayers._compile import cached_tensor
from moelayers._dtypes import to_dtype
from moelayers.dispatch.flags import BAD_REPLICA, BAD_ROUTE, merge_flags
from moelayers.kernels import unpermute_combine
from moelayers.placement import ExpertPlacement

if TYPE_CHECKING:
    from moelayers.metrics import MoEStats


@dataclass
class Routes:
    """Step 2's output: a physical destination for each (token, k).

    Attributes:
        topk_ids: ``[T, K]`` logical experts.
        weights: ``[T, K]`` routing weights (in the hidden-state dtype).
        dest_rank: ``[T, K]`` int64 expert-parallel rank of the chosen replica.
        dest_slot: ``[T, K]`` int64 local slot of the chosen replica on ``dest_rank``.
        nonfinite: optional 0-dim int device word of this rank's routing flags (named for its first
            bit; ``moelayers.dispatch.flags``): ``NONFINITE_LOGITS``
            (router logits with NaN/inf) | ``FORCED_OUT_OF_RANGE`` (forced expert ids outside
            ``[0, E)``) | ``BAD_INPUT`` (the layer refused this rank's input and sends no tokens) |
            ``BAD_REPLICA`` (a custom replica policy picked a slot without the routed expert) |
            ``BAD_ROUTE`` (a route outside the ranks or slots, :func:`check_routes`), and
            ``RECORDS_AUTOGRAD`` | ``DISPATCH_AUTOGRAD`` | ``REPLICA_AUTOGRAD`` (the backward's
            exchanges this rank will run; not errors alone: raised when some ranks set one and others not),
            and in bits ``ORDER_SHIFT`` on, the order of the backwards since the layer's previous forward;
            dispatchers exchange it with their split sizes (no extra sync) and every rank raises.
        overflow: capacity mode: optional 0-dim device flag, true when this rank had more tokens
            than the capacity (it sends the first ``capacity``); exchanged like ``nonfinite``.
        in_range: ``dest_rank`` and ``dest_slot`` are known to lie in ``[0, R)`` and ``[0, S)``
            (:func:`routes_from_placement` and :func:`checked_plan` set it). Otherwise the
            dispatchers check them on the device (:func:`check_routes`; no sync) and every rank
            raises on a route outside.
        refusal: this rank's own account of routes it flagged (a replica policy or a ``plan()``
            override that raised or returned something else here): the layer raises it on this
            rank after the exchange (the other ranks raise from the flags), its cause the
            policy's or override's own exception.
    """

    topk_ids: torch.Tensor
    weights: torch.Tensor
    dest_rank: torch.Tensor
    dest_slot: torch.Tensor
    nonfinite: torch.Tensor | None = None
    overflow: torch.Tensor | None = None
    in_range: bool = False
    refusal: Exception | None = None


@dataclass
class Received:
    """Tokens delivered to this rank, ready for the grouped experts.

    Attributes:
        expert_input: ``[P, H]`` one row per (token, local slot) pair, sorted by slot (in capacity
            mode every received (row, k) entry, ``R * C * K`` rows: the counted ones first, by slot,
            the unused ones after them).
        slot_counts: ``[S]`` rows per local slot (device tensor).
        state: dispatcher-private bookkeeping for ``combine``.
    """

    expert_input: torch.Tensor
    slot_counts: torch.Tensor
    state: Any = field(repr=False)


class Dispatcher(Protocol):
    """Steps 3 and 5 of the forward, and what the layer reads from its dispatcher.

    Attributes:
        placement_digest: the layer's 62-bit digest of its settings (``MoELayerBase._digest``),
            exchanged with every forward's header; the layer sets it again when they change.
        last_stats: :class:`~moelayers.metrics.MoEStats` of the last forward.
        payload: the last forward's :func:`payload_dtypes` (named when the ranks' digests differ).
    """

    placement_digest: int
    last_stats: MoEStats | None
    payload: tuple

    def dispatch(self, x: torch.Tensor, routes: Routes) -> Received:
        """Send ``x [T, H]`` to the ranks/slots in ``routes``; return what this rank computes."""

    def combine(self, expert_output: torch.Tensor, received: Received) -> torch.Tensor:
        """Return ``y [T, H] = sum_k w_k * expert_k(x)`` in the caller's order."""


class ReplicaPolicy(Protocol):
    """Chooses one physical replica per (token, expert): ``-> [T, K]`` physical slot ids.

    Contract: a physical slot id is ``rank * placement.slots_per_rank + slot`` and must be one that
    ``placement.log2phy`` lists for ``topk_ids[t, k]``; the picks are an integer, strided tensor on
    ``topk_ids``' device. A custom policy gets its own copy of ``topk_ids`` (edits to it change no
    routing); it must not edit the placement or its cached tables, and should pick the same slots when called again on the same ids (activation checkpointing
    recomputes the forward). With ``capacity`` it sees the padded rows too; with ``cuda_graph`` it
    runs once, at capture. Picks that break the contract, or a policy that raises, make every
    expert-parallel rank raise after the exchange (a ``RuntimeWarning`` on the rank says which).
    """

    def __call__(self, topk_ids: torch.Tensor, placement: ExpertPlacement, rank: int) -> torch.Tensor: ...


class LocalFirstPolicy:
    """A replica on the token's own rank if there is one, else replicas in turn by token index,
    offset by the rank, so that each expert's remote load spreads evenly over its replicas."""

    def __call__(self, topk_ids: torch.Tensor, placement: ExpertPlacement, rank: int) -> torch.Tensor:
        _, log2phy, logcnt = placement.device_tables(topk_ids.device)
        if placement.max_replicas == 1:
            return placement.first_replica(topk_ids.device)[topk_ids]
        cand = log2phy[topk_ids]  # [T, K, Rmax]
        is_local = (cand >= 0) & (cand // placement.slots_per_rank == rank)
        has_local = is_local.any(-1)
        t = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]
        spread = (t + rank) % logcnt[topk_ids]
        pick = torch.where(has_local, is_local.to(torch.int8).argmax(-1), spread)
        return torch.gather(cand, 2, pick[..., None]).squeeze(-1)


def routes_from_placement(
    topk_ids: torch.Tensor, weights: torch.Tensor, placement: ExpertPlacement, rank: int, policy: ReplicaPolicy
) -> Routes:
    """Step 2 for placement-driven layers: logical ids -> chosen replica -> (rank, local slot)."""
    if placement.max_replicas == 1 and type(policy) is LocalFirstPolicy:  # one replica each: two table lookups
        rank_of, slot_of = placement.first_replica_location(topk_ids.device)
        return Routes(topk_ids, weights, rank_of[topk_ids], slot_of[topk_ids], in_range=True)
    flag, refusal = None, None
    if type(policy) is LocalFirstPolicy:
        phys = policy(topk_ids, placement, rank)
    else:
        try:  # a custom policy raising here alone would leave the other ranks waiting in the exchange
            # its own copy of the ids: one edited in place would route the tokens to other experts,
            # and the picks would be checked against the edited ids
            phys = policy(topk_ids.clone(), placement, rank)
        except Exception as exc:  # noqa: BLE001 -- raised on this rank after the exchange, flagged to every rank
            phys = exc
        phys, flag, refusal = _checked_picks(policy, phys, topk_ids, placement)
    dest_rank = torch.div(phys, placement.slots_per_rank, rounding_mode="floor")
    return Routes(topk_ids, weights, dest_rank, phys - dest_rank * placement.slots_per_rank, nonfinite=flag,
                  in_range=True, refusal=refusal)  # (a custom policy's picks are clamped into the slots)


def check_routes(routes: Routes, num_ranks: int, num_slots: int, *, padding: bool = False) -> Routes:
    """``routes`` with every route in range, checked on the device (no host sync).

    Routes not known to be in range (``Routes.in_range`` false: a ``plan()`` override, or routes
    built by hand for a dispatcher) could send a token to no rank at all (an activation lost
    silently) or index past the payload. A route with ``dest_rank`` outside ``[0, num_ranks)``
    (``-1`` allowed with ``padding``: capacity mode's padding rows, sent nowhere) or, where it is
    sent, ``dest_slot`` outside ``[0, num_slots)`` is redirected to rank 0, slot 0, so that the
    exchange completes, and flagged ``BAD_ROUTE`` in ``nonfinite``: every rank raises
    (:func:`~moelayers.dispatch.flags.raise_if_flagged`).

    Returns:
        ``routes`` itself when ``in_range``, else new :class:`Routes` with ``in_range`` set.
    """
    if routes.in_range:
        return routes
    rank, slot = routes.dest_rank, routes.dest_slot
    sent = rank >= 0 if padding else torch.ones_like(rank, dtype=torch.bool)
    bad = (rank < (-1 if padding else 0)) | (rank >= num_ranks) | (sent & ((slot < 0) | (slot >= num_slots)))
    flag = torch.where(bad.any(), BAD_ROUTE, 0).to(torch.int32)
    return dataclasses.replace(routes, dest_rank=rank.masked_fill(bad, 0), dest_slot=slot.masked_fill(bad, 0),
                               nonfinite=merge_flags(routes.nonfinite, flag), in_range=True)


def _refusal(what: str, problem: str, cause: BaseException | None = None) -> ValueError:
    """The error a rank raises after the exchange for its own broken routes (``cause``: the
    policy's or override's exception)."""
    err = ValueError(f"{what} {problem}")
    err.__cause__ = cause
    return err


def checked_plan(plan: Any, owner: str, topk_ids: torch.Tensor, weights: torch.Tensor, token_ids: torch.Tensor | None,
                 placement: ExpertPlacement) -> Routes:
    """Step 2 by a ``plan()`` override, its routes checked on the device (no host sync): every
    ``(token, k)`` must go to a slot of ``placement`` that holds ``topk_ids[t, k]`` (one of
    ``placement.log2phy``'s replicas of it), with ``dest_rank`` / ``dest_slot`` integer ``[T, K]``
    strided tensors on ``topk_ids``' device and ``weights`` a ``[T, K]`` float one there (cast to
    ``weights``' dtype). An override that raises, returns anything else or routes a token
    elsewhere on one rank alone would leave the other ranks waiting in the exchange, or compute
    another expert silently: here its routes are replaced by rank 0, slot 0 (the exchange
    completes) and flagged ``BAD_ROUTE``, so that every rank raises after the exchange, this one
    with :attr:`Routes.refusal` (what the override did, its exception as the cause).

    Args:
        plan: the bound override, called with its own copy of the ids.
        owner: the layer's class name, for the messages.
        topk_ids, weights, token_ids: the router's (step 1) output and the forward's token ids.
        placement: the layer's placement.

    Returns:
        :class:`Routes` with the router's ``topk_ids``, ``in_range`` set.
    """
    problem, cause, routes = None, None, None
    try:
        routes = plan(topk_ids.clone(), weights, token_ids)
    except Exception as exc:  # noqa: BLE001 -- raised on this rank after the exchange, flagged to every rank
        problem, cause = f"raised {type(exc).__name__}: {exc}", exc
    if problem is None:
        problem = _plan_contract(routes, topk_ids)
    if problem is not None:
        zero = torch.zeros_like(topk_ids)
        return Routes(topk_ids, weights, zero, zero, nonfinite=torch.full((), BAD_ROUTE, dtype=torch.int32,
                                                                          device=topk_ids.device),
                      in_range=True, refusal=_refusal(f"{owner}.plan()", problem, cause))
    phy2log = placement.device_tables(topk_ids.device)[0]  # [R, S]
    num_ranks, num_slots = phy2log.shape
    dest_rank, dest_slot = routes.dest_rank.to(torch.int64), routes.dest_slot.to(torch.int64)
    inside = (dest_rank >= 0) & (dest_rank < num_ranks) & (dest_slot >= 0) & (dest_slot < num_slots)
    dest_rank, dest_slot = dest_rank.clamp(0, num_ranks - 1), dest_slot.clamp(0, num_slots - 1)
    wrong = (~inside | (phy2log[dest_rank, dest_slot] != topk_ids)).any()
    flag = wrong.to(torch.int32) * BAD_ROUTE
    return Routes(topk_ids, routes.weights.to(weights.dtype), dest_rank, dest_slot,
                  nonfinite=merge_flags(routes.nonfinite, flag), overflow=routes.overflow, in_range=True)


def _plan_contract(routes: Any, topk_ids: torch.Tensor) -> str | None:
    """What a ``plan()`` override's return breaks of its contract (:func:`checked_plan`), or ``None``."""
    if not isinstance(routes, Routes):
        return f"must return Routes, got {type(routes).__name__}"
    for name in ("dest_rank", "dest_slot", "weights"):
        t = getattr(routes, name)
        wants_float = name == "weights"
        if (not isinstance(t, torch.Tensor) or t.is_complex() or t.dtype == torch.bool
                or t.is_floating_point() != wants_float):
            kind = "a float" if wants_float else "an integer"
            return f"must return Routes.{name} as {kind} tensor, got {getattr(t, 'dtype', type(t).__name__)}"
        if t.shape != topk_ids.shape or t.device != topk_ids.device or t.layout != torch.strided:
            return (f"must return Routes.{name} as a strided [T, K] = {list(topk_ids.shape)} tensor on "
                    f"{topk_ids.device}, got {t.layout} {list(t.shape)} on {t.device}")
    for name in ("nonfinite", "overflow"):
        t = getattr(routes, name)
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 0 or t.is_floating_point()
                              or t.device != topk_ids.device):
            return f"must leave Routes.{name} None or a 0-dim integer tensor on {topk_ids.device}, got {t!r}"
    return None


def _checked_picks(policy, phys, topk_ids, placement: ExpertPlacement
                   ) -> tuple[torch.Tensor, torch.Tensor, ValueError | None]:
    """A custom policy's picks, checked on the device (no sync): ``(phys clamped into the slots, so
    that the exchange completes, 0-dim int32 flag: BAD_REPLICA where a pick does not hold the
    routed expert, this rank's refusal)``. A policy that raised (``phys`` is the exception) or
    returned anything but an integer, strided ``[T, K]`` tensor on ``topk_ids``' device is flagged
    the same way, with the refusal this rank raises after the exchange saying what happened
    (raising here would leave the other ranks waiting in the exchange)."""
    problem, cause, refusal = None, None, None
    if isinstance(phys, Exception):
        cause = phys
        problem = f"picks, but raised {type(phys).__name__}: {phys}"
    elif not isinstance(phys, torch.Tensor):
        problem = f"a torch tensor of integer physical slots, got {type(phys).__name__}"
    elif phys.is_floating_point() or phys.is_complex() or phys.dtype == torch.bool:
        problem = f"integer physical slots, got {phys.dtype}"
    elif phys.shape != topk_ids.shape:
        problem = f"[T, K] = {list(topk_ids.shape)} physical slots, got {list(phys.shape)}"
    elif phys.device != topk_ids.device or phys.layout != torch.strided:
        problem = f"a strided tensor on {topk_ids.device}, got {phys.layout} on {phys.device}"
    if problem is not None:
        refusal = _refusal(f"replica policy {type(policy).__name__}", f"must return {problem}", cause)
        phys = torch.full_like(topk_ids, -1)  # flagged below: every rank raises after the exchange
    phy2log = placement.device_tables(topk_ids.device)[0].flatten()
    inside = (phys >= 0) & (phys < phy2log.numel())
    phys = phys.to(torch.int64).clamp(0, phy2log.numel() - 1)
    wrong = (~inside | (phy2log[phys] != topk_ids)).any()
    return phys, wrong.to(torch.int32) * BAD_REPLICA, refusal


@dataclass
class LocalPairs:
    """The (row, slot) pairs a rank computes, from per-row slot lists.

    Attributes:
        pair_row: ``[P]`` row of each pair, pairs sorted by slot (stable).
        slot_counts: ``[S]`` pairs per slot.
        index: ``[N, J]`` position of (row, j) among the sorted pairs, ``-1`` where slot is ``-1``.
    """

    pair_row: torch.Tensor
    slot_counts: torch.Tensor
    index: torch.Tensor


def local_pairs(slots: torch.Tensor, num_slots: int, num_pairs: int | None = None, *, static: bool = False) -> LocalPairs:
    """Sort the valid entries of ``slots [N, J]`` (``-1`` = none) by slot.

    Args:
        slots: ``[N, J]`` local slot per (row, j), ``-1`` where the row has no expert here.
        num_slots: ``S``.
        num_pairs: number of valid entries if known on the host (saves a device sync).
        static: keep every entry (``P = N * J``, invalid ones sorted last and outside
            ``slot_counts``): static shapes and no sync, for CUDA graphs.
    """
    n, j = slots.shape
    key = torch.where(slots >= 0, slots, num_slots).flatten().to(torch.int64)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    if static:
        position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=slots.device))
        index = torch.where(key < num_slots, position, -1)
        return LocalPairs(order // j, counts[:num_slots], index.view(n, j))
    if num_pairs is None:
        num_pairs = int(counts[:num_slots].sum())
    sel = order[:num_pairs]
    index = torch.full((n * j,), -1, dtype=torch.int64, device=slots.device)
    index[sel] = torch.arange(num_pairs, device=slots.device)
    return LocalPairs(sel // j, counts[:num_slots], index.view(n, j))


def dense_pairs(slots: torch.Tensor, num_slots: int) -> LocalPairs:
    """:func:`local_pairs` of ``slots [N, J]`` whose entries are all valid slots (one rank computes
    every ``(token, k)``): the same pairs, counts and index in fewer kernels (no masking of absent
    entries, the index an inverse permutation), which decide a small forward's time on a GPU."""
    n, j = slots.shape
    key = to_dtype(slots.flatten(), torch.int64)
    order = torch.argsort(key, stable=True)
    dev = slots.device
    counts = torch.zeros(num_slots, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, cached_ones(n * j, dev))
    index = torch.empty_like(order).scatter_(0, order, cached_arange(n * j, dev))
    return LocalPairs(order // j, counts, index.view(n, j))


_ONES: dict = {}
_ARANGE: dict = {}


def cached_ones(n: int, device: torch.device) -> torch.Tensor:
    """``[n]`` int64 ones: a view of a cached, never written tensor (no kernel)."""
    return _cached_prefix(_ONES, n, device, torch.ones)


def cached_arange(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` in int64: a view of a cached, never written tensor (no kernel)."""
    return _cached_prefix(_ARANGE, n, device, torch.arange)


def _cached_prefix(cache: dict, n: int, device: torch.device, make) -> torch.Tensor:
    """The first ``n`` entries of ``make(size, dtype=int64, device=device)``, cached per device and
    power-of-two ``size >= n`` (normal tensors even when first made under inference mode)."""
    size = max(1024, 1 << max(n - 1, 0).bit_length())

    def build() -> torch.Tensor:
        with torch.inference_mode(False):
            return make(size, dtype=torch.int64, device=device)

    return cached_tensor(cache, (device, size), build)[:n]


def partial_sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the per-rank partial sums a combine sends back: float32 for float16 layers (a
    rank's subtotal of a token can exceed float16's range, 65504, where the other ranks' outputs
    cancel it: the output was ``inf`` at two ranks and finite at one), else the layer's dtype."""
    return torch.float32 if dtype == torch.float16 else dtype


def combine_pairs(expert_output: torch.Tensor, pairs: LocalPairs, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum of each row's pair outputs: ``[P, H] -> [N, H]``."""
    return unpermute_combine(expert_output, pairs.index, weights, out_dtype=out_dtype)
