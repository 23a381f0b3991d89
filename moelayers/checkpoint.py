"""torch distributed checkpointing (``torch.distributed.checkpoint``, DCP) of models with moelayers layers.

A layer's ``state_dict()`` holds *this rank's* expert slots, ``experts.w13 [S, 2F, H]`` and
``experts.w2 [S, H, F]``, under the same keys on every rank. DCP takes equal keys on several ranks
for copies of one tensor and writes one of them: ``dcp.save(model.state_dict())`` would keep one
rank's experts and lose the others' (a layer whose rank's experts were lost refuses such a
checkpoint when it is loaded: ``MoELayerBase.set_extra_state``). The state dicts of this module name the experts by their logical
id instead, one entry per expert and weight::

    <layer>.experts.w13.<e>   [2F, H]    (w2: [H, F]; optimizer state alike)

Every rank lists the experts its slots hold; replicas of an expert (a placement's extra copies,
expert-data-parallel ranks) are equal entries, which DCP writes once. So a checkpoint loads into any
placement and any expert-parallel size, each rank reading only the experts it holds. The placement
itself is not in these state dicts: the loading layers keep their own (to resume in the saved
placements too, save :func:`placement_state_dict` beside them and, after loading the weights and
the optimizer, move into them with :func:`load_placement_state_dict`). The entries are views of the live
weights (and optimizer state), so ``dcp.load`` reads straight into them; the ``load_*`` functions
then fill the replicas and load the rest of the model (or optimizer) as torch's
``torch.distributed.checkpoint.state_dict`` functions do::

    from moelayers import checkpoint as mlc
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": mlc.model_state_dict(model),
              "optim": mlc.optimizer_state_dict(model, optimizer)}, checkpoint_id=path)

    # later, in a model built with any placement and expert-parallel size:
    state = {"model": mlc.model_state_dict(model), "optim": mlc.optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    mlc.load_model_state_dict(model, state["model"])
    mlc.load_optimizer_state_dict(model, optimizer, state["optim"])

Every rank must hold the same weights for the same expert (as after a data-parallel step). Take
the state dicts right before each save and each load: they are views laid out by the placement of
the moment, and after a move (``apply_placement``, a re-plan) a view holds another expert than its
name says. A layer registered under several names has its experts under the first one.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moelayers.experts import is_slot_major
from moelayers.groups import collective_device
from moelayers.layers.moves import PlacementMoveError, check_can_move
from moelayers.placement import ExpertPlacement

__all__ = ["model_state_dict", "load_model_state_dict", "optimizer_state_dict", "load_optimizer_state_dict",
           "placement_state_dict", "load_placement_state_dict", "placements_fit", "EXPERT_KEYS", "slot_copies"]

#: a layer's parameters with one row per slot of its placement
EXPERT_KEYS = ("experts.w13", "experts.w2")


def slot_copies(phy2log: torch.Tensor, rank: int) -> list[tuple[int, int]]:
    """Which expert each slot of ``rank`` holds, and which copy of it.

    Args:
        phy2log: ``[R, S]`` a placement's logical expert per slot (``-1``: empty).
        rank: the expert-parallel rank.

    Returns:
        ``S`` pairs ``(expert, copy)``: ``copy`` counts the expert's slots before this one in global
        slot order (0 for the first, the main replica); ``(-1, 0)`` for an empty slot.
    """
    flat = phy2log.flatten().tolist()
    per_rank = phy2log.shape[1]
    seen: dict[int, int] = {}
    out = []
    for g, e in enumerate(flat):
        copy = seen.get(e, 0)
        seen[e] = copy + 1
        if g // per_rank == rank:
            out.append((e, copy) if e >= 0 else (-1, 0))
    return out


class _ExpertParam:
    """One slot-major parameter of a layer and the state-dict names (FQNs) torch gives it."""

    def __init__(self, names: list[str], layer: nn.Module, name: str):
        #: every name of the parameter in the model's state dict (a layer registered under several
        #: names has several); the experts' entries are named after the first
        self.names, self.layer, self.name = names, layer, name
        self.fqn = names[0]
        self.param: torch.Tensor = layer.get_parameter(name)
        #: the expert in each slot of this rank (-1: empty)
        self.slots = [e for e, _ in slot_copies(layer.placement.phy2log, layer.groups.ep_rank)]
        #: ``{expert: its slot}`` for the experts this rank holds (a rank holds an expert once)
        self.experts = {e: s for s, e in enumerate(self.slots) if e >= 0}

    @property
    def layer_keys(self) -> list[str]:
        """The names of the parameter and of its layer's placement (``_extra_state``), under every name."""
        return self.names + [n[: -len(self.name)] + "_extra_state" for n in self.names]

    def key(self, expert: int) -> str:
        return f"{self.fqn}.{expert}"

    def split(self, value: Any) -> dict[str, Any]:
        """``value`` (the parameter or one of its optimizer states) by expert: rows of a slot-major
        tensor, anything else (a step count) the same for every expert."""
        if self.slot_major(value):
            return {self.key(e): value[s] for e, s in self.experts.items()}
        return {self.key(e): value for e in self.experts}

    def slot_major(self, value: Any) -> bool:
        return is_slot_major(value, len(self.slots))

    def rows(self, state: Mapping[str, Any], what: str) -> dict[int, Any]:
        """This rank's experts' entries of ``state``, checked to be there.

        Raises:
            KeyError: an expert of this rank is missing (nothing has been loaded yet).
        """
        missing = [self.key(e) for e in self.experts if self.key(e) not in state]
        if missing:
            raise KeyError(f"{what}: missing the expert entries {missing[:4]}{' ...' if len(missing) > 4 else ''} "
                           f"({len(missing)} of {len(self.experts)} on this rank); nothing was loaded. Build the "
                           f"state dict with moelayers.checkpoint, which names the experts by id, before dcp.load. "
                           f"A state dict of another live model holds the experts that model keeps on this rank: "
                           f"in another placement those are others (export_full_weights / load_full_weights move "
                           f"whole layers between placements)")
        return {e: state[self.key(e)] for e in self.experts}

    def in_optimizer(self, state: Mapping[str, Any]) -> str | None:
        """The name an optimizer state dict keeps the parameter's state under (``None``: not there)."""
        return next((n for n in self.names if n in state), None)


