"""The custom ops the passes put into graphs; importing this package registers them.

- :mod:`.allreduce_rmsnorm`: ``weave::allreduce_add_rmsnorm`` (the fused op), its async form
  ``weave::allreduce_add_rmsnorm_start`` and ``weave::comm_wait``, one schema for both forms; its
  implementations live in :mod:`weave_compile.kernels`.
- :mod:`.causal_suffix_attention`: ``weave::causal_suffix_attention`` (the token split's suffix half).
- :mod:`.sibling_linear`: ``weave::sibling_linear`` (linears that read one input, as one GEMM).
- :mod:`.lowering`: the fused ops' Inductor lowering (never-reuse outputs left in the ring).
"""

from .allreduce_rmsnorm import ARG_NAMES, FUSED_OP, FUSED_OPS, SCHEMA, START_OP, WAIT_OP, allreduce_add_rmsnorm
from .causal_suffix_attention import SUFFIX_ATTENTION, causal_suffix_attention
from .sibling_linear import SIBLING_LINEAR, sibling_linear

__all__ = ["ARG_NAMES", "FUSED_OP", "FUSED_OPS", "SCHEMA", "SIBLING_LINEAR", "START_OP", "SUFFIX_ATTENTION", "WAIT_OP",
           "allreduce_add_rmsnorm", "causal_suffix_attention", "sibling_linear"]
