"""Launch cache: relaunch a compiled kernel without ``JITFunction.run``'s per-call binder.

``kernel[grid](*args, **kwargs)`` costs ~25 µs of host time per launch in Triton 3.6 (binding ~50 arguments,
specialising each, hashing the specialisation, building launch metadata), as much as a whole small-shape kernel.
``launch(kernel, grid, *args, **kwargs)`` makes the same call. The first call with a given key goes through Triton's
own ``run`` and records the ``CompiledKernel`` it returns; later calls with that key hand the same arguments straight to
that kernel's launcher, as ``run`` would.

The key refines Triton's: for every argument its type, and
- tensors: dtype and whether ``data_ptr()`` is 16-byte aligned (Triton's pointer specialisation);
- tensor descriptors: the base's dtype, the block shape and the padding (Triton's ``tensordesc<dtype[block]>``), and a
  Gluon descriptor's shared-memory layout (Gluon's ``tensordesc<dtype[block],layout>``);
- anything else (ints, floats, bools, None, strings): the value itself, which covers ``== 1``, ``% 16 == 0``, the
  int32/int64/uint64 range and every constexpr;
plus the launch options (``num_warps``...), the current device, and the knobs ``run`` folds into its options
(``debug``, ``instrumentation_mode``). Equal keys therefore mean equal Triton cache keys, so the same compiled kernel
(tests/ops/test_launch.py checks this against Triton's binder). The key is finer than Triton's (it holds shapes and
strides), so a new shape costs one ordinary call.

Gluon kernels (``GluonJITFunction``, a ``JITFunction`` whose ``run`` is the same) are kept alike.

Everything unusual takes the ordinary path, every call: the interpreter (``TRITON_INTERPRET=1`` makes kernels
``InterpretedFunction``), a launch hook or pre-run hook installed, a parameter left to its default, an argument of a
type outside the list above, an unhashable option, a callable grid, a non-CUDA target (ROCm specialises tensors on
their storage size as well) and a Triton other than 3.6 (the hit path uses its launcher's calling convention).
"""

from __future__ import annotations

import functools
import os
from operator import itemgetter

import torch
import triton
from triton import knobs
from triton.knobs import HookChain
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from .._validate import bounded_put  # noqa: F401 (the launchers' per-metadata tables)

try:  # Triton 3.6's CUDA launcher, which a Relaunch calls without its per-launch Python (_direct)
    from triton.backends.nvidia import driver as nvidia_driver
except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
    nvidia_driver = None
try:  # Gluon as triton 3.6 has it (ops/forward_sm90.py, backward_sm90.py)
    from triton.experimental.gluon._runtime import GluonJITFunction
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:  # pragma: no cover - other Triton versions
    GluonJITFunction = GluonTensorDescriptor = None

_VALUE_TYPES = frozenset({int, float, bool, str, type(None)})  # hashable and keyed by value
# Exact types only: another tensor or descriptor subclass may specialise differently, so it takes run().
_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_DESCRIPTOR_TYPES = frozenset({TensorDescriptor, GluonTensorDescriptor} - {None})
_KERNEL_TYPES = frozenset({JITFunction, GluonJITFunction} - {None})
_KEYED_TYPES = _VALUE_TYPES | _TENSOR_TYPES | _DESCRIPTOR_TYPES
# ONLINEATTN_LAUNCH_CACHE=0 (or false/off/no) turns the cache off (every launch through run()), for A/B timing and
# as an escape hatch. The hit path calls CompiledKernel.run with Triton 3.6's private argument order, so any other
# Triton version takes run() every call.
enabled = (os.environ.get("ONLINEATTN_LAUNCH_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")
           and triton.__version__.startswith("3.6."))
MAX_ENTRIES = 1024  # per kernel: shapes enter the key, so a stream of new shapes (varlen batches) must not grow it


class _Layout:
    """Where the tensors, descriptors and plain values sit in one kernel's bound arguments, for one tuple of types."""

    __slots__ = ("values", "tensors", "array_positions", "descriptors")

    def __init__(self, types: tuple):
        positions = lambda kinds: [i for i, t in enumerate(types) if t in kinds]  # noqa: E731
        self.values = _getter(positions(_VALUE_TYPES))
        self.tensors = _getter(positions(_TENSOR_TYPES))
        self.array_positions = tuple(positions(_TENSOR_TYPES | _DESCRIPTOR_TYPES))  # what a Relaunch may swap
        self.descriptors = _getter(positions(_DESCRIPTOR_TYPES))