def _expert_params(model: nn.Module, model_state: Mapping[str, Any]) -> list[_ExpertParam]:
    """The slot-major parameters of every moelayers layer in ``model``, with the names they have in
    ``model_state`` (torch's ``get_model_state_dict``; found by storage, so that wrappers such as
    DDP, which rename them, are allowed for)."""
    from moelayers.layers.base import MoELayerBase

    by_storage: dict[tuple, list[str]] = {}
    for fqn, value in model_state.items():
        if type(value) is torch.Tensor and value.numel():  # (not a DTensor of a sharding wrapper)
            by_storage.setdefault((value.data_ptr(), value.shape), []).append(fqn)
    out = []
    for layer in model.modules():  # (each module once, under however many names)
        if not isinstance(layer, MoELayerBase):
            continue
        for name in EXPERT_KEYS:
            param = layer.get_parameter(name)
            names = by_storage.get((param.data_ptr(), param.shape))
            if names is None:
                raise ValueError(f"moelayers.checkpoint: {type(layer).__name__}'s {name} is not in the model's state "
                                 "dict as the parameter itself (a sharding wrapper such as FSDP over the MoE layer?); "
                                 "its experts cannot be named by id")
            out.append(_ExpertParam(names, layer, name))
    return out


def _expert_keys(experts: list[_ExpertParam]) -> set[str]:
    """Every name an expert entry of these parameters can have (any expert, held here or not)."""
    return {p.key(e) for p in experts for e in range(p.layer.placement.num_experts)}


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model``'s state dict for ``torch.distributed.checkpoint``, its experts by id.

    torch's ``get_model_state_dict(model)`` with every moelayers layer's ``experts.w13`` /
    ``experts.w2`` replaced by ``<name>.<e>`` entries for the experts this rank holds (views of the
    slot holding each), and without the layers' ``_extra_state`` (their placement, which the loading
    layers keep). See the module docstring. Take it right before each save or load: after a move
    (``apply_placement``, a re-plan) its views hold other experts than their names say.

    Args:
        model: any module; its moelayers layers may sit anywhere inside (DDP-wrapped too).

    Returns:
        ``{name: tensor}``; the same keys as torch's for everything but the MoE experts.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model)
    experts = _expert_params(model, state)
    drop = {k for p in experts for k in p.layer_keys}
    out = {k: v for k, v in state.items() if k not in drop}
    for p in experts:
        out.update(p.split(p.param.detach()))
    return out


