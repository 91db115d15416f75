"""The program of one ``ce`` call: its ops in stream order, how they are enqueued, what they load.

:func:`build_program` turns one rank's call into ops (the protocol's steps 1-7, see
:mod:`.copy_engine`), :func:`execute` enqueues them, :func:`preload` compiles and loads the
kernels they launch, :func:`issue_order` interleaves several emulated ranks' programs so that
every wait's signal is enqueued before the wait, and :func:`preload_site` loads every add+norm
variant the calls of a compiled site can launch.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Union

import torch

from weave_compile.rows import rows_of_rank

from ..shared import addnorm
from ..shared.shapes import ROWWISE_WARPS
from ..shared.symm_call import kernel_eps
from ..spec import FusedSpec, Rows
from . import memops
from .workspace import AG, RS, CeWorkspace, quant_views, slot_of

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Copy:
    dst: torch.Tensor
    src: torch.Tensor


@dataclass(frozen=True, eq=False)
class Signal:  # write 1 to a flag word of a peer
    flag: torch.Tensor
    peer: int


@dataclass(frozen=True, eq=False)
class Wait:  # wait until our flag word >= 1
    flag: torch.Tensor
    peer: int


@dataclass(frozen=True, eq=False)
class Reset:  # write 0 to our flag word
    flag: torch.Tensor
    peer: int


@dataclass(frozen=True, eq=False)
class Norm:
    kwargs: dict = field(hash=False)


@dataclass(frozen=True, eq=False)
class Mark:  # write a progress mark (no fence) to the watched workspace's host-mapped word
    word: torch.Tensor  # CPU view of the word (what the watchdog reads)
    ptr: int  # its device address
    value: int


Op = Union[Copy, Signal, Wait, Reset, Norm, Mark]

# Progress marks (read by the watchdog): odd while a call waits (call number, phase, peer), even
# once its waits are done. The call number wraps at 2**21, so every value fits 31 bits.
_SEQ_MOD, _PEER_BITS = 1 << 21, 8


def waiting_mark(seq: int, phase: int, peer: int) -> int:
    return (((seq % _SEQ_MOD) << 1 | phase) << _PEER_BITS | peer) << 1 | 1


def done_mark(seq: int) -> int:
    return (seq % _SEQ_MOD) << (_PEER_BITS + 2)


def decode_mark(value: int) -> tuple[int, Optional[int], Optional[int]]:
    """``(call number, phase or None, peer or None)`` of a mark (phase/peer None: not waiting)."""
    if not value & 1:
        return value >> (_PEER_BITS + 2), None, None
    v = value >> 1
    return v >> (_PEER_BITS + 1), (v >> _PEER_BITS) & 1, v & ((1 << _PEER_BITS) - 1)


def build_program(ws: CeWorkspace, rows: Rows, spec: FusedSpec, normed: torch.Tensor, residual_out: torch.Tensor,
                  *, config: Optional[addnorm.LaunchConfig] = None, scales: Optional[torch.Tensor] = None) -> list[Op]:
    """The ops of one call on rank ``ws.rank`` (:mod:`.copy_engine`, steps 1-7), in stream order.

    On a watched workspace (``ws.mark``) a mark precedes each wait and follows the last one, and
    the add+norm kernel reads the rank's abort word. With an fp8 epilogue (``spec.quant``) the
    kernel writes this rank's codes and row scales into its ``out`` region's bytes
    (:func:`.workspace.quant_views`), ``normed`` is the fp8 output ``[T, H]`` and ``scales`` the
    row scales' ``[T, 1]`` fp32 (a per-row scale), and the pulls move codes and scales."""
    x, residual = rows.x, rows.residual
    N, r, T = ws.world_size, ws.rank, x.shape[0]
    S = math.ceil(T / N)
    me = ws.regions[r]
    peers = [p for p in range(N) if p != r]
    seq, ws.calls = ws.calls, ws.calls + 1
    watched = ws.mark is not None

    def wait(phase: int, p: int) -> list[Op]:
        flag = me.flags[phase, p:p + 1]
        mark = [Mark(ws.mark.tensor[:1], ws.mark.device_ptr, waiting_mark(seq, phase, p))] if watched else []
        return mark + [Wait(flag, p), Reset(flag, p)]

    prog: list[Op] = []
    for p in peers:  # 1. push our partials of p's rows into p's slot for us
        n = rows_of_rank(T, S, p)
        if n:
            prog.append(Copy(ws.regions[p].recv[slot_of(r, p), :n], x[p * S:p * S + n]))
    prog += [Signal(ws.regions[p].flags[RS, r:r + 1], p) for p in peers]  # 2.
    for p in peers:  # 3.
        prog += wait(RS, p)
    n_mine = rows_of_rank(T, S, r)
    if residual is None:
        res_in = None
    elif spec.residual_in_sharded:
        res_in = residual
    else:
        res_in = residual[r * S:r * S + n_mine]
    quant = spec.quant
    views = [quant_views(reg) for reg in ws.regions] if quant is not None else None
    kwargs = dict(  # 4.
        x=x[r * S:r * S + n_mine] if n_mine else x[:0], recv=me.recv[:N - 1] if N > 1 else None,
        residual=res_in, bias=rows.bias, weight=rows.weight,
        scale=None if rows.scale is None else rows.scale.reshape(1),
        normed=me.out if quant is None else views[r][0].view(quant.dtype),
        res_out=residual_out if spec.residual_out_sharded else me.res[:n_mine], n_valid=n_mine,
        eps=kernel_eps(rows, spec), mid_dtype=spec.mid_dtype, weight_offset=spec.weight_offset, num_ctas=spec.comm_ctas,
        config=config)
    if spec.norm != "rmsnorm" or rows.norm_bias is not None:  # the LayerNorm variant (RMSNorm's launch as it was)
        kwargs.update(norm=spec.norm, norm_bias=rows.norm_bias)
    if spec.batch_invariant and N > 1:  # the partials in rank order, one launch shape for every T
        kwargs["rank_order"] = r
    if quant is not None:
        kwargs.update(quant=quant, out_dtype=spec.out_dtype,
                      quant_scale=None if rows.quant_scale is None else rows.quant_scale.reshape(1),
                      row_scales=views[r][1] if quant.kind == "row" else None)
    if watched:
        kwargs["abort"] = me.abort
    prog.append(Norm(kwargs))
    prog += [Signal(ws.regions[p].flags[AG, r:r + 1], p) for p in peers]  # 5.
    for p in peers:  # 6.
        prog += wait(AG, p)
    if watched:
        prog.append(Mark(ws.mark.tensor[:1], ws.mark.device_ptr, done_mark(seq)))
    for p in range(N):  # 7. pull every rank's rows (our own too: a local copy-engine copy)
        n = rows_of_rank(T, S, p)
        if not n:
            continue
        if quant is not None:  # fp8 codes as bytes, and the row scales
            prog.append(Copy(normed.view(torch.uint8)[p * S:p * S + n], views[p][0][:n]))
            if quant.kind == "row":
                prog.append(Copy(scales[p * S:p * S + n], views[p][1][:n]))
        else:
            prog.append(Copy(normed[p * S:p * S + n], ws.regions[p].out[:n]))
        if not spec.residual_out_sharded:
            prog.append(Copy(residual_out[p * S:p * S + n], ws.regions[p].res[:n]))
    return prog


