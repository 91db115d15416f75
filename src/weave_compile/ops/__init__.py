"""The custom ops the passes put into graphs; importing this package registers them.

- :mod:`.allreduce_rmsnorm`: ``weave::allreduce_add_rmsnorm`` (the fused op), its async form
  ``weave::allreduce_add_rmsnorm_start`` and ``weave::comm_wait``, one schema for both forms.
- :mod:`.reference`: the collective-based implementation and the float64 oracle.
- :mod:`.selection`: which implementation a site gets, at compile time.
- :mod:`.causal_suffix_attention`: ``weave::causal_suffix_attention`` (the token split's suffix half).
"""

from .allreduce_rmsnorm import ARG_NAMES, FUSED_OP, SCHEMA, START_OP, WAIT_OP, allreduce_add_rmsnorm
from .causal_suffix_attention import SUFFIX_ATTENTION, causal_suffix_attention
from .reference import allreduce_add_rmsnorm_ref, group_size, rows_per_rank
from .selection import KERNELS, select_kernel

__all__ = ["ARG_NAMES", "FUSED_OP", "KERNELS", "SCHEMA", "START_OP", "SUFFIX_ATTENTION", "WAIT_OP",
           "allreduce_add_rmsnorm", "allreduce_add_rmsnorm_ref", "causal_suffix_attention", "group_size",
           "rows_per_rank", "select_kernel"]
