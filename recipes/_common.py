"""Shared helpers of the Hydra recipes: launching ranks, devices, settings, overrides, tables (the
run dir's helpers are in ``recipes/_outputs.py``).

``launch(cfg, fn)`` runs ``fn(rank, world, cfg_dict)`` on every rank:

- under ``torchrun`` (``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` set) it initialises the default process
  group (NCCL when CUDA is available and ``parallel.backend`` is ``auto`` or ``nccl``, else gloo) and
  calls ``fn`` in this process, returning its result;
- otherwise it spawns ``cfg.parallel.world_size`` processes (gloo on CPU by default) with
  :func:`moelayers.testing.run_distributed` and returns rank 0's result.

``cfg_dict`` is the resolved config as plain containers, plus ``run_dir`` (the Hydra output dir,
where rank 0 writes its files). ``fn`` must be defined at module level (it is pickled by name).
"""

from __future__ import annotations

import datetime
import errno
import importlib
import inspect
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from recipes._outputs import mark_launched, pipe_safe_output, run_dir, under_torchrun

__all__ = [
    "launch", "resolve_backend", "device_for", "invocation", "to_dict", "print_table", "print_grid",
    "percentile", "provenance", "absolute_path", "EXECUTION_KWARGS", "shared_execution_kwargs", "flag",
    "normalize_flags", "LAYER_FLAGS", "int_setting", "check_layer_settings", "timeout_setting",
    "import_object", "plan_fraction_setting", "capacity_setting", "capacity_bound", "check_input_file", "not_a_file", "refuse_empty_paths", "PATH_KEYS",
    "refuse_unread_overrides", "unread_overrides", "layer_objects", "OBJECT_KWARGS", "require_keys",
]

#: Layer kwargs that say *how* a layer executes rather than *what* it is: a comparison gives the
#: baseline ours' values, so that only the layer differs (dispatcher, de-duplication, NaN check,
#: expert GEMM backend, capacity, CUDA graph and what runs beyond the capacity: fixed buffers or an
#: exact exchange; bench.py refuses capacity and cuda_graph in layer.kwargs and sets them itself).
EXECUTION_KWARGS = ("dispatcher", "dedup", "check_finite", "expert_backend", "capacity", "cuda_graph",
                    "beyond_capacity")


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def _recipe_doc() -> str:
    """The running recipe's docstring: ``--help`` shows it above Hydra's config listing (the primary
    configs set ``hydra.help.header: ${recipe_doc:}``)."""
    doc = getattr(sys.modules.get("__main__"), "__doc__", None)
    # Hydra fills the help template with string.Template: a "$" of the docstring must be "$$"
    return (doc or "A moelayers recipe (recipes/).").strip().replace("$", "$$") + "\n"


def _recipe_groups() -> str:
    """``--help``'s list of the config groups the running recipe reads (its ``CONFIG_GROUPS``; all
    of ``conf/`` for a recipe without one), each with its options, one per line."""
    groups = getattr(sys.modules.get("__main__"), "CONFIG_GROUPS", None)
    if groups is None:
        groups = sorted(n for n in os.listdir(CONF_DIR) if os.path.isdir(os.path.join(CONF_DIR, n)))
    lines = []
    for group in sorted(groups):
        lines.append(f"{group}: {', '.join(app_options(group))}")
    return "\n".join(lines).replace("$", "$$")


def config_dirs() -> list[str]:
    """The folders of this run's config search path, in Hydra's order: conf/, a user's
    ``--config-dir`` and ``hydra.searchpath`` folders (``file://`` ones; the sources Hydra composed
    this run from, or, before that, e.g. for ``--help``, its search path); conf/ alone outside a
    Hydra app."""
    found: list[str] = []
    start = os.getcwd()
    try:
        from hydra.core.hydra_config import HydraConfig

        runtime = HydraConfig.get().runtime
        start = str(runtime.cwd)  # a relative folder is Hydra's from where the run started (hydra.job.chdir)
        found = [str(src.path) for src in runtime.config_sources if src.schema == "file"]
    except Exception:  # (no job yet: --help) the app's search path
        try:
            from hydra.core.global_hydra import GlobalHydra

            if GlobalHydra.instance().is_initialized():
                for entry in GlobalHydra.instance().config_loader().get_search_path().get_path():
                    path = str(entry.path)
                    if path.startswith("file://"):
                        found.append(path[len("file://"):])
                    elif "://" not in path:
                        found.append(path)
        except Exception:  # (a Hydra without these: conf/ alone)
            pass
    dirs: list[str] = []
    seen: set[str] = set()
    for path in [*found, CONF_DIR]:
        path = path if os.path.isabs(path) else os.path.join(start, path)
        if os.path.isdir(path) and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            dirs.append(path)
    return dirs


def app_options(group: str) -> list[str]:
    """The options of config ``group`` this run can select: conf/'s and those of a user's config
    folders (:func:`config_dirs`), sorted."""
    return sorted({n[:-5] for d in config_dirs() if os.path.isdir(os.path.join(d, group))
                   for n in os.listdir(os.path.join(d, group)) if n.endswith(".yaml")})


def app_groups() -> set[str]:
    """The top-level config groups of this run's config folders (:func:`config_dirs`)."""
    return {n for d in config_dirs() for n in os.listdir(d) if os.path.isdir(os.path.join(d, n)) and n != "hydra"}


