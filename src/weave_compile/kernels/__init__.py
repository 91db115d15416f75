"""Symmetric-memory kernels of the fused all-reduce + add + RMSNorm op.

Modules: :mod:`.common` (limits, dtype helpers), :mod:`.sync` (signal-pad barriers),
:mod:`.multimem` (multimem PTX, compile-checked only), :mod:`.rownorm` (the one add + RMSNorm
device body), :mod:`.push` (the ``p2p`` kernel), :mod:`.pull` (the load-based kernel behind
``multimem``), :mod:`.workspace` (symmetric buffers and pointer tables), :mod:`.launch`
(launch shapes, launchers, :func:`fused_allreduce_rmsnorm_symm`), :mod:`.select` (which kernel
a group can run).  Importable without Triton and without CUDA: the kernels are then None and
:func:`select_symm_variant` says why none can run.  Never creates multicast objects and never
touches the variables that keep NVLink multicast off; ``multimem`` runs only when PyTorch
itself made a multicast object (``multicast_ptr != 0``).
"""

from .common import HAS_TRITON, SUPPORTED_DTYPES, vector_width
from .launch import allreduce_rmsnorm_on, fused_allreduce_rmsnorm_symm
from .select import SYMM_KERNELS, check_hidden, select_symm_variant
from .sync import pad_offset_for
from .workspace import SymmCapacityError, SymmWorkspace, get_workspace, input_buffer, reserve

__all__ = [
    "HAS_TRITON",
    "SUPPORTED_DTYPES",
    "SYMM_KERNELS",
    "SymmCapacityError",
    "SymmWorkspace",
    "allreduce_rmsnorm_on",
    "check_hidden",
    "fused_allreduce_rmsnorm_symm",
    "get_workspace",
    "input_buffer",
    "pad_offset_for",
    "reserve",
    "select_symm_variant",
    "vector_width",
]