@torch.no_grad()
def load_model_state_dict(model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True):
    """Load a :func:`model_state_dict` (e.g. after ``dcp.load`` into one) into ``model``.

    Every slot gets its expert's entry (replicas included); the rest of the model is loaded with
    torch's ``set_model_state_dict``. The layers keep their placement. Keys and shapes are checked before
    anything is loaded.

    Args:
        model: the model the state dict was taken from (``dcp.load`` may have filled it in place).
        state_dict: ``{name: tensor}`` as :func:`model_state_dict` names them.
        strict: as torch's: keys missing or unexpected raise; with ``strict=False`` they are
            returned (what an MoE layer misses, e.g. its router, keeps its value). A missing
            *expert* always raises (a layer with some experts left behind would serve wrong outputs).

    Returns:
        ``(missing_keys, unexpected_keys)``, as torch's ``load_state_dict``.

    Raises:
        TypeError: ``state_dict`` is not a mapping of names to tensors.
        KeyError: an expert held by this rank is missing.
        ValueError: an entry has another shape than the model's tensor, or another rank refused
            its state dict.
        RuntimeError: ``strict`` and keys missing or unexpected.
        Each is checked before anything is loaded, and the ranks agree first: a small all-reduce
        over each moelayers layer's expert-parallel group, then its expert-data-parallel group
        (``ParallelGroups.edp``), so that every rank of the model raises and none loads when one
        refuses. Call it on every rank (as ``dcp.load``). Groups made without ``edp``
        (``ParallelGroups.from_groups`` without it, ``from_megatron``) agree within each
        expert-parallel group only.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.nn.modules.module import _IncompatibleKeys

    live = get_model_state_dict(model)
    experts = _expert_params(model, live)
    layer_keys = {k for p in experts for k in p.layer_keys}
    expected = [k for k in live if k not in layer_keys]
    expert_keys = _expert_keys(experts)
    with _agreed_across_ranks(experts, "load_model_state_dict"):
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_model_state_dict: the state dict must be a mapping of names to tensors, got "
                            f"{type(state_dict).__name__}; nothing was loaded")
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in live and k not in expert_keys]
        rows = [p.rows(state_dict, "load_model_state_dict") for p in experts]
        for p, by_expert in zip(experts, rows):
            for e, row in by_expert.items():
                _check_row(p.key(e), row, p.param[0])
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_model_state_dict: missing keys {missing}, unexpected keys {unexpected}; nothing "
                               "was loaded (strict=False loads the rest)")
        for k in expected:
            if k in state_dict:
                _check_row(k, state_dict[k], live[k])
    for p, by_expert in zip(experts, rows):
        for s, e in enumerate(p.slots):
            if e >= 0:
                p.param[s].copy_(by_expert[e])
    # what is missing keeps its value (an MoE layer loads all of its keys or none) and is reported
    rest = {k: state_dict[k] if k in state_dict else live[k] for k in expected}
    for p in experts:
        rest.update({n: p.param.detach() for n in p.names})
        rest.update({n[: -len(p.name)] + "_extra_state": p.layer.get_extra_state() for n in p.names})
    set_model_state_dict(model, rest, options=StateDictOptions(strict=True))
    return _IncompatibleKeys(missing, unexpected)


class _Agreement:
    """What the checks inside :func:`_agreed_across_ranks` leave for the ranks to compare:
    ``digest``, a 62-bit digest of something every rank must have alike, and ``of``, what it is."""

    digest, of = 0, ""


@contextlib.contextmanager
def _agreed_across_ranks(experts: list[_ExpertParam], what: str):
    """Run the checks of a loader, then agree with the model's other ranks: an exception raised
    inside (any refusal) is told to them first; another rank's refusal, or a digest the checks set
    (:class:`_Agreement`) that differs between the ranks, raises ``ValueError`` here."""
    agreement = _Agreement()
    try:
        yield agreement
    except Exception:  # noqa: BLE001 - any refusal: told to the other ranks before it is raised
        _refused_on_any_rank(experts, True)
        raise
    refused, alike = _refused_on_any_rank(experts, False, agreement.digest)
    if refused:
        raise ValueError(f"{what}: another rank refused its state dict (see its error); nothing was loaded")
    if not alike:
        raise ValueError(f"{what}: the ranks' {agreement.of} differ; nothing was loaded")


def _refused_on_any_rank(experts: list[_ExpertParam], refused: bool, digest: int = 0) -> tuple[bool, bool]:
    """Whether any rank of the model refused, and whether every rank has the same ``digest``: an
    all-reduce MAX over each distinct expert-parallel group of the layers, then over each distinct
    expert-data-parallel group (together they span the ranks of a model built over the world,
    several expert-parallel groups included)."""
    flag = torch.tensor([int(refused), digest, -digest], dtype=torch.int64)
    for kind in ("ep", "edp"):
        seen = set()
        for layer in dict.fromkeys(p.layer for p in experts):  # layer order, the same on every rank
            group = getattr(layer.groups, kind)
            if group is None or id(group) in seen or dist.get_world_size(group) == 1:
                continue
            seen.add(id(group))
            flag = flag.to(collective_device(group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    refused_somewhere, high, minus_low = flag.tolist()
    return bool(refused_somewhere), high == -minus_low


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state dict for ``torch.distributed.checkpoint``, the experts' state by id.

    torch's ``get_optimizer_state_dict(model, optimizer)`` (``{"state": {name: {...}},
    "param_groups": [...]}``, which gives a fresh optimizer its state first) with the state of every
    moelayers layer's ``experts.w13`` / ``experts.w2`` split into ``<name>.<e>`` entries as in
    :func:`model_state_dict`: slot-major states (Adam's moments) by row, others (the step) the same
    for every expert. ``param_groups`` keep the parameters' own names. Take it right before each
    save or load, as :func:`model_state_dict`.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    experts = _expert_params(model, get_model_state_dict(model))
    osd = get_optimizer_state_dict(model, optimizer)
    state = {k: v for k, v in osd["state"].items() if not any(k in p.names for p in experts)}
    for p in experts:
        name = p.in_optimizer(osd["state"])
        if name is None:
            continue
        per_expert: dict[str, dict] = {p.key(e): {} for e in p.experts}
        for what, value in osd["state"][name].items():
            for key, part in p.split(value).items():
                per_expert[key][what] = part
        state.update(per_expert)
    return {**osd, "state": state}


@torch.no_grad()
def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]):
    """Load an :func:`optimizer_state_dict` (e.g. after ``dcp.load`` into one) into ``optimizer``.

    Every slot's state gets its expert's entry (replicas included); the rest, hyperparameters too, is
    loaded with torch's ``set_optimizer_state_dict``.

    Raises:
        KeyError: an expert held by this rank, or one of its states, is missing.
        ValueError: an entry has another shape than the slot's state, or another rank refused its
            state dict.
        Nothing is loaded on any rank when one refuses: the ranks agree first, as in
        :func:`load_model_state_dict` (call it on every rank).
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    experts = _expert_params(model, get_model_state_dict(model))
    with _agreed_across_ranks(experts, "load_optimizer_state_dict") as agreement:
        live_osd = get_optimizer_state_dict(model, optimizer)
        live = live_osd["state"]
        # which expert weights the optimizers hold and their shared states: _share_slot_table_states relies on it
        agreement.of = "optimizers (the expert weights they hold, or those weights' states)"
        agreement.digest = _digest([(p.fqn, p.in_optimizer(live) is not None,
                                     [what for what, _ in _slot_table_states(p, live.get(p.in_optimizer(live), {}))])
                                    for p in experts])
        _check_param_groups(state_dict, live_osd["param_groups"])
        saved = state_dict["state"]
        copies, sets = [], []  # (live tensor, loaded value), (live state, name, loaded value): all checked first
        expert_keys = _expert_keys(experts)
        native = {k: v for k, v in saved.items() if k not in expert_keys}
        for p in experts:
            name = p.in_optimizer(live)
            if name is None:
                continue
            native[name] = live[name]
            if not p.experts:  # its shared states (the step) come from the ranks that hold experts, below
                continue
            rows = p.rows(saved, "load_optimizer_state_dict")
            for what, value in live[name].items():
                slot_major = p.slot_major(value)
                for e, entry in rows.items():
                    if what not in entry:
                        raise KeyError(f"load_optimizer_state_dict: {p.key(e)} has no {what!r} state; nothing was "
                                       "loaded")
                    _check_row(f"{p.key(e)}.{what}", entry[what], value[0] if slot_major else value)
                if slot_major:
                    copies += [(value[s], rows[e][what]) for s, e in enumerate(p.slots) if e >= 0]
                elif torch.is_tensor(value):  # the same for every expert (a step count): the first one's
                    copies.append((value, rows[next(iter(rows))][what]))
                else:
                    sets.append((live[name], what, rows[next(iter(rows))][what]))
        slot_tables = {n for p in experts for n in p.names}  # (their states are checked expert by expert above)
        for name, mine in live.items():  # the dense parameters' states, before torch loads them
            if name in slot_tables or not mine:
                continue
            entry = saved.get(name)
            if not isinstance(entry, Mapping):
                raise (KeyError if entry is None else TypeError)(
                    f"load_optimizer_state_dict: {name!r} has {'no' if entry is None else 'a malformed'} state in the "
                    f"checkpoint ({type(entry).__name__}); nothing was loaded")
            for what, value in mine.items():
                if what not in entry:
                    raise KeyError(f"load_optimizer_state_dict: {name} has no {what!r} state; nothing was loaded")
                _check_row(f"{name}.{what}", entry[what], value)
    for value, loaded in copies:
        value.copy_(loaded)
    for state, what, loaded in sets:  # (the optimizer's own state dicts)
        state[what] = loaded
    for p in experts:  # (whether the optimizer holds each, and its shared states, agreed above)
        name = p.in_optimizer(live)
        if name is not None:
            _share_slot_table_states(p, live[name])
            p.layer._trained = True  # its optimizer holds state for these slots: a move without it warns
    return set_optimizer_state_dict(model, optimizer, {**state_dict, "state": native})


