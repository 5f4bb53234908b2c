"""Running the loop's stages: eagerly, or captured once per shape and replayed (CUDA graphs).

A step of :func:`~specselect.hf.speculative_generate` is a few *stages* (drafting, then target
verification with its bookkeeping) separated by eager host work (selection, the read-back). A
stage is a Python callable without arguments or results: it reads and writes only tensors that
outlive it (the KV caches, the generation state, the step's input/output buffers), and its
shapes depend only on its *key* (batch bucket, widths). That makes it capturable: the first call
of a key runs it for real, the capture records its kernels, and every later call replays them —
at new positions and with new data, because every position is read from device tensors.

:class:`StageRunner` does this in one of three modes:

* ``"eager"`` — call the stage (no capture);
* ``"cuda"`` — ``torch.cuda.CUDAGraph`` per key, one shared memory pool, random generators
  registered so sampling draws fresh numbers on every replay;
* ``"trace"`` — a CPU stand-in for tests: the first call of a key runs eagerly (the warm-up, as
  before a CUDA capture), the second is traced with ``make_fx`` (which runs it for real) and
  later calls replay the traced graph, whose constants are the live buffers.
  Like a CUDA graph replay, it repeats the recorded ops with whatever the buffers hold, so any
  host value baked into a stage or any data passed outside the persistent buffers shows up as a
  wrong result; host reads inside a stage raise (:class:`HostReads`).

Host reads are what a CUDA graph cannot contain and what serialises the host with the device.
:class:`HostReads` counts them (``.item()``, ``int()``/``bool()``/``float()`` of a tensor,
``.tolist()``, ``.numpy()``, and ops whose output shape depends on data, such as boolean
indexing): the tests use it to check the loop's documented number of reads per step, and trace
mode uses it to forbid reads inside stages.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode

Mode = Literal["eager", "cuda", "trace"]

#: Batch sizes captured in graph mode; a batch runs in the smallest bucket that holds it, the
#: free slots padded with inactive rows. Beyond the last one, multiples of 64.
GRAPH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)

_EMULATE_ON_CPU = False

#: One CUDA capture at a time in the process: ``torch.cuda.graph`` synchronises and empties the
#: allocator's cache on entry, which would break another thread's capture under way.
_CAPTURE_LOCK = threading.Lock()

#: Why graph mode is off for the rest of the process: a capture failed (see
#: :meth:`StageRunner._capture_cuda`), or ``None``.
_BROKEN: str | None = None

#: Forgotten graphs a runner keeps before it destroys all its graphs at once (see
#: :meth:`StageRunner.forget`).
PARKED_GRAPHS = 64


def capture_failure() -> str | None:
    """Why CUDA graphs are off in this process (an earlier capture failed), or ``None``."""
    return _BROKEN


def bucket_for(rows: int, graphs: bool) -> int:
    """The batch size that serves ``rows`` active rows: ``rows`` itself in eager mode (finished
    rows leave the batch at once), else the smallest graph bucket that holds them."""
    if not graphs or rows == 0:
        return rows
    for size in GRAPH_BUCKETS:
        if size >= rows:
            return size
    return -(-rows // 64) * 64


@contextlib.contextmanager
def emulate_on_cpu() -> Iterator[None]:
    """Let ``cuda_graphs=True`` run on the CPU in ``"trace"`` mode (for tests; see the module
    doc). Graph mode then exercises the same capture discipline without a GPU."""
    global _EMULATE_ON_CPU
    before, _EMULATE_ON_CPU = _EMULATE_ON_CPU, True
    try:
        yield
    finally:
        _EMULATE_ON_CPU = before


def emulating_on_cpu() -> bool:
    """Whether :func:`emulate_on_cpu` is in effect."""
    return _EMULATE_ON_CPU


class StageRunner:
    """Runs stages by key: eagerly, or captured on first use and replayed after.

    Args:
        mode: ``"eager"``, ``"cuda"`` or ``"trace"`` (see the module doc).
        generators: random generators the stages draw from (sampling), registered with every
            CUDA graph so each replay draws new numbers; ``None`` entries mean the device's
            default generator, which CUDA graphs handle by themselves.
        fall_back: when a CUDA capture fails, warn and run eagerly from then on (for graph
            mode that was not explicitly required) instead of raising. The failed stage has
            already run for real, so nothing is lost. A failed capture turns graph mode off
            for the rest of the process (:func:`capture_failure`).
        device: the CUDA device the stages run on (default: the current one).
    """

    def __init__(
        self,
        mode: Mode,
        generators: Sequence[torch.Generator | None] = (),
        *,
        fall_back: bool = False,
        device: torch.device | None = None,
    ) -> None:
        self.mode = mode
        self.device = device
        self.generators = [g for g in generators if g is not None]
        self.fall_back = fall_back
        self.captures = 0  # keys captured (trace mode: keys warmed up, to be traced) so far
        self._graphs: dict[Hashable, Any] = {}
        self._parked: list[Any] = []  # forgotten graphs, destroyed all at once (see forget)
        self._warm: set[Hashable] = set()  # trace mode: keys run once, to be traced next
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None  # what CUDA captures record on

    def __call__(
        self,
        key: Hashable,
        stage: Callable[[], None],
        recording: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        """Run ``stage`` under ``key``: eagerly, by replaying its recording, or by recording
        it (after a warm-up run) inside ``recording()``, a context that may check what the
        recording did and raise (the recording is then dropped)."""
        if self.mode == "eager":
            stage()
            return
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay() if self.mode == "cuda" else graph()
            return
        if self.mode == "trace":
            self._trace_or_warm_up(key, stage, recording)
            return
        stage()  # the real run doubles as the warm-up
        try:
            self._graphs[key] = self._capture_checked(stage, recording)
        except RuntimeError as err:
            global _BROKEN
            _BROKEN = f"a CUDA graph capture failed earlier in this process ({err})"
            if not self.fall_back:
                raise
            warnings.warn(
                f"CUDA graph capture failed ({err}); speculative_generate continues in eager "
                "mode, and so does every later call in this process (a failed capture can leave "
                "PyTorch's allocator unable to capture again): pass cuda_graphs=False to skip "
                "capturing, True to make this an error",
                RuntimeWarning,
                stacklevel=3,
            )
            self.mode = "eager"
            return
        self.captures += 1

    def _capture_checked(
        self, stage: Callable[[], None], recording: Callable[[], AbstractContextManager[None]]
    ) -> Any:
        """Capture ``stage`` inside ``recording()``. A capture that the recording's check then
        refuses is parked, not destroyed: destroying it could free memory the kept graphs
        still use (see :meth:`forget`)."""
        graph = None
        try:
            with recording():
                graph = self._capture_cuda(stage)
        except BaseException:
            if graph is not None:
                self._parked.append(graph)
            raise
        return graph

    def _trace_or_warm_up(
        self,
        key: Hashable,
        stage: Callable[[], None],
        recording: Callable[[], AbstractContextManager[None]],
    ) -> None:
        """Trace mode: run a new key eagerly, trace it the next time.

        Like a CUDA capture, a trace follows a warm-up run of its key: state that a stage
        allocates when first run (a selector's) must exist before it is recorded. The warm-up
        is what ``captures`` counts, so a key costs one capture in both modes. The warm-up
        forbids host reads too: CUDA captures every key on its first use, where a key used
        once would otherwise never be checked (state allocated on first use may be made from
        host values, as outside a capture).
        """
        if key in self._warm:
            with recording():
                graph = _trace(stage, self.generators)
            self._graphs[key] = graph
            return
        self._warm.add(key)
        with HostReads(forbid=True):
            stage()
        self.captures += 1

    def forget(self, stale: Callable[[Hashable], bool]) -> None:
        """Forget the captures whose keys ``stale`` accepts.

        Their graphs are not destroyed one by one but parked, and destroyed with all the
        others once :data:`PARKED_GRAPHS` are parked: some torch versions free a capture
        stream's cuBLAS workspace when one of its graphs is destroyed, while the graphs left
        on that stream still use it. (A parked graph holds little: its scratch memory went
        back to the shared pool when its capture ended.)
        """
        for key in [key for key in self._graphs if stale(key)]:
            self._parked.append(self._graphs.pop(key))
        self._warm = {key for key in self._warm if not stale(key)}
        if len(self._parked) >= PARKED_GRAPHS:
            self.clear()

    def clear(self) -> None:
        """Forget every capture, all destroyed at once (the buffers they recorded were
        replaced, or too many are parked)."""
        self._graphs.clear()
        self._parked.clear()
        self._warm.clear()

    def _capture_cuda(self, stage: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """Record ``stage`` (which has just run for real: that was its warm-up).

        Capture only records kernels, so the state the real run advanced is not advanced again.
        """
        graph = torch.cuda.CUDAGraph()
        for generator in self.generators:
            graph.register_generator_state(generator)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # The models' device, current for the capture (CUDAGraph records the current device)
        # and the capture's own stream there: torch's default capture stream is made once per
        # process, on whichever device was current at the first capture.
        device = self.device if self.device is not None else torch.device("cuda")
        with torch.cuda.device(device), _CAPTURE_LOCK:
            if self._stream is None:
                self._stream = _primed_stream()
            before = torch.cuda.current_stream()
            try:
                # "thread_local": other threads' work (another call's eager steps) does not
                # invalidate this capture; only this thread's unsafe calls do.
                with torch.cuda.graph(
                    graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"
                ):
                    stage()
            except RuntimeError:
                _end_pool_allocation(torch.cuda.current_device(), self._pool)
                _leave_capture_mode(self.generators)
                raise
            finally:
                # A failed capture_end skips torch.cuda.graph's own exit: restore the stream.
                torch.cuda.set_stream(before)
        return graph


def _primed_stream() -> torch.cuda.Stream:
    """A new stream on the current device, its cuBLAS state made outside any capture.

    cuBLAS workspaces are made per (handle, stream) on a stream's first matrix product; made
    during a capture they would come from the graph's pool, and some torch versions free a
    stream's workspace when one of its graphs is destroyed while the others still use it.
    """
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            with contextlib.suppress(RuntimeError):  # a dtype this GPU has no GEMM for
                x = torch.ones(8, 8, device="cuda", dtype=dtype)
                torch.mm(x, x)  # cuBLAS
                torch.nn.functional.linear(x, x, x[0])  # cuBLASLt, with a bias
    stream.synchronize()
    return stream


def _end_pool_allocation(device: int, pool: Any) -> None:
    """After a failed capture: end the allocator's routing to the graph pool and release the
    capture's use of the pool, which ``capture_end`` skips when it raises (best effort: an
    allocator left routing breaks every later ``torch.cuda.empty_cache``, and a pool still in
    use is never freed). If ``capture_end`` got as far as ending the routing, ending it again
    raises and the pool is not released twice."""
    # torch 2.7 names it _cuda_endAllocateCurrentStreamToPool.
    end = getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(
        torch._C, "_cuda_endAllocateCurrentStreamToPool", None
    )
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None:
        return
    with contextlib.suppress(RuntimeError, TypeError):
        end(device, pool)
        release(device, pool)


def _leave_capture_mode(generators: Sequence[torch.Generator]) -> None:
    """After a failed capture: torch before 2.13 leaves the generators a capture registered
    (``generators`` and the device's default one) flagged as capturing, and their next eager
    draw raises. Each gets a fresh state object with the same seed and offset (best effort)."""
    index = torch.cuda.current_device()
    for generator in [*generators, torch.cuda.default_generators[index]]:
        with contextlib.suppress(RuntimeError, AttributeError, TypeError):
            fresh = torch.Generator(device=generator.device)
            fresh.set_state(generator.get_state())
            generator.graphsafe_set_state(fresh.graphsafe_get_state())


def _trace(
    stage: Callable[[], None], generators: Sequence[torch.Generator]
) -> torch.fx.GraphModule:
    """Trace ``stage`` with ``make_fx`` (running it for real), forbidding host reads inside.

    ``make_fx`` stores a *copy* of each generator a stage draws from; the copies are swapped
    for the originals, so replays draw from the caller's generators, as registered generators
    do in CUDA graphs.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    def checked() -> None:
        with HostReads(forbid=True, forbid_host_tensors=True):
            stage()

    graph = make_fx(checked)()
    for name, value in list(vars(graph).items()):
        if isinstance(value, torch.Generator):
            state = value.get_state()
            original = next((g for g in generators if torch.equal(g.get_state(), state)), None)
            if original is not None:
                setattr(graph, name, original)
    return graph


# Ops that read device data on the host, or whose output shape depends on data (which on an
# accelerator means a sync). Boolean-mask indexing dispatches to index/index_put with bool
# indices: that case is recognised below.
_READ_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::repeat_interleave",
    "aten::bincount",
    "aten::equal",
    "aten::is_nonzero",
}
_INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


