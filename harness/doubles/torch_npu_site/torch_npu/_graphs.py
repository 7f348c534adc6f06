"""NPU graphs in the double: capture records, replay re-runs, update rewrites a task.

torch_npu's Python graph API (``torch_npu/npu/graphs.py`` and the op handlers in
``torch_npu/npu/_npugraph_handlers/``) is loaded unmodified from the pinned wheel, as the
meta functions are; this module stands in for what it calls in ``torch_npu._C``
(``_NPUGraph``, ``_graph_pool_handle``, ``_npu_isCurrentStreamCapturing``,
``_graph_task_group_begin``/``_end``, ``_graph_task_update_begin``/``_end``,
``_weak_ref_tensor``) and for ``torch.npu.ExternalEvent``.

What the device does, and so what the double does:

- **Capture launches nothing** (but collectives, below). Each op that reaches the dispatcher between
  ``capture_begin`` and ``capture_end`` is recorded with its arguments: tensors by their
  memory, every Python value (ints, lists, shapes, strings) frozen as it was. Nothing runs:
  memory that existed before the capture is not written, and outputs are new, unwritten
  memory (floating outputs are NaN) from the graph's pool, which lives as long as the graph.
  Views, allocations and the host-side helpers torch_npu's handlers call
  (``*_get_max_workspace``, ``*_infer_output``) run, since they launch nothing.
- **Collectives** (``c10d`` ops, gloo here where HCCL would run on an NPU) are recorded and
  also run at capture: every rank captures the same graphs in the same order, and their
  callers wait on the ``Work`` they return (what a collective's run or wait dispatches is
  its own work, not recorded). A replay runs them again and waits for them.
- **Host reads of device values are errors during capture**: ``item()``/``bool()`` and
  the other reads the double counts as synchronisations (``_syncs.py``), and ops whose
  output size depends on device data (no meta function can size them).
- **Ops documented for single-op and static-graph modes only** (``_NOT_CAPTURED``:
  ``npu_recurrent_gated_delta_rule``) are contract violations during capture.
- **Replay re-runs exactly the recorded ops** on the recorded memory, with the frozen
  Python values, through the double's kernels (their documented rules are checked then).
- **Memory from before the capture is held by address, not owned**: if it was freed
  (a buffer re-allocated after capture), replay fails naming the op and argument, where
  the device would read freed memory.
- **Update** (``NPUGraph.update`` → ``graph_task_update_begin`` … ``_end``): the op called
  between the two replaces the captured task of that task group, with its new Python values;
  it runs nothing either. The update stream must not be the capture stream (torch_npu's
  ``graph_task_update_begin`` docs: "图更新阶段的流同图捕获阶段的流必须不同").
- **External events** (``torch.npu.ExternalEvent``, which torch_npu's capture puts before each
  task group it can update): a ``wait`` or ``reset`` issued during capture is a task of the
  graph, a ``record`` outside it happens at once. A wait "blocks the stream until the event
  completes" and resets it (torch_npu's ``ExternalEvent().wait`` docs). A replay runs its
  tasks up to the first wait whose event nothing recorded since the last wait and stops
  there; each ``record`` (an update's, one per task group) lets it run on to the next such
  wait, so an update may come before the replay or right after it, as torch_npu's own
  ``CapturedGraphUpdateAndReplay`` and vllm-ascend order them (replay, then update). While a
  replay waits, the host must not wait for the device (a synchronisation or a read of a
  device value), replay again or launch another op: the device would block for ever, or,
  for an op, the double (which runs work in program order) cannot queue it behind the
  replay; each is refused (``GraphReplayHang``).
- **Update order.** An update rewrites task groups of the graph, so the update stream must
  have waited for every earlier replay of it (else a replay still running on the device
  would pick up this step's arguments: ``GraphUpdateRace``), and must not wait for the
  replay that is waiting for this update (a deadlock: ``GraphReplayHang``). The double's
  streams count the replays launched on them and what other streams waited for.
- **Streams**: capture on the default stream is refused (torch_npu's capture diagnostics name
  it as a cause of failed captures).
- **Counts** for the graph benchmark (``stats``): replays, and the ops updates re-issued;
  the call log (``TORCH_NPU_DOUBLE_CALL_LOG``) has them as ``graph::replay`` and
  ``graph::update_op``, and each collective a replay ran as ``graph::c10d.<op>``.
- **Memory**: a graph's pool counts as used device memory in ``torch_npu.npu.mem_get_info``
  until the graph is reset or freed.

One liberty the double takes: torch_npu's graph code records a device tensor by address
(``TensorWeakRef``) and deep-copies anything else. The double's tensors are CPU tensors
standing for device tensors, so a ``deepcopy`` of a tensor (or a parameter) made by that
code returns the tensor itself, as its weak reference would on a device.

Only one capture at a time per process, as torch_npu documents.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import linecache
import os
import sys
import traceback
import types
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _python_dispatch as dispatch_modes
from torch.utils._pytree import tree_map

from . import _contract, _syncs
from ._rules import require


class GraphCaptureError(RuntimeError):
    """What the device refuses during capture (a host read, a data-dependent size)."""


class StaleGraphInput(RuntimeError):
    """A captured graph would read memory freed since its capture."""


class GraphReplayHang(RuntimeError):
    """A replay would wait for an external event that nothing records: the device hangs."""


class GraphUpdateRace(RuntimeError):
    """An update could rewrite a task of a replay that may still be running on the device."""


_GRAPH_MODULES = ("torch_npu.npu.graphs", "torch_npu.npu._npugraph_handlers.npugraph_handler")
# Helpers torch_npu's handlers call during capture to allocate an op's workspace and outputs.
_HOST_SIDE = frozenset(
    {
        "_npu_fused_infer_attention_score_get_max_workspace",
        "_npu_fused_infer_attention_score_infer_output",
        "_npu_fused_infer_attention_score_v2_get_max_workspace",
        "_npu_fused_infer_attention_score_v2_infer_output",
    }
)
_ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})
_HOST_READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal"})
# device ops whose docs name the modes they run in, ACL graph capture not among them
_NOT_CAPTURED = {"npu_recurrent_gated_delta_rule": "RGDR.modes"}
# ops that are device kernels (recorded as tasks); others are Python custom ops, whose bodies run
_DEVICE_NAMESPACES = frozenset({"aten", "prims", "npu", "atb", "c10d", "_c10d_functional"})
_PLAIN = (int, float, bool, str, bytes, type(None), complex)
_PLAIN += (torch.dtype, torch.device, torch.layout, torch.memory_format)

_SITES = os.environ.get("TORCH_NPU_DOUBLE_GRAPH_SITES", "0") == "1"


def _capture_site() -> str:
    """The innermost frames outside torch and the double: where the op was issued."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    frames = [f for f in traceback.extract_stack() if not f.filename.startswith(skip)]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} ({f.name})" for f in reversed(frames[-4:]))


