"""LayerNorm cases of the symmetric-memory kernels (``p2p``'s push kernel, ``oneshot``), checked
against the float64 oracle.

Not a test module: the CPU interpreter tests (tests/kernels/p2p/test_push_layernorm.py,
tests/kernels/test_oneshot.py, the pull kernel's in tests/kernels/p2p/test_launch.py) and the one-GPU
emulated-rank tests (tests/kernels/p2p/test_push.py, tests/kernels/test_oneshot_gpu.py) import it, and
the launchers' keyword tests use :func:`check_layernorm_keywords`. :func:`make_inputs` draws fresh random rows with a
common ``offset`` added to every rank's x (a mean the LayerNorm removes and RMSNorm does not);
:func:`check` compares every rank's outputs with
:func:`weave_compile.kernels.reference.allreduce_add_rmsnorm_ref` the way
``tests/kernels/shared/_addnorm_cases.py`` does for the shared add+norm kernel:

- the residual rows (gathered from the ranks' shards where the output is sharded): the oracle's
  float64 sum rounded once, within one ulp of the residual dtype and the rounding of the kernel's
  fp32 adds (Triton's interpreter rounds to bf16 its own way, so bitwise equality is too strict);
  a shard's rows past T are +0;
- the normed rows: the oracle's norm of the kernel's own residual rows, to the output (or mid)
  dtype's rounding, so a residual an ulp apart does not hide the norm's error; and the same on every
  rank, bit for bit (peers copy the owner's rows, or compute every row in the same order);
- that the check tells LayerNorm from RMSNorm: the oracle's RMSNorm of the same rows misses the
  bound tenfold (the offset makes the mean matter).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels._symm_cases import DTYPES, EPS_TENSOR_VALUE, NO_RESIDUAL, sharding
from tests.kernels.shared._addnorm_cases import _residual_ok
from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref

#: eps where the case gives it as a number (``eps_tensor`` cases use ``EPS_TENSOR_VALUE``).
EPS = 1e-5

#: The LayerNorm keywords of the kernels on the shared row bodies (kernels/shared/shapes.layernorm_constexprs).
LAYERNORM_KEYWORDS = frozenset({"NORM_BIAS", "IS_LAYERNORM", "HAS_NORM_BIAS"})


class KernelStub:
    """Stands in for a Triton kernel: ``stub[grid](*args, **kw)`` records ``kw`` in ``seen`` and runs nothing."""

    def __init__(self):
        self.seen = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.seen.append(kw)


def check_layernorm_keywords(keywords, hidden: int, dtype: torch.dtype) -> None:
    """A launcher hands its kernel the LayerNorm keywords for a LayerNorm or a norm bias only.

    ``keywords(norm, norm_bias, other_path)`` launches on ``hidden``-wide rows of ``dtype`` with the kernel
    stubbed (:class:`KernelStub`) and returns the keywords it got; ``other_path``: through the launcher's
    second entry (the one that copies or stages the rows first). RMSNorm without a norm bias gets none of
    :data:`LAYERNORM_KEYWORDS` (the kernel binds its defaults: its binary is the one before the variant),
    ``norm="layernorm"`` IS_LAYERNORM, a norm bias NORM_BIAS (that tensor) and HAS_NORM_BIAS on either path,
    and a norm bias of the wrong size is refused."""
    for other_path in (False, True):
        assert not LAYERNORM_KEYWORDS & set(keywords("rmsnorm", None, other_path)), other_path
    kw = keywords("layernorm", None, False)
    assert kw["IS_LAYERNORM"] is True and not {"NORM_BIAS", "HAS_NORM_BIAS"} & set(kw)
    nb = torch.randn(hidden).to(dtype)
    for norm, other_path in (("layernorm", False), ("layernorm", True), ("rmsnorm", False)):
        kw = keywords(norm, nb, other_path)
        assert kw["HAS_NORM_BIAS"] is True and kw["NORM_BIAS"].data_ptr() == nb.data_ptr(), (norm, other_path)
        assert kw.get("IS_LAYERNORM", False) == (norm == "layernorm")
    with pytest.raises(ValueError, match=f"norm_bias must have {hidden} elements"):
        keywords("layernorm", torch.randn(hidden + 8).to(dtype), False)


def ln_case(T, H, dtype="bf16", *, res="full", weight=True, norm_bias=True, bias=False, mid=None, woff=0.0,
            res_dtype=None, out_dtype=None, ctas=2, seed=0, eps_tensor=False, offset=None, norm="layernorm"):
    """One LayerNorm launch: ``res`` as in ``_symm_cases`` (none | full | shard_in | shard_out | shard_both |
    first), ``norm_bias`` the LayerNorm's bias after the weight, ``bias`` the one added before the norm,
    ``offset`` added to every rank's x (default 200 in fp32 inputs, 3 in 16 bits; ``_addnorm_cases``'s
    choice: a mean that E[x^2] - mean^2 would lose digits to in fp32)."""
    if offset is None:
        offset = 200.0 if dtype == "fp32" else 3.0
    return dict(T=T, H=H, dtype=dtype, res=res, bias=bias, weight=weight, norm_bias=norm_bias, mid=mid, woff=woff,
                res_dtype=res_dtype, out_dtype=out_dtype, ctas=ctas, channel=0, seed=seed, eps_tensor=eps_tensor,
                offset=offset, norm=norm)


def case_name(c) -> str:
    parts = [c["norm"], f"T={c['T']}", f"H={c['H']}", c["dtype"], f"res={c['res']}"]
    parts += [name for name in ("bias", "weight", "norm_bias") if c[name]]
    parts += [f"{k}={c[k]}" for k in ("mid", "res_dtype", "out_dtype", "woff") if c[k]]
    if c["eps_tensor"]:
        parts.append("eps=tensor")
    return " ".join(parts + [f"ctas={c['ctas']}"])


def dtypes(c) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """``(inputs, residual, normed output)`` dtypes of a case."""
    dt = DTYPES[c["dtype"]]
    return dt, DTYPES[c["res_dtype"]] if c["res_dtype"] else dt, DTYPES[c["out_dtype"]] if c["out_dtype"] else dt


def eps_of(c) -> float:
    return EPS_TENSOR_VALUE if c["eps_tensor"] else EPS


def spec_kwargs(c, device) -> dict:
    """The launch's :class:`~weave_compile.kernels.spec.FusedSpec` keywords and ``eps_tensor`` (a 0-d
    float64 tensor on ``device`` where the case says so: the spec's float is then 0.0, so a kernel that
    read it would miss the oracle)."""
    in_sh, out_sh = sharding(c)
    kw = dict(eps=0.0 if c["eps_tensor"] else EPS, mid_dtype=DTYPES[c["mid"]] if c["mid"] else None,
              weight_offset=c["woff"], residual_in_sharded=in_sh, residual_out_sharded=out_sh, norm=c["norm"])
    if c["eps_tensor"]:
        kw["eps_tensor"] = torch.tensor(EPS_TENSOR_VALUE, dtype=torch.float64, device=device)
    return kw


def make_inputs(c, world, device):
    """Every rank's x (``offset`` added), the full residual, bias, weight and norm bias, drawn on the
    CPU from the case's seed (the same on every device)."""
    g = torch.Generator().manual_seed(int(c["seed"]))
    T, H = c["T"], c["H"]
    dt, rdt, _ = dtypes(c)

    def draw(*shape):
        return torch.randn(*shape, generator=g)

    xs = [(draw(T, H) + c["offset"]).to(dt).to(device) for _ in range(world)]
    residual = draw(T, H).to(rdt).to(device) if c["res"] not in NO_RESIDUAL else None
    bias = (0.5 * draw(H)).to(dt).to(device) if c["bias"] else None
    weight = (1 + 0.5 * draw(H)).to(dt).to(device) if c["weight"] else None
    norm_bias = draw(H).to(dt).to(device) if c["norm_bias"] else None
    return xs, residual, bias, weight, norm_bias