def group_option(group: str, name: str) -> dict | None:
    """The unresolved content of option ``name`` of config ``group`` as a dict, from the first of
    :func:`config_dirs` that has it (a user's option too); ``None`` where none has it."""
    for folder in config_dirs():
        path = os.path.join(folder, group, f"{name}.yaml")
        if os.path.isfile(path):
            content = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            return content if isinstance(content, dict) else None
    return None


def _run_stamp() -> str:
    """The time part of a default run dir (``${run_stamp:}``): ``HH-MM-SS-ffffff`` (microseconds:
    two runs started in one second must not share a dir), but ``HH-MM-SS`` under torchrun, whose
    ranks each resolve it and must find one dir (they start within the same second, as before)."""
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    return datetime.datetime.now().strftime("%H-%M-%S" if torchrun else "%H-%M-%S-%f")


if not OmegaConf.has_resolver("recipe_doc"):
    OmegaConf.register_new_resolver("recipe_doc", _recipe_doc)
if not OmegaConf.has_resolver("recipe_groups"):
    OmegaConf.register_new_resolver("recipe_groups", _recipe_groups)
if not OmegaConf.has_resolver("run_stamp"):
    OmegaConf.register_new_resolver("run_stamp", _run_stamp, use_cache=True)


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def flag(cfg: dict, key: str, default: bool) -> bool:
    """The on/off setting ``cfg[key]`` (``default`` when absent or null).

    Hydra passes ``progress=off`` from the command line as the *string* ``'off'``, which Python
    would take as true; this reads true/false, yes/no, on/off and 1/0 (any case) as what they say.

    Raises:
        ValueError: any other value, naming ``key``.
    """
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{key} must be true or false (yes/no, on/off), got {value!r}")





#: the on/off layer kwargs a recipe's ``layer.kwargs`` may set (read with :func:`flag`)
LAYER_FLAGS = ("layer.kwargs.dedup", "layer.kwargs.check_finite", "layer.kwargs.cuda_graph",
               "layer.kwargs.auto_replan", "layer.kwargs.record_loads")  # the last two: VariabilityAwareMoE
#: words besides on/off that a flag of :data:`LAYER_FLAGS` may take (kept as the word, lower case)
FLAG_WORDS = {"layer.kwargs.check_finite": ("deferred",)}


def merge_curves_path(d: dict) -> str | None:
    """One spelling of the profiled latency curves for every recipe: ``curves.path=FILE`` (plan.py's)
    and ``variability.curves.path=FILE`` (serve.py's emulation) name the same file; both are set
    to it, in place, so that neither recipe ignores the other's spelling.

    Returns:
        The path, or ``None``.

    Raises:
        ValueError: both are set, to different files.
    """
    top = d.get("curves")
    top = top.get("path") if isinstance(top, dict) else None
    var = d.get("variability")
    nested = var.get("curves") if isinstance(var, dict) else None
    nested = nested.get("path") if isinstance(nested, dict) else None
    if top and nested and top != nested:
        raise ValueError(f"curves.path={top} and variability.curves.path={nested} name different files: give one")
    path = top or nested
    if path:
        d["curves"] = dict(d.get("curves") or {}, path=path)
        if isinstance(var, dict):
            var["curves"] = dict(var.get("curves") or {}, path=path)
    return path


def normalize_flags(d: dict, keys: Sequence[str]) -> None:
    """Replace each on/off setting named by a dotted key (``"bench.profile"``) with its bool, in
    place, where it is set (see :func:`flag`); absent keys stay absent. A word of
    :data:`FLAG_WORDS` for its key (``layer.kwargs.check_finite=deferred``) stays that word.

    Raises:
        ValueError: a value that is not on/off, naming its dotted key.
    """
    for key in keys:
        *parents, leaf = key.split(".")
        node = d
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) is not None:
            word = node[leaf].strip().lower() if isinstance(node[leaf], str) else None
            if word in FLAG_WORDS.get(key, ()):
                node[leaf] = word
            else:
                node[leaf] = flag({key: node[leaf]}, key, False)