def execute(prog: list[Op], stream: Optional[torch.cuda.Stream] = None) -> None:
    """Enqueue a program on ``stream`` (default: the current one). Capturable in a CUDA graph."""
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for op in prog:
            if isinstance(op, Copy):
                op.dst.copy_(op.src)  # contiguous same-dtype rows: cudaMemcpyAsync, a copy engine
            elif isinstance(op, Signal):
                memops.write(stream, op.flag.data_ptr(), 1)
            elif isinstance(op, Wait):
                memops.wait(stream, op.flag.data_ptr(), 1)
            elif isinstance(op, Reset):
                memops.write(stream, op.flag.data_ptr(), 0)
            elif isinstance(op, Mark):
                memops.write(stream, op.ptr, op.value, fence=False)
            else:
                addnorm.add_rmsnorm_rows(**op.kwargs)


def preload(prog: list[Op]) -> None:
    """Compile and load every kernel ``prog`` launches, launching nothing (see
    :mod:`.copy_engine`, "Deadlock freedom")."""
    for op in prog:
        if isinstance(op, Norm):
            addnorm.add_rmsnorm_rows(**op.kwargs, preload=True)


def issue_order(programs: list[list[Op]]) -> list[tuple[int, list[Op]]]:
    """``(rank, ops)`` chunks of every emulated rank's program, in an order in which every wait's
    signal is enqueued before the wait: each program cut before each of its waits, the k-th chunks
    of all ranks before any (k+1)-th. A rank's reduce-scatter signals are in its chunk 0, its waits
    from chunk 1 on; its all-gather signals are in the chunk of its last reduce-scatter wait
    (N-1), every all-gather wait in a later one. Whatever the host blocks on between two
    enqueues (a module load, an allocation) and however streams share hardware queues, what any
    enqueued wait needs is enqueued already."""
    chunks = []
    for prog in programs:
        cuts = [i for i, op in enumerate(prog) if isinstance(op, Wait)]
        # a wait's mark goes with the wait (the chunk before stays the one with the signals)
        cuts = [i - 1 if i and isinstance(prog[i - 1], Mark) else i for i in cuts]
        bounds = [0, *cuts, len(prog)]
        chunks.append([prog[a:b] for a, b in zip(bounds, bounds[1:])])
    order = []
    for k in range(max(len(c) for c in chunks)):
        order += [(r, c[k]) for r, c in enumerate(chunks) if k < len(c) and c[k]]
    return order


#: What a site's norm may apply when the site does not say (e.g. a hand-made Site): (bias, weight,
#: mid) dtypes, None meaning absent; the input dtype stands for bias and weight.
def _unknown_terms(site_dtype: torch.dtype, residual_dtype: torch.dtype) -> list[tuple]:
    return list(itertools.product((None, site_dtype), (None, site_dtype), (None, residual_dtype)))


