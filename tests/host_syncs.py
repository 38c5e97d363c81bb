"""Find, on any device (the CPU included), the operations that make a CUDA host wait for its GPU.

A host sync on CUDA is what stops a step from being captured in a CUDA graph and what makes an eager
layer wait for the GPU. ``torch.cuda.set_sync_debug_mode`` sees them only on a GPU, and CI has none;
these operations sync because of what they compute, whatever the device, so they can be found where
they are called:

* dispatcher operators whose CUDA kernels read a value back to size their output or to return a
  Python number: ``_local_scalar_dense`` (``item()``, ``bool()``, ``int()``, ``float()``),
  ``nonzero``, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without
  ``output_size``, ``equal``, and indexing by a boolean mask (a ``nonzero`` inside);
* Python-level reads of a tensor's data that bypass the dispatcher on the CPU: ``tolist()``,
  ``numpy()``, ``cpu()`` and ``to("cpu")`` with a literal ``"cpu"`` (a copy to the host from a GPU),
  unless the tensor holds host data (below): what ``cpu()`` returns does, so ``t.cpu().numpy()`` is
  one sync;
* copies of host data to the device: ``torch.tensor(data, device=d)``, ``torch.as_tensor(data,
  device=d)`` of Python or NumPy data, and ``t.new_tensor(data)``. These build the tensor on the
  host and copy it with ``non_blocking=False``, which on CUDA waits for the stream (pytorch#190217:
  ``torch.tensor(3.14, device="cuda")`` syncs, ``torch.full((), 3.14, device="cuda")`` does not).
  The CPU cannot tell ``d`` = the caller's CUDA device from a deliberate host tensor, so every such
  call with a ``device`` other than the literal string ``"cpu"`` is recorded;
* the same copy made in two steps: ``t.to(d)`` (or ``t.to(device=d)``) of a tensor built from host
  data (``torch.from_numpy``, or ``torch.tensor`` / ``torch.as_tensor`` of Python or NumPy data
  without a device, a factory's or a random draw's tensor made on the host, their views, reshapes,
  clones and casts, and the results of any operator whose tensor inputs are all host data), with
  ``d`` (or another tensor's device) not the literal ``"cpu"`` and without ``non_blocking=True``.
  (With ``non_blocking=True`` from pinned memory, as :func:`routelab._checks.to_device` copies,
  CUDA does not wait.)

Known over-report: ``F.one_hot(x, num_classes)`` checks its indices' range with ``item()`` on the CPU
only (its CUDA kernel does not when ``num_classes`` is given), and this recorder sees that check.

Importable from every test directory (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import routelab

__all__ = ["HostSync", "record_host_syncs"]

_aten = torch.ops.aten

#: Operators whose CUDA kernels read data back to the host.
_SYNCING_OPS = {
    _aten._local_scalar_dense.default, _aten.nonzero.default, _aten.argwhere.default, _aten.masked_select.default,
    _aten.bincount.default, _aten.equal.default, _aten.is_nonzero.default, _aten.unique_consecutive.default,
    _aten._unique2.default, _aten.unique_dim.default, _aten.repeat_interleave.Tensor, _aten.allclose.default,
}

#: Indexing operators that sync when an index is a boolean mask.
_INDEXING_OPS = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                 _aten._index_put_impl_.default}

#: Tensor methods that read data on the host without a dispatcher call on the CPU.
_HOST_READS = ("tolist", "numpy", "cpu")

#: Factories that build a tensor from host data (and copy it to ``device=`` when given one).
_HOST_DATA_FACTORIES = ("tensor", "as_tensor")

#: Factories that make their tensor on the host when given no device or the literal "cpu" (and a
#: random draw by a CPU generator, made on the host for the same numbers on every device): moving
#: the result to the device is a copy of host data.
_HOST_MADE = ("rand", "randn", "randint", "randperm", "arange", "zeros", "ones", "empty", "full", "eye", "linspace")

#: Tensor methods whose result of host data is host data too (views, reshapes, casts).
_HOST_DATA_KEEPERS = ("view", "reshape", "flatten", "unsqueeze", "squeeze", "t", "contiguous", "clone",
                      "double", "float", "long", "int", "half", "bfloat16")


@dataclass(frozen=True)
class HostSync:
    """One operation that syncs on CUDA: its name and where routelab called it."""

    op: str
    where: str

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


#: The folder that holds the imported ``routelab`` package (``src/`` in a checkout, ``site-packages``
#: in an install, or any copy on ``PYTHONPATH``): routelab's own frames are named from it.
_PACKAGE_ROOT = Path(routelab.__file__).resolve().parent.parent.as_posix() + "/"


def _caller() -> str:
    """The innermost frame outside torch and this module, as ``file:line``: ``routelab/...`` for
    routelab's own code wherever the package was imported from, otherwise the path as it is."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        name = Path(frame.filename).resolve().as_posix()
        if "/torch/" not in name and name.rsplit("/", 1)[-1] != "host_syncs.py":
            return f"{name.removeprefix(_PACKAGE_ROOT)}:{frame.lineno}"
    return "?"


