"""What several implementations share: device-side bodies, launch shapes, the symmetric workspace.

- :mod:`.common`: limits (CTAs, world size, hidden size), dtype helpers, the optional Triton import;
- :mod:`.rownorm`: the add + RMSNorm device bodies every kernel runs on its rows;
- :mod:`.sync`: the signal-pad block barriers of the barrier kernels;
- :mod:`.shapes`: launch shapes shared by the barrier kernels;
- :mod:`.addnorm`: the few-CTA add+norm kernel on local rows (``ce``, ``nccl``);
- :mod:`.workspace`: the symmetric workspace (buffers, pointer table, signal-pad range);
- :mod:`.probe`: what symmetric memory can do for a group, and which hidden sizes fit;
- :mod:`.symm_call`: the host path of the symmetric-memory barrier kernels;
- :mod:`.outside_pool`: long-lived allocations outside cudagraph trees' memory pool.
"""