class _Kernel:
    """Per ``JITFunction``: how to order a call's arguments as ``run`` binds them, the layouts seen, the entries."""

    __slots__ = ("fn", "param_names", "binders", "layouts", "entries")

    def __init__(self, fn: JITFunction):
        self.fn = fn
        self.param_names = tuple(p.name for p in fn.params)
        self.binders = {}  # (len(args), kwargs names) -> (getter of the remaining params, getter of the options)
        self.layouts = {}  # types of the bound arguments -> _Layout, or None where a type is outside the key's list
        self.entries = {}  # key -> CompiledKernel

    def binder(self, n_args: int, names: tuple):
        binder = self.binders.get((n_args, names), False)
        if binder is False:
            rest = self.param_names[n_args:]
            options = tuple(name for name in names if name not in rest)  # call order, as Triton's key has them
            # every parameter passed (no defaults to fill in), options apart: anything else is left to run()
            ok = set(rest) <= set(names) and not set(options) & set(self.param_names)
            binder = (_getter(list(rest)), _getter(list(options)), options) if ok else None
            self.binders[(n_args, names)] = binder
        return binder

    def layout(self, types: tuple):
        layout = self.layouts.get(types, False)
        if layout is False:
            layout = _Layout(types) if all(t in _KEYED_TYPES for t in types) else None
            self.layouts[types] = layout
        return layout


# id(JITFunction) -> _Kernel. By id: a JITFunction hashes by its source's hash, a Python call per lookup. The _Kernel
# holds the JITFunction, so the id cannot be reused while the entry lives.
_kernels: dict = {}


def _getter(keys: list):
    """``itemgetter`` that always returns a tuple (itemgetter of one key returns the bare item)."""
    if not keys:
        return lambda _: ()
    if len(keys) == 1:
        key = keys[0]
        return lambda x: (x[key],)
    return itemgetter(*keys)


def _idle(hook) -> bool:
    return hook is None or (type(hook) is HookChain and not hook.calls)


def bind(kernel, args: tuple, kwargs: dict):
    """``(state, bound, key)``: the call's arguments in ``run``'s bound order and the cache key, or None where the
    call is one this cache leaves to ``run``. The key omits the device and the knobs (``launch`` adds them)."""
    if type(kernel) not in _KERNEL_TYPES or kernel.pre_run_hooks:
        return None
    state = _kernels.get(id(kernel))
    if state is None:
        state = _kernels[id(kernel)] = _Kernel(kernel)
    binder = state.binder(len(args), tuple(kwargs))
    if binder is None:
        return None
    params, options, option_names = binder
    bound = args + params(kwargs)
    types = tuple(map(type, bound))
    layout = state.layout(types)
    if layout is None:
        return None
    tensors = tuple([(x.dtype, x.data_ptr() % 16 == 0) for x in layout.tensors(bound)])
    descriptors = tuple([_descriptor_key(d) for d in layout.descriptors(bound)])
    # The layout stands for the types (one layout per tuple of types, per kernel) and hashes by id: cheaper than them.
    key = (layout, layout.values(bound), tensors, descriptors, option_names, options(kwargs))
    return state, bound, key


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, skipping Triton's binder when this key was launched before."""
    looked = _lookup(kernel, grid, args, kwargs)
    if looked is None:
        return kernel[grid](*args, **kwargs)
    state, values, key, device, compiled = looked
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        if compiled is not None:  # None: a jit_cache_hook skipped the compile
            if len(state.entries) >= MAX_ENTRIES:
                state.entries.clear()
            state.entries[key] = compiled.result() if hasattr(compiled, "result") else compiled
        return compiled
    if not _globals_unchanged(kernel):  # run() raises its error for a changed global: let it
        return kernel[grid](*args, **kwargs)
    _run(compiled, grid, device, values)
    return compiled


