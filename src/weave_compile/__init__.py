"""weave_compile: TokenWeave (fused AllReduce-RMSNorm, token-split overlap) as a torch.compile backend.

Use it with ``torch.compile(model, backend="tokenweave", options=weave_compile.Options(...))``
(``Options`` checks every option when built; a plain dict is checked when the first call
compiles); see README.md.
"""

from weave_compile.config import Options, TokenWeaveConfig
from weave_compile.report import explain, reset

__all__ = ["BatchInvariantError", "Options", "TokenWeaveConfig", "explain", "reset", "tokenweave_backend"]


def __getattr__(name):
    # Lazy: importing the package must not pull in Inductor.
    if name == "tokenweave_backend":
        from weave_compile.backend import tokenweave_backend

        return tokenweave_backend
    if name == "BatchInvariantError":
        from weave_compile.kernels.auto import BatchInvariantError

        return BatchInvariantError
    raise AttributeError(name)