def _slot_table_states(p: _ExpertParam, state: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The numeric states of ``p`` shared by all its slots (the step), in a fixed order."""
    return [(what, value) for what, value in sorted(state.items(), key=lambda kv: str(kv[0]))
            if not p.slot_major(value) and (torch.is_tensor(value) and value.numel() == 1
                                            or isinstance(value, (int, float)) and not isinstance(value, bool))]


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 2


def _share_slot_table_states(p: _ExpertParam, state: dict) -> None:
    """Give a rank that holds none of a layer's experts the states the loaded ranks share (the step).

    The checkpoint keeps them in every expert's entry, so such a rank read none; its fresh
    optimizer's step would then differ from the other ranks', and every later move with the
    optimizer is refused. Where the placement leaves an expert-parallel rank empty, the ranks of
    the group take the maximum of the holders' values (non-holders offer ``-inf``): one small
    all-reduce per parameter, only for such placements (every rank of the group holds the same
    states: agreed before anything was loaded).
    """
    if p.layer.groups.ep is None or bool((p.layer.placement.phy2log >= 0).any(1).all()):
        return  # every rank holds experts: every rank read its own
    shared = _slot_table_states(p, state)
    device = collective_device(p.layer.groups.ep)
    offered = [float(value) if p.experts else -math.inf for _, value in shared]
    agreed = torch.tensor(offered, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=p.layer.groups.ep)
    if p.experts:
        return
    for (what, value), got in zip(shared, agreed.tolist()):
        if torch.is_tensor(value):
            value.fill_(got)
        else:
            state[what] = type(value)(got)


def _check_param_groups(state_dict: Mapping[str, Any], live_groups: list[dict]) -> None:
    """The saved ``param_groups`` name the optimizer's parameters, group by group."""
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise KeyError("load_optimizer_state_dict: the state dict needs 'state' and 'param_groups' (as "
                       "optimizer_state_dict gives them); nothing was loaded")
    saved = state_dict["param_groups"]
    names = [sorted(map(str, g.get("params", []))) if isinstance(g, Mapping) else None for g in saved]
    if names != [sorted(map(str, g["params"])) for g in live_groups]:
        raise ValueError(f"load_optimizer_state_dict: the saved param_groups ({len(saved)} groups) do not name the "
                         f"optimizer's parameters ({len(live_groups)} groups), group by group; nothing was loaded")


def _check_row(key: str, loaded: Any, like: Any) -> None:
    if torch.is_tensor(like) and (not torch.is_tensor(loaded) or loaded.shape != like.shape):
        shape = list(loaded.shape) if torch.is_tensor(loaded) else type(loaded).__name__
        raise ValueError(f"{key}: {shape} in the checkpoint, {list(like.shape)} here; nothing was loaded")
    if torch.is_tensor(like) and loaded.is_meta and not like.is_meta:
        raise ValueError(f"{key}: a meta tensor in the checkpoint (no values to load); nothing was loaded")


def placement_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every moelayers layer's placement, for ``torch.distributed.checkpoint`` beside
    :func:`model_state_dict`: ``{<layer>.placement: phy2log [R, S] int64}`` (the same on every rank of
    an expert-parallel group; DCP writes it once), a copy, so it can be taken at any time.

    To resume in the saved placements (e.g. after re-planning), load the weights and the optimizer
    as usual, then move the layers with :func:`load_placement_state_dict`::

        dcp.save({"model": ..., "optim": ..., "placements": mlc.placement_state_dict(model)}, checkpoint_id=path)
        ...
        state = {"model": ..., "optim": ..., "placements": mlc.placement_state_dict(model)}
        dcp.load(state, checkpoint_id=path)
        mlc.load_model_state_dict(model, state["model"]); mlc.load_optimizer_state_dict(model, optim, state["optim"])
        mlc.load_placement_state_dict(model, state["placements"], optimizer=optim)

    A placement is a table of the expert-parallel ranks and slots it was saved with: only a model of
    the same expert-parallel size and slots per rank can take it (``dcp.load`` refuses another
    shape); at another size, leave the placements out and resume in the loading layers' own
    (:func:`placements_fit` tells which).

    Returns:
        ``{name: tensor}``, one entry per layer (a layer under several names: the first).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {_placement_key(p): p.layer.placement.phy2log.clone()
            for p in _expert_params(model, get_model_state_dict(model)) if p.name == EXPERT_KEYS[0]}


def placements_fit(model: nn.Module, checkpoint_id: str | os.PathLike, key: str = "placements") -> bool:
    """Whether the placements a checkpoint saved (``{key: placement_state_dict(model)}`` in a DCP
    checkpoint on the local file system) can be loaded into ``model``: an entry for each of its
    layers, of the same expert-parallel size and slots per rank (the shapes; the experts the tables
    hold are checked by :func:`load_placement_state_dict`). Reads the checkpoint's metadata only (no
    collective); ``dcp.load`` of placements that do not fit raises ``CheckpointException``, which is
    not an ``Exception``::

        state = {"model": mlc.model_state_dict(model), "optim": mlc.optimizer_state_dict(model, optim)}
        if mlc.placements_fit(model, path):  # the same sizes: resume in the saved placements
            state["placements"] = mlc.placement_state_dict(model)

    Raises:
        FileNotFoundError: no checkpoint metadata at ``checkpoint_id``.
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        saved = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{checkpoint_id}: no torch.distributed.checkpoint metadata there ({exc})") from exc
    for name, phy2log in placement_state_dict(model).items():
        entry = saved.get(f"{key}.{name}")
        if getattr(entry, "size", None) != phy2log.shape:
            return False
    return True


def load_placement_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *,
                              optimizer: torch.optim.Optimizer | None = None) -> None:
    """Move every moelayers layer of ``model`` into the placement a :func:`placement_state_dict`
    saved for it: ``layer.apply_placement(p, optimizer=optimizer)``, a transactional move per layer
    and a collective over its expert-parallel group (every rank calls this with the same state
    dict). Call it after loading the weights and the optimizer (the move carries both); layers
    already in their saved placement do not move. Before any move, one small all-reduce per layer
    over its expert-parallel group agrees on whether a rank refused its entry and whether the
    layer moves, so that the ranks raise, move or stay together; a refusal is then shared over the
    layer's expert-data-parallel group (``ParallelGroups.edp``, where known), so that its copies in
    the other expert-parallel groups raise too instead of moving alone.

    Args:
        model: the model (its layers under the names the state dict was taken with).
        state_dict: ``{<layer>.placement: phy2log [R, S]}``.
        optimizer: the torch optimizer over the expert weights, whose per-slot state (Adam's
            moments) moves with them; ``None`` for none. Frozen layers (expert weights with
            ``requires_grad=False``) that it does not hold move without state.

    Raises:
        KeyError: a layer has no entry (nothing moved).
        ValueError: an entry is not a placement of the layer's experts, ranks and slots per rank
            (``TypeError``: it holds no integer ids), or another rank of a layer's expert-parallel (or
            expert-data-parallel) group refused its entry (nothing moved).
        TypeError, RuntimeError: a layer that would move cannot, for a reason this rank knows before
            any move (see ``apply_placement``: ``optimizer`` does not hold its trained expert weights,
            they hold gradients, or a forward awaits its backward); nothing moved.
        PlacementRejected, PlacementMoveError: a layer's move failed in its collective part (ranks
            handed different placements or optimizer states, a failure while staging), on every rank:
            the layers before it have moved, it and the ones after it have not (where a move fails in
            one expert-parallel group, the layer's other groups move back).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    checked = []  # (layer, key, new placement or None, this rank's refusal or None), layer order
    for p in _expert_params(model, get_model_state_dict(model)):
        if p.name != EXPERT_KEYS[0]:
            continue
        key = _placement_key(p)
        try:
            new = _saved_placement(key, state_dict, p.layer.placement)
            if new != p.layer.placement:  # every layer's own checks before the first move
                check_can_move(p.layer, new, optimizer)
            checked.append((p.layer, key, new, None))
        except Exception as exc:  # noqa: BLE001 - any refusal (a meta tensor too): told to the other ranks first
            checked.append((p.layer, key, None, exc))
    # every rank of each layer's expert-parallel group learns whether any refused its entry, and moves
    # when any needs to (a rank raising alone, or skipping a move the others make, left them waiting)
    moves, raised = [], None  # every layer agrees before anything is raised: a rank raising at one layer left
    for layer, key, new, refused in checked:  # ranks of another group waiting in a later layer's all-reduce
        # (a refusal at an earlier layer rides along: ranks of other groups learn it where a group spans them)
        flags = torch.tensor([int(refused is not None or raised is not None),
                              int(new is not None and new != layer.placement)])
        if layer.groups.ep is not None and layer.groups.ep_size > 1:
            flags = flags.to(collective_device(layer.groups.ep))
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=layer.groups.ep)
        refused_somewhere, move = flags.tolist()
        edp = layer.groups.edp  # the layer's copies in the other expert-parallel groups: they refuse together too
        if edp is not None and dist.get_world_size(edp) > 1:  # and move together: a group already in the
            flag = torch.tensor([refused_somewhere, move], device=collective_device(edp))  # placement moves nothing
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=edp)
            refused_somewhere, move = flag.tolist()
        if raised is None and refused is not None:
            raised = refused
        elif raised is None and refused_somewhere:
            raised = ValueError(f"load_placement_state_dict: another rank refused its entry {key!r} or an earlier one "
                                "(see its error); nothing was moved")
        if move:
            moves.append((layer, new))
    if raised is not None:
        raise raised
    befores = [layer.placement for layer, _ in moves]
    for layer, new in moves:
        _move_with_its_copies(layer, new, optimizer)
    for (layer, _), before in zip(moves, befores):  # every layer moved: trained weights moved without the
        layer._warn_if_moments_left(before, optimizer)  # optimizer warn now (a filter may make it an error)