class _Recorder(TorchDispatchMode):
    def __init__(self, found: list[HostSync], host_data: weakref.WeakValueDictionary[int, torch.Tensor]) -> None:
        super().__init__()
        self.found = found
        self.host_data = host_data

    def _all_host(self, values: object) -> bool:
        """Whether every tensor among ``values`` (nested in lists and tuples) holds host data, and
        there is at least one."""
        tensors = [v for v in _flat(values) if isinstance(v, torch.Tensor)]
        return bool(tensors) and all(self.host_data.get(id(t)) is t for t in tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        syncs = func in _SYNCING_OPS
        if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None:
            syncs = False
        if func in _INDEXING_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            syncs = any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
        if syncs:
            self.found.append(HostSync(str(func), _caller()))
        out = func(*args, **kwargs)
        if self._all_host((args, kwargs)):
            # An operation on host data alone runs on the host: its results are host data too (on a
            # GPU, an operation mixing host and device tensors is an error, or a 0-dim host scalar's).
            for t in _flat(out):
                if isinstance(t, torch.Tensor):
                    self.host_data[id(t)] = t
        return out


def _flat(values: object) -> Iterator[object]:
    """The leaves of nested lists, tuples and dicts (values)."""
    if isinstance(values, (list, tuple)):
        for v in values:
            yield from _flat(v)
    elif isinstance(values, dict):
        for v in values.values():
            yield from _flat(v)
    else:
        yield values


@contextlib.contextmanager
def record_host_syncs() -> Iterator[list[HostSync]]:
    """Record every operation inside the block that would sync a CUDA host with its GPU.

    Yields the list the block's syncs are appended to. ``item()``, ``bool()`` and the like are
    recorded once, as ``_local_scalar_dense``.
    """
    found: list[HostSync] = []
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def recording(name: str):  # noqa: ANN202
        original = originals[name]

        def read(self: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if host_data.get(id(self)) is not self:  # (reading host data waits for no GPU)
                found.append(HostSync(f"Tensor.{name}", _caller()))
            out = original(self, *args, **kwargs)
            if not isinstance(out, torch.Tensor):
                return out
            # What .cpu() returns is host data: t.cpu().numpy() is one sync, not two. (On the CPU it
            # returns t itself, which is not: an alias of it is, as a GPU's copy would be.)
            return holds_host_data(out.view_as(out) if out is self else out)

        return read

    # Tensors that hold host data (by id: a WeakSet would compare tensors with ==).
    host_data: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def holds_host_data(t: torch.Tensor) -> torch.Tensor:
        host_data[id(t)] = t
        return t

    def to_host(self: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        # Only a literal "cpu": on the CPU, t.to(t.device) or t.to(other) cannot be told from a
        # copy to the host, and on a GPU they are none.
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, str) and torch.device(target).type == "cpu" and host_data.get(id(self)) is not self:
            found.append(HostSync("Tensor.to(cpu)", _caller()))
        out = original_to(self, *args, **kwargs)
        if isinstance(target, str) and torch.device(target).type == "cpu":
            # on the host now, wherever it came from (an alias where the CPU returns t itself, as above)
            out = holds_host_data(out.view_as(out) if out is self else out)
        if host_data.get(id(self)) is self:
            # to(device, dtype, non_blocking) / to(dtype, non_blocking) / to(other, non_blocking)
            non_blocking = kwargs.get("non_blocking", next((a for a in args if isinstance(a, bool)), False))
            if not isinstance(target, (str, torch.device, torch.Tensor)):  # a dtype, or nothing: still host data
                holds_host_data(out)
            elif not (isinstance(target, str) and target == "cpu") and non_blocking is not True:
                # (to(other): other's device, taken as the caller's GPU as a device= is)
                found.append(HostSync("Tensor.to(device) of host data", _caller()))
        return out

    def keeping_host_data(name: str):  # noqa: ANN202
        original = view_likes[name]

        def same_data(self: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = original(self, *args, **kwargs)
            return holds_host_data(out) if host_data.get(id(self)) is self else out

        return same_data

    def from_numpy(array):  # noqa: ANN001, ANN202
        return holds_host_data(original_from_numpy(array))

    def drawing(name: str):  # noqa: ANN202
        sample = randoms[name]

        def draw(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = sample(*args, **kwargs)
            generator, device = kwargs.get("generator"), kwargs.get("device")
            on_host = (device is None or (isinstance(device, str) and device == "cpu")
                       or (generator is not None and generator.device.type == "cpu"))
            return holds_host_data(out) if on_host else out

        return draw

    def copying(name: str):  # noqa: ANN202
        factory = factories[name]

        def build(data, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            device = kwargs.get("device")
            from_host = not isinstance(data, torch.Tensor)
            if from_host and device is not None and not (isinstance(device, str) and device == "cpu"):
                found.append(HostSync(f"torch.{name}(host data, device=)", _caller()))
            out = factory(data, *args, **kwargs)
            return holds_host_data(out) if from_host and device is None else out

        return build

    def new_tensor(self: torch.Tensor, data, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if not isinstance(data, torch.Tensor):
            found.append(HostSync("Tensor.new_tensor(host data)", _caller()))
        return original_new_tensor(self, data, *args, **kwargs)

    original_to, original_new_tensor, original_from_numpy = torch.Tensor.to, torch.Tensor.new_tensor, torch.from_numpy
    factories = {name: getattr(torch, name) for name in _HOST_DATA_FACTORIES}
    view_likes = {name: getattr(torch.Tensor, name) for name in _HOST_DATA_KEEPERS}
    randoms = {name: getattr(torch, name) for name in _HOST_MADE}
    for name in _HOST_MADE:
        setattr(torch, name, drawing(name))
    for name in _HOST_DATA_KEEPERS:
        setattr(torch.Tensor, name, keeping_host_data(name))
    for name in _HOST_READS:
        setattr(torch.Tensor, name, recording(name))
    for name in _HOST_DATA_FACTORIES:
        setattr(torch, name, copying(name))
    torch.Tensor.to = to_host
    torch.Tensor.new_tensor = new_tensor
    torch.from_numpy = from_numpy
    try:
        with _Recorder(found, host_data):
            yield found
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for name, factory in factories.items():
            setattr(torch, name, factory)
        torch.Tensor.to = original_to
        torch.Tensor.new_tensor = original_new_tensor
        torch.from_numpy = original_from_numpy
        for name, original in view_likes.items():
            setattr(torch.Tensor, name, original)
        for name, original in randoms.items():
            setattr(torch, name, original)
        # torch.compile's trace rules look torch's functions and Tensor methods up by name once and
        # cache them: built while this block's wrappers stood in for torch.arange & co. (a compile
        # inside the block), they would refuse the restored originals in every later compile of the
        # process ("Dynamo does not know how to trace the builtin ... arange"). Rebuilt on demand.
        trace_rules = getattr(getattr(torch, "_dynamo", None), "trace_rules", None)
        if trace_rules is not None and hasattr(trace_rules, "clear_lru_cache"):
            trace_rules.clear_lru_cache()
