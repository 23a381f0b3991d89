"""CUDA-graph capture of a capacity-mode forward (inference).

With a fixed token capacity every shape in the forward is static and nothing syncs with the host,
so the whole forward, collectives included, is captured once and replayed: one launch instead of
a hundred, which is what decides latency at decode-sized batches.
"""

from __future__ import annotations

from typing import Callable

import torch


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream every capture on ``device`` warms up and captures on. One per device: the
    caching allocator reuses a freed block only on the stream it was allocated on, so a stream per
    capture kept every capture's warm-up memory, and captures sharing a pool could not reuse each
    other's blocks (4 layers of 10 sizes held 1.9 GB each whether or not they shared a pool). Not
    torch's default capture stream: that one is made once per process, on whichever device was
    current then."""
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


class GraphedForward:
    """Captures ``fn(x_static [C, H], num_valid [] int64, flag [] int32) -> (y [C, H], aux [C, ...])``
    on first use and replays it.

    Args:
        fn: the padded forward; must be free of host syncs and shape changes.
        capacity: ``C``; hidden: ``H``; dtype/device: of the activations.
        warmup: eager iterations on a side stream before capture (compiles kernels, warms NCCL).
        pool: the memory pool to capture into (``torch.cuda.graph_pool_handle()``), shared with other
            graphs whose replays never overlap this one's and whose static outputs are read before
            another of them replays; ``None``: a pool of its own.
    """

    # normal static inputs even when captured under torch.inference_mode(): replays outside it copy into them
    @torch.inference_mode(False)
    def __init__(self, fn: Callable, capacity: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 warmup: int = 3, pool: tuple | None = None):
        self.fn, self.capacity, self.warmup, self.pool = fn, capacity, warmup, pool
        self.x = torch.zeros(capacity, hidden, dtype=dtype, device=device)
        self.num_valid = torch.zeros((), dtype=torch.int64, device=device)
        self.flag = torch.zeros((), dtype=torch.int32, device=device)
        # what the static inputs hold, known on the host: a replay of a batch like the previous one
        # (decode steps) launches no kernel to set them
        self._rows_set, self._num_valid, self._flag = 0, 0, 0  # rows of x that may be non-zero; the fills
        self.graph: torch.cuda.CUDAGraph | None = None
        self.y: torch.Tensor | None = None
        self.aux: torch.Tensor | None = None

    def _capture(self) -> None:
        device = self.x.device
        side = capture_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.fn(self.x, self.num_valid, self.flag)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=side):
            self.y, self.aux = self.fn(self.x, self.num_valid, self.flag)
        self.graph = graph

    def __call__(self, x: torch.Tensor, num_valid: int | None = None, flag: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` with ``T <= C`` -> ``(y [T, H], aux [T, ...])``.

        ``num_valid``: what ``fn`` sees as the valid rows (default ``T``; more than ``C`` flags an
        overflow). ``flag``: a routing flag ``fn`` passes on to the other ranks (e.g. ``BAD_INPUT``
        for a refused input: the refusal replays the same graph, so every rank runs the same
        collectives). ``y`` is a copy; ``aux`` (e.g. the routing) is a view of the static output,
        valid until the next replay (no extra kernel on the latency path). Capture and replay run
        with the activations' device current, whichever device was current before."""
        t = x.shape[0]
        num_valid = t if num_valid is None else num_valid
        with torch.cuda.device(self.x.device):
            self.x[:t].copy_(x)
            if t < self._rows_set:  # the padding rows are zeros (a stale row could hold a NaN, flagged)
                self.x[t:self._rows_set].zero_()
            self._rows_set = t
            if num_valid != self._num_valid:
                self.num_valid.fill_(num_valid)
                self._num_valid = num_valid
            if flag != self._flag:
                self.flag.fill_(flag)
                self._flag = flag
            if self.graph is None:
                self._capture()
            self.graph.replay()
            return self.y[:t].clone(), self.aux[:t]

    def release(self) -> None:
        """Drop the captured graph and its static outputs, once its work is done.

        Waits for the device the graph was captured on (``self.x.device``, not the current
        device, which may differ), so no replay is still running, e.g. a collective, when the
        caller then destroys the process group. Without a captured graph it makes no CUDA call
        (safe on CPU-only machines). The next call captures again.
        """
        if self.graph is not None:
            torch.cuda.synchronize(self.x.device)
        self.graph = self.y = self.aux = None


def share_graph_pool(module: torch.nn.Module, pool: tuple | None = None) -> tuple | None:
    """Capture the CUDA graphs of every moelayers layer in ``module`` into one memory pool.

    Each layer built with ``cuda_graph=True`` captures its graphs (one per capacity) into a pool of
    its own, which holds about the memory of its largest forward; sharing one pool across the layers
    of a model holds that once instead of once per layer. The layers' forwards must then run one
    after another on one CUDA stream, as a model's layers do (not concurrently on several streams).
    On an H200, 4 layers of Qwen3-30B-A3B's shape with graphs of 10 sizes from 16 to 8,192 tokens
    reserved 5.1-5.9 GiB in pools of their own (1.3-1.5 GiB a layer), and 1.6 GiB in one shared pool
    (``tools/gpu_graph_memory.py``, 2026-11-29, docs/benchmarks.md).
    Graphs captured before are dropped (captured again, into the pool, on their next forward).

    Args:
        module: a model, or a layer; every :class:`~moelayers.layers.base.MoELayerBase` in
            ``module.modules()`` takes the pool.
        pool: a ``torch.cuda.graph_pool_handle()`` to use (default: a new one).

    Returns:
        The pool's handle, or ``None`` without CUDA (graphs run eagerly there: nothing to share).

    Raises:
        ValueError: ``module`` holds no moelayers layer.
    """
    from moelayers.layers.base import MoELayerBase

    layers = [m for m in module.modules() if isinstance(m, MoELayerBase)]
    if not layers:
        raise ValueError(f"share_graph_pool: {type(module).__name__} holds no moelayers layer")
    if pool is None:
        if not torch.cuda.is_available():
            return None
        pool = torch.cuda.graph_pool_handle()
    for layer in layers:
        if layer.graph_pool != pool:
            layer.release_graphs()
            layer.graph_pool = pool
    return pool
