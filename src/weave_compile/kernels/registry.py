"""The registry of implementations of ``weave::allreduce_add_rmsnorm``: one entry each.

An :class:`Implementation` says everything the rest of the package needs to know about one
implementation: its name, why it cannot run at a site (checked at compile time), the workspace it
reserves at compile time, how it runs (``run(rows, spec)``, at run time), the error it raises when
its buffers cannot grow now (inside CUDA-graph capture: the op falls back, logged), what it takes
(a scale, an eps tensor, an output slot, a LayerNorm), how ``auto`` treats it, and whether it is a fallback:
:func:`fallback` (``reference``: the CPU path and the oracle) or :func:`gpu_fallback` (``nccl``:
compiled work, what a CUDA site gets where nothing chosen can run; :mod:`.auto` says when). Everything that lists or
switches on implementations derives from here: the config's valid ``kernel`` names
(:func:`names`), the op's dispatch (``ops/allreduce_rmsnorm.py``), the fuse pass's
choice and reservation (:mod:`.auto`, :attr:`Implementation.reserve`) and what ``explain()``
reports.

Adding an implementation is one module that defines ``IMPLEMENTATION`` and one line in
:func:`_load_builtins` (or a :func:`register` call from anywhere, e.g. a test or a plugin).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, NamedTuple, Optional

import torch

from weave_compile.quant import QuantSpec

from .spec import FusedSpec, Rows

#: The ``kernel`` option that lets :mod:`.auto` choose; never an implementation's name.
AUTO = "auto"

#: ``(normed, residual_out)``, and the per-row scales third where the spec has an fp8 epilogue
#: (``FusedSpec.quant``, kind "row"; an empty tensor or nothing for "static").
Outputs = tuple[torch.Tensor, ...]


class NormTerms(NamedTuple):
    """What a site's op applies besides x and the residual, as dtypes (None: absent): what a
    reservation needs to compile every kernel variant the site can launch."""

    bias: Optional[torch.dtype]
    weight: Optional[torch.dtype]
    mid: Optional[torch.dtype]  # the norm's mid dtype (None: none)
    scale: Optional[torch.dtype]
    norm_bias: Optional[torch.dtype] = None  # a LayerNorm's bias, added after the weight


@dataclasses.dataclass(frozen=True)
class Site:
    """What the fuse pass knows of one site at compile time: the input of the capability checks,
    of the reservations and of ``auto``."""

    device: torch.device
    dtype: torch.dtype  # x's (the partial sums)
    residual_dtype: torch.dtype  # the residual output's
    out_dtype: torch.dtype  # the normed output's
    hidden: int
    group_name: str
    world_size: int
    num_tokens: Optional[int] = None  # the token count when static, None when symbolic
    size_hint: Optional[int] = None  # the token count, or Dynamo's hint of a symbolic one (None: no hint)
    #: ``(lowest, highest or None: unbounded)`` of a symbolic token count as the shape environment
    #: bounds it (``torch._dynamo.mark_dynamic(x, dim, min=, max=)``); None when static or unknown
    token_range: Optional[tuple[int, Optional[int]]] = None
    residual_in_dtype: Optional[torch.dtype] = None  # the residual input's (None: no residual)
    split: bool = False  # the token split will run on this graph
    #: the site reduces with a reduce-scatter of the model's own sequence shard (sequence
    #: parallelism): its plain graph already norms this rank's rows only
    sequence_parallel: bool = False
    has_scale: bool = False
    norm: str = "rmsnorm"  # the site's norm: "rmsnorm" or "layernorm" (``takes_layernorm``)
    eps_on_device: bool = False  # eps is a graph input living on the device
    out_in_place: bool = False  # outputs may stay in the symmetric output ring (option)
    comm_ctas: Optional[int] = None  # the thread blocks the op will run with (None: the default)
    terms: Optional[NormTerms] = None  # None: unknown (a reservation then covers every case)
    batch_invariant: bool = False  # the option: only implementations that claim it may run here
    #: the fp8 epilogue the site's op will run (``weave_compile.quant.QuantSpec``; None: none): only
    #: implementations with ``takes_quant`` may run here
    quant: Optional[QuantSpec] = None


@dataclasses.dataclass(frozen=True)
class Workspaces:
    """A design's table of reserved workspaces, as the measured choice frees those of a loser: the
    keys now held, and ``drop(keys)``, which forgets those entries (and whatever watches them), so
    their memory is freed once nothing else holds it. Every rank drops the same keys at the same
    point, after its group's last timing collective (a symmetric allocation may be freed
    collectively)."""

    keys: Callable[[], frozenset]
    drop: Callable[[Iterable], None]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of the fused op (see the module doc)."""

    name: str
    #: One line: the design, for docs and error messages.
    summary: str
    #: Compile time: why it cannot run at ``site`` (None if it can). May be collective (a
    #: symmetric-memory probe): every rank compiles the same graphs, so every rank calls it alike.
    check: Callable[[Site], Optional[str]]
    #: Run time: ``(normed [T, H], residual_out [T, H] or this rank's [S, H] shard)`` for ``rows``,
    #: or None where it must fall back now (e.g. tensors on a device it does not run on).
    run: Callable[[Rows, FusedSpec], Optional[Outputs]]
    #: Compile time, collective: allocate the workspace the site will use, outside any CUDA graph.
    reserve: Optional[Callable[[Site], None]] = None
    #: The table ``reserve`` adds to (designs that share a table share the object): the measured
    #: choice drops the entries its timing added for designs that won nowhere.
    workspaces: Optional[Workspaces] = None
    #: Raised by ``run`` where its buffers are too small and cannot grow now (CUDA-graph capture):
    #: the op then runs the fallback instead, with the reason logged once.
    capacity_error: Optional[type[Exception]] = None
    takes_scale: bool = False  # multiplies the reduced sum by a 0-d ``scale``
    takes_eps_tensor: bool = False  # reads eps from a 0-d device tensor (the others read it on the host)
    takes_out_slot: bool = False  # can leave ``normed`` in a slot of the symmetric output ring
    #: computes ``norm="layernorm"`` (the row's mean subtracted, the variance of the centred row)
    #: and its post-norm bias (``norm_bias``, after the weight); the others compute RMSNorm only
    takes_layernorm: bool = False
    #: With the op's ``batch_invariant`` set, adds the ranks' partial sums of a row in rank order
    #: (0, 1, ..., N-1) in fp32 and computes the rest of the row as for any other row: a row's
    #: outputs are then the same whatever T, the other rows, the launch and the owning rank.
    batch_invariant: bool = False
    #: The device types on which ``batch_invariant`` holds (a claim checked there; elsewhere the
    #: option refuses it) and, where it does not hold everywhere, why not.
    batch_invariant_on: tuple[str, ...] = ("cpu", "cuda")
    batch_invariant_why: str = ""
    #: Computes the fp8 epilogue (``FusedSpec.quant``: the normed rows quantized on this rank's rows,
    #: gathered as fp8 codes and row scales; ``weave_compile.quant``); the others return bf16 rows.
    takes_quant: bool = False
    #: The implementation every other falls back to off GPUs, and the oracle (exactly one is
    #: registered); on a GPU it runs only where forced (its body is eager torch ops).
    fallback: bool = False
    #: The fallback on CUDA devices (at most one is registered): compiled work, never an eager chain;
    #: where it is measured slower than plain Inductor the site stays as written (:mod:`.auto`).
    gpu_fallback: bool = False
    #: What explain() adds where it is chosen (e.g. what a probe found); None: nothing.
    note: Optional[Callable[[Site], str]] = None
    #: The order of the preferred designs and of the "also available" note (lower first); None:
    #: auto takes it only from measured rows (it takes no design by rank alone).
    auto_rank: Optional[int] = None
    #: ``auto`` takes it ahead of the measured table wherever it can run (and its crossover and
    #: readiness allow).
    auto_preferred: bool = False
    #: ``auto`` takes it only for a static token count whose message T x H x itemsize is at most this.
    auto_max_bytes: Optional[int] = None
    #: False: ``auto`` never takes it (not measured where it matters yet); forcing it still works.
    auto_ready: bool = True


