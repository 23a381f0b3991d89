"""The weights of a moelayers layer as tensors: initialisation, loading and exporting them in
logical (expert id) order, checking that every copy agrees, and the ``nn.Module`` protocol around
them — casts and moves (``.to``), copies, pickling and ``state_dict`` with the placement the slots
are laid out in.

:class:`LayerWeights` is a part of :class:`~moelayers.layers.base.MoELayerBase`, which holds the
forward; it reads the layer's ``config``, ``groups``, ``placement``, ``seed``, ``router`` and
``experts`` and calls its ``release_graphs``, ``_check_placement`` and ``_adopt_placement``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from moelayers.dispatch.comm import fingerprint
from moelayers.experts import agree_on_dtypes, gather_logical
from moelayers.layers.inflight import InFlightGraphs
from moelayers.layers.moves import check_own_weights
from moelayers.layers.turns import one_at_a_time
from moelayers.layers.replay import ForcedForRecompute
from moelayers.placement import ExpertPlacement

if TYPE_CHECKING:
    from moelayers.layers.base import MoELayerBase

#: parameter attributes a deep copy leaves out: gradient buffers a data-parallel wrapper attaches
#: (megatron's ``main_grad``), which the copy's own wrapper allocates
_GRAD_BUFFERS = frozenset({"main_grad", "grad_added_to_main_grad"})

#: integer dtype of each element size: a weight's bits, summed exactly
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: the layout of the placement record ``state_dict()`` saves (see ``LayerWeights.get_extra_state``)
_STATE_FORMAT = 2


def _some(ids: list[int], what: str, shown: int = 8) -> str:
    """``"expert(s) [0, 1, 2]"``, or ``"16 experts: [0, 1, 2, 3, 4, 5, 6, 7, ...]"`` past ``shown`` of them."""
    if len(ids) <= shown:
        return f"{what}(s) {ids}"
    return f"{len(ids)} {what}s: [{', '.join(map(str, ids[:shown]))}, ...]"


def placement_record(placement: ExpertPlacement, ep_rank: int) -> torch.Tensor:
    """The placement as ``state_dict()`` saves it: one int64 tensor ``[5 + R*S]``, ``(format,
    num_experts, ep_rank, R, S)`` then ``phy2log`` row by row (format 1, older checkpoints, was a
    dict; :meth:`LayerWeights.set_extra_state` reads both)."""
    r, s = placement.phy2log.shape
    head = torch.tensor([_STATE_FORMAT, placement.num_experts, ep_rank, r, s], dtype=torch.int64, device="cpu")
    return torch.cat([head, placement.phy2log.reshape(-1).to("cpu", torch.int64)])  # (on the CPU under torch.device)


def read_placement_record(state: Any) -> tuple[torch.Tensor, int, int | None]:
    """``(phy2log [R, S], num_experts, ep_rank or None)`` of a saved placement record: the tensor of
    :func:`placement_record`, or the dict ``{phy2log, num_experts[, ep_rank]}`` of format 1.

    Raises:
        ValueError: neither.
    """
    if isinstance(state, dict) and {"phy2log", "num_experts"} <= set(state) <= {"phy2log", "num_experts", "ep_rank"}:
        return torch.as_tensor(state["phy2log"]), int(state["num_experts"]), state.get("ep_rank")
    if (isinstance(state, torch.Tensor) and state.dim() == 1 and state.dtype == torch.int64 and state.numel() >= 5
            and int(state[0]) == _STATE_FORMAT):
        _, num_experts, ep_rank, r, s = (int(v) for v in state[:5].tolist())
        if r >= 1 and s >= 1 and state.numel() == 5 + r * s:
            return state[5:].detach().cpu().clone().view(r, s), num_experts, ep_rank
    if (isinstance(state, torch.Tensor) and state.dim() == 1 and state.dtype == torch.int64 and state.numel() >= 1
            and int(state[0]) > _STATE_FORMAT):
        from moelayers import __version__

        raise ValueError(f"the checkpoint's placement record of this MoE layer is of format {int(state[0])}, written by "
                         f"a newer moelayers; this one ({__version__}) reads formats up to {_STATE_FORMAT}: upgrade "
                         f"moelayers to load it")
    got = f"a tensor of shape {list(state.shape)} and dtype {state.dtype}" if isinstance(state, torch.Tensor) else \
        type(state).__name__
    if isinstance(state, torch.Tensor) and state.dtype != torch.int64:
        got += " (was the state dict cast to another dtype as a whole? the layer's _extra_state must stay int64)"
    raise ValueError(f"the checkpoint's extra state of this MoE layer must be its placement (moelayers' placement "
                     f"record: an int64 tensor [5 + R*S] of format {_STATE_FORMAT}, or a dict "
                     f"{{phy2log, num_experts[, ep_rank]}}), got {got}")


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def _like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (the same on every rank) as ``param`` holds it: sharded like a DTensor parameter (FSDP's
    ``fully_shard``), each rank cutting its own shard without communication; otherwise as it is."""
    if not _is_dtensor(param):
        return full
    from torch.distributed.tensor import distribute_tensor

    try:
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    except TypeError:  # torch before 2.7: rank 0's copy scattered (every rank loads the same weights)
        return distribute_tensor(full, param.device_mesh, param.placements)