def int_setting(value: Any, key: str, minimum: int | None = None) -> int:
    """``value`` as an integer setting (at least ``minimum`` when given).

    A float is refused rather than truncated (``iters=2.7`` is not silently 2), and so is a bool.

    Raises:
        ValueError: not an integer, or below ``minimum``, naming ``key``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{key} must be an integer{bound}, got {value!r}")
    return value


def capacity_bound(layer_kwargs: dict | None) -> int | None:
    """The most tokens per rank a layer built with ``layer_kwargs`` takes in a forward: its
    ``capacity`` (the largest of a list), ``None`` without one or with ``beyond_capacity='exact'``
    (which runs larger batches exact)."""
    kwargs = layer_kwargs or {}
    capacity = capacity_setting(kwargs.get("capacity"))
    return None if kwargs.get("beyond_capacity") == "exact" else capacity


def capacity_setting(value: Any, key: str = "layer.kwargs.capacity") -> int | None:
    """The most tokens per rank a layer's ``capacity`` takes (an int, or a list of the sizes a
    forward may be padded to: the largest); ``None`` without one.

    Raises:
        ValueError: not an int >= 1 or a non-empty list of them, naming ``key``.
    """
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{key} must be an integer >= 1 or a non-empty list of them, got {value!r}")
        return max(int_setting(v, f"{key}[{i}]", 1) for i, v in enumerate(value))
    return int_setting(value, key, 1)


def plan_fraction_setting(value: Any, key: str) -> float:
    """A semantic plan's share of the replay trace's sequences (it is built on the first part):
    ``None`` means 0.5, else a number in ``(0, 1)``.

    Raises:
        ValueError: anything else (a bool too), naming ``key``.
    """
    if value is None:
        return 0.5
    try:
        frac = float(value)
    except (TypeError, ValueError):
        frac = math.nan
    if isinstance(value, bool) or not 0.0 < frac < 1.0:
        raise ValueError(f"{key} must be null (0.5) or a number in (0, 1), the share of the replay trace's "
                         f"sequences the plan is built on; got {value!r}")
    return frac


def import_object(path: str, key: str, sep: str = ".") -> Any:
    """The object that ``path`` names, ``module<sep>name`` (``moelayers.VanillaMoE``, or
    ``mypkg.sched:assign`` with ``sep=":"``).

    Raises:
        ValueError: ``path`` is not such a string, its module cannot be imported, or it has no
            such name; the message names ``key`` (the setting that gave it).
    """
    mod, found, name = path.rpartition(sep) if isinstance(path, str) else ("", "", "")
    if not (found and mod and name):
        raise ValueError(f"{key}={path!r} must name an object as 'module{sep}name'")
    try:
        module = importlib.import_module(mod)
    except ImportError as exc:
        raise ValueError(f"{key}={path!r}: cannot import {mod!r} ({exc})") from exc
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{key}={path!r}: module {mod!r} has no {name!r}") from None


#: layer keyword arguments that take a callable, which a config gives by import path
OBJECT_KWARGS = ("replica_policy", "planner")


def layer_objects(kwargs: dict, what: str = "layer.kwargs") -> dict:
    """``kwargs`` with each of :data:`OBJECT_KWARGS` given as a string (``mypkg.policies.Last`` or
    ``mypkg.policies:last``) replaced by the object it names, a class by an instance made without
    arguments (a ``ReplicaPolicy`` class; a function is used as it is).

    Raises:
        ValueError: a path that names nothing (naming ``what.KEY``), or a class that cannot be
            made without arguments.
    """
    out = dict(kwargs)
    for key in OBJECT_KWARGS:
        path = out.get(key)
        if not isinstance(path, str):
            continue
        obj = import_object(path, f"{what}.{key}", sep=":" if ":" in path else ".")
        if inspect.isclass(obj):
            try:
                obj = obj()
            except TypeError as exc:
                raise ValueError(f"{what}.{key}={path!r}: a class is made without arguments here ({exc}); name a "
                                 "function or an instance instead") from exc
        out[key] = obj
    return out


#: the settings that name a file or folder (refused when set to an empty string)
PATH_KEYS = ("trace.path", "layer.plan_path", "layer.placement_path", "scheduler.plan_path", "curves.path",
             "variability.curves.path", "plan.path", "planner.embeddings", "bench.save_to",
             "compare.layer.plan_path", "compare.layer.placement_path", "compare.scheduler.plan_path")


def refuse_empty_paths(d: dict) -> None:
    """Refuse a path setting given as an empty string (``trace.path=$TRACE`` with ``TRACE`` unset):
    read as "not given", it ran on a synthetic trace, a solved plan or the linear placement instead,
    silently. ``null`` (or leaving it out) says "not given"."""
    for key in PATH_KEYS:
        node: Any = d
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, str) and not node.strip():
            raise ValueError(f"{key} is empty ({node!r}): give a path, or null to leave it unset (an empty value "
                             "from an unset shell variable would otherwise run without the file)")


def not_a_file(path: str) -> str | None:
    """Why ``path`` is not a regular file to read (``"does not exist"``, ``"is a directory"``, ``"is not
    a regular file (a pipe or a device?)"``, a symbolic link loop or a broken one), or ``None``."""
    if os.path.isfile(path):
        return None
    if os.path.islink(path) and not os.path.exists(path):
        try:
            os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return "is a symbolic link that loops"
        return "is a symbolic link to nothing"
    if os.path.isdir(path):
        return "is a directory"
    return "is not a regular file (a pipe or a device?)" if os.path.exists(path) else "does not exist"


def check_input_file(path: str, key: str, what: str) -> None:
    """Refuse a setting naming a file that is not there (or a folder, a pipe) before any rank starts.

    Raises:
        FileNotFoundError: nothing at ``path`` (or a broken link). IsADirectoryError: a folder.
        ValueError: a pipe or a device. The messages name ``key`` and ``what`` the file should hold.
    """
    reason = not_a_file(path)
    if reason is None:
        return
    if reason == "is a directory":
        raise IsADirectoryError(f"{key}={path} is a directory, not {what}")
    error = ValueError if reason.startswith("is not a regular") else FileNotFoundError
    raise error(f"{key}={path} {reason} (it names {what})")


def timeout_setting(parallel: dict | None) -> float:
    """``parallel.timeout_s`` (default 600) as seconds: a finite number > 0. The ranks' process
    group takes it as its timeout: a rank that waits longer than this in a collective or the
    rendezvous (for a peer that hung or died) raises and fails the run, as does a spawned rank that
    has not reported this long after another did; the run itself may take as long as it needs.

    Raises:
        ValueError: anything else, naming the key (0 would fail every collective).
    """
    value = (parallel or {}).get("timeout_s", 600)
    try:
        seconds = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"parallel.timeout_s must be a number of seconds > 0 (a rank waiting this long for a hung "
                         f"one fails the run), got {value!r}")
    return seconds