_IMPLEMENTATIONS: dict[str, Implementation] = {}
_loaded = False

#: The package's implementations, each the module of its name (``kernels/<name>``), in listing
#: order (config errors, docs): the fallback first. Their names are known without importing them
#: (:func:`names`: building ``Options`` checks a kernel name and loads no kernel).
BUILTINS = ("reference", "p2p", "multimem", "oneshot", "ce", "nccl")


def _load_builtins() -> None:
    """Register the package's implementations (once, on first use: their modules import triton)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib

    for name in BUILTINS:
        register(importlib.import_module(f"{__package__}.{name}").IMPLEMENTATION)


def register(impl: Implementation) -> Implementation:
    """Add ``impl``; its name must be new (and not ``auto``), and only one may be the fallback."""
    _load_builtins()
    if impl.name == AUTO or not impl.name:
        raise ValueError(f"{impl.name!r} cannot name an implementation")
    if impl.name in _IMPLEMENTATIONS:
        raise ValueError(f"an implementation named {impl.name!r} is already registered")
    if impl.fallback and any(e.fallback for e in _IMPLEMENTATIONS.values()):
        raise ValueError(f"{impl.name!r}: a fallback implementation ({fallback().name}) is already registered")
    if impl.gpu_fallback and any(e.gpu_fallback for e in _IMPLEMENTATIONS.values()):
        raise ValueError(f"{impl.name!r}: a GPU fallback ({gpu_fallback().name}) is already registered")
    _IMPLEMENTATIONS[impl.name] = impl
    return impl


def unregister(name: str) -> Implementation:
    """Remove and return the implementation registered as ``name``."""
    _load_builtins()
    return _IMPLEMENTATIONS.pop(get(name).name)


def replace(impl: Implementation) -> Implementation:
    """Put ``impl`` in place of the registered implementation of its name; returns the old one."""
    old = get(impl.name)
    _IMPLEMENTATIONS[impl.name] = impl
    return old


def invariant_on(impl: Implementation, device: torch.device) -> Optional[str]:
    """Why ``impl`` cannot honour ``batch_invariant`` on ``device`` (None if it can)."""
    if not impl.batch_invariant:
        return (f"batch_invariant: {impl.name} does not add the partial sums in a fixed order (its order may depend "
                "on the token count or the rank that owns a row)")
    if torch.device(device).type not in impl.batch_invariant_on:
        return (f"batch_invariant on {torch.device(device).type}: {impl.name} is batch-invariant on "
                f"{', '.join(impl.batch_invariant_on)} only ({impl.batch_invariant_why})")
    return None


def invariant_takers(device: torch.device) -> list[str]:
    """The implementations that honour ``batch_invariant`` on ``device``, by name."""
    return [e.name for e in implementations() if invariant_on(e, device) is None]


def get(name: str) -> Implementation:
    """The implementation registered as ``name``; ValueError naming the valid ones otherwise."""
    _load_builtins()
    try:
        return _IMPLEMENTATIONS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown kernel {name!r}; valid: {list(names())}") from None


def names() -> tuple[str, ...]:
    """Every registered implementation's name, in listing order; before anything loaded them,
    the built-in ones' (:data:`BUILTINS`), without importing them."""
    return tuple(_IMPLEMENTATIONS) if _loaded else BUILTINS


def implementations() -> tuple[Implementation, ...]:
    _load_builtins()
    return tuple(_IMPLEMENTATIONS.values())


def fallback() -> Implementation:
    """The implementation the others fall back to off GPUs (the CPU path and the oracle)."""
    for impl in implementations():
        if impl.fallback:
            return impl
    raise RuntimeError("no fallback implementation is registered")


def gpu_fallback() -> Optional[Implementation]:
    """The implementation a CUDA site falls back to (compiled work), or None if none is registered."""
    for impl in implementations():
        if impl.gpu_fallback:
            return impl
    return None