def _move_with_its_copies(layer: nn.Module, new: ExpertPlacement, optimizer: Any) -> None:
    """``layer.apply_placement(new)``, kept or undone together with the layer's copies in the other
    expert-parallel groups: each group's move is its own transaction, so after it the groups share,
    over the expert-data-parallel group, whether any failed; a group that moved then moves back, and
    every rank raises."""
    old = layer.placement
    failure = None
    try:
        layer._move(new, optimizer)  # (its warning after every layer's move: load_placement_state_dict)
    except Exception as exc:  # noqa: BLE001 - raised on every rank of this expert-parallel group; shared first
        failure = exc
    edp = layer.groups.edp
    if edp is None or dist.get_world_size(edp) == 1:
        if failure is not None:
            raise failure
        return
    flag = torch.tensor([int(failure is not None)], device=collective_device(edp))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=edp)
    if failure is not None:
        raise failure
    if flag.item():
        layer._move(old, optimizer)
        raise PlacementMoveError("load_placement_state_dict: the move failed in another expert-parallel group (see "
                                 "its error), so this group moved back: every group serves the placement it had; the "
                                 "layers before this one have moved, it and the ones after it have not", [], "staging")


def _saved_placement(key: str, state_dict: Mapping[str, torch.Tensor], old: ExpertPlacement) -> ExpertPlacement:
    """The placement ``state_dict[key]`` saved for a layer now in ``old``, checked against it."""
    if key not in state_dict:
        raise KeyError(f"load_placement_state_dict: no entry {key!r}; nothing was moved")
    table = state_dict[key]
    if not torch.is_tensor(table) or table.shape != old.phy2log.shape:
        shape = tuple(table.shape) if torch.is_tensor(table) else type(table).__name__
        raise ValueError(f"load_placement_state_dict: {key} is {shape}, the layer's placement is "
                         f"{tuple(old.phy2log.shape)} (ranks, slots per rank): a placement resumes only at the "
                         f"same expert-parallel size and slots per rank; nothing was moved")
    if table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool:
        raise TypeError(f"load_placement_state_dict: {key} holds {table.dtype}, a placement's table holds integer "
                        "expert ids; nothing was moved")
    try:
        new = ExpertPlacement(table.detach().to("cpu", torch.int64), old.num_experts)
        new.validate()
    except ValueError as e:
        raise ValueError(f"load_placement_state_dict: {key} is not a placement of {old.num_experts} experts: {e}; "
                         "nothing was moved") from e
    return new


def _placement_key(p: _ExpertParam) -> str:
    return p.names[0][: -len(p.name)] + "placement"