def shared_execution_kwargs(layer_cfg: dict) -> dict:
    """The :data:`EXECUTION_KWARGS` set in ``layer_cfg['kwargs']``."""
    kwargs = layer_cfg.get("kwargs") or {}
    return {k: kwargs[k] for k in EXECUTION_KWARGS if k in kwargs}


#: layer kwargs the recipes check elsewhere, for the whole world (per-rank slowdowns, curves of every
#: rank, a placement of every rank): left out of :func:`check_layer_settings`' one-process build
_WORLD_KWARGS = ("slowdown", "curves", "placement")


def check_layer_settings(build: Callable[..., Any], kwargs: dict, what: str, layer_cls: type | None = None) -> None:
    """Fail fast on a layer's settings: ``build(**kwargs)`` (a one-process layer on the meta device:
    no weights, no collectives) runs the constructor's checks here, before any rank starts, and
    its error names ``what`` (e.g. ``layer.kwargs``) and, for a keyword ``layer_cls`` does not take,
    those it takes; :data:`_WORLD_KWARGS` are left out."""
    from moelayers.layers.base import layer_kwargs

    try:
        build(**{k: v for k, v in kwargs.items() if k not in _WORLD_KWARGS})
    except (TypeError, ValueError) as exc:
        hint = ""
        if layer_cls is not None and isinstance(exc, TypeError) and "unexpected keyword argument" in str(exc):
            hint = f" ({layer_cls.__name__} takes {', '.join(sorted(layer_kwargs(layer_cls)))})"
        raise type(exc)(f"{what}: {exc}{hint}") from exc


def resolve_backend(requested: str | None, *, torchrun: bool) -> str:
    """``'auto'``: NCCL under torchrun when CUDA is available, else gloo (spawned runs stay on CPU).

    Raises:
        ValueError: an unknown backend, or NCCL without CUDA.
    """
    requested = (requested or "auto").lower()
    if requested not in ("auto", "gloo", "nccl"):
        raise ValueError(f"parallel.backend must be auto, gloo or nccl, got {requested!r}")
    if requested == "auto":
        return "nccl" if torchrun and torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ValueError("parallel.backend=nccl needs CUDA GPUs; use parallel.backend=gloo on CPU")
    return requested


