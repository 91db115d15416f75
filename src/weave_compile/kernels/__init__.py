"""Implementations of ``weave::allreduce_add_rmsnorm`` (all-reduce + residual add + RMSNorm).

One registry entry per implementation (:mod:`.registry`), one module or subpackage each:

- :mod:`.reference`: reduce-scatter / add + RMSNorm / all-gather with functional collectives; the
  fallback off GPUs, and the float64 oracle of the op's contract;
- :mod:`.p2p`: the push kernel over peer-mapped symmetric memory (any NVLink / P2P machine);
- :mod:`.multimem`: the pull kernel through NVLink SHARP (multicast machines; compile-checked here);
- :mod:`.oneshot`: the barrier-free one-shot kernel for decode-sized token counts;
- :mod:`.ce`: copy engines and stream-memory-op flags around a few-CTA add+norm;
- :mod:`.nccl`: NCCL reduce-scatter / all-gather around the same add+norm; the fallback on GPUs.

Around them: :mod:`.spec` (the op's arguments as the implementations receive them: a frozen
:class:`FusedSpec` and the :class:`Rows` adapter), :mod:`.auto` (which implementation a site
gets: the whole policy) with its measured table :mod:`.auto_table`, and :mod:`.shared`, what
several implementations use: the add + RMSNorm device bodies (``rownorm``), the signal-pad
barriers (``sync``), limits and dtype helpers (``common``), launch shapes (``shapes``), the
few-CTA add+norm kernel (``addnorm``), the symmetric workspace, its probe and host path
(``workspace``, ``probe``, ``symm_call``) and allocation outside CUDA-graph pools
(``outside_pool``).

Importable without Triton and without CUDA: the kernels are then absent and the capability
checks say why. Nothing here creates multicast objects or touches the variables that keep NVLink
multicast off; ``multimem`` runs only where PyTorch itself made a multicast object. Nothing here
imports the op layer above (``ops/``); both use :mod:`weave_compile.rows`.
"""

from .registry import (AUTO, Implementation, NormTerms, Site, fallback, get, gpu_fallback, implementations, names,
                       register, unregister)
from .spec import FusedSpec, Rows

__all__ = ["AUTO", "FusedSpec", "Implementation", "NormTerms", "Rows", "Site", "fallback", "get", "gpu_fallback",
           "implementations", "names", "register", "unregister"]
