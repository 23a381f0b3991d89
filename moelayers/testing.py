"""Helpers for checking layers against the dense reference (used by our tests; handy for yours).

The tolerance rule of every equivalence check, against a float64 reference ``ref64``:

- float32 (and float64): ``max|y - ref64| <= 1e-5 * max(1, max|ref64|)``;
- bfloat16/float16: ``max|y - ref64| <= 3 * max|ref_low - ref64| + 1e-3 * max|ref64|``, where
  ``ref_low`` is the same reference computed in the low precision. Where the layer sums terms over
  ranks in the low precision in an order it does not fix (the attention partials of ``forward_tp``
  in its reduce-scatter: ring collectives add them in another order for every chunk), each order is
  an equally valid low-precision reference: ``ref_low`` is then the list of them
  (:func:`sums_in_every_order`) and the bound takes the largest of their errors.
"""

from __future__ import annotations

import datetime
import itertools
import os
import pickle
import socket
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def tolerance(ref64: torch.Tensor, ref_low: torch.Tensor | Sequence[torch.Tensor] | None, dtype: torch.dtype) -> float:
    """The allowed ``max|y - ref64|`` for output dtype ``dtype`` (``ref_low``: one low-precision
    reference, or several that differ only in the order of a sum: the largest of their errors)."""
    scale = float(ref64.detach().abs().max()) if ref64.numel() else 0.0
    if dtype in (torch.float32, torch.float64):
        return 1e-5 * max(1.0, scale)
    if ref_low is None or (not isinstance(ref_low, torch.Tensor) and len(ref_low) == 0):
        raise ValueError(f"the {dtype} tolerance needs the reference computed in {dtype}")
    lows = [ref_low] if isinstance(ref_low, torch.Tensor) else list(ref_low)
    low_err = max(float((r.detach().double() - ref64.detach()).abs().max()) for r in lows) if ref64.numel() else 0.0
    return 3.0 * low_err + 1e-3 * scale