def _lookup(kernel, grid, args: tuple, kwargs: dict):
    """``(state, bound values, full key, device, CompiledKernel or None)`` for a call the cache keeps, None for one it
    leaves to ``run`` (module docstring)."""
    rt = knobs.runtime
    if not (enabled and type(grid) is tuple and _hooks_idle(rt)):
        return None
    bound = bind(kernel, args, kwargs)
    if bound is None:
        return None
    state, values, key = bound
    device = driver.active.get_current_device()
    if not _cuda_target(device):
        return None
    key = (key, device, rt.debug, knobs.compilation.instrumentation_mode)
    try:
        compiled = state.entries.get(key)
    except TypeError:  # an unhashable option value: run() decides what it means
        return None
    return state, values, key, device, compiled


def _hooks_idle(rt) -> bool:
    return _idle(rt.launch_enter_hook) and _idle(rt.launch_exit_hook)


def _globals_unchanged(kernel) -> bool:
    """``run()``'s check that the globals the kernel read at compile time still hold the same values."""
    for (name, _), (value, globals_dict) in kernel.used_global_vals.items():
        if globals_dict.get(name, _MISSING) != value:
            return False
    return True


def _run(compiled, grid: tuple, device, values: tuple) -> None:
    """Launch ``compiled`` with the bound argument values, as ``run`` does (Triton 3.6's launcher convention)."""
    compiled.run(*_grid3(grid), driver.active.get_current_stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *values)


def _grid3(grid: tuple) -> tuple:
    """A grid of one to three dims as the launcher's three (missing dims 1)."""
    return grid + (1,) * (3 - len(grid))


class Relaunch:
    """One launch kept for repeats that differ only in their leading arguments, tensors and tensor descriptors (same
    types in the same places; every other argument equal): ``relaunch(grid, arrays)`` launches the compiled kernel
    with them, or returns False, launching nothing, where the call might specialise differently (a tensor's type or
    16-byte alignment, a descriptor's dtype, block shape, padding or Gluon layout changed; another device; a hook,
    pre-run hook, knob or global the kernel read changed since), or, for a direct launch, a tensor is not on CUDA
    (Triton's launcher would refuse its pointer), and so needs ``launch``. The two halves are
    ``ready(arrays)`` and ``go(grid, arrays)``, for callers that must know several launches can be repeated before
    starting any. ``prepare`` makes one."""

    __slots__ = ("kernel", "compiled", "rest", "types", "aligned", "tensor_at", "descriptor_at", "descriptor_keys",
                 "device", "knobs", "options", "direct")

    def __init__(self, kernel, compiled, arrays: tuple, rest: tuple, device, knob_values: tuple, options: dict):
        self.kernel, self.compiled, self.rest = kernel, compiled, rest
        self.types = tuple(map(type, arrays))
        self.tensor_at = _getter([i for i, t in enumerate(self.types) if t not in _DESCRIPTOR_TYPES])
        self.descriptor_at = [i for i, t in enumerate(self.types) if t in _DESCRIPTOR_TYPES]
        self.aligned = tuple([x.data_ptr() % 16 == 0 for x in self.tensor_at(arrays)])
        self.descriptor_keys = _descriptor_keys(arrays, self.descriptor_at)
        self.device, self.knobs = device, knob_values
        self.options = options  # the launch options (num_warps...): not needed to relaunch, kept for checks
        self.direct = _direct(compiled, self.types)

    def __call__(self, grid: tuple, arrays: tuple) -> bool:
        pointers = self._pointers(arrays)
        if pointers is None:
            return False
        self.go(grid, arrays, pointers)
        return True

    def ready(self, arrays: tuple) -> bool:
        """Whether a call with these leading arguments launches the kept kernel (see the class docstring)."""
        return self._pointers(arrays) is not None

    def go(self, grid: tuple, arrays: tuple, pointers: list | None = None) -> None:
        """Launch the kept kernel with these leading arguments; only after ``ready(arrays)``. ``pointers``: their
        tensors' data pointers, where the caller has them (``__call__``)."""
        if self.direct is None:
            _run(self.compiled, grid, self.device, arrays + self.rest)
            return
        if pointers is None:
            pointers = [x.data_ptr() for x in self.tensor_at(arrays)]
        launcher, fixed, metas = self.direct
        if self.descriptor_at:
            args, at = [], iter(pointers)
            for x, meta in zip(arrays, metas):
                if meta is _TENSOR:
                    args.append(next(at))
                else:
                    args.extend(_descriptor_args(x, meta))
        else:
            args = pointers
        launcher(*_grid3(grid), driver.active.get_current_stream(self.device), *fixed, *args, *self.rest)

    def _pointers(self, arrays: tuple) -> list | None:
        """``ready``: the tensors' data pointers where a call with these arrays launches the kept kernel, else None.
        A direct launch passes them to the C launcher as ints, which skips its ``data_ptr()`` call and its
        ``cuPointerGetAttribute`` check per tensor (~0.3 µs each); so there every tensor must be a CUDA one (that
        check's point: anything else is declined, and ``launch`` raises Triton's error for it)."""
        rt = knobs.runtime
        if not (enabled and _hooks_idle(rt) and not self.kernel.pre_run_hooks
                and (rt.debug, knobs.compilation.instrumentation_mode) == self.knobs):
            return None
        if tuple(map(type, arrays)) != self.types:
            return None
        tensors = self.tensor_at(arrays)
        pointers = [x.data_ptr() for x in tensors]
        if tuple([p % 16 == 0 for p in pointers]) != self.aligned:
            return None
        if self.direct is not None:
            if not all([x.is_cuda for x in tensors]):
                return None
            # Triton 3.6's CUDA driver asks torch.cuda.current_device(), whose Python re-checks CUDA's lazy
            # initialisation; with CUDA tensors in hand it is initialised, so its C call answers alone (that
            # Python was ~3 % of a decoding step's host time under cProfile on the device, NOTES v43).
            device = torch._C._cuda_getDevice()
        else:
            device = driver.active.get_current_device()
        if self.descriptor_at and _descriptor_keys(arrays, self.descriptor_at) != self.descriptor_keys:
            return None
        if device != self.device or not _globals_unchanged(self.kernel):
            return None
        return pointers