class HostReads(TorchDispatchMode):
    """Count (or forbid) host reads of tensor data while active.

    Counted: ops that read device values on the host or have data-dependent output shapes (see
    ``_READ_OPS``, boolean-mask indexing, and ``torch.isin`` with many test elements, which
    deduplicates them inside its kernel), plus ``Tensor.tolist`` and ``Tensor.numpy``, which
    bypass the dispatcher. ``reads`` lists what was read, in order.

    Args:
        forbid: raise ``RuntimeError`` at the first read instead of counting it.
        forbid_host_tensors: also raise when a tensor is made from host data
            (``torch.tensor(list)``): inside a CUDA graph that is a copy from pageable memory,
            which cannot be captured. Python scalars (``x[i] = 1``) are fine.
    """

    def __init__(self, forbid: bool = False, forbid_host_tensors: bool = False) -> None:
        super().__init__()
        self.forbid = forbid
        self.forbid_host_tensors = forbid_host_tensors
        self.reads: list[str] = []
        self._saved: dict[str, Any] = {}

    @property
    def count(self) -> int:
        return len(self.reads)

    def __enter__(self) -> HostReads:
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._read(f"Tensor.{name}")
            return original(tensor, *args, **kwargs)

        return wrapper

    def _read(self, what: str) -> None:
        if self.forbid:
            raise RuntimeError(
                f"host read inside a captured stage ({what}): a CUDA graph cannot contain it. "
                "A stage holds the models' passes and, for a selector whose capture_key is not "
                "None, its select and update (and its estimator's): a selector that must read "
                "device values returns capture_key None and then runs eagerly between the "
                "captured passes (the traceback shows the read)"
            )
        self.reads.append(what)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        name = func._schema.name
        if (
            name in _READ_OPS
            or (name in _INDEX_OPS and _has_bool_index(args))
            or (name == "aten::isin" and _isin_sorts(args, kwargs or {}))
        ):
            self._read(name)
        # A 0-dim lift is a Python scalar (``x[i] = 1``), which a CUDA tensor takes as a fill.
        if self.forbid_host_tensors and name == "aten::lift_fresh" and args[0].dim():
            raise RuntimeError(
                "a tensor made from host data inside a captured stage: a CUDA graph would copy "
                "from pageable host memory; build it with device ops"
            )
        return func(*args, **(kwargs or {}))


def _isin_sorts(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether ``torch.isin`` takes its sorting path, which deduplicates both inputs with
    ``_unique`` (a data-dependent shape: a sync on an accelerator). ATen compares element by
    element only while the test elements are fewer than ``10 * elements ** 0.145``."""
    if len(args) < 2 or not all(isinstance(t, torch.Tensor) for t in args[:2]):
        return False
    elements, tests = args[0], args[1]
    assume_unique = bool(args[2]) if len(args) > 2 else bool(kwargs.get("assume_unique", False))
    return not assume_unique and tests.numel() >= int(10.0 * elements.numel() ** 0.145)


def _has_bool_index(args: Sequence[Any]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
        for t in (indices or ())
    )


__all__ = [
    "GRAPH_BUCKETS",
    "HostReads",
    "StageRunner",
    "bucket_for",
    "capture_failure",
    "emulate_on_cpu",
    "emulating_on_cpu",
]
