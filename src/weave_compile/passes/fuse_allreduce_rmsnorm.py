"""Fuse ``all_reduce -> (+bias) -> (+residual) -> RMSNorm`` into ``weave::allreduce_add_rmsnorm``.

Also the sequence-parallel form of the same computation, ``reduce_scatter -> (+bias) -> (+residual
shard) -> RMSNorm -> all_gather`` (:mod:`.sequence_parallel`), whose op keeps the model's own
sharded residual.

Three steps per all_reduce or reduce_scatter, in graph order:

1. **match** (:func:`.allreduce_site.match_site`, the norm by :mod:`.rmsnorm_match`): the site's
   nodes and what the op needs, or the reason it is left alone;
2. **choice** (:func:`weave_compile.kernels.auto.choose`): which registered implementation runs
   the site, with the reason, or that the site stays as written (on a GPU where plain Inductor was
   measured faster and nothing else can run it: the reason goes to the report); then the
   implementation's compile-time reservation (collective);
3. **emission** (:meth:`.allreduce_site.SiteMatch.replace_with`): the op replaces the site.

Rewrite to::

    normed, residual_out = weave.allreduce_add_rmsnorm(x, residual, bias, w, eps, group, ..., kernel=...)

A site that does not match keeps its graph and gets the reason in the explain report.

Assumption (TokenWeave's, and every TP program's): what the graph applies after the all_reduce
(bias, residual, scale, norm weight) is the same on every rank of the group, since each row is
now normalized on one rank and broadcast. The graph cannot prove it; TP frameworks guarantee it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Optional

import torch
import torch.fx as fx

from weave_compile import kernels
from weave_compile.agreement import group_ranks
from weave_compile.config import TokenWeaveConfig
from weave_compile.kernels import auto
from weave_compile.report import SiteReport
from weave_compile.rows import group_size

from . import fp8_quant_match
from .allreduce_site import NoMatch, SiteMatch, match_site
from .base import WeavePass
from .graph_utils import REDUCING_TARGETS, fake_mode_of, is_call, val
from .sequence_parallel import collective_of

log = logging.getLogger(__name__)

#: ``node.meta`` key of a fused op: the name of the collective node it replaced (the site's id
#: in the report); the split pass copies it onto each half's op.
SITE_KEY = "weave_site"
#: ``node.meta`` key of a fused op whose residual is the model's own shard (a reduce-scatter site):
#: the shard pass leaves its layout alone.
MODEL_SHARDED_KEY = "weave_model_sharded"
#: What the report says of such a site's residual.
MODEL_SHARDED = "sharded by the model"


def reducing_sites(graph: fx.Graph, reason: str = "") -> list[SiteReport]:
    """A report of every all_reduce and reduce_scatter of ``graph``, none fused (``reason`` says why)."""
    out = []
    for n in graph.nodes:
        if is_call(n, REDUCING_TARGETS):
            c = collective_of(n)
            out.append(SiteReport(node=n.name, group=c.group_name, fused=False, reason=reason, form=c.form))
    return out


def _same_ranks(a: str, b: str) -> bool:
    return a == b or group_ranks(a) == group_ranks(b)


def _hints(shape) -> tuple[Optional[int], Optional[int]]:
    """``(static token count or None, size hint or None)`` of the leading dims ``shape``."""
    sizes = [d if isinstance(d, int) else None for d in shape]
    hints = [d if isinstance(d, int) else d.node.hint for d in shape]
    static = None if None in sizes else math.prod(sizes)
    hint = None if None in hints else math.prod(int(h) for h in hints)
    return static, hint


def _token_range(shape) -> Optional[tuple[int, Optional[int]]]:
    """``(lowest, highest or None)`` of a symbolic token count (the product of the leading dims) as
    the shape environment bounds it (``mark_dynamic(x, dim, min=, max=)``), None when static or
    unknown: the floor's choice may depend on T (kernels/auto.py)."""
    syms = [d for d in shape if not isinstance(d, int)]
    if not syms:
        return None
    try:
        expr = math.prod(d.node.expr if not isinstance(d, int) else d for d in shape)
        bounds = syms[0].node.shape_env.bound_sympy(expr)
    except Exception:  # noqa: BLE001 - no bounds: the choice treats the count as unknown
        return None

    def finite(v) -> Optional[int]:
        try:  # sympy's oo and torch's int_oo do not convert
            return int(v)
        except (TypeError, ValueError, AttributeError, OverflowError):
            return None

    return max(0, finite(bounds.lower) or 0), finite(bounds.upper)


def site_of(m: SiteMatch, config: TokenWeaveConfig, split: bool = False) -> kernels.Site:
    """What the choice and the reservation need to know of a matched site; ``split``: the graph's
    split decision (:mod:`.split_tokens.decision`), made before this pass."""
    tx = val(m.collective.x)
    group = m.collective.group_name
    rows, hint = _hints(tx.shape[:-1])
    eps = m.norm.eps
    return kernels.Site(
        device=tx.device, dtype=tx.dtype, residual_dtype=val(m.residual_out).dtype, out_dtype=val(m.norm.out).dtype,
        hidden=int(tx.shape[-1]), group_name=group, world_size=group_size(group), num_tokens=rows, size_hint=hint,
        token_range=_token_range(tx.shape[:-1]),
        residual_in_dtype=val(m.residual).dtype if m.residual is not None else None,
        split=split,
        sequence_parallel=m.collective.scatters,
        has_scale=m.scale is not None,
        norm=m.norm.kind,
        # A tensor eps reaches the op on the site's device (allreduce_site.eps_on_device).
        eps_on_device=isinstance(eps, fx.Node) and (val(eps).device.type != "cpu" or tx.device.type != "cpu"),
        out_in_place=config.output_in_place, comm_ctas=config.comm_ctas, terms=_terms(m),
        batch_invariant=config.batch_invariant, quant=m.quant_spec)


