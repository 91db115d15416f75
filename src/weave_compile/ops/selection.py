"""Which implementation of ``weave::allreduce_add_rmsnorm`` a fused site gets, chosen at compile time.

The choice is baked into the graph as the op's ``kernel`` argument, with a reason for the
explain report. The symmetric-memory kernels are reached through :mod:`weave_compile.kernels`'
public names only.
"""

from __future__ import annotations

import torch

#: Values of the op's ``kernel`` argument.
KERNELS = ("reference", "p2p", "multimem")
#: The kernels in :mod:`weave_compile.kernels` (the others run :func:`.reference.reference_impl`).
SYMM_KERNELS = ("p2p", "multimem")


def select_kernel(
    requested: str, device: torch.device, dtypes: tuple[torch.dtype, ...], hidden: int, group_name: str
) -> tuple[str, str]:
    """Pick the implementation at compile time; returns ``(kernel, reason)`` for the explain report.

    ``dtypes`` are the input's, the residual's and the output's. On CUDA this rendezvous-es a
    probe buffer on first use (collective): every rank compiles the same graphs, so every rank
    gets here together.
    """
    if requested == "reference":
        return "reference", "requested"
    if device.type != "cuda":
        return "reference", f"{device.type} tensors: only the collective-based reference runs there"
    try:
        from weave_compile.kernels import symm_mem_allreduce_rmsnorm as symm  # TODO(merge): `kernels as symm`
    except Exception as e:  # triton or symmetric memory unavailable
        return "reference", f"symmetric-memory kernels unavailable ({type(e).__name__}: {e})"
    variant, reason = symm.select_symm_variant(group_name, device, dtypes[0], hidden)
    why = symm.check_hidden(hidden, dtypes[1:])  # the residual's and output's dtypes too
    if variant is not None and why:
        variant, reason = None, why
    if variant is None:
        return "reference", reason
    if requested == "auto":
        return variant, f"auto: {reason}"
    if requested == variant:
        return variant, "requested"
    if requested == "p2p" and variant == "multimem":
        return "p2p", "requested (multimem also available)"
    return "reference", f"requested {requested!r} unavailable: {reason}"
