"""`ParallelGroups`: the process groups an MoE layer talks over.

The world is ``dp x tp``; TP groups are consecutive ranks; the expert-parallel group spans the
world unless told otherwise (consecutive blocks of ``ep`` ranks; then the ranks at the same place
of every block hold the same experts while the blocks serve the same placement: the
expert-data-parallel group ``edp``). Works on gloo and NCCL alike.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for a single process


def collective_device(group: ProcessGroup) -> torch.device:
    """The device a collective over ``group`` takes its tensors on: the current CUDA device for an
    NCCL group, else the CPU (gloo; ``None``, a group of one process)."""
    return backend_device(dist.get_backend(group) if group is not None else None)


def backend_device(backend: str | None) -> torch.device:
    """The current CUDA device for a backend with NCCL (``"nccl"``, or ``"cpu:gloo,cuda:nccl"``),
    else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend) else torch.device("cpu")


@dataclass(frozen=True)
class ParallelGroups:
    """Expert-parallel (``ep``), tensor-parallel (``tp``) and data-parallel (``dp``) groups.

    A ``None`` group means a group of one process (this rank alone); collectives are skipped.
    ``backend`` is the default process group's backend when the groups were built over it
    (:meth:`from_world`), so that a layer on a world of one NCCL rank, whose groups are all
    ``None``, still defaults to the GPU; ``None`` otherwise (:meth:`single`: CPU by default).

    ``edp`` (expert data parallel): with expert-parallel groups smaller than the world, the ranks
    that hold the same experts, one from each expert-parallel group (``world_size // ep_size``
    ranks); ``None`` when the expert-parallel group is the world, or when not known
    (:meth:`from_groups` without it, :meth:`from_megatron`: megatron's DDP reduces the expert
    gradients itself). :func:`moelayers.reduce_expert_grads` uses it under torch DDP.
    """

    ep: ProcessGroup
    tp: ProcessGroup
    dp: ProcessGroup
    ep_size: int
    ep_rank: int
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    world_size: int
    rank: int
    backend: str | None = None
    edp: ProcessGroup = None

    def __post_init__(self) -> None:
        """Check that sizes, ranks and groups agree (a mismatch would only show up later, as a
        wrong result or an ``IndexError`` deep in a layer).

        Raises:
            ValueError: a size is not a positive int or a rank is not in ``[0, size)``; a size > 1
                without its group (``None`` means a group of one); a group whose size or this
                rank's position in it differs from the declared one; ``ep_size`` or ``tp_size``
                not dividing ``world_size``.
        """
        for size_name, rank_name in (("ep_size", "ep_rank"), ("tp_size", "tp_rank"), ("dp_size", "dp_rank"),
                                     ("world_size", "rank")):
            size, rank = getattr(self, size_name), getattr(self, rank_name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"ParallelGroups.{size_name} must be a positive int, got {size!r}")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
                raise ValueError(f"ParallelGroups.{rank_name} must be an int in [0, {size_name}={size}), got {rank!r}")
        for name in ("ep", "tp", "dp"):
            group, size, rank = getattr(self, name), getattr(self, f"{name}_size"), getattr(self, f"{name}_rank")
            if group is None:
                if size != 1:
                    raise ValueError(f"ParallelGroups.{name} is None (a group of one) but {name}_size={size}: "
                                     f"pass the {name} process group, or build with from_world() / from_megatron()")
                continue
            if not dist.is_available() or not dist.is_initialized():
                raise ValueError(f"ParallelGroups.{name} is a process group but torch.distributed is not initialised")
            actual_size, actual_rank = dist.get_world_size(group), dist.get_rank(group)
            if (actual_size, actual_rank) != (size, rank):
                raise ValueError(f"ParallelGroups.{name} has {actual_size} ranks and this process is its rank "
                                 f"{actual_rank}, but {name}_size={size}, {name}_rank={rank}")
        if self.backend is not None and not isinstance(self.backend, str):
            raise ValueError(f"ParallelGroups.backend must be a backend name or None, got {self.backend!r}")
        if self.edp is not None:
            if not dist.is_available() or not dist.is_initialized():
                raise ValueError("ParallelGroups.edp is a process group but torch.distributed is not initialised")
            if dist.get_world_size(self.edp) * self.ep_size != self.world_size:
                raise ValueError(f"ParallelGroups.edp has {dist.get_world_size(self.edp)} ranks; expected world_size "
                                 f"// ep_size = {self.world_size // self.ep_size} (one from each expert-parallel group)")
        for name in ("ep", "tp"):
            if self.world_size % getattr(self, f"{name}_size"):
                raise ValueError(f"ParallelGroups.{name}_size={getattr(self, f'{name}_size')} does not divide "
                                 f"world_size={self.world_size}")

    def __deepcopy__(self, memo: dict) -> "ParallelGroups":
        """Itself: frozen, and its process groups are handles a copy of a model shares (they cannot
        be copied)."""
        return self

    @classmethod
    def single(cls) -> "ParallelGroups":
        """One process: no collectives at all."""
        return cls(None, None, None, 1, 0, 1, 0, 1, 0, 1, 0)

    @classmethod
    def from_world(cls, ep: int | None = None, tp: int = 1) -> "ParallelGroups":
        """Groups over the initialised default process group.

        Args:
            ep: expert-parallel size; default the whole world. Must divide the world size.
            tp: tensor-parallel size (consecutive ranks). Must divide the world size.

        Every rank must call this with the same arguments: it checks that they agree (an all-reduce:
        with NCCL, set this rank's CUDA device first) and creates the groups collectively.

        Raises:
            TypeError: a size that is not an integer (numpy integers are taken).
            ValueError: if torch.distributed is not initialised, the sizes do not fit the world or
                differ between the ranks (on every rank; a rank whose own sizes are refused raises
                that error, the others this one).
        """
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "ParallelGroups.from_world needs torch.distributed initialised "
                "(init_process_group); use ParallelGroups.single() for one process"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        ep = world if ep is None else ep
        sizes, refused = {}, None
        try:
            for name, size in (("ep", ep), ("tp", tp)):
                if isinstance(size, (bool, np.bool_)) or not isinstance(size, numbers.Integral):
                    raise TypeError(f"{name} must be an int, got {size!r}")
                sizes[name] = int(size)  # (numpy integers too)
                if sizes[name] < 1 or world % sizes[name]:
                    raise ValueError(f"{name}={sizes[name]} does not divide the world size {world}")
        except (TypeError, ValueError) as exc:
            refused = exc
        # every rank's sizes, before any group is made: a rank asking for others made other groups (a
        # hang, or a first forward failing on some ranks only), and one refusing alone left the others waiting
        mine = [0, 0, 0, 0] if refused else [sizes["ep"], sizes["tp"], -sizes["ep"], -sizes["tp"]]
        agreed = torch.tensor(mine, dtype=torch.int64, device=backend_device(dist.get_backend()))
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # the smallest sizes and the largest ones
        if refused is not None:
            raise refused
        if agreed.tolist() != mine:
            raise ValueError(f"ParallelGroups.from_world: the ranks asked for different sizes or one refused its own "
                             f"(this rank: ep={sizes['ep']}, tp={sizes['tp']}; over the ranks ep "
                             f"{agreed[0]}..{-agreed[2]}, tp {agreed[1]}..{-agreed[3]}): every rank must pass the "
                             "same ep and tp")
        ep, tp = sizes["ep"], sizes["tp"]
        dp = world // tp
        ep_group = _blocks(world, ep)
        tp_group = _blocks(world, tp)
        dp_group = _strided(world, tp)
        edp_group = _strided(world, ep)  # the same place in every expert-parallel block: the same experts
        return cls(
            ep=ep_group, tp=tp_group, dp=dp_group,
            ep_size=ep, ep_rank=rank % ep,
            tp_size=tp, tp_rank=rank % tp,
            dp_size=dp, dp_rank=rank // tp,
            world_size=world, rank=rank, backend=str(dist.get_backend()), edp=edp_group,
        )

    @classmethod
    def from_groups(cls, ep: ProcessGroup, tp: ProcessGroup = None, dp: ProcessGroup = None,
                    edp: ProcessGroup = None) -> "ParallelGroups":
        """Wrap existing process groups (any may be ``None`` for a group of one; ``edp``: see the class).

        Raises:
            ValueError: the ``ep`` or ``tp`` group's size does not divide the world size.
        """
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0

        def size_rank(g: ProcessGroup) -> tuple[int, int]:
            if g is None:
                return 1, 0
            return dist.get_world_size(g), dist.get_rank(g)

        (es, er), (ts, tr), (ds, dr) = size_rank(ep), size_rank(tp), size_rank(dp)
        if world % es or world % ts:
            raise ValueError(f"group sizes ep={es}, tp={ts} do not divide the world size {world}")
        return cls(ep, tp, dp, es, er, ts, tr, ds, dr, world, rank, edp=edp)

    @classmethod
    def from_megatron(cls, pg_collection: Any = None) -> "ParallelGroups":
        """Groups from megatron-core: a ``ProcessGroupCollection`` if given (megatron-core >= 0.19
        passes one to builders), else ``megatron.core.parallel_state``'s initialised groups.

        Raises:
            ImportError: megatron-core is missing (without ``pg_collection``).
            ValueError: ``parallel_state`` is not initialised; group sizes that do not divide the
                world (:meth:`from_groups`).
        """
        if pg_collection is not None:
            ep = getattr(pg_collection, "ep", None)
            tp = getattr(pg_collection, "tp", None)
            dp = getattr(pg_collection, "dp", None)
            return cls.from_groups(ep, tp, dp)
        try:
            from megatron.core import parallel_state as ps
        except ImportError as e:  # pragma: no cover - megatron-core is a dependency
            raise ImportError("ParallelGroups.from_megatron needs megatron-core: pip install megatron-core") from e
        if not ps.model_parallel_is_initialized():
            raise ValueError("megatron-core parallel_state is not initialised (initialize_model_parallel)")
        return cls.from_groups(
            ps.get_expert_model_parallel_group(),
            ps.get_tensor_model_parallel_group(),
            ps.get_data_parallel_group(),
        )


def _make_groups(rank_lists: list[list[int]]) -> ProcessGroup:
    """Create every group collectively; return the one holding this rank."""
    me, mine = dist.get_rank(), None
    world = dist.get_world_size()
    for ranks in rank_lists:
        if len(ranks) == world:
            group = dist.group.WORLD
        else:
            group = dist.new_group(ranks)
        if me in ranks:
            mine = group
    return mine


def _blocks(world: int, size: int) -> ProcessGroup:
    if size == 1:
        return None
    return _make_groups([list(range(s, s + size)) for s in range(0, world, size)])


def _strided(world: int, stride: int) -> ProcessGroup:
    if world // stride == 1:
        return None
    return _make_groups([list(range(s, world, stride)) for s in range(stride)])
