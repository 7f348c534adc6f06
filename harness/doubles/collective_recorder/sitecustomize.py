"""Test-only collective recorder. With ``VLLM_ASCEND_TEST_COLLECTIVES=DIR`` in the
environment, every Python process started with this directory on ``PYTHONPATH`` appends
each torch.distributed collective it issues (and vLLM's point-to-point
``cpu_all_reduce_``, as one all_reduce) to ``DIR/<pid>.jsonl``: the op, the global
ranks of its group, this process's global rank, the tensor's dtype and shape. The DP
tests read the files back to count metadata collectives per step and to compare the
sequences of the ranks. Without the variable nothing is imported or changed."""

import os

_DIR = os.environ.get("VLLM_ASCEND_TEST_COLLECTIVES")

if _DIR:
    import json
    import threading

    import torch.distributed as dist

    _lock = threading.Lock()
    _OPS = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "barrier",
        "gather",
        "scatter",
    )

    def _group_ranks(group):
        try:
            return (
                dist.get_process_group_ranks(group)
                if group is not None
                else list(range(dist.get_world_size()))
            )
        except Exception:  # a group this process is not in, or not initialised yet
            return None

    def _record(name, group, tensor):
        entry = {
            "op": name,
            "ranks": _group_ranks(group),
            "rank": dist.get_rank() if dist.is_initialized() else None,
            "dtype": str(getattr(tensor, "dtype", "")),
            "shape": list(getattr(tensor, "shape", [])),
        }
        with _lock, open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a") as out:
            out.write(json.dumps(entry) + "\n")

    def _wrap(name, fn):
        def recorded(*args, **kwargs):
            tensor = kwargs.get("tensor", args[0] if args else None)
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            _record(name, group, tensor)
            return fn(*args, **kwargs)

        recorded.__wrapped__ = fn
        return recorded

    for _name in _OPS:
        if hasattr(dist, _name):
            setattr(dist, _name, _wrap(_name, getattr(dist, _name)))

    # vLLM's cpu_all_reduce_ (Model Runner V2's DP step agreement) sums a small CPU tensor
    # with point-to-point sends on the gloo group, which the wrappers above do not see: it
    # is recorded as one all_reduce when vllm.distributed.parallel_state is imported.
    import importlib.abc
    import importlib.util
    import sys

    def _record_cpu_all_reduce(coordinator_cls):
        fn = coordinator_cls.cpu_all_reduce_

        def recorded(self, tensor):
            if tensor.device.type == "cpu" and tensor.is_contiguous():  # else dist.all_reduce
                _record("all_reduce", self.cpu_group, tensor)
            return fn(self, tensor)

        coordinator_cls.cpu_all_reduce_ = recorded

    class _AfterParallelState(importlib.abc.MetaPathFinder):
        NAME = "vllm.distributed.parallel_state"

        def find_spec(self, name, path, target=None):
            if name != self.NAME:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                _record_cpu_all_reduce(module.GroupCoordinator)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _AfterParallelState())