def device_for(backend: str) -> torch.device:
    """The device a rank computes on: its CUDA device under NCCL, else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def invocation() -> dict:
    """How this run was started, for its own outputs (the recipes keep no ``.hydra/`` in the run dir:
    ``hydra.output_subdir: null``): ``argv`` and the Hydra command-line ``overrides`` (empty outside
    a Hydra app)."""
    overrides: list[str] = []
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = [str(o) for o in HydraConfig.get().overrides.task]
    except Exception:  # not inside @hydra.main
        pass
    return {"argv": [str(a) for a in sys.argv], "overrides": overrides}


def absolute_path(path: str) -> str:
    """A path as given on the command line, made absolute against where the run was started (Hydra's
    ``to_absolute_path``). ``a/../b`` stays as typed: the system resolves it through a symlink ``a``,
    which a textual normalisation would get wrong (:func:`provenance` records the resolved file)."""
    import hydra

    return hydra.utils.to_absolute_path(str(path))


def provenance(inputs: dict[str, Any] | None = None) -> dict:
    """What produced a run, for its outputs: the moelayers version and, from a git checkout of it,
    its commit (and whether the checkout had uncommitted changes to tracked files), the UTC date, the
    host, Python's and torch's versions, and each input file (``{setting: path}``, empty settings
    left out) as ``{"path", "bytes", "sha256"}`` (``path`` resolved: absolute, without symlinks or
    ``..``; a file rewritten later under the same name is then told apart). A file that cannot be
    read is recorded as ``{"path", "error"}``: a finished run is not lost to its record."""
    import hashlib
    import platform
    import socket

    import moelayers

    files = {}
    for key, path in (inputs or {}).items():
        if path:
            digest, real = hashlib.sha256(), os.path.realpath(str(path))
            try:
                with open(real, "rb") as f:
                    for block in iter(lambda: f.read(1 << 24), b""):
                        digest.update(block)
                files[key] = {"path": real, "bytes": os.path.getsize(real), "sha256": digest.hexdigest()}
            except OSError as exc:
                files[key] = {"path": real, "error": f"{type(exc).__name__}: {exc.strerror or exc}"}
    return {"moelayers": moelayers.__version__, **_source_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__,
            "inputs": files}


#: the variables that point git at another repository than the one ``git -C`` names (``git rev-parse
#: --local-env-vars`` without the configuration ones: safe.directory given as GIT_CONFIG_* must stay)
_GIT_REPOSITORY_VARS = frozenset({
    "GIT_DIR", "GIT_WORK_TREE", "GIT_IMPLICIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_PREFIX", "GIT_INTERNAL_SUPER_PREFIX", "GIT_SHALLOW_FILE", "GIT_GRAFT_FILE",
    "GIT_NO_REPLACE_OBJECTS", "GIT_REPLACE_REF_BASE", "GIT_NAMESPACE"})


def _source_commit() -> dict:
    """``{"commit", "dirty"}`` of the git checkout moelayers is imported from, or of the ``git
    archive`` it was unpacked from (``dirty`` then ``None``: unknown); ``None`` for an installed
    copy (a checkout around the install, say a project holding its virtualenv, is not moelayers')."""
    import subprocess

    import moelayers

    source = os.path.dirname(os.path.dirname(os.path.abspath(moelayers.__file__)))
    env = {k: v for k, v in os.environ.items() if k not in _GIT_REPOSITORY_VARS}  # (GIT_DIR: another repository)
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", source, *args], capture_output=True, text=True, timeout=10,
                                  check=True, env=env).stdout.strip()

        if os.path.realpath(git("rev-parse", "--show-toplevel")) == os.path.realpath(source):
            return {"commit": git("rev-parse", "HEAD"),
                    "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):  # no git, not a checkout
        pass
    return {"commit": _archived_commit(source), "dirty": None}


def _archived_commit(source: str) -> str | None:
    """The commit ``git archive`` wrote into ``source/.git_archival.txt`` (its ``export-subst``
    attribute), or ``None``: no such file (an installed copy), or a checkout's unexpanded one."""
    try:
        with open(os.path.join(source, ".git_archival.txt"), encoding="utf-8") as f:
            text = f.read(4096)
    except (OSError, ValueError):
        return None
    found = re.search(r"^commit: ([0-9a-f]{40,64})$", text, flags=re.M)
    return found.group(1) if found else None


def chosen_options() -> dict[str, str]:
    """The option each config group of this run took (``{"planner": "gem", "layer": "vanilla", ...}``,
    Hydra's runtime choices: the defaults list with the command line's ``GROUP=NAME`` applied); empty
    outside a Hydra app."""
    try:
        from hydra.core.hydra_config import HydraConfig

        choices = HydraConfig.get().runtime.choices
    except Exception:  # not inside @hydra.main
        return {}
    return {str(k): str(v) for k, v in choices.items() if v is not None and not str(k).startswith("hydra")}


def in_sweep(group: str) -> bool:
    """Whether this run is one job of a Hydra ``-m`` sweep over the options of config ``group``
    (``layer=vanilla,semantic``, ``layer=choice(...)``, ``glob(...)``), on the command line or in a
    config's ``hydra.sweeper.params``; ``False`` outside a Hydra app."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN:
            return False
    except Exception:  # not inside @hydra.main
        return False
    params = OmegaConf.select(hydra_cfg, "sweeper.params", default=None) or {}
    swept = [a.split("=", 1)[1] for a in sys.argv[1:] if a.split("=", 1)[0].lstrip("+~") == group and "=" in a]
    if not swept:  # (a command-line value replaces the config's sweep of the group)
        swept = [str(value) for key, value in params.items() if str(key).lstrip("+~") == group]
    return any("," in value or "(" in value for value in swept)


def overridden(keys: Sequence[str]) -> list[str]:
    """The command-line overrides (``key=value``, as typed) that set one of ``keys`` (dotted config
    paths, e.g. ``trace.num_experts``) or a key under one (``workload.prompt_len.min`` for
    ``workload.prompt_len``): for refusing settings a run would ignore. Empty outside a Hydra app."""
    out = []
    for override in invocation()["overrides"]:
        key = override.split("=", 1)[0].lstrip("+~")
        if any(key == k or key.startswith(k + ".") for k in keys):
            out.append(override)
    return out


def unread_overrides(keys: Sequence[str], deciders: Sequence[str]) -> list[str]:
    """:func:`overridden` ``keys`` that this run does not read, less the ``++KEY`` ones of a ``-m``
    sweep over one of ``deciders`` (the settings that decide whether a run reads them): another job
    of the sweep reads those (``-m bench.profile=true,false ++bench.profile_rows=3``)."""
    swept = any(in_sweep(k) for k in deciders)
    return [o for o in overridden(keys) if not (swept and o.startswith("++"))]


def _yaml_keys(path: str) -> set[str]:
    """The dotted paths of a conf yaml file's keys (nested dicts included; ``defaults`` and
    ``hydra`` left out: Hydra reads them)."""
    out: set[str] = set()

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                out.add(prefix + str(key))
                walk(value, prefix + str(key) + ".")

    tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    walk({k: v for k, v in tree.items() if k not in ("defaults", "hydra")}, "")
    return out


def _options(group: str) -> list[str]:
    """The options of config group ``conf/GROUP/`` (its yaml files' names), sorted."""
    folder = os.path.join(CONF_DIR, group)
    return sorted(n[:-5] for n in os.listdir(folder) if n.endswith(".yaml")) if os.path.isdir(folder) else []


def _option_keys(group: str, option: str | None = None) -> set[str]:
    """``GROUP.KEY`` for every key of option ``conf/GROUP/OPTION.yaml``, or of every option of the
    group where ``option`` is None or names no option there."""
    options = [option] if option in _options(group) else _options(group)
    return {group} | {f"{group}.{k}" for o in options for k in _yaml_keys(os.path.join(CONF_DIR, group, o + ".yaml"))}


def readable_keys(primary: str, groups: Sequence[str], extra_keys: Sequence[str] = (),
                  mirrors: dict[str, str] | None = None, choices: dict[str, str] | None = None) -> set[str]:
    """Every config key a recipe can read: those of ``conf/<primary>.yaml`` and, under ``GROUP.``,
    those of the option ``conf/GROUP/NAME.yaml`` that ``choices`` names for each of the ``groups``
    it reads (of every option of a group without a choice), the ``extra_keys`` it reads with a
    default where no yaml holds them, and under each ``mirrors`` key ``K`` the keys of every option
    of its group ``G`` (``compare.layer`` holds what ``layer`` does, and can name any option)."""
    keys = _yaml_keys(os.path.join(CONF_DIR, primary + ".yaml")) | set(extra_keys)
    for group in groups:
        keys |= _option_keys(group, (choices or {}).get(group))
    for alias, source in (mirrors or {}).items():
        keys |= {alias + k[len(source):] for k in _option_keys(source) if k.startswith(source + ".")}
    return keys


_INTERPOLATION = re.compile(r"\$\{([^${}]*)\}")  # the innermost ${...} of a value
_KEY_TOKEN = re.compile(r"[A-Za-z_][\w.\-]*")


def referenced_keys(cfg: Any) -> set[str]:
    """The config keys that values of ``cfg`` (unresolved) refer to by interpolation: ``${a.b}``,
    relative ``${.n}`` / ``${..n}``, and the names among a resolver's arguments
    (``${oc.select:my.n,8}``), in the config itself and, inside a Hydra app, in its ``hydra`` node
    (``hydra.run.dir: runs/${tag}``): read by that value, so a key of the user's own that only feeds
    others (``my.n`` in ``workload.num_requests: ${my.n}``) is not one the run ignores. A resolver's
    argument that names no key adds a name nothing has (harmless)."""
    refs: set[str] = set()

    def walk(node: Any, parents: list[str]) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, [*parents, str(key)] if isinstance(value, (dict, list)) else parents)
        elif isinstance(node, list):
            for value in node:
                walk(value, parents)
        elif isinstance(node, str):
            for body in _INTERPOLATION.findall(node):
                name, colon, args = body.partition(":")
                if colon:  # a resolver: the names among its arguments
                    refs.update(_KEY_TOKEN.findall(args))
                    continue
                body = body.strip()
                dots = len(body) - len(body.lstrip("."))
                if dots:  # relative: from the node holding the value, one level up per extra dot
                    base = parents[:max(0, len(parents) - (dots - 1))]
                    body = ".".join([*base, body[dots:]])
                refs.add(body)

    walk(OmegaConf.to_container(cfg, resolve=False) if not isinstance(cfg, dict) else cfg, [])
    try:
        from hydra.core.hydra_config import HydraConfig

        walk({"hydra": OmegaConf.to_container(HydraConfig.get(), resolve=False)}, [])
    except Exception:  # not inside @hydra.main
        pass
    return refs