class LayerWeights:
    """Weight handling of :class:`~moelayers.layers.base.MoELayerBase` (see the module docstring)."""

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Default init: ``N(0, init_std)``, each logical expert from its own seeded generator.

        Raises:
            TypeError: a weight is computed from others (a parametrization; see :meth:`load_full_weights`).
        """
        check_own_weights(self, "reset_parameters")
        cfg, dev = self.config, self.router.weight.device
        if dev.type == "meta":  # shapes only (deferred init): call again after to_empty(device=...)
            return
        gen = torch.Generator(device=dev)
        gen.manual_seed(self.seed * 1_000_003 + cfg.num_experts)
        router = self.router.weight  # drawn whole and cut as held (a DTensor's normal_ ignores the generator)
        full = torch.empty(router.shape, dtype=router.dtype, device=dev).normal_(0.0, cfg.init_std, generator=gen)
        router.copy_(_like(router, full))
        for s, e in enumerate(self.placement.experts_on(self.groups.ep_rank)):
            if e < 0:
                self.experts.w13[s].zero_()
                self.experts.w2[s].zero_()
                continue
            gen.manual_seed(self.seed * 1_000_003 + e)
            self.experts.w13[s].normal_(0.0, cfg.init_std, generator=gen)
            self.experts.w2[s].normal_(0.0, cfg.init_std, generator=gen)

    # ------------------------------------------------------------------ weights in logical order
    @torch.no_grad()
    @one_at_a_time
    def load_full_weights(self, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                          verify: bool = True) -> None:
        """Load logical weights, identical on every rank; all checks happen before any copy.

        Every rank calls it (a collective over the expert-parallel group and its ``edp`` copies when
        ``verify``): the ranks compare an exact per-expert checksum of the weights in small all-reduces, so that weights that
        differ between ranks (e.g. drawn with another seed on each) raise instead of giving wrong
        outputs, and a rank whose weights are refused makes every rank raise instead of leaving
        them waiting later.

        Args:
            router_weight: ``[E, H]``; w13: ``[E, 2F, H]`` (gate rows, then up); w2: ``[E, H, F]``.
            verify: compare the weights across the expert-parallel ranks (one pass over them and one
                all-reduce of ``6E + 2 + R`` integers over the expert-parallel group: the max and minus
                the min of ``3E`` fingerprints and of the weights' dtype, and one refusal flag per
                rank; a second one over ``edp`` where the groups have one; ``False`` skips it).

        Raises:
            TypeError: ``verify`` is not a bool; a weight is not a tensor, or has the wrong dtype or
                device; or one of the
                layer's weights is computed from other parameters (``torch.nn.utils.parametrize``,
                ``weight_norm``, ``prune``), which a copy into it would not reach: load first.
            ValueError: a weight has the wrong shape; with ``verify``, the weights differ between
                ranks, or another rank's were refused (nothing is loaded on any rank then).
        """
        if not isinstance(verify, bool):  # a config's string "no" would be truthy
            raise TypeError(f"verify must be a bool, got {verify!r}")
        cfg = self.config
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.ffn_hidden_size
        dev = self.router.weight.device
        weights = (("router_weight", router_weight, (e, h)), ("w13", w13, (e, 2 * f, h)), ("w2", w2, (e, h, f)))
        refused = None
        try:
            check_own_weights(self, "load_full_weights")
            for name, t, shape in weights:
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
                if tuple(t.shape) != shape:
                    raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
                if t.dtype != cfg.params_dtype:
                    raise TypeError(f"{name} has dtype {t.dtype}, the layer's params_dtype is {cfg.params_dtype}: "
                                    f"cast it first")
                if t.device != dev:
                    hint = ("the layer has no storage yet: call layer.to_empty(device=...) first" if dev.type == "meta"
                            else "move it first")
                    raise TypeError(f"{name} is on {t.device}, the layer is on {dev}: {hint}")
        except (TypeError, ValueError) as exc:
            if not verify or (self.groups.ep is None and self.groups.edp is None):
                raise
            refused = exc
        if verify and (self.groups.ep is not None or self.groups.edp is not None):
            self._agree_on_weights([t for _, t, _ in weights], refused)
        self.router.weight.copy_(_like(self.router.weight, router_weight.detach()))
        self.experts.load_full(w13, w2, self.placement, self.groups.ep_rank)

    def _agree_on_weights(self, weights: list[torch.Tensor], refused: Exception | None) -> None:
        """A ``MAX`` all-reduce over the EP group, then over the ``edp`` group (the other groups'
        copies of these experts; the two span the world), of ``[E]`` exact fingerprints per weight
        (each expert's bits, order-sensitive: :func:`~moelayers.dispatch.comm.fingerprint`) and a
        refusal flag per expert-parallel rank; raises on every rank when any rank refused its
        weights (``refused`` itself on that rank) or the fingerprints differ."""
        from moelayers.config import PARAMS_DTYPES

        e, r, dev = self.config.num_experts, self.groups.ep_size, self.router.weight.device
        flags = torch.zeros(r, dtype=torch.int64, device=dev)
        flags[self.groups.ep_rank] = int(refused is not None)
        if refused is None:
            sums = torch.stack([fingerprint(t.contiguous().view(_SAME_SIZE_INT[t.element_size()]).reshape(e, -1))
                                for t in weights]).flatten() >> 1  # [3E]; halved: the negation cannot overflow
            dtype = PARAMS_DTYPES.index(self.experts.w13.dtype)
            sums = torch.cat([sums, torch.tensor([dtype], dtype=torch.int64, device=dev)])
            vec = torch.cat([sums, -sums, flags])  # MAX gives the max and -min of every fingerprint (and dtype)
        else:  # a refused rank's checksums count for nothing in MAX
            lowest = torch.iinfo(torch.int64).min + 1
            vec = torch.cat([torch.full((6 * e + 2,), lowest, dtype=torch.int64, device=dev), flags])
        for group in (self.groups.ep, self.groups.edp):  # (edp: groups of one copy each were checked alone)
            if group is not None:
                dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
        n = 3 * e + 1
        high, low, bad = vec[:n], -vec[n:2 * n], vec[2 * n:]
        if refused is not None:
            raise refused
        bad_ranks = torch.nonzero(bad).flatten().tolist()
        if bad_ranks:
            raise ValueError(f"load_full_weights refused the weights of expert-parallel rank(s) {bad_ranks} (of this "
                             f"or another expert-parallel group; see their error); nothing was loaded on this rank "
                             f"{self.groups.rank} either")
        if int(high[-1]) != int(low[-1]):
            raise ValueError(f"load_full_weights: the expert-parallel ranks hold the layer in different dtypes (this "
                             f"rank {self.groups.ep_rank}: {self.experts.w13.dtype}): cast the layer alike on every "
                             "rank (the same params_dtype, or .to(dtype) on all of them); nothing was loaded")
        high, low = high[:-1], low[:-1]
        differ = (high != low).view(3, e).cpu()
        if differ.any():
            named = ", ".join(f"{name} of {_some(torch.nonzero(row).flatten().tolist(), 'expert')}"
                              for name, row in zip(("router_weight", "w13", "w2"), differ) if row.any())
            raise ValueError(f"load_full_weights: the weights differ between ranks of the layer ({named}; within "
                             f"or across expert-parallel groups): "
                             f"load the same logical weights on every rank (e.g. the same checkpoint or seed), "
                             f"or pass verify=False to skip this check")

    @torch.no_grad()
    def check_weights(self) -> None:
        """Check that every copy of a weight is the same: each expert's replicas (on this rank and
        the others, in every expert-parallel group) and the router on every expert-parallel rank and
        its ``edp`` copies (a router sharded by FSDP is not compared).

        A collective over ``groups.ep`` and ``groups.edp``: one pass over the weights and an
        all-reduce of ``6E`` integers (exact fingerprints of each copy's bits). The layer's own
        init, :meth:`load_full_weights` and the backward (which sums the replicas' gradients) keep
        copies equal; a custom init through ``Module.apply`` draws each slot on each rank on its own.

        Raises:
            ValueError: on every rank, naming the experts whose copies differ (init the weights of a
                dense model and :meth:`load_full_weights` them instead, or :meth:`reset_parameters`).
        """
        # copies of other dtypes: told as such, not as other bits (both groups reduced before any rank decides)
        agree_on_dtypes((self.experts.w13, self.experts.w2), self.groups.ep, self.groups.edp)
        e, dev = self.config.num_experts, self.router.weight.device
        lowest = torch.iinfo(torch.int64).min + 1
        ids = self.placement.phy2log[self.groups.ep_rank].to(dev)
        held = ids >= 0
        high = torch.full((3, e), lowest, dtype=torch.int64, device=dev)
        neg_low = high.clone()
        weights = [self.experts.w13, self.experts.w2]
        router = self.router.weight
        if _is_dtensor(router):  # sharded by FSDP: no copies to compare (the row agrees by construction)
            high[2], neg_low[2] = 0, 0
        else:
            weights.append(router)
        for row, w in enumerate(weights):
            rows = w.detach().contiguous().view(_SAME_SIZE_INT[w.element_size()])
            prints = fingerprint(rows.reshape(rows.shape[0], -1)) >> 1  # halved: the negation cannot overflow
            where = torch.arange(e, device=dev) if w is router else ids[held]
            prints = prints if w is router else prints[held]
            high[row].scatter_reduce_(0, where, prints, "amax")
            neg_low[row].scatter_reduce_(0, where, -prints, "amax")
        vec = torch.cat([high.flatten(), neg_low.flatten()])
        for group in (self.groups.ep, self.groups.edp):
            if group is not None:
                dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
        differ = (vec[:3 * e] != -vec[3 * e:]).view(3, e).cpu()
        if differ.any():
            named = ", ".join(f"{name} of {_some(torch.nonzero(row).flatten().tolist(), 'expert')}"
                              for name, row in zip(("w13", "w2", "router_weight"), differ) if row.any())
            raise ValueError(f"{type(self).__name__}: copies of the same weights differ ({named}; an expert's "
                             "replicas, or the router, across ranks): initialise a dense model's weights and "
                             "load_full_weights them (the same on every rank), or reset_parameters(); a custom init "
                             "through Module.apply draws each slot on each rank on its own")

    # ------------------------------------------------------------------ module protocol
    def _apply(self, fn, recurse: bool = True):
        """``.to(dtype)`` / ``.half()`` / ``.bfloat16()`` / ``.double()`` after construction: the layer
        computes in its weights' new dtype (``config.params_dtype`` follows; a captured CUDA graph,
        recorded for the old dtype, is dropped)."""
        from moelayers.config import PARAMS_DTYPES

        weight = self._router_parameter()
        target = fn(torch.empty(0, dtype=weight.dtype, device=weight.device)).dtype  # before anything is cast
        if target not in PARAMS_DTYPES:
            raise TypeError(f"{type(self).__name__} computes in one of {[str(d) for d in PARAMS_DTYPES]}, "
                            f"not {target}: the layer was left as it was")
        try:  # before the router is cast: the experts' own check would leave the layer half cast
            self.experts.check_dtype(target)
        except ValueError as exc:
            raise TypeError(f"{exc}; the layer was left as it was") from None
        storage = [(p.device, p.data_ptr()) for p in self.parameters()]

        def keep_integers(t: torch.Tensor) -> torch.Tensor:  # Module.type(dtype) casts every tensor: the integer
            out = fn(t)                                      # buffers (loads, placement records) keep their
            if t.is_floating_point() or out.dtype == t.dtype:  # values (a round trip through bf16 rounds them)
                return out
            return t.to(device=out.device)

        out = super()._apply(keep_integers, recurse)
        dtype = self._router_parameter().dtype
        if dtype != self.config.params_dtype:
            self.config = self.config.replace(params_dtype=dtype)
            self.router.config = self.config
        if storage != [(p.device, p.data_ptr()) for p in self.parameters()]:
            self._new_storage()  # another dtype, .cpu() / .cuda(), to_empty() of a meta-built layer
        return out

    def _router_parameter(self) -> nn.Parameter:
        """The router's weight as a parameter: the one it computes from where a parametrization or
        ``prune`` made ``router.weight`` a computed (and, with prune, until the next forward stale) tensor."""
        return next(self.router.parameters())

    def _new_storage(self) -> None:
        """The parameters got new tensors: drop a captured graph (it reads the old ones), rebuild the
        replica tie on their device and give buffers still on the meta device (a layer built under
        ``torch.device("meta")`` and loaded with ``assign=True``) real zeros beside the weights."""
        self.release_graphs()
        self.experts.tie_replicas(self.placement, self.groups.ep_rank, self.groups.ep)
        device = self.router.weight.device
        if device.type != "meta":
            for module in self.modules():
                for name, buf in module._buffers.items():
                    if buf is not None and buf.is_meta:
                        module._buffers[name] = torch.zeros_like(buf, device=device)

    #: attributes a deep copy starts afresh (factories) instead of copying: a captured CUDA graph, a lock
    _fresh_on_copy: dict[str, Callable[[], Any]] = {"_graphed": dict, "graph_pool": lambda: None, "_own_pool": lambda: None,
                                                    "_forced_for_recompute": ForcedForRecompute,
                                                    "_graphs": InFlightGraphs,
                                                    "_reduced_grads": dict,
                                                    "_turn": lambda: None,  # (made on first use: turns.py)
                                                    # a copy has not trained (a frozen reference model's moves
                                                    # do not warn about optimizer state): see apply_placement
                                                    "_trained": lambda: False,
                                                    "_warned_moments": lambda: False}

    @torch.inference_mode(False)  # a copy made in a rollout takes weights in place later, as a layer built there
    def __deepcopy__(self, memo: dict) -> "MoELayerBase":
        """A copy with its own weights and state that shares the process groups (handles, which
        cannot be copied; the dispatcher and the replica ties hold them too) and drops a captured
        CUDA graph (the copy captures its own). Its tensors are normal ones, also when copied under
        ``torch.inference_mode()`` (inference tensors could not be updated in place outside it)."""
        for group in (self.groups.ep, self.groups.tp, self.groups.dp, self.groups.edp):  # (edp: its own group
            if group is not None:                                                      # when ep < world)
                memo[id(group)] = group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            fresh = self._fresh_on_copy.get(key)
            new.__dict__[key] = fresh() if fresh is not None else copy.deepcopy(value, memo)
        for old_p, new_p in zip(self.parameters(), new.parameters()):  # torch copies a Parameter without its
            for name, value in vars(old_p).items():                  # attributes (allreduce, sequence_parallel)
                if name not in _GRAD_BUFFERS and not hasattr(new_p, name):
                    setattr(new_p, name, copy.deepcopy(value, memo))
        return new

    def __getstate__(self) -> dict:
        """What pickling (``torch.save(model)``) keeps: the layer without a captured CUDA graph or
        other per-process state (``_fresh_on_copy``).

        Raises:
            TypeError: the layer runs over process groups, which are handles of this process: save
                its ``state_dict()`` (every rank its own file) and build the layer again to load it.
        """
        if any(g is not None for g in (self.groups.ep, self.groups.tp, self.groups.dp)):
            raise TypeError(f"a {type(self).__name__} over process groups cannot be pickled (torch.save of a whole "
                            "model): the groups are handles of this process. Save model.state_dict() on every "
                            "rank and load it into a model built again")
        state = self.__dict__.copy()
        for key, fresh in self._fresh_on_copy.items():
            if key in state:
                state[key] = fresh()
        return state

    @one_at_a_time  # (the weights and set_extra_state's placement together)
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """A load that holds some but not all of this layer's keys, or whose weights do not fit this
        layer's shapes, fails before anything of the layer is loaded: the placement (extra state)
        and the expert weights go together, and adopting one without the other would leave a layer
        that serves wrong outputs if the error is caught. A load with none of those keys (``strict=False``
        on a partial checkpoint) leaves them as they are; torch lists the keys as missing. The router's
        weight (logical order, whatever the placement) loads or is missing on its own, as any module's.
        (torch passes ``strict=True`` here whatever the caller asked, so the keys decide.) The keys of a
        replica policy that is an ``nn.Module`` are the policy's own: torch loads them as any submodule's."""
        own = {k: v for k, v in self.state_dict(keep_vars=True).items() if not k.startswith("replica_policy.")}
        placed = [k for k in own if not k.startswith("router.")]  # the placement and the weights laid out in it
        lacking = [prefix + k for k in placed if prefix + k not in state_dict]
        if lacking and len(lacking) < len(placed):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: missing key(s) "
                               f"{lacking}; nothing of this MoE layer was loaded (its expert weights are laid out "
                               f"in the checkpoint's placement, which comes with them)")
        misfit = [f"{prefix + k}: {list(state_dict[prefix + k].shape)} in the checkpoint, {list(v.shape)} here"
                  for k, v in own.items() if isinstance(v, torch.Tensor) and isinstance(state_dict.get(prefix + k),
                                                                                       torch.Tensor)
                  and state_dict[prefix + k].shape != v.shape]
        if misfit:  # torch would load the placement (extra state) first and raise about the sizes at the end
            if prefix + "_extra_state" in state_dict:  # the reason in the placement's terms, where it has one
                with self._naming_the_layer(prefix):
                    self._saved_placement(state_dict[prefix + "_extra_state"])
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: size mismatch for "
                               f"{'; '.join(misfit)}; nothing of this MoE layer was loaded")
        if local_metadata.get("assign_to_params_buffers", False):  # the checkpoint's tensors become the weights
            self._check_assigned_dtypes([state_dict[prefix + k] for k, v in own.items()
                                         if isinstance(v, nn.Parameter) and prefix + k in state_dict])
        # load_state_dict(assign=True) puts the checkpoint's tensors in place of the parameters: their
        # flags (allreduce, sequence_parallel) are put back, and the dtype followed, in _after_load
        self._flags_before_load = {name: (p.data_ptr(), dict(vars(p))) for name, p in self.named_parameters()}
        with self._naming_the_layer(prefix):  # (set_extra_state's refusal: which of the model's layers)
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)

    @contextlib.contextmanager
    def _naming_the_layer(self, prefix: str) -> Iterator[None]:
        """A checkpoint's placement refused while loading names the layer (its key prefix in the model
        and :meth:`_label`): torch raises ``set_extra_state``'s errors as they are."""
        try:
            yield
        except (ValueError, TypeError) as exc:
            where = f"{prefix.rstrip('.')} ({self._label()})" if prefix else self._label()
            try:
                named = type(exc)(f"{where}: {exc}")  # (the same class where it takes a message alone)
            except Exception:  # noqa: BLE001 - a class of other arguments: told as its base
                named = (ValueError if isinstance(exc, ValueError) else TypeError)(f"{where}: {exc}")
            raise named from exc

    def _check_assigned_dtypes(self, tensors: list[torch.Tensor]) -> None:
        """``load_state_dict(assign=True)`` makes ``tensors`` the parameters: one dtype the layer can
        compute in, or a ``TypeError`` before anything is loaded."""
        from moelayers.config import PARAMS_DTYPES

        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1 or not dtypes <= set(PARAMS_DTYPES):
            raise TypeError(f"{type(self).__name__}: load_state_dict(assign=True) would give the parameters dtypes "
                            f"{sorted(map(str, dtypes))}; the layer computes in one of "
                            f"{[str(d) for d in PARAMS_DTYPES]}, the same for all: nothing of this MoE layer was loaded")
        if dtypes:
            try:
                self.experts.check_dtype(next(iter(dtypes)))
            except ValueError as exc:
                raise TypeError(f"{exc}; nothing of this MoE layer was loaded") from None

    def _after_load(self, incompatible_keys: Any) -> None:
        """After ``load_state_dict``: parameters replaced by ``assign=True`` get their flags back;
        the layer computes in their dtype (``config.params_dtype`` follows, as after ``.to(dtype)``)
        and drops what referred to the old tensors (:meth:`_new_storage`)."""
        before, self._flags_before_load = self._flags_before_load, {}
        replaced = False
        for name, p in self.named_parameters():
            if name not in before:
                continue
            ptr, flags = before[name]
            replaced |= p.data_ptr() != ptr
            for key, value in flags.items():
                if key not in _GRAD_BUFFERS and not hasattr(p, key):
                    setattr(p, key, value)
        dtype = self.router.weight.dtype  # one for all: _check_assigned_dtypes refused the rest up front
        if dtype != self.config.params_dtype:
            self.config = self.config.replace(params_dtype=dtype)
            self.router.config = self.config
        if replaced:
            self._new_storage()

    def get_extra_state(self) -> torch.Tensor:
        """What ``state_dict()`` saves beside the weights: the placement, since ``experts.w13`` /
        ``experts.w2`` hold one row per *slot* of it (a moved or re-planned layer's rows would load
        into another expert's slot of a freshly built layer), and the expert-parallel rank that
        holds those slots: :func:`placement_record`, one int64 tensor.

        A tensor, like the weights: a snapshot that clones the state dict's tensors
        (``{k: v.clone() ...}``) clones it with them (a nested dict would keep the live placement,
        which a later move changes under the cloned weights), and, like the weights of a ``state_dict()``
        (views of the live parameters), the live record follows the layer: a move commits the
        weights in place and updates it in place, so a state dict taken before the move pairs the
        new weights with the new placement."""
        return self._placement_rec

    def set_extra_state(self, state: Any) -> None:
        """Adopt the placement a checkpoint was saved in (``load_state_dict`` calls it with the
        weights; every expert-parallel rank loads its own file of the same moment). Reads the
        records of :func:`read_placement_record` (both formats).

        Raises:
            ValueError: ``state`` is not a saved placement, or one this layer cannot take (other
                experts, ranks or slots per rank).
        """
        try:
            saved = self._saved_placement(state)
        except BaseException:
            # a loader that reads in place into the tensors of a state dict (torch.distributed.checkpoint)
            # may have written another rank's record into the live one: it describes this layer again
            self._placement_rec.copy_(placement_record(self.placement, self.groups.ep_rank))
            raise
        self._placement_unchecked = True  # the other ranks may have loaded another placement's checkpoint
        if saved != self.placement:
            self._adopt_placement(saved)

    def _saved_placement(self, state: Any) -> ExpertPlacement:
        """The placement of a checkpoint's extra state, checked for this layer (``set_extra_state``)."""
        phy2log, num_experts, ep_rank = read_placement_record(state)
        if phy2log.dim() == 2 and phy2log.shape[0] != self.groups.ep_size:  # before the rank: the cause
            raise ValueError(f"this checkpoint was saved at expert-parallel size {phy2log.shape[0]}, this "
                             f"layer's group has {self.groups.ep_size} rank(s): a layer's state_dict() holds one rank's "
                             "expert slots and loads at the same size only; to change it, save and load the experts "
                             "by id (moelayers.checkpoint, or export_full_weights / load_full_weights)")
        if ep_rank is not None and ep_rank != self.groups.ep_rank:  # (older checkpoints lack it)
            raise ValueError(f"this checkpoint holds the expert slots of expert-parallel rank {ep_rank}, "
                             f"this layer is rank {self.groups.ep_rank}: every rank loads the file its own rank "
                             "saved. (A checkpointer that writes one copy of the keys all ranks share, such as "
                             "torch.distributed.checkpoint of model.state_dict(), kept one rank's experts only: save "
                             "moelayers.checkpoint.model_state_dict(model) with it)")
        try:
            saved = ExpertPlacement(phy2log, num_experts)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"the checkpoint's placement: {exc}") from exc
        if saved != self.placement:
            try:
                self._check_placement(saved, self.config, self.groups)
            except ValueError as exc:
                raise ValueError(f"the checkpoint's {exc}") from exc
            if saved.slots_per_rank != self.placement.slots_per_rank:
                raise ValueError(f"the checkpoint's placement has {saved.slots_per_rank} slots per rank, this layer "
                                 f"{self.placement.slots_per_rank}: build it with placement= of that shape")
        return saved

    def export_full_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(router_weight [E, H], w13 [E, 2F, H], w2 [E, H, F])`` gathered over the EP group: plain
        tensors, the same on every rank (a collective: every expert-parallel rank calls it; a router
        sharded by FSDP's ``fully_shard`` is gathered over FSDP's mesh too)."""
        w13, w2 = gather_logical(self.experts.w13, self.experts.w2, self.placement, self.groups.ep)
        router = self.router.weight.detach()
        return (router.full_tensor() if _is_dtensor(router) else router).clone(), w13, w2  # (full_tensor() may
        # return the parameter's own shard when there is nothing to gather)

    def expert_grads_full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of the logical experts ``([E, 2F, H], [E, H, F])``, gathered over the EP group
        (a collective). Every replica of an expert holds its whole gradient: the backward sums the
        replicas' shares into each of them, so a plain optimizer step keeps the replicas equal.

        A weight's gradient is its ``.grad``, else its ``main_grad`` (where megatron-core's
        ``DistributedDataParallel`` accumulates it, in its own dtype), else zeros (no backward
        since the gradients were cleared). They are this rank's, as the backward left them: not
        averaged over data-parallel copies unless that already happened.

        Raises:
            TypeError: the expert weights are computed from other parameters (a parametrization),
                whose gradients these are not."""
        check_own_weights(self, "expert_grads_full", ("experts.w13", "experts.w2"))

        def grad_of(w: torch.Tensor) -> torch.Tensor:
            if w.grad is not None:
                return w.grad
            main = getattr(w, "main_grad", None)
            return main.view(w.shape) if main is not None else torch.zeros_like(w)

        return gather_logical(grad_of(self.experts.w13), grad_of(self.experts.w2), self.placement, self.groups.ep)