capturing: _Graph | None = None
waiting: _Replay | None = None  # a replay stopped at a wait for its update (one stream: one at most)
_updating: tuple[_Graph, int, _Recorder] | None = None  # graph, task group, recorder
_handles = itertools.count(1)
# host-issued graph work since the process started (the graph benchmark reads them)
stats = {"replays": 0, "update_ops": 0}


# -- recorded arguments --------------------------------------------------------------------
class _Memory:
    """A tensor argument as a device task holds it: its memory and its view of it."""

    __slots__ = ("strong", "weak", "offset", "size", "stride", "dtype", "ptr")

    def __init__(self, tensor: torch.Tensor, owned: bool) -> None:
        storage = tensor.untyped_storage()
        self.strong = storage if owned else None
        self.weak = None if owned else StorageWeakRef(storage)
        self.offset, self.size, self.stride = tensor.storage_offset(), tuple(tensor.shape), tensor.stride()
        self.dtype, self.ptr = tensor.dtype, storage.data_ptr()

    def tensor(self, where: str) -> torch.Tensor:
        storage = self.strong
        if storage is None:
            if self.weak.expired():
                raise StaleGraphInput(
                    f"{where}: the graph reads memory at 0x{self.ptr:x} ({self.dtype} {list(self.size)}) "
                    "that was freed after capture "
                    "(a buffer re-allocated since?); keep captured inputs alive and copy new values "
                    "into them, or capture again"
                )
            storage = torch.UntypedStorage._new_with_weak_ptr(self.weak.cdata)
        return torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)


