"""Signal-pad block barriers: CTA b of this rank <-> CTA b of every peer, replay-safe.

CTA ``b`` of rank ``r`` owns the 32-bit slots ``pad[r][pad_offset + b*N + p]`` (one per peer
``p``) of its symmetric signal pad; each slot is a counting semaphore written only by CTA ``b``
of peer ``p`` (+1) and CTA ``b`` of ``r`` (-1).  A *block barrier* is

* ``bar.sync``; ``fence.acq_rel.sys``; then thread 0 adds 1 (relaxed, system scope) to
  ``pad[p][pad_offset + b*N + r]`` of every peer ``p != r``.  The fence followed by the
  increment is a release pattern (cumulative over the CTA's writes, which thread 0 observed
  through ``bar.sync``); the increments are fire-and-forget, so N-1 peers cost one fence, not
  N-1 round trips;
* thread 0, for every peer ``p != r``: spin on an acquire read (atomic add of 0, system scope)
  of ``pad[r][pad_offset + b*N + p]`` until it is >= 1, then subtract 1: the wait *consumes*
  the signal.  ``bar.sync`` then orders every thread's later accesses after the acquires.

A kernel that posts and consumes the same number of signals per (CTA, peer) leaves every slot
at 0: replay-safe in CUDA graphs, no host-side reset.  Signals are counted, not matched: the
k-th wait of CTA ``b`` on ``r`` passes once the count of signals from ``p`` reached k, whatever
the interleaving (a slot can transiently hold 2).  Scalar Triton atomics are executed by one
thread of the CTA (the PTX predicates them on thread 0).

Everything relies on all CTAs of a launch being co-resident with their peers (few CTAs) and on
all ranks issuing the same sequence of launches per channel.  Two launches that may run
*concurrently* must use different channels: each channel has its own slot range
:func:`pad_offset_for`, above the slots PyTorch's own symmetric-memory kernels use
(``block * N + rank`` for up to 32 blocks; ``barrier(channel)`` uses ``channel * N + rank``).
"""

from __future__ import annotations

from .common import HAS_TRITON, MAX_CTAS, tl, triton

TORCH_RESERVED_BLOCKS = 32  # pad slots block * N + rank of PyTorch's own kernels


def pad_offset_for(channel: int, world_size: int) -> int:
    """First uint32 signal slot of ``channel`` (each channel: MAX_CTAS * N slots, after the
    32 * N slots PyTorch's own kernels may use).  Channel 0 needs (32 + 32) * N * 4 bytes of
    pad: 2048 bytes (the old default) for N = 8; the newer 9216-byte default holds channels
    0..7 for N <= 8."""
    return (TORCH_RESERVED_BLOCKS + int(channel) * MAX_CTAS) * int(world_size)


if HAS_TRITON:

    @triton.jit
    def sys_fence():
        """``fence.acq_rel.sys`` on every thread (one is enough for thread 0's pattern)."""
        tl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def pad_wait(slot, SPIN_LIMIT: tl.constexpr):
        """Consume one signal from ``slot`` (own pad): spin on an acquire read (system
        scope) until the count is >= 1, then decrement it.  Returns 1 on timeout."""
        v = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
        if SPIN_LIMIT > 0:
            spins = 0
            while (v < 1) & (spins < SPIN_LIMIT):
                v = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
                spins += 1
            if v >= 1:
                tl.atomic_add(slot, -1, sem="relaxed", scope="sys")
        else:
            while v < 1:
                v = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
            tl.atomic_add(slot, -1, sem="relaxed", scope="sys")
        return (v < 1).to(tl.int32)

    @triton.jit
    def block_barrier(PTR_TABLE, STATUS, rank, pad_offset, WORLD_SIZE: tl.constexpr,
                      SPIN_LIMIT: tl.constexpr, FENCE_ASM: tl.constexpr):
        """CTA b of this rank <-> CTA b of every peer (see the module docstring).

        ``PTR_TABLE[3N + p]`` is rank p's signal pad (the workspace's table layout)."""
        base = pad_offset + tl.program_id(0) * WORLD_SIZE
        # Every thread's earlier loads/stores are ordered before thread 0's signals.
        tl.debug_barrier()
        if FENCE_ASM:
            # One system fence, then fire-and-forget relaxed increments to every peer:
            # each (fence, increment) pair is a release pattern, and the increments are
            # not serialised behind each other's round trips.
            sys_fence()
        for p in tl.static_range(WORLD_SIZE):
            if p != rank:
                peer_pad = tl.load(PTR_TABLE + 3 * WORLD_SIZE + p).to(tl.pointer_type(tl.int32))
                if FENCE_ASM:
                    tl.atomic_add(peer_pad + base + rank, 1, sem="relaxed", scope="sys")
                else:  # TRITON_INTERPRET (no inline asm): release increments instead
                    tl.atomic_add(peer_pad + base + rank, 1, sem="release", scope="sys")
        own_pad = tl.load(PTR_TABLE + 3 * WORLD_SIZE + rank).to(tl.pointer_type(tl.int32))
        timeouts = tl.zeros((), dtype=tl.int32)
        for p in tl.static_range(WORLD_SIZE):
            if p != rank:
                timeouts += pad_wait(own_pad + base + p, SPIN_LIMIT)
        if timeouts > 0:
            tl.atomic_add(STATUS, timeouts)
        # Every thread's later loads/stores are ordered after thread 0's acquires.
        tl.debug_barrier()