_TENSOR = object()  # in a direct launch's per-array metadata: a tensor, passed as its data pointer


def _direct(compiled, types: tuple):
    """``(C launcher, its fixed arguments, per leading array: _TENSOR or its descriptor's metadata)`` to launch
    ``compiled`` as Triton 3.6's ``CudaLauncher`` does, minus its Python: the C launcher that its
    ``wrap_handle_tensordesc`` wraps, given each descriptor's arguments as ``make_tensordesc_arg`` expands them
    (``_descriptor_args`` keeps those of a descriptor kept by address). None where the launcher is not that one (the
    interpreter, another driver or version), allocates scratch memory per launch, or its descriptors are not exactly
    the leading arrays' (then ``go`` calls ``compiled.run``)."""
    run = compiled.run
    if nvidia_driver is None or type(run) is not getattr(nvidia_driver, "CudaLauncher", None):
        return None
    if run.global_scratch_size or run.profile_scratch_size:
        return None
    launcher, desc_at, desc_meta = run.launch, [], []
    if getattr(launcher, "__qualname__", "") == "wrap_handle_tensordesc.<locals>.inner":
        cells = dict(zip(launcher.__code__.co_freevars, [c.cell_contents for c in launcher.__closure__]))
        if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
            return None
        launcher, desc_at = cells["launcher"], sorted(cells["tensordesc_indices"])
        desc_meta = cells["tensordesc_meta"] or [None] * len(desc_at)
    elif not callable(launcher) or type(launcher).__name__ != "builtin_function_or_method":
        return None
    if desc_at != [i for i, t in enumerate(types) if t in _DESCRIPTOR_TYPES]:
        return None
    metas = dict(zip(desc_at, desc_meta))
    fixed = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
             None, None, None)  # function; cooperative, PDL; no scratch; the kernel's metadata; no launch hooks
    return launcher, fixed, tuple(metas.get(i, _TENSOR) for i in range(len(types)))


