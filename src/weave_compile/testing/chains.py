"""A chain of ``all_reduce -> (+bias) -> +residual -> RMSNorm`` sites, each on its own process group.

The smallest program that exercises everything the passes decide per site: which group reduces,
whether the residual may stay sharded into the next site, what else reads it. Used by the
shard-residual, agreement and reliability tests on CPU ranks (gloo), where the reference is the
same module run eagerly in float64 (its collectives too), so no tolerance hides a wrong row.

Weights come from a seeded generator, identical on every rank. Each rank's partial sum differs
(``x @ w * (1 + e_k) / n`` for group rank ``k`` of ``n``, the ``e_k`` summing to zero), so a row
reduced on the wrong rank, or taken from the wrong rank, shows up at once; yet every group's sum
is ``x @ w``, so the residual stays replicated on every rank (tensor parallelism's invariant, which
the fused op relies on) even when consecutive sites reduce over different groups.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn


class SiteChain(nn.Module):
    """``len(groups)`` sites; site ``i`` all-reduces over ``groups[i]`` (a ProcessGroup, or None for WORLD).

    ``forward(x, residual)`` returns the last site's normed output, and with ``leak_at=i`` also
    ``3 * residual`` after site ``i`` (a reader that is not a fused site). ``diverge_on_rank=r``
    makes rank ``r`` alone do what users do by accident, after site 0:
    ``"break"`` stores a statistic on the module with ``.item()`` (a graph break on that rank only),
    ``"count"`` counts calls in a module attribute (a guard that recompiles an identical graph on
    that rank only).
    """

    def __init__(self, hidden: int, groups: Sequence[Optional[dist.ProcessGroup]], *, seed: int = 0,
                 bias: bool = False, leak_at: Optional[int] = None, diverge_on_rank: Optional[int] = None,
                 diverge: str = "break"):
        super().__init__()
        self.diverging = dist.is_initialized() and dist.get_rank() == diverge_on_rank
        self.diverge = diverge
        self.calls = 0
        g = torch.Generator().manual_seed(seed)
        self.groups = list(groups)
        self.leak_at = leak_at
        n = len(self.groups)
        self.w = nn.ParameterList(nn.Parameter(torch.randn(hidden, hidden, generator=g) / hidden ** 0.5)
                                  for _ in range(n))
        self.nw = nn.ParameterList(nn.Parameter(1 + 0.1 * torch.randn(hidden, generator=g)) for _ in range(n))
        self.b = nn.ParameterList(nn.Parameter(0.1 * torch.randn(hidden, generator=g)) for _ in range(n)) if bias else None
        self.register_buffer("share", torch.tensor([_share(grp) for grp in self.groups]), persistent=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor):
        x, residual, leaked = self._site(0, x, residual, None)
        # Outside the loop below: a graph break inside a loop makes Dynamo run the whole frame
        # eagerly, here the breaking rank compiles two graphs where the others compile one.
        if self.diverging:
            if self.diverge == "break":
                self.stat = residual.abs().max().item()
            else:
                self.calls += 1
        for i in range(1, len(self.groups)):
            x, residual, leaked = self._site(i, x, residual, leaked)
        return x if self.leak_at is None else (x, leaked)

    def _site(self, i: int, x: torch.Tensor, residual: torch.Tensor, leaked):
        y = (x @ self.w[i].to(x.dtype)) * self.share[i].to(x.dtype)
        dist.all_reduce(y, group=self.groups[i])
        if self.b is not None:
            y = y + self.b[i].to(y.dtype)
        residual = residual + y
        if i == self.leak_at:
            leaked = residual * 3
        hf = residual.float()
        x = self.nw[i].to(x.dtype) * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return x, residual, leaked


def _share(group: Optional[dist.ProcessGroup]) -> float:
    n = dist.get_world_size(group)
    k = dist.get_rank(group)
    return (1.0 + 0.5 * (k - (n - 1) / 2)) / n


def eager_float64(model: nn.Module, *inputs: torch.Tensor):
    """``model(*inputs)`` run eagerly in float64 (weights and inputs), restoring the model's dtype after."""
    dtype = next(model.parameters()).dtype
    model.double()
    try:
        with torch.no_grad():
            return model(*(t.double() if t.is_floating_point() else t for t in inputs))
    finally:
        model.to(dtype)