def _touches(name: str, refs: set[str]) -> bool:
    """Whether key ``name`` is one of ``refs``, above one (read with it) or below one (read as part of it)."""
    return any(r == name or r.startswith(name + ".") or name.startswith(r + ".") for r in refs)


def unread_config_keys(cfg: Any, keys: set[str], open_keys: Sequence[str] = (), skip: Sequence[str] = ()) -> list[str]:
    """The keys of the composed config ``cfg`` (its config files; ``hydra`` aside) that the recipe
    reads nowhere: not in ``keys`` (:func:`readable_keys`), not under one of ``open_keys``, not read
    by an interpolation, not set by one of the command-line keys ``skip`` (checked as overrides).
    The highest such key of a branch only."""
    tree = OmegaConf.to_container(cfg, resolve=False) if not isinstance(cfg, dict) else cfg
    refs = referenced_keys(tree)
    out: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            name = prefix + str(key)
            if (any(name == k or name.startswith(k + ".") for k in open_keys) or _touches(name, refs)
                    or any(name == k or name.startswith(k + ".") for k in skip)):
                continue
            if name not in keys:
                out.append(name)
            elif isinstance(value, dict):
                walk(value, name + ".")

    walk({k: v for k, v in tree.items() if k != "hydra"}, "")
    return out


def _near(name: str, keys: set[str]) -> str:
    """`` (did you mean KEY?)`` for a key of ``keys`` spelt like ``name``, at the same level first, then
    at any level, else ``""``."""
    import difflib

    parent, _, leaf = name.rpartition(".")
    siblings = {k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent}
    close = difflib.get_close_matches(leaf, sorted(siblings), n=1, cutoff=0.75)
    if close:
        return f" (did you mean {parent + '.' if parent else ''}{close[0]}?)"
    elsewhere = {}  # a key spelt like it at another level (num_request: at the top for workload.num_requests)
    for key in sorted(keys):
        elsewhere.setdefault(key.rpartition(".")[2], key)
    close = difflib.get_close_matches(leaf, sorted(elsewhere), n=1, cutoff=0.75)
    return f" (did you mean {elsewhere[close[0]]}?)" if close else ""


