"""Which implementation of ``weave::allreduce_add_rmsnorm`` a fused site gets, chosen at compile time.

The choice is baked into the graph as the op's ``kernel`` argument, with a reason for the
explain report. The symmetric-memory kernels are reached through :mod:`weave_compile.kernels`'
public names only.
"""

from __future__ import annotations

from typing import Optional

import torch

from .reference import group_size

#: Values of the op's ``kernel`` argument.
KERNELS = ("reference", "p2p", "multimem", "oneshot", "ce", "nccl")
#: The barrier-based symmetric-memory Triton kernels of :mod:`weave_compile.kernels`.
SYMM_KERNELS = ("p2p", "multimem")
#: The kernels that take no ``scale`` (the pass sends scaled sites to ``reference``).
NO_SCALE_KERNELS = SYMM_KERNELS + ("oneshot",)


def symm_kernels():
    """The symmetric-memory kernels' public names (``fused_allreduce_rmsnorm_symm``,
    ``select_symm_variant``, ``check_hidden``, ``SymmCapacityError``, ``reserve``); imported on
    first use: they need triton. The one place that names their module."""
    from weave_compile import kernels as symm

    return symm


def select_kernel(
    requested: str, device: torch.device, dtypes: tuple[torch.dtype, ...], hidden: int, group_name: str,
    num_tokens: Optional[int] = None, split: bool = False,
) -> tuple[str, str]:
    """Pick the implementation at compile time; returns ``(kernel, reason)`` for the explain report.

    ``dtypes`` are the input's, the residual's and the output's; ``num_tokens`` the graph's static
    row count (None when symbolic) and ``split`` whether the token split will run: ``auto`` takes
    ``multimem`` where multicast exists, the one-shot kernel for a small static T once it is
    measured (``oneshot.AUTO_PICKS_ONESHOT``), else looks them up in the measured table
    (:mod:`weave_compile.kernels.auto_table`). On CUDA this
    rendezvous-es a probe buffer on first use (collective): every rank compiles the same graphs,
    so every rank gets here together.
    """
    if requested == "reference":
        return "reference", "requested"
    from weave_compile.kernels import comm_kernels

    if requested in comm_kernels.KERNELS:
        return comm_kernels.select(requested, device, dtypes, hidden, group_name)
    if device.type != "cuda":
        return "reference", f"{device.type} tensors: only the collective-based reference runs there"
    try:
        symm = symm_kernels()
    except Exception as e:  # triton or symmetric memory unavailable
        return "reference", f"symmetric-memory kernels unavailable ({type(e).__name__}: {e})"
    variant, reason = symm.select_symm_variant(group_name, device, dtypes[0], hidden)
    why = symm.check_hidden(hidden, dtypes[1:])  # the residual's and output's dtypes too
    if variant is not None and why:
        variant, reason = None, why
    if variant is None:
        return "reference", reason
    if requested == "auto" and variant == "multimem":  # multicast present: TokenWeave's own design
        return variant, f"auto: {reason}"
    if requested == "oneshot" or (requested == "auto" and variant == "p2p"):
        # One-shot needs what p2p needs; auto would take it for a small static T, once measured.
        from weave_compile.kernels import oneshot

        use, why = oneshot.choose(requested, num_tokens, hidden, dtypes[0])
        if use and requested == "auto" and not oneshot.AUTO_PICKS_ONESHOT:
            use, why = False, (f"{why} fits, but auto waits for its 2-GPU measurement "
                               "(force kernel='oneshot' to use it)")
        if use:
            return "oneshot", why if requested == "oneshot" else f"auto: {why}"
        if requested == "auto":
            kernel, auto_why = comm_kernels.pick_auto(variant, reason, group_size(group_name), num_tokens, split)
            return kernel, f"{auto_why}; not one-shot: {why}"
    if requested == variant:
        return variant, "requested"
    if requested == "p2p" and variant == "multimem":
        return "p2p", "requested (multimem also available)"
    return "reference", f"requested {requested!r} unavailable: {reason}"