#: The dtypes an eps tensor may have (a Python-float graph input is float64; a model's own 0-d
#: buffer may be float32): a site whose eps lives on the device loads the kernel for each.
EPS_TENSOR_DTYPES = (torch.float64, torch.float32)


def preload_site(ws: CeWorkspace, *, residual_dtype: Optional[torch.dtype], terms: Optional[Iterable[tuple]],
                 scale_dtype: Optional[torch.dtype], eps_on_device: bool = False, norm: str = "rmsnorm",
                 batch_invariant: bool = False, quant=None) -> int:
    """Compile and load every add+norm variant that calls on ``ws`` can launch; returns how many
    distinct kernels that is (0 off GPU: the torch path loads nothing).

    A variant is the kernel's constexprs (dtypes, H, slots, which terms, the launch shape) and
    Triton's specialization of its run-time arguments. For a site those follow from the site:
    ``residual_dtype`` (the residual input's, None: none), ``terms`` (``(bias, weight, mid)`` or
    ``(bias, weight, mid, norm_bias)`` dtypes, None: absent; None: unknown, every combination;
    a norm bias only with ``norm="layernorm"``), ``norm``, ``batch_invariant`` (the rank-order
    variant, one launch shape), ``quant`` (the site's fp8 epilogue, a
    :class:`weave_compile.quant.QuantSpec`, or None), ``scale_dtype``, whether eps comes as
    a device tensor (``eps_on_device``: one variant per :data:`EPS_TENSOR_DTYPES`, its pointer's
    dtype being part of the signature) and whether ``ws`` is watched. Not from T: the row counts
    are not specialized (``do_not_specialize``), and the two launch shapes T can select (one warp
    per row from 8 rows per CTA on, else the tile loop:
    :func:`weave_compile.kernels.shared.addnorm.launch_config`) are both loaded. Pointers are
    16-byte aligned at every T: fresh outputs and regions are, and every row is a multiple of 16
    bytes (the ``ce`` check requires it), so row offsets keep the base's alignment."""
    in_dt, out_dt, res_dt = ws.dtypes
    H, N = ws.hidden, ws.world_size
    me = ws.regions[ws.rank]
    dev = me.flags.device
    rows = ROWWISE_WARPS  # rows per CTA from which one warp per row is used (where it fits)
    if terms is None:
        terms = _unknown_terms(in_dt, res_dt)
        log.info("ce preload: the site's norm terms are unknown; loading %d combinations", len(terms))
    x = torch.empty(rows, H, dtype=in_dt, device=dev)
    # 256 rows per slot: the slot stride of a workspace (a multiple of 256 rows)
    recv = torch.empty(max(1, N - 1), 256, H, dtype=in_dt, device=dev) if N > 1 else None
    residual = torch.empty(rows, H, dtype=residual_dtype, device=dev) if residual_dtype is not None else None
    normed = torch.empty(rows, H, dtype=out_dt, device=dev)
    res_out = torch.empty(rows, H, dtype=res_dt, device=dev)
    scale = torch.ones(1, dtype=scale_dtype, device=dev) if scale_dtype is not None else None
    abort = torch.zeros(1, dtype=torch.int32, device=dev) if ws.mark is not None else None
    epss = [torch.full((), 1e-6, dtype=dt, device=dev) for dt in EPS_TENSOR_DTYPES] if eps_on_device else [1e-6]
    loaded = set()
    for bias_dt, weight_dt, mid, *rest in dict.fromkeys(tuple(t) for t in terms):
        bias = torch.empty(H, dtype=bias_dt, device=dev) if bias_dt is not None else None
        weight = torch.empty(H, dtype=weight_dt, device=dev) if weight_dt is not None else None
        nb_dt = rest[0] if rest else None
        variant = {} if norm == "rmsnorm" and nb_dt is None else dict(
            norm=norm, norm_bias=torch.empty(H, dtype=nb_dt, device=dev) if nb_dt is not None else None)
        if batch_invariant and N > 1:
            variant["rank_order"] = ws.rank
        if quant is not None:
            codes, row_scales = quant_views(me)
            # as a call passes them (:func:`ce_call`): row scales only per row, the scale only static;
            # a pointer where a call has none is another specialization, a kernel loaded at run time
            variant.update(quant=quant, out_dtype=out_dt, row_scales=row_scales if quant.kind == "row" else None,
                           quant_scale=torch.ones(1, device=dev) if quant.kind == "static" else None)
        for n, eps in itertools.product((1, rows), epss):
            # 1 row per CTA: the tile loop; `rows` per CTA: one warp per row where it fits
            out = normed if quant is None else codes[:rows].view(quant.dtype)
            k = addnorm.add_rmsnorm_rows(x, recv, residual, bias, weight, scale, out, res_out[:n], n_valid=n,
                                         eps=eps, mid_dtype=mid, weight_offset=0.0, num_ctas=1, abort=abort,
                                         preload=True, **variant)
            if k is not None:
                loaded.add(id(k))
    return len(loaded)