def rank_residual(c, world, rank, residual):
    """Rank ``rank``'s residual input: the full one, or its [S, H] shard (rows past T zero)."""
    if residual is None or not sharding(c)[0]:
        return residual
    T, H = residual.shape
    S = math.ceil(T / world)
    out = torch.zeros(S, H, dtype=residual.dtype, device=residual.device)
    lo, hi = rank * S, min(T, (rank + 1) * S)
    if hi > lo:
        out[:hi - lo] = residual[lo:hi]
    return out


def poisoned_outputs(c, world, device) -> list:
    """Every rank's ``(normed, residual_out)``, NaN: an element the kernel does not write fails."""
    T, H = c["T"], c["H"]
    _, rdt, odt = dtypes(c)
    rows = math.ceil(T / world) if sharding(c)[1] else T
    return [(torch.full((T, H), float("nan"), dtype=odt, device=device),
             torch.full((rows, H), float("nan"), dtype=rdt, device=device)) for _ in range(world)]


def check(c, world, outs, inputs) -> list[str]:
    """What is wrong with every rank's ``(normed, residual_out)`` in ``outs`` for ``inputs`` (from
    :func:`make_inputs`); empty: correct (module doc)."""
    xs, residual, bias, weight, nb = [None if t is None else (t.cpu() if isinstance(t, torch.Tensor) else
                                                              [x.cpu() for x in t]) for t in inputs]
    T, H = c["T"], c["H"]
    _, rdt, odt = dtypes(c)
    mid = DTYPES[c["mid"]] if c["mid"] else None
    eps = eps_of(c)
    S = math.ceil(T / world)
    outs = [(n.cpu(), r.cpu()) for n, r in outs]
    errs = []
    for r, (n, ro) in enumerate(outs):
        want_rows = S if sharding(c)[1] else T
        if n.shape != (T, H) or n.dtype != odt or ro.shape != (want_rows, H) or ro.dtype != rdt:
            errs.append(f"rank {r}: normed {n.dtype}{tuple(n.shape)}, residual {ro.dtype}{tuple(ro.shape)}")
    if errs:
        return errs
    # The kernel's residual rows: the owners' shards, or every rank's full copy (the same bits).
    if sharding(c)[1]:
        parts = []
        for r, (_, ro) in enumerate(outs):
            n_own = max(0, min(S, T - r * S))
            parts.append(ro[:n_own])
            pad = ro[n_own:]
            if not (bool((pad == 0).all()) and not bool(torch.signbit(pad).any())):
                errs.append(f"rank {r}: residual shard rows past T are not +0")
        got_res = torch.cat(parts)
    else:
        got_res = outs[0][1]
        errs += [f"rank {r}: residual differs from rank 0's" for r, (_, ro) in enumerate(outs)
                 if not torch.equal(ro.view(torch.uint8), got_res.view(torch.uint8))]
    errs += [f"rank {r}: normed differs from rank 0's" for r, (n, _) in enumerate(outs)
             if not torch.equal(n.view(torch.uint8), outs[0][0].view(torch.uint8))]
    _, want_res = allreduce_add_rmsnorm_ref(xs, residual, bias, weight, eps=eps, weight_offset=c["woff"],
                                            residual_dtype=rdt, out_dtype=odt, mid_dtype=mid, norm=c["norm"],
                                            norm_bias=nb)
    terms = list(xs) + [t for t in (bias, residual) if t is not None]
    if not _residual_ok(got_res, want_res, terms, rdt):
        errs.append(f"residual rows off by more than one ulp (max err "
                    f"{(got_res.double() - want_res.double()).abs().nan_to_num(1e9).max().item():.3g})")
        return errs
    want, _ = allreduce_add_rmsnorm_ref([got_res], None, None, weight, eps=eps, weight_offset=c["woff"],
                                        out_dtype=torch.float64, mid_dtype=mid, norm=c["norm"], norm_bias=nb)
    rounded = mid is not None or odt != torch.float32
    # A 16-bit rounding (two with a mid dtype), or fp32's sums (``_addnorm_cases``' bounds).
    tol = 2 ** -6 if rounded else 5e-5
    size = 1 + want.abs() + (nb.double().abs() if nb is not None else 0)
    bound = tol * size
    if c["norm"] == "layernorm":
        # The row's fp32 mean is a few ulps of |mean| off, which moves the centred row by that
        # against its spread (E[x^2] - mean^2 would err by the square of that ratio).
        rr = got_res.double()
        mean = rr.mean(-1, keepdim=True)
        spread = ((rr - mean).pow(2).mean(-1, keepdim=True) + eps).sqrt()
        gain = (weight.double() + c["woff"]).abs() if weight is not None else 1
        bound = bound + 4 * 2.0 ** -24 * mean.abs() / spread * gain
    for r, (n, _) in enumerate(outs):
        err = (n.double() - want).abs()
        if not bool((err <= bound).all()):  # NaN (an element not written) fails too
            errs.append(f"rank {r}: normed rows off by up to {(err / bound).nan_to_num(1e9).max().item():.3g} x "
                        "the bound")
    if c["norm"] == "layernorm" and c["offset"] >= 1 and H >= 8:
        # The bound above tells LayerNorm from RMSNorm here: the RMSNorm of these rows misses it tenfold.
        rms, _ = allreduce_add_rmsnorm_ref([got_res], None, None, weight, eps=eps, weight_offset=c["woff"],
                                           out_dtype=torch.float64, mid_dtype=mid, norm_bias=nb)
        if not ((rms - want).abs() / size).max() > 10 * tol:
            errs.append("the check cannot tell this LayerNorm from an RMSNorm (offset too small?)")
    return errs


