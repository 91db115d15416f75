"""The token split's options: :class:`SplitOptions`, which ``weave_compile.Options`` extends.

They live with the split so that changing the split means opening one package; ``Options`` (in
``weave_compile.config``) checks their types with every other option's and calls
:meth:`SplitOptions.check_split` for their values. This module imports nothing of the split's
rewrite, so building ``Options`` stays cheap.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

SplitCost = Literal["measured", "formula"]


# Keyword-only: ``Options``' own fields keep their positions in its constructor.
@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitOptions:
    """The token split's options (README.md lists them with every other option)."""

    #: Split each layer into a token prefix and suffix whose fused communication runs on a
    #: second, high-priority stream while the other half computes (TokenWeave's overlap). Off by
    #: default: where it was measured across two GPUs it was slower than the fused op alone
    #: (docs/performance.md, section 4).
    split: bool = False
    #: Fewest tokens (batch x sequence) for which the split is used; below it the fused op runs
    #: unsplit. TokenWeave's value for dense models. Compared in one place,
    #: :mod:`weave_compile.passes.split_tokens.decision`.
    split_threshold: int = 1024
    #: Prefix length to use instead of the computed smart split (0: computed). For sweeps.
    split_at: int = 0
    #: With the split on, linears that read one input (q/k/v, gate/up) run as one GEMM on their
    #: weights re-pointed into one buffer (same values, no memory added): a half would otherwise
    #: pay each small GEMM's fixed cost again (docs/performance.md, section 4). Inference only
    #: (grad mode off); ignored without ``split``; ``False`` keeps the projections as written.
    merge_projections: bool = True
    #: SM count the SM formula plans GEMM waves for (0: the device's; 132 off-GPU).
    num_sms: int = 0
    #: What the smart split's GEMM times come from: ``measured`` (cuBLAS timed at compile time on
    #: the GPU, cached on disk; the SM formula off-GPU) or ``formula`` (the SM-count formula).
    split_cost: SplitCost = "measured"

    def check_split(self) -> None:
        """``ValueError`` naming the option for a value out of range (types are checked by ``Options``)."""
        if self.split_threshold < 2:
            raise ValueError(f"tokenweave option 'split_threshold' must be >= 2 (two non-empty halves), "
                             f"got {self.split_threshold}")
        for name in ("split_at", "num_sms"):
            if getattr(self, name) < 0:
                raise ValueError(f"tokenweave option {name!r} must be >= 0, got {getattr(self, name)}")