def refuse_unread_overrides(recipe: str, primary: str, groups: Sequence[str], open_keys: Sequence[str] = (),
                            extra_keys: Sequence[str] = (), mirrors: dict[str, str] | None = None,
                            cfg: Any = None) -> None:
    """Refuse command-line overrides that add something this recipe would ignore: ``+GROUP=NAME``
    for a config group of ``conf/`` it does not read (e.g. ``serve.py +planner=semantic``), and
    ``+KEY=VALUE`` / ``++KEY=VALUE`` for a key that it does not read (:func:`readable_keys`; a
    misspelt ``+layer.placment_path=FILE``, ``+planner.restart=3``; a key of another option of its
    group, ``+planner.restarts=3`` with ``planner=semantic``, ``+layer.plan_path=FILE`` with
    ``layer=vanilla``; ``++KEY`` of another option passes in a ``-m`` sweep, which sets a key of some
    of its jobs' options so): Hydra adds such a key and nothing reads it. Keys under one of ``open_keys`` (and groups named there) are read by code that
    checks them itself (a layer's constructor for ``layer.kwargs``, a scheduler for ``scheduler``, a
    recipe's own refusal with its reason) and pass; so do Hydra's own settings, an option of a
    group of the user's own config dirs (``+experiment=NAME``, which may set anything), and a key
    that an interpolation of the config reads (``++my.n=3`` for ``workload.num_requests: ${my.n}``).
    With the composed ``cfg``, keys of the user's config files that nothing reads (a misspelt
    ``num_request:`` in an experiment file, an own option's ``placment_path:``) are named in a
    warning (rank 0): a config file may hold notes of its own.

    Args:
        recipe: the recipe's file name, for the message.
        primary: its primary config, ``conf/<primary>.yaml``.
        groups: the config groups it reads.
        open_keys: key prefixes whose sub-keys are checked where they are read.
        extra_keys, mirrors: see :func:`readable_keys`.
        cfg: the composed config (for the keys interpolations read and the config files' keys).

    Raises:
        ValueError: naming the override and what the recipe reads.
    """
    package_groups = {n for n in os.listdir(CONF_DIR) if os.path.isdir(os.path.join(CONF_DIR, n))}
    refs = referenced_keys(cfg) if cfg is not None else set()
    keys, union, choices = None, None, chosen_options()
    known_groups = package_groups | app_groups() | set(choices)
    overrides = invocation()["overrides"]
    for override in overrides:
        key = override.split("=", 1)[0]
        name = key.lstrip("+~")
        selected, _, package = name.partition("@")  # +GROUP@PACKAGE=NAME puts the option at PACKAGE
        group = selected.split("/", 1)[0]  # +hydra/GROUP=NAME
        if not key.startswith("+") or group == "hydra" or name.startswith("hydra."):
            continue
        selects = "." not in selected and group in known_groups  # an option of a config group
        if selects and group not in groups and group not in open_keys:
            if group not in package_groups:  # the user's own group (an experiment: it may set anything)
                continue
            raise ValueError(f"{override}: {recipe} does not read the {group} config group (it reads "
                             f"{', '.join(sorted(groups))}), so the run would ignore it: drop it")
        name = package or name  # where the override adds something
        keys = readable_keys(primary, groups, extra_keys, mirrors, choices) if keys is None else keys
        if name in keys or any(name == k or name.startswith(k + ".") for k in open_keys) or _touches(name, refs):
            continue
        union = readable_keys(primary, groups, extra_keys, mirrors) if union is None else union
        if key.startswith("++") and name in union and in_sweep(name.split(".", 1)[0]):  # a -m sweep across
            continue                                                # the group's options sets a key some read
        head = name.split(".", 1)[0]
        others = [o for o in _options(head) if name in _option_keys(head, o)] if head in groups else []
        if others and head in choices:  # a key of another option of the group (+layer.plan_path with layer=vanilla)
            raise ValueError(f"{override}: {recipe} with {head}={choices[head]} reads no key {name} ({head}="
                             f"{' | '.join(others)} reads it), so the run would ignore it: choose that option, "
                             "or drop it")
        parent = name.rpartition(".")[0]
        while parent and parent not in keys:  # the nearest key that exists
            parent = parent.rpartition(".")[0]
        near = sorted(k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent)
        where = f"the keys under {parent} are" if parent else "the top-level keys are"
        hint = f"{where} {', '.join(near)}" if near else f"{parent} takes no keys"
        raise ValueError(f"{override}: {recipe} reads no key {name}, so the run would ignore it "
                         f"({hint}): check the spelling, or drop it")
    if cfg is None:
        return
    keys = readable_keys(primary, groups, extra_keys, mirrors, choices) if keys is None else keys
    set_here = [key for key in (o.split("=", 1)[0].lstrip("+~").partition("@")[0] for o in overrides)
                if "." in key or key not in known_groups]  # keys set on the command line (not GROUP=NAME)
    unread = unread_config_keys(cfg, keys, open_keys, set_here)
    if unread and not (under_torchrun() and int(os.environ.get("RANK", "0"))):
        names = ", ".join(f"{name}{_near(name, keys)}" for name in unread)
        print(f"warning: {recipe} reads no key {names} of the config, so the run ignores "
              f"{'it' if len(unread) == 1 else 'them'}: check the spelling in your config file", file=sys.stderr,
              flush=True)


def require_keys(d: dict, recipe: str, keys: Sequence[str]) -> None:
    """Refuse a config without one of the top-level ``keys`` the recipe reads throughout (removed
    with ``~KEY``, or left out of a config of one's own that does not inherit the recipe's), which
    would end in a bare ``KeyError`` deep in the run.

    Raises:
        ValueError: naming the missing keys.
    """
    missing = [k for k in keys if k not in d]
    if missing:
        raise ValueError(f"{recipe} needs the config's {', '.join(missing)} (removed with ~KEY, or a config that does "
                         f"not inherit the recipe's?): set the values you want there instead")