def run_push(ranks, c, inputs, *, meta=None, out_slot: int = -1, device="cpu") -> list:
    """The push kernel on every emulated rank (``weave_compile.testing.emulated_ranks``) for case ``c``:
    ``[(normed, residual_out)]`` per rank. The outputs are NaN-poisoned first (with ``out_slot`` >= 0
    the normed rows are that ring slot, which ``EmulatedRanks.create`` poisoned), and a residual shard's
    rows past T are NaN in the launch's input (they must never be read)."""
    from weave_compile.kernels.shared.workspace import ring_output
    from weave_compile.testing.emulated_ranks import push_allreduce_rmsnorm

    xs, residual, bias, weight, nb = inputs
    world, T = ranks.world_size, c["T"]
    res_in = [rank_residual(c, world, r, residual) for r in range(world)]
    if residual is not None and sharding(c)[0]:
        S = math.ceil(T / world)
        for r, shard in enumerate(res_in):
            shard[max(0, min(S, T - r * S)):] = float("nan")
    outputs = poisoned_outputs(c, world, device)
    if out_slot >= 0:
        outputs = [(ring_output(ws, out_slot, T), ro) for ws, (_, ro) in zip(ranks.workspaces, outputs)]
    return push_allreduce_rmsnorm(ranks, xs, res_in, bias, weight, comm_ctas=c["ctas"], outputs=outputs, meta=meta,
                                  out_slot=out_slot, norm_bias=nb, **spec_kwargs(c, device))