def sums_in_every_order(terms: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``terms[i0] + terms[i1] + ...`` added left to right in the terms' dtype, once per order of the
    ``n`` terms (``n!`` tensors; the first is the given order). Chains only: a collective that adds
    in a tree (``(a + b) + (c + d)``: recursive halving, NCCL's tree) rounds in a bracketing that is
    not among them.

    A layer that sums per-rank terms in the low precision in a collective (``forward_tp``'s
    reduce-scatter of the attention partials over ``R`` TP ranks) rounds after every addition in an
    order that the collective picks, and that differs between chunks of the buffer (a ring starts
    each chunk on another rank). Every order is an equally valid low-precision result, and the
    low-precision reference computed with one fixed order can be several times more accurate than
    with another (measured: up to 4x at ``R = 4`` for the gradients of
    ``forward_tp``'s inputs and parameters). Build the
    low-precision reference once per sum returned here and pass the list as ``ref_low``: the bound
    is then 3 x the error of the worst admissible order, not of an arbitrary one. Commutativity
    makes the two orders of two terms equal: at ``R = 2`` this changes no bound.

    Args:
        terms: ``n`` tensors of one shape and dtype (keep ``n`` small: ``n!`` sums).

    Returns:
        the ``n!`` sums, each ``terms[0]``'s shape and dtype.
    """
    sums = []
    for order in itertools.permutations(range(len(terms))):
        total = terms[order[0]]
        for i in order[1:]:
            total = total + terms[i]
        sums.append(total)
    return sums


def max_error(y: torch.Tensor, ref64: torch.Tensor) -> float:
    """``max|y - ref64|`` in float64 (NaN never passes: it is returned as inf)."""
    if y.shape != ref64.shape:
        raise ValueError(f"shape mismatch: {list(y.shape)} vs reference {list(ref64.shape)}")
    if y.numel() == 0:
        return 0.0
    err = (y.detach().double().cpu() - ref64.detach().double().cpu()).abs().max()
    return float("inf") if torch.isnan(err) else float(err)


#: a low-precision tolerance above this share of max|ref64| checks nothing (see check_close)
LOOSE_TOLERANCE = 0.25

#: a float32/float64 tolerance (its absolute floor) above this share of max|ref64| checks little
SMALL_TOLERANCE = 0.01

#: a float64 reference below this (absolute) is zero up to round-off: told so, not "scale it up"
ROUND_OFF = 1e-10


def check_close(name: str, y: torch.Tensor, ref64: torch.Tensor,
                ref_low: torch.Tensor | Sequence[torch.Tensor] | None = None, *,
                allow_loose: bool = False, dtype: torch.dtype | None = None) -> str | None:
    """``None`` if ``y`` obeys the rule, else a message naming ``name`` with error and bound.

    The bf16 bound is 3 x the bf16 reference's own error: where that reference picks another expert
    than the float64 one for some token (a router near-tie), the bound grows to a whole expert's
    output and would let almost anything pass. Such a check fails (a message saying so) when the
    bound exceeds ``LOOSE_TOLERANCE`` of ``max|ref64|``, unless ``allow_loose``: draw the inputs with
    :func:`redraw_near_ties`, or compare with the routing forced (``topk_ids``) instead. So does a
    float32/float64 check whose outputs are so small that the bound's absolute floor (``1e-5``)
    exceeds ``SMALL_TOLERANCE`` of ``max|ref64|`` (weights drawn with a small ``init_std`` give
    outputs of about 1e-4, where an expert's weights 5 % off pass): scale the weights or inputs up
    (``allow_loose`` lets both kinds of loose check pass).

    Args:
        name: what is checked, for the message.
        y: ``[...]`` the output under test (any dtype; float32/float64 or bfloat16/float16 rule).
        ref64: ``[...]`` the float64 reference, ``y``'s shape.
        ref_low: ``[...]`` the reference computed in ``y``'s dtype, ``ref64``'s shape; needed for a
            bfloat16/float16 ``y`` (its bound), unused for float32/float64. Or a list of such
            references that differ only in the order of a low-precision sum that the layer does not
            fix (:func:`sums_in_every_order`): the bound takes the largest of their errors.
        allow_loose: let a loose check pass (see above) instead of failing it.
        dtype: the precision ``y`` was computed in, whose rule applies (default ``y.dtype``): for
            output computed under ``torch.autocast`` only (a float32 layer returns float32 computed
            in autocast's dtype): pass ``dtype=torch.bfloat16`` and, as ``ref_low``, the reference
            computed under the same autocast. A lower precision than ``y``'s otherwise loosens the
            check for nothing.

    Returns:
        ``None`` when ``y`` is within the bound; else a message (the error and the bound, or why the
        check is too loose to mean anything).

    Raises:
        ValueError: a bfloat16/float16 ``y`` without ``ref_low``; ``ref_low`` of another dtype than
            ``y`` or another shape than ``ref64``; ``y`` and ``ref64`` of different shapes.
    """
    rule = y.dtype if dtype is None else dtype
    lows = None if ref_low is None else [ref_low] if isinstance(ref_low, torch.Tensor) else list(ref_low)
    if lows is not None and not lows:
        raise ValueError(f"{name}: ref_low is an empty list")
    bad = None if lows is None else next((r for r in lows if r.dtype != rule or r.shape != ref64.shape), None)
    if bad is not None:
        raise ValueError(f"{name}: ref_low must be the reference computed in {rule} (the precision of the rule) with "
                         f"ref64's shape {list(ref64.shape)}, got {bad.dtype} {list(bad.shape)} (a coarser one "
                         f"loosens the check{'' if dtype is not None else '; under autocast pass dtype= its dtype'})")
    err = max_error(y, ref64)  # (its shape check, and tolerance's need of ref_low, raise first)
    tol = tolerance(ref64.double().cpu(), None if lows is None else [r.cpu() for r in lows], rule)
    if ref64.numel() and not bool(torch.isfinite(ref64).all()):
        return f"{name}: the float64 reference is not finite (NaN or inf inputs or weights?): nothing to compare with"
    if lows is not None and rule not in (torch.float32, torch.float64) and not all(bool(torch.isfinite(r).all())
                                                                                      for r in lows):
        return (f"{name}: the {rule} reference is not finite (it overflowed), so it bounds nothing: compare at a "
                "smaller scale (a lower loss scale), or against ref64 alone")
    scale = float(ref64.detach().abs().max()) if ref64.numel() else 0.0
    if lows is not None and not allow_loose and tol > LOOSE_TOLERANCE * scale > 0:
        return (f"{name}: the {rule} tolerance {tol:.3e} is over {LOOSE_TOLERANCE:.0%} of max|ref64| = {scale:.3e}: "
                "the low-precision reference routes some token to other experts (a router near-tie), so the check "
                "would pass almost anything; draw inputs without near-ties (redraw_near_ties) or force the routing")
    if rule in (torch.float32, torch.float64) and not allow_loose and tol > SMALL_TOLERANCE * scale > 0:
        if scale < ROUND_OFF:
            return (f"{name}: max|ref64| = {scale:.3e} is zero up to round-off, so the check means nothing: a "
                    "quantity that does not depend on the inputs (e.g. the router's gradient with top_k=1 and "
                    "norm_topk_prob=True) is left out or checked with allow_loose=True; a real output this small "
                    "needs its weights (init_std) or inputs scaled up")
        return (f"{name}: max|ref64| = {scale:.3e} is so small that the {rule} tolerance {tol:.3e} (its absolute "
                f"floor) is over {SMALL_TOLERANCE:.0%} of it, so the check would pass wrong outputs: scale the "
                "weights (init_std) or the inputs up")
    if err <= tol:
        return None
    return f"{name}: max|y - ref64| = {err:.3e} > tolerance {tol:.3e} ({rule})"


def redraw_near_ties(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, draw: Callable[[int], torch.Tensor], *,
                     margin: float = 0.1, tries: int = 100, score_fn: str | None = None,
                     score_margin: float = 2.0 ** -5) -> torch.Tensor:
    """Test inputs without router near-ties: every token whose ``top_k``-th and next logits lie within
    ``margin`` is replaced by ``draw(n)`` (fresh tokens), until none is left.

    Args:
        x: ``[T, H]`` float64 inputs (replaced rows are written in place).
        router_weight: ``[E, H]`` float64 router weight.
        top_k: experts per token (``>= E``: nothing to tie).
        draw: ``n -> [n, H]`` fresh float64 tokens (e.g. from the generator that drew ``x``).
        margin: the least gap between a token's ``top_k``-th and next logits.
        tries: rounds of redrawing before giving up.
        score_fn: with ``'softmax'`` or ``'sigmoid'``, the ``top_k``-th and next *scores* must differ by
            more than ``score_margin`` relative too: scores rounded to bf16 (``rank_in_logits_dtype``)
            tie within 2^-8, although their logits lie further apart where the sigmoid saturates.
        score_margin: that relative gap of the scores (default ``2^-5``).

    Returns:
        ``x``.

    Raises:
        RuntimeError: still near-ties after ``tries`` rounds.
    """
    if top_k >= router_weight.shape[0] or x.shape[0] == 0:
        return x
    for _ in range(tries):
        logits = x @ router_weight.t()
        top = logits.topk(top_k + 1, dim=1).values
        tie = (top[:, -2] - top[:, -1]) < margin
        if score_fn is not None:
            scores = torch.softmax(logits, dim=1) if score_fn == "softmax" else torch.sigmoid(logits)
            s = scores.topk(top_k + 1, dim=1).values
            tie |= (s[:, -2] - s[:, -1]) < score_margin * s[:, -2]
        if not tie.any():
            return x
        x[tie] = draw(int(tie.sum()))
    raise RuntimeError(f"still router near-ties (margin {margin}) after {tries} redraws")


# ---------------------------------------------------------------------- multi-process runner
def error_of(fn: Callable[..., Any], *args: Any, expected: tuple[type[BaseException], ...] = (ValueError,),
             **kwargs: Any) -> str:
    """``fn(*args, **kwargs)``'s message if it raises one of ``expected``, else ``"no error"``: what a
    distributed worker returns so that the test sees every rank's outcome (other exceptions fail
    the worker, as they should)."""
    try:
        fn(*args, **kwargs)
    except expected as exc:
        return str(exc)
    return "no error"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a test's rendezvous; another process may take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, queue,
            collective_timeout: float | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank, unless the caller's environment says
    try:                                           # how many (a journey found OMP_NUM_THREADS=2 ignored)
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    except ValueError:
        torch.set_num_threads(1)
    try:
        try:
            limit = {} if collective_timeout is None else {"timeout": datetime.timedelta(seconds=collective_timeout)}
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **limit,
            )
        except Exception as e:  # the port free_port() found was taken before the store bound it: try another
            if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
                queue.put((rank, "port", traceback.format_exc()))
                return
            raise
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        result = fn(rank, world, *args)
        # pickled here, not in the queue's feeder thread: a result that cannot be pickled (a process
        # group, say) is this rank's error, not "died without reporting"
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report every failure, never hang the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _next_report(queue, procs: list, reported: dict, timeout: float | None) -> tuple[int, str, Any]:
    """The next ``(rank, status, payload)`` from the ranks; fails at once when a rank that has not
    reported died (an import error in the child, a crash), else after ``timeout`` seconds (``None``:
    waits as long as the ranks live)."""
    import queue as queue_mod
    import time

    deadline = float("inf") if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return queue.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
            if dead:
                time.sleep(0.5)  # a report put just before the exit may still be in flight
                try:
                    return queue.get_nowait()
                except queue_mod.Empty:
                    codes = ", ".join(f"{r}: {_exit_reason(procs[r].exitcode)}" for r in dead)
                    raise RuntimeError(f"rank(s) {dead} died without reporting (exit codes {{{codes}}})") from None
            if time.monotonic() >= deadline:
                missing = [r for r in range(len(procs)) if r not in reported]
                after = f" after rank(s) {sorted(reported)} reported" if reported else ""
                raise RuntimeError(f"distributed run timed out after {timeout:g} s: rank(s) {missing} did not "
                                   f"report{after} (hung, or still working past the limit)") from None


def _exit_reason(code: int) -> str:
    """A child's exit code, with the signal that ended it and what usually sends that signal."""
    import signal

    if code >= 0:
        return str(code)
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return str(code)
    why = {"SIGABRT": " - an abort: e.g. NCCL's watchdog ending a rank whose collective waited past the process "
                      "group's timeout, or a failed assertion in native code",
           "SIGKILL": " - killed from outside, often for memory (the kernel's OOM killer)",
           "SIGSEGV": " - a crash in native code"}.get(name, "")
    return f"{code} ({name}{why})"


#: variables that change all the time and that nothing reads at import: no reason to restart the fork server
_VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})

#: ``os.environ`` as the fork server of :func:`_start_context` saw it when it started (None: not started by us)
_forkserver_env: dict[str, str] | None = None


def _start_context(backend: str):
    """How :func:`run_distributed` starts its ranks.

    Spawning a fresh interpreter costs an ``import torch`` per rank (3 s on a slow 2-core machine,
    most of a short test). For ``gloo`` ranks on POSIX we fork them instead from multiprocessing's
    fork server, which has imported torch once (and nothing that reads the environment at import,
    such as triton). A forked rank inherits the server's environment, not ours, so the server is
    restarted whenever ``os.environ`` has changed since it started, and ranks are spawned where
    that is not possible. ``nccl`` ranks are always spawned (CUDA is initialised in them alone), and
    ``MOELAYERS_SPAWN_RANKS=1`` spawns every rank.
    """
    global _forkserver_env
    spawn = mp.get_context("spawn")
    if (backend != "gloo" or os.environ.get("MOELAYERS_SPAWN_RANKS") == "1"
            or "forkserver" not in mp.get_all_start_methods()):
        return spawn
    import multiprocessing.forkserver as forkserver

    env = {k: v for k, v in os.environ.items() if k not in _VOLATILE_ENV}
    if _forkserver_env != env:
        server = getattr(forkserver, "_forkserver", None)
        if not hasattr(server, "_stop"):  # another Python: no way to restart the server with our environment
            return spawn
        server._stop()  # a server started by someone else (or with an older environment) is not ours
        _forkserver_env = env
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    return ctx


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                    timeout: float | None = 240.0, daemon: bool = True,
                    collective_timeout: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes.

    The ranks see this process's environment as it is at the call (see :func:`_start_context` for
    how they start). With ``backend='nccl'`` the ranks run Triton natively even if this process runs
    it under the interpreter (``TRITON_INTERPRET`` is not passed on: CPU kernel tests set it at import).

    Args:
        fn: importable (module level) ``fn(rank, world_size, *args)``; its result must pickle.
        world_size: number of ranks.
        *args: passed to ``fn`` after the rank and world size.
        backend: ``'gloo'`` or ``'nccl'``.
        timeout: seconds to wait for each rank's report in turn (a test's bound on a run); ``None``:
            for the first report, as long as the ranks live (a long run), for the others
            ``collective_timeout`` (a rank hung after its peers finished fails; pair the two).
        collective_timeout: the process group's timeout (``init_process_group(timeout=)``): a rank
            that waits longer than this in a collective (a peer hung or gone) raises, which fails the
            run; ``None``: torch's default.
        daemon: ``False`` for ranks that start processes of their own (megatron's checkpoint writer
            does; daemonic processes cannot have children). Ranks still alive at the end are
            killed either way (not their own children).

    Returns:
        the per-rank results, in rank order.

    Raises:
        RuntimeError: with every failing rank's traceback, or on timeout (a hang fails, it does not
            stall; with ``timeout=None`` a hang that no collective or later report meets does).
    """
    for _ in range(_PORT_TRIES):
        try:
            return _run_once(fn, world_size, args, backend, timeout, daemon, collective_timeout)
        except _PortTaken as e:  # another process took the port between free_port() and the store's bind
            taken = e
    raise RuntimeError(f"distributed run failed: the rendezvous port was taken {_PORT_TRIES} times:\n{taken}")


_PORT_TRIES = 3


class _PortTaken(Exception):
    """Rank 0 could not bind the rendezvous port (EADDRINUSE): the run is started again on another."""


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, backend: str, timeout: float | None,
              daemon: bool, collective_timeout: float | None) -> list[Any]:
    ctx = _start_context(backend)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, queue, collective_timeout),
                         daemon=daemon) for r in range(world_size)]
    interpret = os.environ.pop("TRITON_INTERPRET", None) if backend == "nccl" else None
    try:
        for p in procs:
            p.start()  # a spawned child inherits the environment as it is now
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    results: dict[int, Any] = {}
    errors: list[str] = []
    taken = None
    stopped = False  # Ctrl-C or another exception here: the ranks are killed at once, not waited for
    try:
        for _ in range(world_size):
            # a run without a limit: once a rank has reported, the others report within collective_timeout
            # (a rank hung outside any collective after its peers finished fails too)
            wait = timeout if timeout is not None or not results else collective_timeout
            rank, status, payload = _next_report(queue, procs, results, wait)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            elif status == "port":
                taken = payload
                break  # the other ranks wait for a store that never comes: killed below
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # other ranks may be stuck in a collective with the failed one
    except BaseException:
        stopped = True
        raise
    finally:
        for p in procs:
            if stopped:
                p.kill()
            p.join(timeout=5 if not (errors or taken or stopped) else 0.5)
            if p.is_alive():
                p.kill()
    if taken is not None:
        raise _PortTaken(taken)
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