def to_dict(cfg: Any) -> dict:
    """A resolved plain-dict copy of an OmegaConf config (dicts pass through)."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover - hydra-core depends on omegaconf
        pass
    return dict(cfg)


def launch(cfg: Any, fn: Callable[[int, int, dict], Any]) -> Any:
    """Run ``fn(rank, world, cfg_dict)`` on every rank (see the module docstring).

    Args:
        cfg: the recipe config (``DictConfig`` or dict) with ``parallel.world_size`` and optional
            ``parallel.backend`` (``auto`` | ``gloo`` | ``nccl``) and ``parallel.timeout_s``.
        fn: module-level function; its return value on rank 0 is returned here.

    Returns:
        Under torchrun: this rank's result. Spawned: rank 0's result.
    """
    d = to_dict(cfg)
    d.setdefault("run_dir", run_dir())
    par = d.get("parallel") or {}
    timeout = timeout_setting(par)
    if under_torchrun():
        import torch.distributed as dist

        backend = resolve_backend(par.get("backend"), torchrun=True)
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        mark_launched()  # (the settings were checked: an error from here on is this rank's own)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        d.setdefault("parallel", {})["world_size"] = world
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world, d)
        if backend == "nccl":
            torch.cuda.synchronize()
        dist.barrier()
        return result  # the caller writes its outputs, then calls shutdown()
    from moelayers.testing import run_distributed

    world = int_setting(par.get("world_size", 1), "parallel.world_size", 1)  # 1.9 is not 1
    backend = resolve_backend(par.get("backend"), torchrun=False)
    mark_launched()
    # no limit on the run's length: a rank that waits in a collective longer than timeout_s fails it, and so
    # does one that has not reported timeout_s after another did
    try:
        results = run_distributed(_rank_with_safe_output, world, fn, d, backend=backend, timeout=None,
                                  collective_timeout=timeout)
    except Exception:
        if sys.stderr is not None and sys.stderr.isatty() and flag(d, "progress", True):  # rank 0's bar may hold the line: the error
            print(file=sys.stderr, flush=True)                  # starts on its own
        raise
    return results[0]


def _rank_with_safe_output(rank: int, world: int, fn: Callable[..., Any], d: dict) -> Any:
    """A spawned rank running ``fn``: its stdout and stderr, like the launcher's, drop what a reader
    that went away (``recipe | head``) no longer takes, instead of failing the run."""
    pipe_safe_output()
    return fn(rank, world, d)


def shutdown() -> None:
    """Destroy the torchrun process group (after the outputs are written: should NCCL's teardown
    stall, nothing is lost)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------- output
def percentile(values: Sequence[float], q: float) -> float:
    """``q``-th percentile (0..100, linear interpolation) of the values; NaN if none.

    ``None`` and NaN (not measured) are left out; ``+inf`` counts as larger than any other value
    (e.g. the TTFT of a request that got no first token before the run ended), so a percentile that
    falls among such values is ``inf``.
    """
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return float("nan")
    pos = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    if pos == lo:
        return vals[lo]
    if math.isinf(vals[hi]):  # no interpolation towards inf (inf - inf is NaN)
        return vals[hi]
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def _cell(v: Any) -> str:
    """A table cell: floats to 4 significant digits (``nan`` as such), anything else as ``str``."""
    return format(v, ".4g") if isinstance(v, float) and not isinstance(v, bool) else str(v)


def print_grid(header: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None, *,
               left_first: bool = True) -> str:
    """Print (and return) a table with a header row; the first column left-aligned (``left_first``),
    the rest right-aligned; floats to 4 significant digits."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]
    bar = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(vals: Sequence[str]) -> str:
        return "| " + " | ".join(v.ljust(w) if i == 0 and left_first else v.rjust(w)
                                 for i, (v, w) in enumerate(zip(vals, widths))) + " |"

    text = "\n".join(([title] if title else []) + [bar, line(header), bar] + [line(r) for r in cells] + [bar])
    print(text, flush=True)
    return text


def print_table(rows: Sequence[tuple[str, Any]], title: str | None = None) -> str:
    """Print (and return) a two-column ``metric | value`` table (:func:`print_grid`)."""
    return print_grid(["metric", "value"], rows, title)


def config_trace(tc: dict, *, num_sequences: int, num_layers: int, num_experts: int, top_k: int, vocab_size: int,
                 seed: int, seq_len: Any, need: str):
    """The routing trace a recipe's ``trace`` block names: ``trace.path`` (npz, validated), else a
    synthetic trace of the given shape when ``trace.synthetic`` is true.

    Args:
        tc: the ``trace`` config block (``path``, ``synthetic``, optional ``seq_len``).
        num_sequences, num_layers, num_experts, top_k, vocab_size, seed: the synthetic trace's shape.
        seq_len: default tokens per synthetic sequence (``trace.seq_len`` wins): an int or ``[lo, hi]``.
        need: who needs it, for the error (e.g. ``"router=replay"``).

    Raises:
        ValueError: no path and ``trace.synthetic`` false; the loader's errors for a bad file.
    """
    from moelayers.trace import load_trace, synthetic_trace

    if tc.get("path"):
        return load_trace(tc["path"])
    if not tc.get("synthetic", False):
        raise ValueError(f"{need} needs trace.path=FILE (or trace.synthetic=true)")
    shape = {"num_sequences": num_sequences, "num_layers": num_layers, "num_experts": num_experts, "top_k": top_k,
             "vocab_size": vocab_size, "seed": seed}
    shape = {k: int_setting(int(v) if isinstance(v, np.integer) else v, f"the synthetic trace's {k}")
             for k, v in shape.items()}  # 4.9 sequences is an error, not 4
    if tc.get("seq_len") is not None:  # 0 or [] is the setting, refused by the generator, not "use the default"
        seq_len = tc["seq_len"]
    seq_len = tuple(seq_len) if isinstance(seq_len, list) else seq_len  # the generator checks the values
    return synthetic_trace(shape["num_sequences"], shape["num_layers"], shape["num_experts"], shape["top_k"],
                           shape["vocab_size"], seq_len=seq_len, seed=shape["seed"])