def ring_errors(ranks, outs, out_slot: int) -> list[str]:
    """With the normed output left in ring slot ``out_slot``: it is the slot itself on every rank, and the
    other slots (the copying launches' staging slot 0 included) are untouched (still NaN)."""
    from weave_compile.kernels.shared.common import OUT_RING_SLOTS

    errs = []
    for r, (n, _) in enumerate(outs):
        ring = ranks.workspaces[r].out_ring
        if n.data_ptr() != ring[out_slot].data_ptr():
            errs.append(f"rank {r}: normed is not ring slot {out_slot}")
        written = [k for k in range(OUT_RING_SLOTS) if k != out_slot and not bool(torch.isnan(ring[k]).all())]
        if written:
            errs.append(f"rank {r}: ring slot(s) {written} written")
    return errs


def ranks_for(c, world, device, extra_rows: int = 0):
    """Emulated ranks (regions NaN-poisoned) for case ``c``, with room for ``extra_rows`` more rows than
    T (the peers' slots then start elsewhere than the global rows)."""
    from weave_compile.testing.emulated_ranks import EmulatedRanks

    dt, rdt, odt = dtypes(c)
    return EmulatedRanks.create(world, c["H"], c["T"] + extra_rows, dtype=dt, out_dtype=odt, residual_dtype=rdt,
                                device=device)


def meta_for(c, world, kind: str, interp: bool):
    """The push kernel's launch shape of loop kind ``kind`` for case ``c``, forced: ``default`` (None: the
    launcher's), ``pipelined`` (the ``tl.range`` pipeline), ``prefetch`` (the register-prefetched tile;
    under the interpreter 1-row tiles unrolled twice, so a wrong next-tile offset shows) or ``rowwise``
    (one warp per row; under the interpreter 16-column chunks loaded 2 ahead, at H=40 the last one
    half masked; on a GPU the launcher's rowwise shape: 256-column chunks)."""
    import dataclasses

    from weave_compile.kernels.p2p import launch

    dt, rdt, _ = dtypes(c)
    args = (c["H"], math.ceil(c["T"] / world), c["ctas"], world, dt.itemsize, rdt.itemsize)
    if kind == "default":
        return None
    if kind == "pipelined":
        return launch.pipelined_meta(*args)
    base = launch.push_meta(*args)
    if kind == "prefetch":
        if interp:
            return dataclasses.replace(base, block_rows=1, norm_unroll=2, norm_prefetch=True, norm_chunk=0)
        # the launcher's tile where it prefetches; a one-warp-per-row shape's groups cut back to one tile
        return dataclasses.replace(base, norm_prefetch=True, norm_chunk=0,
                                   norm_unroll=1 if base.norm_chunk else base.norm_unroll)
    if kind == "rowwise":
        if interp:
            return dataclasses.replace(base, block_rows=1, norm_unroll=2, norm_chunk=16, norm_depth=2,
                                       norm_prefetch=False)
        block_rows = min(base.block_rows, launch.ROWWISE_WARPS)
        return dataclasses.replace(base, block_rows=block_rows, num_warps=launch.ROWWISE_WARPS, norm_prefetch=False,
                                   norm_unroll=launch.ROWWISE_WARPS // block_rows, norm_chunk=launch.ROWWISE_CHUNK,
                                   norm_depth=launch.PUSH_ROWWISE_DEPTH)
    raise ValueError(f"unknown loop kind {kind!r}")