def _terms(m: SiteMatch) -> kernels.NormTerms:
    """The dtypes of what the op will apply besides x and the residual (a float scale becomes a
    float32 tensor: SiteMatch.replace_with)."""
    def dtype(node):
        return None if node is None else val(node).dtype

    scale = dtype(m.scale) if isinstance(m.scale, fx.Node) else None if m.scale is None else torch.float32
    return kernels.NormTerms(bias=dtype(m.bias), weight=dtype(m.norm.weight), mid=m.norm.mid_dtype, scale=scale,
                             norm_bias=dtype(m.norm.bias))


def _quant_of(m: SiteMatch) -> tuple[Optional[fp8_quant_match.QuantMatch], Optional[str]]:
    """The fp8 quantization the site's op takes in (:mod:`.fp8_quant_match`), or None and why not
    (None: no reader quantizes). A sequence-parallel site quantizes after its all-gather, and a static
    scale computed after the op's place cannot be read there: both keep the quant outside."""
    if m.gather is not None:
        return None, None if fp8_quant_match.match_quant(m.gather.out) is None else \
            "sequence-parallel site (its rows are gathered by the model's own all-gather before the quant)"
    try:
        quant, why = fp8_quant_match.match_quant_readers(m.norm.out)
    except Exception as e:  # noqa: BLE001 - a graph the grammar did not foresee: the quant stays outside, said
        log.warning("tokenweave: the fp8 quant matcher failed at %s: %r", m.collective.node.name, e)
        return None, f"the quant matcher failed on this graph ({type(e).__name__}: {e})"
    if quant is None:
        return None, why
    scale = quant.static_scale
    if scale is not None and scale.op not in ("placeholder", "get_attr"):
        order = {n: i for i, n in enumerate(m.collective.node.graph.nodes)}
        if order[scale] > order[m.anchor]:
            return None, f"the static scale {scale.name} is computed after the reduced rows are available"
    return quant, None


#: ``chooser(site name, site) -> (kernel, reason, reserve)``: the design a site gets (or
#: ``auto.AS_WRITTEN``), why, and whether to reserve its workspace now.
Chooser = Callable[[str, kernels.Site], tuple[str, str, bool]]


class FuseAllReduceRMSNormPass(WeavePass):
    """Rewrite every matchable site, in graph order; returns a report of every all_reduce."""

    def __init__(self, config: TokenWeaveConfig):
        self.config = config
        self.matched_count = 0

    def __call__(self, graph: fx.Graph, split: bool = False, chooser: Optional[Chooser] = None) -> list[SiteReport]:
        """Fuse every site; ``split``: whether the graph will be split (its decision), which the
        choice of each site's design depends on; ``chooser``: who chooses each site's design
        (default: ``auto.choose`` on the configured ``kernel``, then the workspace reserved)."""
        fake_mode = fake_mode_of(graph)
        sites = reducing_sites(graph)
        by_name = {s.node: s for s in sites}
        for node in [n for n in graph.nodes if is_call(n, REDUCING_TARGETS)]:
            site = by_name[node.name]
            try:
                if group_size(collective_of(node).group_name) == 1:
                    raise NoMatch("group of size 1: nothing to reduce")
                self._fuse(match_site(node, _same_ranks), site, fake_mode, split, chooser or self._choose)
            except NoMatch as e:
                site.reason = str(e)
                log.info("tokenweave: %s not fused: %s", node.name, e)
        return sites

    def _choose(self, name: str, where: kernels.Site) -> tuple[str, str, bool]:
        kernel, reason = auto.choose(self.config.kernel, where)
        return kernel, reason, True

    def _fuse(self, m: SiteMatch, site: SiteReport, fake_mode, split: bool, chooser: Chooser) -> None:
        m.quant, quant_reason = _quant_of(m)
        where = site_of(m, self.config, split)
        try:
            kernel, kernel_reason, reserve = chooser(m.collective.node.name, where)
        except auto.BatchInvariantError as e:
            raise auto.BatchInvariantError(f"{m.collective.node.name}: {e}") from None
        if kernel == auto.AS_WRITTEN:
            raise NoMatch(f"left as written: {kernel_reason}")
        if reserve:
            # Allocate now, outside any CUDA-graph pool: run-time allocation would land in the pool
            # of cudagraph trees' warm-up under mode="reduce-overhead" (which rejects live
            # allocations it does not own). Collective: every rank compiles the same graph.
            for impl, top in auto.reservations(kernel, where):
                if impl.reserve is not None:
                    impl.reserve(dataclasses.replace(where, size_hint=top))
        fused = m.replace_with(fake_mode, kernel=kernel, comm_ctas=self.config.comm_ctas,
                               batch_invariant=self.config.batch_invariant)
        fused.meta[SITE_KEY] = m.collective.node.name
        if m.collective.scatters:
            fused.meta[MODEL_SHARDED_KEY] = True
        kept = m.kept_norm_nodes()
        self.matched_count += 1
        site.fused = True
        site.reason = m.describe() + (f" (norm intermediates kept for other users: {kept})" if kept else "")
        if quant_reason:
            site.reason += f"; the quantization after the norm stays outside the op: {quant_reason}"
        site.kernel, site.kernel_reason = kernel, kernel_reason
        site.residual = MODEL_SHARDED if m.collective.scatters else "full"
        log.info("tokenweave: fused %s: %s, kernel %s", m.collective.node.name, site.reason, kernel)


__all__ = ["MODEL_SHARDED_KEY", "SITE_KEY", "FuseAllReduceRMSNormPass", "NoMatch", "reducing_sites", "site_of"]