def _host_made_scalar(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.untyped_storage().nbytes() <= 8


class _HostTask:
    """A task of the stream that is not an op: an external event's wait or reset. ``waits_for``:
    the event a wait blocks on until something records it."""

    __slots__ = ("name", "run", "waits_for")

    def __init__(self, name: str, run, waits_for: ExternalEvent | None = None) -> None:
        self.name, self.run, self.waits_for = name, run, waits_for

    def __str__(self) -> str:
        return self.name


class _Task:
    __slots__ = ("func", "args", "kwargs", "outputs", "site")

    def __init__(self, func, args, kwargs, outputs) -> None:
        self.func, self.args, self.kwargs, self.outputs = func, args, kwargs, outputs
        # TORCH_NPU_DOUBLE_GRAPH_SITES=1: where each task was captured, for the errors of replay
        self.site = _capture_site() if _SITES else None

    def run(self) -> None:
        where = str(self.func) if self.site is None else f"{self.func} (captured at {self.site})"

        def live(value):
            return value.tensor(where) if isinstance(value, _Memory) else value

        result = self.func(*tree_map(live, self.args), **tree_map(live, self.kwargs))
        if self.func.namespace == "c10d":  # a collective: the replay waits for it, as its caller did
            _contract.calls[f"graph::{self.func}"] += 1  # (what a rank's replays exchanged)
            _wait_for(result)
        if self.outputs is not None:  # a functional op: its result goes where capture placed it
            flat = result if isinstance(result, (list, tuple)) else [result]
            for out, got in zip(self.outputs, flat):
                if isinstance(out, torch.Tensor) and isinstance(got, torch.Tensor):
                    try:
                        out.copy_(got)
                    except RuntimeError as e:
                        raise RuntimeError(f"{where}: {e} (output {out.shape} {out.stride()})") from e


def _wrap_collective_waits() -> None:
    """``Work.wait`` during a capture runs what it dispatches at once (``collective_running``)."""
    work = getattr(getattr(torch._C, "_distributed_c10d", None), "Work", None)
    if work is None or getattr(work.wait, "_double_wrapped", False):
        return
    plain_wait = work.wait

    def wait(self, *args, **kwargs):
        recorder = capturing._recorder if capturing is not None else None
        if recorder is None:
            return plain_wait(self, *args, **kwargs)
        with recorder.collective_running():
            return plain_wait(self, *args, **kwargs)

    wait._double_wrapped = True
    work.wait = wait


def _wait_for(collective_result) -> None:
    """Wait for the ``Work`` objects a c10d op returned."""
    items = collective_result if isinstance(collective_result, (list, tuple)) else [collective_result]
    for item in items:
        if not isinstance(item, (torch.Tensor, list)) and hasattr(item, "wait"):
            item.wait()


# -- the graph ----------------------------------------------------------------------------
class _Replay:
    """One replay on its way through the graph's tasks (``replay`` number ``seq`` of its stream)."""

    def __init__(self, graph: _Graph, seq: int) -> None:
        self.graph, self.seq = graph, seq
        self.next = 0
        self.blocked_on: ExternalEvent | None = None
        self.running = False

    def advance(self) -> bool:
        """Run tasks until one waits for an event nothing recorded (False) or to the end (True)."""
        tasks = self.graph._tasks
        self.running = True
        try:
            with dispatch_modes._disable_current_modes(), torch.inference_mode():
                while self.next < len(tasks):
                    task = tasks[self.next]
                    event = getattr(task, "waits_for", None)
                    if event is not None and not event.recorded:
                        self.blocked_on = event
                        return False
                    self.next += 1
                    task.run()
        finally:
            self.running = False
        self.blocked_on = None
        _syncs.launched()
        return True


def refuse_while_a_replay_waits(what: str) -> None:
    """``what`` (a host wait, a replay, a launch) is refused while a replay waits for its update."""
    if waiting is not None and not waiting.running:
        raise GraphReplayHang(
            f"{what} while a graph replay waits for the ExternalEvent of its next task group: nothing "
            "has recorded it (update the graph before the replay, or right after it, before anything "
            "else); on the device the stream would block for ever"
        )


class _Graph:
    """``torch_npu._C._NPUGraph`` as the double models it."""

    def __init__(self, *args, **kwargs) -> None:
        self._tasks: list[_Task] = []
        self._pool_storages: dict[int, torch.UntypedStorage] = {}
        self._pool = None
        self._captured = False
        self._recorder: _Recorder | None = None
        self._open_group: int | None = None
        self._groups: dict[int, list[int]] = {}
        self._capture_stream = None
        # (stream, its replay number) of this graph's last replay and of the one before it
        self._last_replay: tuple[object, int] | None = None
        self._previous_replay: tuple[object, int] | None = None

    # capture ---------------------------------------------------------------------------
    def capture_begin(self, pool=None, capture_error_mode="global", report_shape=True) -> None:
        global capturing
        from torch_npu import npu

        if capturing is not None:
            raise GraphCaptureError("another NPU graph capture is underway in this process")
        stream = npu.current_stream()
        if stream is npu.default_stream():
            raise GraphCaptureError(
                "NPU graph capture on the default stream; capture on a side stream "
                "(torch.npu.graph makes one when none is given)"
            )
        self.reset()
        self._capture_stream = stream
        self._pool = pool if pool is not None else _graph_pool_handle()
        capturing = self
        _wrap_collective_waits()
        _syncs.ensure_wrappers()
        _syncs.drained()
        self._recorder = _Recorder(self)
        _push_below_graph_modes(self._recorder)

    def capture_end(self) -> None:
        global capturing
        if capturing is not self:
            raise GraphCaptureError("capture_end without a capture underway on this graph")
        _remove_below_graph_modes(self._recorder)
        self._recorder = None
        capturing = None
        _syncs.drained()  # the captured ops were recorded, not launched
        if self._open_group is not None:
            raise GraphCaptureError("capture ended inside a task group (graph_task_group_begin without _end)")
        self._captured = True

    def replay(self) -> None:
        global waiting
        from torch_npu import npu

        if not self._captured:
            raise GraphCaptureError("replay of a graph that was not captured")
        if capturing is not None:
            raise GraphCaptureError("replay during a capture")
        refuse_while_a_replay_waits("a replay")
        stream = npu.current_stream()
        stream.launched += 1
        self._previous_replay, self._last_replay = self._last_replay, (stream, stream.launched)
        stats["replays"] += 1
        _contract.calls["graph::replay"] += 1  # the call log (TORCH_NPU_DOUBLE_CALL_LOG) counts them
        run = _Replay(self, stream.launched)
        if not run.advance():
            waiting = run

    def check_update_order(self, update_stream) -> None:
        """An update of this graph on ``update_stream``: after every earlier replay of it, and
        not after the replay (if any) that waits for this update."""
        waits = waiting if waiting is not None and waiting.graph is self else None
        finished = self._previous_replay if waits is not None else self._last_replay
        if waits is not None:
            stream, seq = self._last_replay
            if update_stream.waited_for(stream) >= seq:
                raise GraphReplayHang(
                    "the update stream waits for the replay that waits for this update (it waited for "
                    "the replay stream after the replay was launched): take the wait before the replay"
                )
        if finished is not None and update_stream.waited_for(finished[0]) < finished[1]:
            raise GraphUpdateRace(
                "the update would rewrite task groups of an earlier replay of this graph that may still "
                "be running on the device: the update stream must wait for the replay stream first"
            )

    def reset(self) -> None:
        from torch_npu import npu

        npu._device_memory_used(-self.pool_bytes())
        self._tasks, self._pool_storages, self._groups = [], {}, {}
        self._captured, self._open_group = False, None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: modules may be gone
            self.reset()

    def pool(self):
        return self._pool

    # the double's own read-outs, for tests and the graph benchmark
    def tasks(self) -> list[str]:
        return [str(t) if isinstance(t, _HostTask) else str(t.func) for t in self._tasks]

    def pool_bytes(self) -> int:
        return sum(s.nbytes() for s in self._pool_storages.values())

    # recording -------------------------------------------------------------------------
    def _owned(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._pool_storages

    def _adopt(self, value) -> None:
        from torch_npu import npu

        for t in _tensors(value):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._pool_storages:
                self._pool_storages[storage.data_ptr()] = storage
                npu._device_memory_used(storage.nbytes())  # the pool is device memory

    def _freeze(self, value):
        """An argument as the task keeps it: tensors by memory, Python values as they are now,
        handles (a process group, a reduce op) by reference."""
        if isinstance(value, torch.Tensor):
            return _Memory(value, self._owned(value))
        if isinstance(value, (list, tuple)):
            return type(value)(self._freeze(v) for v in value)
        if isinstance(value, _PLAIN):
            return copy.deepcopy(value)
        return value

    def _task(self, func, args, kwargs, outputs) -> _Task:
        if func is torch.ops.aten.fill_.Tensor and len(args) > 1 and _host_made_scalar(args[1]):
            # ``t[i] = <Python number>``: torch makes the number a 0-dim tensor on the host for
            # a host ``t`` (every tensor here) but on the device for an NPU ``t``, by a fill
            # the graph captures into its own pool (ATen/TensorIndexing.h, ``scalarToTensor``
            # and ``copy_to``): the graph holds it, as its pool would
            self._adopt(args[1])
        frozen_kwargs = {k: self._freeze(v) for k, v in kwargs.items()}
        return _Task(func, [self._freeze(a) for a in args], frozen_kwargs, outputs)

    def _record(self, func, args, kwargs, outputs) -> None:
        self._tasks.append(self._task(func, args, kwargs, outputs))
        if self._open_group is not None:
            self._groups[self._open_group].append(len(self._tasks) - 1)

    def _record_host(self, task: _HostTask) -> None:
        if self._open_group is not None:
            raise GraphCaptureError(f"{task} inside a task group: torch_npu issues it before the group")
        self._tasks.append(task)

    def _group_begin(self) -> None:
        if self._open_group is not None:
            raise GraphCaptureError("graph_task_group_begin inside another task group")
        self._open_group = next(_handles)
        self._groups[self._open_group] = []

    def _group_end(self) -> tuple:
        """The task group's handle (opaque to torch_npu): this graph and the group."""
        if self._open_group is None:
            raise GraphCaptureError("graph_task_group_end without graph_task_group_begin")
        group, self._open_group = self._open_group, None
        return weakref.ref(self), group

    def _replace_group(self, group: int, tasks: list[_Task]) -> None:
        slots = self._groups[group]
        if len(tasks) != len(slots):
            raise GraphCaptureError(
                f"an update issued {len(tasks)} ops where task group {group} captured {len(slots)}"
            )
        for slot, task in zip(slots, tasks):
            self._tasks[slot] = task


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _written(schema, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes in place (its mutable and ``out`` arguments)."""
    written = []
    positional = list(args)
    for arg in schema.arguments:
        value = kwargs.get(arg.name) if arg.kwarg_only or not positional else positional.pop(0)
        if (arg.alias_info is not None and arg.alias_info.is_write) or arg.name == "out":
            written.extend(_tensors(value))
    return written


def _to_meta(value):
    return torch.device("meta") if isinstance(value, torch.device) else _contract._to_meta(value)


class _Recorder(dispatch_modes.TorchDispatchMode):
    """Below torch_npu's own dispatch mode: sees each op as the stream would receive it."""

    def __init__(self, graph: _Graph, update: bool = False) -> None:
        super().__init__()
        self.graph = graph
        self.update = update
        self.tasks: list[_Task] = []
        self.in_collective = False  # a collective (or its wait) runs at capture

    @contextlib.contextmanager
    def collective_running(self):
        """What a collective's own run and its wait dispatch (gloo's reduce-scatter copies its
        chunk out of a buffer of its own as its Work is waited for) is the collective's work,
        which the replay's run of it does again, not a task of the graph: it runs at once."""
        outer, self.in_collective = self.in_collective, True
        try:
            yield
        finally:
            self.in_collective = outer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.in_collective:
            return func(*args, **kwargs)
        if func.namespace not in _DEVICE_NAMESPACES:
            return self._run_inside(func, args, kwargs)
        if _syncs.at_host_tensor_site():  # host tensors a test named (_syncs.py): not device work
            return func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if name in _HOST_READS:
            raise GraphCaptureError(
                f"{func} reads a device value on the host during NPU graph capture; the device refuses "
                "this (the value does not exist until replay)"
            )
        if name in _NOT_CAPTURED:
            require(False, name, _NOT_CAPTURED[name], "called during an NPU graph capture")
        if name in _HOST_SIDE:
            return func(*args, **kwargs)  # a helper on the host: nothing launched
        if any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            # a view launches nothing; an op that may alias but copied (``to``, ``contiguous``
            # and ``reshape`` reach here whole under inference mode) made new memory: a task
            result = func(*args, **kwargs)
            inputs = {t.untyped_storage().data_ptr() for t in _tensors(args) + _tensors(kwargs)}
            made = [t for t in _tensors(result) if t.untyped_storage().data_ptr() not in inputs]
            if made:
                self.graph._adopt(made)
                self._keep(func, args, kwargs, _tensors(result))
            return result
        if name in _ALLOCATIONS:
            result = func(*args, **kwargs)
            self.graph._adopt(result)
            return result
        written = _written(func._schema, args, kwargs)
        if func.namespace == "c10d" and not self.update:
            # A collective runs at capture as well (on the capture's unwritten buffers): every
            # rank captures the same graphs in the same order, and its caller waits on the Work
            # it returns. The replay runs it again on the live memory.
            with self.collective_running():
                result = func(*args, **kwargs)
            self.graph._record(func, args, kwargs, None)
            return result
        if written:
            outputs, result = None, _mutated_result(func, written)
        else:
            meta = _meta(func, args, kwargs)
            if any(_overlapping(m) for m in _tensors(meta)):
                # expanded outputs are views (broadcast_tensors reaches here whole under
                # inference mode, its schema naming no alias): nothing launched
                result = func(*args, **kwargs)
                inputs = {t.untyped_storage().data_ptr() for t in _tensors(args) + _tensors(kwargs)}
                if all(t.untyped_storage().data_ptr() in inputs for t in _tensors(result)):
                    return result
                raise GraphCaptureError(
                    f"{func} makes outputs that overlap themselves: not modelled in a capture"
                )
            result = _real_like(meta)
            self.graph._adopt(result)
            outputs = _tensors(result)
        self._keep(func, args, kwargs, outputs)
        return result

    def _run_inside(self, func, args, kwargs):
        """A Python custom op (vLLM's MoE wrapper): on the device its body runs at capture and
        its kernels are what the graph holds, so its body runs here with this recorder seeing
        the ops it issues. torch_npu's dispatch mode does not: torch stashes the modes while a
        mode handles an op, so a fused attention called inside a custom op is captured as a
        plain task, never updated, and replays its capture-time lengths (the platform keeps
        graphs off where attention would be one opaque op)."""
        try:
            kernel = torch.library.get_kernel(func, "CPU")
        except Exception:
            kernel = torch.library.get_kernel(func, "CompositeExplicitAutograd")
        dispatch_modes._push_mode(self)
        try:
            keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
            return kernel.call_boxed(keys, *args, **kwargs)
        finally:
            dispatch_modes._pop_mode()

    def _keep(self, func, args, kwargs, outputs) -> None:
        _syncs.launched()
        if self.update:
            stats["update_ops"] += 1
            _contract.calls["graph::update_op"] += 1
            self.tasks.append(self.graph._task(func, args, kwargs, outputs))
        else:
            self.graph._record(func, args, kwargs, outputs)


def _mutated_result(func, written):
    returns = func._schema.returns
    if not returns:
        return None
    if len(returns) == 1 and not str(returns[0].type).startswith("List"):
        return written[0]
    return tuple(written[: len(returns)])


def _meta(func, args, kwargs):
    try:
        return func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
    except Exception as e:  # no meta kernel, or an output size that depends on device data
        raise GraphCaptureError(
            f"{func} cannot be captured in an NPU graph: its output cannot be sized without running it "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e


def _overlapping(t: torch.Tensor) -> bool:
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))


def _real_like(meta):
    def real(m):
        if not isinstance(m, torch.Tensor):
            return m
        out = torch.empty_strided(m.shape, m.stride(), dtype=m.dtype)
        if out.is_floating_point():
            out.fill_(float("nan"))  # capture computed nothing
        return out

    return tree_map(real, meta)


def _push_below_graph_modes(mode) -> None:
    above = []
    while isinstance(dispatch_modes._get_current_dispatch_mode(), _graph_dispatch_mode_cls()):
        above.append(dispatch_modes._pop_mode())
    dispatch_modes._push_mode(mode)
    for m in reversed(above):
        dispatch_modes._push_mode(m)


def _remove_below_graph_modes(mode) -> None:
    above = []
    while dispatch_modes._get_current_dispatch_mode() is not mode:
        above.append(dispatch_modes._pop_mode())
    dispatch_modes._pop_mode()
    for m in reversed(above):
        dispatch_modes._push_mode(m)


def _graph_dispatch_mode_cls():
    graphs = sys.modules.get("torch_npu.npu.graphs")
    return graphs._GraphDispatchMode if graphs is not None else ()


# -- torch_npu._C names -------------------------------------------------------------------
def _graph_pool_handle():
    return (0, next(_handles))


def _npu_isCurrentStreamCapturing() -> bool:
    return capturing is not None


def _graph_task_group_begin(stream) -> None:
    if capturing is None:
        raise GraphCaptureError("graph_task_group_begin outside a capture")
    capturing._group_begin()


def _graph_task_group_end(stream) -> tuple:
    if capturing is None:
        raise GraphCaptureError("graph_task_group_end outside a capture")
    return capturing._group_end()


def _graph_task_update_begin(stream, handle) -> None:
    global _updating
    graph_ref, group = handle
    graph = graph_ref()
    if graph is None or group not in graph._groups:
        raise GraphCaptureError(
            f"graph_task_update_begin: no captured task group {group} (graph reset or freed)"
        )
    if stream is graph._capture_stream:
        raise GraphCaptureError(
            "graph_task_update_begin on the graph's capture stream: the update stream must be "
            "another one (torch_npu docs: 图更新阶段的流同图捕获阶段的流必须不同)"
        )
    if _updating is not None:
        raise GraphCaptureError("graph_task_update_begin inside another update")
    graph.check_update_order(stream)
    recorder = _Recorder(graph, update=True)
    dispatch_modes._push_mode(recorder)
    _updating = (graph, group, recorder)


def _graph_task_update_end(stream) -> None:
    global _updating
    if _updating is None:
        raise GraphCaptureError("graph_task_update_end without graph_task_update_begin")
    graph, group, recorder = _updating
    _updating = None
    _remove_below_graph_modes(recorder)
    graph._replace_group(group, recorder.tasks)


def _weak_ref_tensor(tensor):
    return tensor  # the double cannot alias without owning; the tensor stands for its address


class ExternalEvent:
    """``torch.npu.ExternalEvent``: ordering between an update stream and a graph's stream.
    Work runs in program order here; what the double keeps is whether the event has been
    recorded since the last wait, which a captured wait needs at replay."""

    def __init__(self) -> None:
        self.recorded = False

    def record(self, stream=None) -> None:
        if capturing is not None:
            capturing._record_host(_HostTask("ExternalEvent.record", self._set))
        else:
            self._set()
            _resume_if_waiting_on(self)

    def wait(self, stream=None) -> None:
        if capturing is not None:
            capturing._record_host(_HostTask("ExternalEvent.wait", self._wait, waits_for=self))
        else:
            self._wait()

    def reset(self, stream=None) -> None:
        if capturing is not None:
            capturing._record_host(_HostTask("ExternalEvent.reset", self._clear))
        else:
            self._clear()

    def _set(self) -> None:
        self.recorded = True

    def _clear(self) -> None:
        self.recorded = False

    def _wait(self) -> None:
        if not self.recorded:
            raise GraphReplayHang(
                "a graph task waits for an ExternalEvent that nothing recorded since its last wait: "
                "on the device the stream would block for ever; update the graph (which records "
                "the event) before every replay"
            )
        self.recorded = False  # a wait resets the event


def _resume_if_waiting_on(event: ExternalEvent) -> None:
    """A replay stopped at a wait for ``event`` runs on (to its next unrecorded wait, or the end)."""
    global waiting
    if waiting is not None and waiting.blocked_on is event and not waiting.running and waiting.advance():
        waiting = None


def _identity_deepcopy_for_graph_code() -> None:
    """Tensors and parameters (which deep-copy by their own method) alike."""
    for cls in (torch.Tensor, torch.nn.Parameter):
        cls.__deepcopy__ = _identity_for_graph_code(cls.__deepcopy__)


def _identity_for_graph_code(original):
    def __deepcopy__(self, memo):
        try:
            caller = sys._getframe(2).f_globals.get("__name__")
        except ValueError:  # called from the top of a stack
            caller = None
        return self if caller in _GRAPH_MODULES else original(self, memo)

    return __deepcopy__


# -- loading torch_npu's graph code from the wheel ------------------------------------------
def install(torch_npu_module, wheel) -> None:
    import torch_npu._C as c

    c._NPUStreamBase = type("_NPUStreamBase", (), {})  # the wheel's "compiled" marker
    c._NPUGraph = _Graph
    for name in (
        "_graph_pool_handle",
        "_npu_isCurrentStreamCapturing",
        "_graph_task_group_begin",
        "_graph_task_group_end",
        "_graph_task_update_begin",
        "_graph_task_update_end",
        "_weak_ref_tensor",
    ):
        setattr(c, name, globals()[name])
    c._super_kernel_scope_begin = c._super_kernel_scope_end = _refused("super kernel scopes")

    npu = torch_npu_module.npu
    npu.ExternalEvent = ExternalEvent
    npu.host_empty_cache = lambda: None
    modules = [
        ("torch_npu._compiler", None),
        ("torch_npu._compiler._config", "torch_npu/_compiler/_config.py"),
        (
            "torch_npu.npu._npugraph_handlers.npugraph_handler",
            "torch_npu/npu/_npugraph_handlers/npugraph_handler.py",
        ),
        ("torch_npu.npu._npugraph_handlers.ifa_handler", "torch_npu/npu/_npugraph_handlers/ifa_handler.py"),
        (
            "torch_npu.npu._npugraph_handlers.simple_handler",
            "torch_npu/npu/_npugraph_handlers/simple_handler.py",
        ),
        (
            "torch_npu.npu._npugraph_handlers._fa3_graph_handler",
            "torch_npu/npu/_npugraph_handlers/_fa3_graph_handler.py",
        ),
        ("torch_npu.npu._npugraph_handlers", "torch_npu/npu/_npugraph_handlers/__init__.py"),
        ("torch_npu.npu.graphs", "torch_npu/npu/graphs.py"),
    ]
    made = {}
    for name, member in sorted(modules, key=lambda m: m[0].count(".")):  # packages before members
        module = types.ModuleType(name)
        package, _, leaf = name.rpartition(".")
        is_package = member is None or member.endswith("__init__.py")
        module.__package__ = name if is_package else package
        if is_package:
            module.__path__ = []
        sys.modules[name] = made[name] = module
        setattr(sys.modules[package], leaf, module)
    for name, member in modules:
        if member is not None:
            module = made[name]
            module.__file__ = f"{wheel.filename}!{member}"
            source = wheel.read(member).decode()
            # torch's config modules read their own source (inspect); tracebacks show it too
            linecache.cache[module.__file__] = (len(source), None, source.splitlines(True), module.__file__)
            exec(compile(source, module.__file__, "exec", dont_inherit=True), module.__dict__)
            if module.__dict__.get("torch") is torch:
                module.torch = _TorchWithNpu(npu)
    graphs = sys.modules["torch_npu.npu.graphs"]
    for name in graphs.__all__:
        setattr(npu, name, getattr(graphs, name))
    _identity_deepcopy_for_graph_code()


class _TorchWithNpu:
    """``torch`` as torch_npu's graph code sees it: with ``torch.npu`` the double's device
    module, which the real torch_npu registers at import and the double registers process-wide
    only when it pretends NPUs exist."""

    def __init__(self, npu) -> None:
        self.npu = npu

    def __getattr__(self, name):
        return getattr(torch, name)


def _refused(what: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"the torch_npu contract double does not model {what}")

    return call