def _descriptor_args(d, meta) -> list:
    """``make_tensordesc_arg(d, meta)``: the CUtensorMap Triton's launcher builds from descriptor ``d`` for a kernel
    whose metadata for it is ``meta``, with d's shape and strides. A descriptor that carries a ``launch_args`` table
    (``keep_launch_args``: one ``forward_sm90.descriptor`` keeps by address, never changed afterwards) keeps its
    expansion there per kernel metadata: each build is a Python call and a driver call (cuTensorMapEncodeTiled)."""
    kept = d.__dict__.get("launch_args")
    if kept is None:
        return nvidia_driver.make_tensordesc_arg(d, meta)
    args = kept.get(id(meta))
    if args is None:  # the entry holds meta itself, so its id stays unique while the entry lives
        args = kept[id(meta)] = (meta, nvidia_driver.make_tensordesc_arg(d, meta))
    return args[1]


def keep_launch_args(d):
    """Mark descriptor ``d`` (whose geometry and base will not change) to keep its launcher arguments per kernel
    (``_descriptor_args``). Returns d."""
    d.launch_args = {}
    return d


class Address:
    """A kept descriptor's base: what a launch reads of its tensor (``data_ptr()``; ``dtype`` for the launch cache's
    key), without a reference that would keep the tensor's memory alive."""

    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"Address(0x{self.ptr:x}, {self.dtype})"


def keep_by_address(d, ptr: int):
    """Descriptor ``d`` of the tensor at ``ptr``, made fit to keep across calls over the same memory: its base becomes
    an ``Address`` (so a kept descriptor does not keep its tensor alive) and it keeps its launcher arguments
    (``keep_launch_args``). Returns d."""
    d.base = Address(ptr, d.base.dtype)
    return keep_launch_args(d)


def _descriptor_key(d) -> tuple:
    """What Triton specialises a tensor descriptor on: base dtype, block shape, padding; a Gluon one, its layout too
    (a hashable frozen value)."""
    return d.base.dtype, tuple(d.block_shape), d.padding, getattr(d, "layout", None)


def _descriptor_keys(arrays: tuple, positions: list) -> tuple:
    return tuple([_descriptor_key(arrays[i]) for i in positions])


def prepare(kernel, grid: tuple, n_arrays: int, *args, **kwargs):
    """``launch(kernel, grid, *args, **kwargs)``, then a ``Relaunch`` of it for repeats that change only the first
    ``n_arrays`` arguments (tensors or tensor descriptors); None where this call is not one the cache keeps, or where
    its tensors and descriptors are not exactly those first arguments."""
    launch(kernel, grid, *args, **kwargs)
    looked = _lookup(kernel, grid, args, kwargs)
    if looked is None:
        return None
    _, values, key, device, compiled = looked
    if compiled is None or key[0][0].array_positions != tuple(range(n_arrays)):  # arrays lead, all of them
        return None
    options = {name: kwargs[name] for name in key[0][4]}
    return Relaunch(kernel, compiled, tuple(values[:n_arrays]), tuple(values[n_arrays:]), device, key[2:], options)


def start(keep: bool, kernel, grid: tuple, n_arrays: int, *args, **kwargs):
    """``launch``; with ``keep``, ``prepare`` instead, returning its ``Relaunch`` (None where it cannot be kept)."""
    if keep:
        return prepare(kernel, grid, n_arrays, *args, **kwargs)
    launch(kernel, grid, *args, **kwargs)
    return None


_MISSING = object()
_CUDA_TARGET: dict = {}  # device -> whether its backend is "cuda"


def _cuda_target(device) -> bool:
    """Only CUDA targets use the cache: on ROCm, Triton also specialises each tensor on whether its storage fits
    2 GiB (buffer ops), which this key does not record."""
    ok = _CUDA_TARGET.get(device)
    if ok is None:
        ok = _CUDA_TARGET[device] = driver.active.get_current_target().backend == "cuda"
    return ok


def sm_count(device: torch.device, off_cuda: int) -> int:
    """The SMs of a CUDA device (by its index, or the current device's where it has none), or ``off_cuda`` for
    tensors elsewhere: a stand-in the caller's grids are sized for (the interpreter's, compile-only runs')."""
    if device.type != "cuda":
        return off_cuda
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Grid and block arithmetic for the launchers. triton.cdiv and triton.next_power_of_2 are constexpr functions in
# Triton 3.6: called from Python they go through a wrapper that costs ~2 µs a call, several per attention call.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n, for n >= 0 (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
