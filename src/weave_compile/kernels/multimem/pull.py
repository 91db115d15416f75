"""The load-based kernel: every rank *pulls* its rows from every peer, then broadcasts them.

With ``N`` ranks and ``T`` token rows padded to ``S * N`` (``S = ceil(T / N)``), rank ``r``
owns the rows ``[r*S, (r+1)*S) ∩ [0, T)``.  For every owned row the kernel

1. *reduce-scatter*: reads that row of every peer's symmetric input buffer and sums in fp32
   (``p2p_pull``: plain peer loads), or lets the NVSwitch do it with ``multimem.ld_reduce``
   (``multimem``);
2. runs the shared add + RMSNorm (or LayerNorm) body (:mod:`weave_compile.kernels.shared.rownorm`);
3. *all-gather*: stores the normed row (and the new residual unless it stays sharded) into
   every peer's symmetric output buffer (plain peer stores, or ``multimem.st``).

Two block barriers (:mod:`weave_compile.kernels.shared.sync`): **entry**, before reading peers
(their inputs are complete, and they finished copying out the previous launch's outputs we are
about to overwrite), and **exit**, after the broadcast stores (every peer CTA finished reading our
input and writing our outputs, so the copy-out that follows sees every row and our next staging
copy cannot race a slow peer).  The caller stages ``x`` into the symmetric input buffer and copies the outputs out.

LayerNorm (``IS_LAYERNORM``, ``HAS_NORM_BIAS`` with the ``NORM_BIAS`` row: the contract's
``norm="layernorm"`` and its bias after the weight) is the shared body's variant, as in the push
and one-shot kernels: the row's mean subtracted after the residual's rounding, the centred row's
mean square as the variance, both passes over the tile already in registers. The flags default
off and the launcher passes none of them for RMSNorm without a norm bias, so that kernel compiles
to the PTX it did before the variant existed. The launch shapes are RMSNorm's (never measured):
with LayerNorm on, the one-row tiles and H=4096's 2-row tiles compile for sm_90 without spilling;
H=8192's 2-row tiles spill (as RMSNorm's do, twice as much), and H=4096's 4-row tiles with a norm
bias (tests/testing/test_ptx.py; the bytes in docs/kernels.md).
Like the rest of the ``multimem`` path this variant is compile-checked only; its plain-load form
(``p2p_pull``) runs in the CPU interpreter's multi-process simulation
(tests/kernels/p2p/test_launch.py).

``multimem`` is the product kernel on NVLS machines (never launched in this project: compile
-checked only); ``p2p_pull`` exists for measurement and is reachable only through
``weave_compile.testing.ptx``.
"""

from __future__ import annotations

from ..shared.common import HAS_TRITON, tl, triton

if HAS_TRITON:
    from ..shared.rownorm import add_norm, load_norm_bias, norm_params, shard_rows, store_residual_shard
    from ..shared.sync import block_barrier
    from .ptx import mm_load_reduce, mm_store_bcast

    @triton.jit
    def p2p_load_reduce(PTR_TABLE, elem_off, mask, IN_DTYPE: tl.constexpr,
                        WORLD_SIZE: tl.constexpr):
        """fp32 sum over ranks 0..N-1 (fixed order) of the peers' input buffers."""
        acc = tl.zeros(elem_off.shape, dtype=tl.float32)
        for p in tl.static_range(WORLD_SIZE):
            buf = tl.load(PTR_TABLE + p).to(tl.pointer_type(IN_DTYPE))
            buf = tl.multiple_of(buf, 16)
            acc += tl.load(buf + elem_off, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        return acc

    @triton.jit
    def p2p_store_bcast(PTR_TABLE, TABLE_ROW: tl.constexpr, elem_off, val, mask,
                        DTYPE: tl.constexpr, WORLD_SIZE: tl.constexpr):
        """Store ``val`` into the same rows of every rank's buffer ``TABLE_ROW``."""
        for p in tl.static_range(WORLD_SIZE):
            buf = tl.load(PTR_TABLE + TABLE_ROW * WORLD_SIZE + p).to(tl.pointer_type(DTYPE))
            buf = tl.multiple_of(buf, 16)
            tl.store(buf + elem_off, val, mask=mask)

    @triton.jit
    def _load_reduce_rows(PTR_TABLE, i0, rank, rows_per_rank, num_tokens, cols, col_ok, mc_in,
                          IN_DTYPE: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_ROWS: tl.constexpr, IN_VEC: tl.constexpr, WORLD_SIZE: tl.constexpr,
                          USE_MULTIMEM: tl.constexpr):
        """fp32 sum over ranks of shard rows ``[i0, i0 + BLOCK_ROWS)``; rows past the shard
        or past T load nothing (so the prefetch past the last iteration is free)."""
        j, rows, row_ok = shard_rows(i0, BLOCK_ROWS, rank, rows_per_rank, num_tokens)
        if USE_MULTIMEM:
            acc = mm_load_reduce(mc_in, rows, row_ok, IN_DTYPE, HIDDEN, BLOCK_H, BLOCK_ROWS, IN_VEC)
        else:
            mask = row_ok[:, None] & col_ok[None, :]
            acc = p2p_load_reduce(PTR_TABLE, rows[:, None] * HIDDEN + cols[None, :], mask, IN_DTYPE,
                                  WORLD_SIZE)
        return acc

    @triton.jit(do_not_specialize=["num_tokens", "rows_per_rank", "rank", "pad_offset"])
    def pull_allreduce_rmsnorm_kernel(
        PTR_TABLE,  # *i64 [4N+3]: in[N], out[N], res[N], pad[N] addresses, mc in/out/res
        RESIDUAL,  # residual input, [T, H] or this rank's shard [S, H]
        BIAS,  # [H]
        WEIGHT,  # [H]
        RESIDUAL_OUT,  # this rank's residual shard [S, H] (RESIDUAL_OUT_SHARDED only)
        STATUS,  # *i32 [1]: barrier timeouts
        num_tokens, rows_per_rank, rank, pad_offset,  # T, S, this rank, first signal slot
        stride_res_row, stride_res_out_row, eps, weight_offset,
        WORLD_SIZE: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, IN_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
        RES_DTYPE: tl.constexpr, MID_DTYPE: tl.constexpr, IN_VEC: tl.constexpr,
        OUT_VEC: tl.constexpr, RES_VEC: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_MID: tl.constexpr,
        RESIDUAL_IN_SHARDED: tl.constexpr, RESIDUAL_OUT_SHARDED: tl.constexpr,
        USE_MULTIMEM: tl.constexpr, SPIN_LIMIT: tl.constexpr, FENCE_ASM: tl.constexpr,
        NORM_BIAS=None,  # [H]: a LayerNorm's bias, added after the weight (HAS_NORM_BIAS only)
        IS_LAYERNORM: tl.constexpr = False, HAS_NORM_BIAS: tl.constexpr = False,
    ):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK_ROWS

        # Entry barrier: every peer's input rows are written, and every peer finished
        # copying out the previous launch's outputs (we are about to overwrite them).
        block_barrier(PTR_TABLE, STATUS, rank, pad_offset, WORLD_SIZE, SPIN_LIMIT, FENCE_ASM)

        cols = tl.arange(0, BLOCK_H)
        col_ok = cols < HIDDEN
        bias, w = norm_params(BIAS, WEIGHT, cols, col_ok, weight_offset, HAS_BIAS, HAS_WEIGHT)
        nb = None  # NORM_BIAS: None (a constexpr, no kernel argument) unless HAS_NORM_BIAS
        if HAS_NORM_BIAS:
            nb = load_norm_bias(NORM_BIAS, cols, col_ok)
        mc_in = tl.load(PTR_TABLE + 4 * WORLD_SIZE + 0)  # 0 without multicast; unused by p2p
        mc_out = tl.load(PTR_TABLE + 4 * WORLD_SIZE + 1)
        mc_res = tl.load(PTR_TABLE + 4 * WORLD_SIZE + 2)

        # Grid-stride loop over this rank's shard (a while loop: the same code also runs
        # under TRITON_INTERPRET=1, which the CPU tests use to simulate ranks). The peers'
        # rows of the next iteration are loaded before this iteration's norm and stores:
        # remote loads are latency-bound with so few CTAs, and two iterations in flight
        # hide one of them. Loads read input buffers, stores write output buffers: no hazard.
        i0 = pid * BLOCK_ROWS
        acc_next = _load_reduce_rows(PTR_TABLE, i0, rank, rows_per_rank, num_tokens, cols, col_ok,
                                     mc_in, IN_DTYPE, HIDDEN, BLOCK_H, BLOCK_ROWS, IN_VEC,
                                     WORLD_SIZE, USE_MULTIMEM)
        while i0 < rows_per_rank:
            j, rows, row_ok = shard_rows(i0, BLOCK_ROWS, rank, rows_per_rank, num_tokens)
            mask = row_ok[:, None] & col_ok[None, :]
            elem_off = rows[:, None] * HIDDEN + cols[None, :]
            acc = acc_next
            acc_next = _load_reduce_rows(PTR_TABLE, i0 + step, rank, rows_per_rank, num_tokens,
                                         cols, col_ok, mc_in, IN_DTYPE, HIDDEN, BLOCK_H,
                                         BLOCK_ROWS, IN_VEC, WORLD_SIZE, USE_MULTIMEM)
            res, normed = add_norm(acc, j, rows, mask, cols, RESIDUAL, stride_res_row, bias, w,
                                   eps, HIDDEN, RES_DTYPE, OUT_DTYPE, MID_DTYPE, HAS_BIAS,
                                   HAS_RESIDUAL, HAS_WEIGHT, HAS_MID, RESIDUAL_IN_SHARDED, nb, IS_LAYERNORM,
                                   HAS_NORM_BIAS)
            if RESIDUAL_OUT_SHARDED:
                store_residual_shard(RESIDUAL_OUT, j, res, mask, col_ok, cols, rows_per_rank,
                                     stride_res_out_row)
            elif USE_MULTIMEM:
                mm_store_bcast(mc_res, rows, row_ok, res, RES_DTYPE, HIDDEN, BLOCK_H, BLOCK_ROWS,
                               RES_VEC)
            else:
                p2p_store_bcast(PTR_TABLE, 2, elem_off, res, mask, RES_DTYPE, WORLD_SIZE)
            # all-gather of the normed rows
            if USE_MULTIMEM:
                mm_store_bcast(mc_out, rows, row_ok, normed, OUT_DTYPE, HIDDEN, BLOCK_H,
                               BLOCK_ROWS, OUT_VEC)
            else:
                p2p_store_bcast(PTR_TABLE, 1, elem_off, normed, mask, OUT_DTYPE, WORLD_SIZE)
            i0 += step

        # Exit barrier: every peer CTA finished reading our input and writing our outputs.
        block_barrier(PTR_TABLE, STATUS, rank, pad_offset, WORLD_SIZE, SPIN_LIMIT, FENCE_ASM)
else:  # pragma: no cover
    pull_allreduce_rmsnorm_kernel = None
