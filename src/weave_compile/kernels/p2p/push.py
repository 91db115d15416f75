"""The push kernel (``p2p``): every cross-rank access is a store, with deep memory-level parallelism.

With ``N`` ranks and ``T`` rows padded to ``S * N`` (``S = ceil(T / N)``), rank ``r`` owns rows
``[r*S, (r+1)*S) ∩ [0, T)``.  The symmetric regions are used as ``[N, slot_rows, H]``: slot
``q`` of a rank's region holds what rank ``q`` pushed there.  Three phases, one block barrier
(:mod:`weave_compile.kernels.shared.sync`) before each (not one per row):

1. *scatter*: our partial sums of owner ``p``'s rows -> slot ``[r]`` of ``p``'s input region;
2. *reduce + norm*: our rows = our own partial + the N-1 partials peers pushed into our input
   slots; the shared add + RMSNorm (or LayerNorm) body (:mod:`weave_compile.kernels.shared.rownorm`); the results go to
   our outputs and are pushed into slot ``[r]`` of every peer's output (and residual) region;
3. *gather*: copy the rows peers pushed into our output slots to the outputs.

With ``OUT_IN_REGION`` the normed output is itself a view of this rank's output region (slot
``out_ring_row // capacity`` of the ring, :data:`weave_compile.kernels.shared.common.OUT_RING_SLOTS`):
phase 2 pushes every row to the same global row of each peer's region, so the peers' rows are in
place when the last barrier passes and phase 3 copies nothing for it (the second copy of the
peers' rows is gone).  Who may read such an output, and until when, is proved at compile time
(:mod:`weave_compile.passes.output_in_place`).

``x`` is read where it is and the outputs are written where they will live: no staging copy,
no copy-out of our own rows.  CTA ``b`` handles the same shard-local rows ``j`` in every phase
and for every owner, so the CTA-pairwise barriers order exactly the rows each pair exchanges.
The barrier before phase 1 also says every peer finished its previous launch on this channel
(its phase 2 read our earlier pushes, its phase 3 our earlier output pushes).

Bytes in flight, not the hardware, set the bandwidth one SM reaches (four rows in flight per
CTA move over twice what one does; docs/performance.md section 1, "What one SM moves").  So
every phase keeps several tiles of ``BLOCK_ROWS`` rows in flight per CTA: the copy phases load
``COPY_UNROLL`` tiles (one grid-stride iteration unrolled: the same rows per CTA) before storing
them, and the add+norm loop (``NORM_PREFETCH``) loads the next tile's inputs into registers
before this tile's math and stores, so few CTAs carry the traffic.  Where that does not fit the
registers the add+norm loop is a ``tl.range`` software pipeline of ``NORM_STAGES`` stages
instead (Triton stages its loads in shared memory, which measured slower than the prefetched
loop; docs/performance.md, "Launch shapes").
With ``NORM_CHUNK`` > 0 (the default where :func:`weave_compile.kernels.shared.shapes.rowwise_fits`:
2 ranks, 16-bit inputs, 2048 <= H, H x residual bytes <= 8 KB, and a shard of at least 8 rows per
CTA) the add+norm runs one warp per row instead
(:func:`weave_compile.kernels.shared.rownorm.rowwise_group`): groups of ``BLOCK_ROWS x NORM_UNROLL``
rows (the CTA's own rows, as in the copy phases) walk their columns in chunks loaded
``NORM_DEPTH`` chunks ahead, the rounded residual kept in registers, and a row's sum of squares
never leaves its warp, so no CTA barrier holds the warps in step (faster than the prefetched
tile where both run; docs/performance.md, "Launch shapes").
:func:`weave_compile.kernels.p2p.launch.push_meta` picks the shape.  The prefetched (and
one-warp-per-row) loops and the pipelined one sum the peers' partials in different orders
(``x + sum(peers)`` vs one at a time): bit-identical with bf16 inputs at 2-4 ranks (checked in
the CPU interpreter), an fp32 ulp apart in places with fp32 inputs and 3+ ranks; the
one-warp-per-row loop adds up a row's squares in its own order, so its normed rows can be an
ulp from the others' (the residual cannot).

Batch invariance (``RANK_ORDER``, the op's ``batch_invariant``): the pipelined loop adds a row's
partials in rank order 0..N-1 in fp32, this rank's own ``x`` at its place (a pointer select on the
run-time rank, not a branch around a load), so every owner adds a row the same way; the launcher
then runs that loop on one-row tiles for every T
(:func:`weave_compile.kernels.p2p.launch.invariant_meta`: the other loops' order of the peers or of
a row's squares, and a tile's layout, move with the rows per CTA). The flag defaults off: the
kernel without it compiles as it did.

LayerNorm (``IS_LAYERNORM``, ``HAS_NORM_BIAS`` with the ``NORM_BIAS`` row: the contract's
``norm="layernorm"`` and its bias after the weight) is the shared body's variant in every add+norm
loop: the row's mean subtracted after the residual's rounding, the centred row's mean square as the
variance, both passes over the row already in registers (the tile, or the one-warp-per-row loop's
kept chunks). The flags default off and the launcher passes none of them for RMSNorm without a norm
bias, so that kernel compiles as it did. The launch shapes are RMSNorm's (chosen by its
measurements); with LayerNorm on they compile for sm_90 without spilling
(tests/testing/test_ptx.py).

The fp8 epilogue (``QUANT`` 1: a per-row scale, 2: a static one; the op's ``quant``): the tile
loops quantize a tile's normed rows in registers (the shared
:func:`weave_compile.kernels.shared.fp8_rows.quant_tile`, bit-exact to ``quant.quantize_rows``) and
push the codes and row scales instead of the normed rows: an output region then holds the codes as
a [N, slot_rows, H] byte array and the scales after it (16-byte aligned), H + 4 bytes a row against
the normed rows' 2H; phase 3 copies both out. Never in the one-warp-per-row loop (its chunks are
stored before the row's amax is known), never into the ring (the launcher refuses both). The code
stores are vectorized as the normed rows' stores are (``_norm_store``): one byte a code would
otherwise widen the tile's layout, and a row would be reduced in another order than without the
epilogue. The flags default off: the kernel without the epilogue compiles as it did.

``PHASES`` (bitmask 1|2|4) and ``SYNC`` are measurement and simulation hooks: the per-CTA
benchmark leaves phases out (barriers kept, so the pads still pair up), and the one-process CPU
simulation runs one phase of every rank at a time without barriers (the host orders them).
"""

from __future__ import annotations

from ..shared.common import HAS_TRITON, tl, triton

if HAS_TRITON:
    from ..shared.rownorm import (add_norm, load_norm_bias, load_residual, norm_params, norm_tile,
                                  rowwise_first_loads, rowwise_group, shard_rows, store_residual_shard)
    from ..shared.fp8_rows import quant_tile
    from ..shared.sync import block_barrier

    @triton.jit
    def _region(PTR_TABLE, KIND: tl.constexpr, owner, DTYPE: tl.constexpr,
                WORLD_SIZE: tl.constexpr):
        """Base of ``owner``'s region ``KIND`` (0 in, 1 out, 2 res), 16-byte aligned (say so,
        or every access is scalar)."""
        ptr = tl.load(PTR_TABLE + KIND * WORLD_SIZE + owner).to(tl.pointer_type(DTYPE))
        return tl.multiple_of(ptr, 16)

    @triton.jit
    def _peer_regions(PTR_TABLE, KIND: tl.constexpr, rank, DTYPE: tl.constexpr,
                      WORLD_SIZE: tl.constexpr, PEERS_P2: tl.constexpr):
        """Bases of region ``KIND`` of the N-1 peers (peer ``t`` is rank ``r + 1 + t``) as one
        [PEERS_P2] pointer tensor, padding masked.  Loaded once before a loop: a table load
        inside it is not hoisted (the loop's stores may alias the table, as far as the
        compiler knows), and every store to a peer would wait on it."""
        t = tl.arange(0, PEERS_P2)
        if PEERS_P2 == WORLD_SIZE - 1:  # no padding: a constant mask the compiler drops
            ok = tl.full(t.shape, 1, tl.int1)
        else:
            ok = t < WORLD_SIZE - 1
        p = (rank + 1 + t) % WORLD_SIZE
        ptr = tl.load(PTR_TABLE + KIND * WORLD_SIZE + p, mask=ok, other=0).to(tl.pointer_type(DTYPE))
        return tl.multiple_of(ptr, 16), ok

    @triton.jit
    def _copy_phase(SRC, stride_src, src_owner_rows: tl.constexpr, DST, stride_dst,
                    dst_owner_rows: tl.constexpr, src_base_row, dst_base_row, owner, pid, step,
                    rows_per_rank, num_tokens, cols, col_ok, BLOCK_ROWS: tl.constexpr,
                    UNROLL: tl.constexpr, STAGES: tl.constexpr, IDX64: tl.constexpr, SRC_VEC: tl.constexpr = 0,
                    DST_VEC: tl.constexpr = 0):
        """Copy ``owner``'s shard rows of this CTA: row ``j`` of ``SRC`` -> row ``j`` of ``DST``.

        A side indexed by global rows (``*_owner_rows`` true) is addressed at ``owner * S +
        j``; a slot side at ``*_base_row + j``.  ``UNROLL`` tiles per iteration are loaded
        before any is stored. ``SRC_VEC``/``DST_VEC`` > 0: that side's rows are aligned for that many
        elements a thread, and take no more (the fp8 epilogue's codes: one byte each, 16 a thread
        would widen the layout of the add+norm tiles too, which share ``cols``; see ``_norm_store``)."""
        for j0 in tl.range(pid * BLOCK_ROWS, rows_per_rank, step * UNROLL, num_stages=STAGES):
            j, rows, ok = shard_rows(j0, BLOCK_ROWS, owner, rows_per_rank, num_tokens, UNROLL, step,
                                     IDX64)
            m = ok[:, None] & col_ok[None, :]
            if src_owner_rows:
                s_row = rows
            else:
                s_row = src_base_row + j
            if dst_owner_rows:
                d_row = rows
            else:
                d_row = dst_base_row + j
            src = SRC + s_row[:, None] * stride_src + cols[None, :]
            if SRC_VEC > 0:
                src = tl.multiple_of(src, [1, SRC_VEC])
            v = tl.load(src, mask=m)
            dst = DST + d_row[:, None] * stride_dst + cols[None, :]
            if DST_VEC > 0:
                dst = tl.multiple_of(dst, [1, DST_VEC])
            tl.store(dst, v, mask=m)

    @triton.jit
    def _norm_loads(X, stride_x_row, in_base, RESIDUAL, stride_res_row, j0, rank, slot_rows,
                    rows_per_rank, num_tokens, step, cols, col_ok, HIDDEN: tl.constexpr,
                    BLOCK_ROWS: tl.constexpr, UNROLL: tl.constexpr, WORLD_SIZE: tl.constexpr,
                    PEERS_P2: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    RESIDUAL_IN_SHARDED: tl.constexpr, IDX64: tl.constexpr):
        """The add+norm inputs of the tile at ``j0``, as loaded (not yet converted): our partial
        sums [R, BLOCK_H], the N-1 partials peers pushed into our input slots as one
        [PEERS_P2, R, BLOCK_H] tile (peer ``t`` is rank ``r + 1 + t``; padding masked), and the
        residual (a placeholder without one).  Rows past the shard are masked (no traffic)."""
        j, rows, ok = shard_rows(j0, BLOCK_ROWS, rank, rows_per_rank, num_tokens, UNROLL, step,
                                 IDX64)
        m = ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=m, other=0.0)
        t = tl.arange(0, PEERS_P2)
        p = (rank + 1 + t) % WORLD_SIZE
        at = (p[:, None, None] * slot_rows + j[None, :, None]) * HIDDEN + cols[None, None, :]
        parts = tl.load(in_base + at, mask=(t < WORLD_SIZE - 1)[:, None, None] & m[None, :, :],
                        other=0.0)
        if HAS_RESIDUAL:
            resid = load_residual(RESIDUAL, j, rows, m, cols, stride_res_row, RESIDUAL_IN_SHARDED)
        else:
            resid = tl.zeros((1,), dtype=tl.float32)
        return x, parts, resid

    @triton.jit
    def _rowwise_inputs(X, stride_x_row, in_base, RESIDUAL, stride_res_row, j0, rank, slot_rows,
                        rows_per_rank, num_tokens, step, HIDDEN: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, UNROLL: tl.constexpr, WORLD_SIZE: tl.constexpr,
                        PEERS_P2: tl.constexpr, RESIDUAL_IN_SHARDED: tl.constexpr,
                        IDX64: tl.constexpr):
        """Row pointers and masks of the add+norm inputs of the group at ``j0`` for
        :func:`weave_compile.kernels.shared.rownorm.rowwise_group`: x [R, 1], the N-1 partials peers
        pushed into our input slots [PEERS_P2, R, 1] (peer ``t`` is rank ``r + 1 + t``), the
        residual [R, 1]."""
        j, rows, ok = shard_rows(j0, BLOCK_ROWS, rank, rows_per_rank, num_tokens, UNROLL, step,
                                 IDX64)
        t = tl.arange(0, PEERS_P2)
        p = (rank + 1 + t) % WORLD_SIZE
        PR = in_base + ((p[:, None] * slot_rows + j[None, :]) * HIDDEN)[:, :, None]
        pm = ((t < WORLD_SIZE - 1)[:, None] & ok[None, :])[:, :, None]
        if RESIDUAL_IN_SHARDED:
            RR = RESIDUAL + (j * stride_res_row)[:, None]
        else:
            RR = RESIDUAL + (rows * stride_res_row)[:, None]
        return X + (rows * stride_x_row)[:, None], PR, RR, ok[:, None], pm

    @triton.jit
    def _norm_store(out_peers, res_peers, peer_ok, NORMED, RESIDUAL_OUT, res, normed, j, rows, m,
                    col_ok, cols, rank, slot_rows, rows_per_rank, stride_out_row, stride_res_out_row,
                    out_ring_row, HIDDEN: tl.constexpr, RESIDUAL_OUT_SHARDED: tl.constexpr,
                    OUT_IN_REGION: tl.constexpr, HAS_BIAS: tl.constexpr, ok=None, QSCALES=None,
                    qstatic=0.0, sc_off=0, QUANT: tl.constexpr = 0, Q_INV_MAX: tl.constexpr = 1.0,
                    Q_FLOOR: tl.constexpr = 0.0, Q_RECIP: tl.constexpr = False, Q_SAT: tl.constexpr = 1.0,
                    Q_SDTYPE: tl.constexpr = None, Q_MBITS: tl.constexpr = 3, Q_BIAS: tl.constexpr = 7,
                    INTERPRET: tl.constexpr = False, Q_VEC: tl.constexpr = 0):
        """Phase 2's stores of one tile: our residual and normed rows, and their pushes into slot
        ``[rank]`` of every peer's residual / output region (the global row of the ring slot
        with ``OUT_IN_REGION``), one [PEERS_P2, R, BLOCK_H] store per region kind
        (``out_peers``/``res_peers``/``peer_ok``: :func:`_peer_regions`, loaded before the loop).

        ``QUANT`` (1 per row, 2 static): the normed rows go as fp8 codes (``NORMED`` and
        ``out_peers`` byte pointers; the codes in the output region's first bytes, a [N, slot_rows,
        H] byte array) and, per row, their scales to ``QSCALES[rows]`` and to the peers' scales
        array at ``sc_off`` bytes into their output region (``ok``: the tile's rows that exist)."""
        slot = (rank * slot_rows + j)[:, None] * HIDDEN + cols[None, :]
        to_peers = peer_ok[:, None, None] & m[None, :, :]
        if RESIDUAL_OUT_SHARDED:
            # Rows past T inside the shard are zero already without a bias (every input of
            # theirs was loaded as 0); only a bias makes them non-zero.
            store_residual_shard(RESIDUAL_OUT, j, res, m, col_ok, cols, rows_per_rank,
                                 stride_res_out_row, HAS_BIAS)
        else:
            tl.store(RESIDUAL_OUT + rows[:, None] * stride_res_out_row + cols[None, :], res, mask=m)
            tl.store(res_peers[:, None, None] + slot[None, :, :], res[None, :, :], mask=to_peers)
        if QUANT == 0:
            tl.store(NORMED + rows[:, None] * stride_out_row + cols[None, :], normed, mask=m)
            if OUT_IN_REGION:  # the global row of the peers' ring slot: their output itself
                out_at = (out_ring_row + rows)[:, None] * HIDDEN + cols[None, :]
            else:
                out_at = slot
            tl.store(out_peers[:, None, None] + out_at[None, :, :], normed[None, :, :], mask=to_peers)
        else:
            code, sc = quant_tile(normed, qstatic, Q_INV_MAX, Q_FLOOR, QUANT == 1, Q_RECIP, Q_SAT, Q_SDTYPE,
                                  Q_MBITS, Q_BIAS, INTERPRET)
            code = code.to(tl.uint8)
            # Stored as many to a thread as the normed rows are without the epilogue: one byte each,
            # aligned rows would get 16 a thread, a layout Triton spreads back over the whole tile,
            # and a row's sum of squares would be reduced in another order than without the
            # epilogue (kernels/shared/addnorm.py, _store_normed). The hints only where the rows are
            # aligned so (Q_VEC: the launcher checked NORMED; the regions: 16-byte aligned bases,
            # rows of HIDDEN bytes).
            ptr = NORMED + rows[:, None] * stride_out_row + cols[None, :]
            if Q_VEC > 0:
                ptr = tl.multiple_of(ptr, [1, Q_VEC])
            tl.store(ptr, code, mask=m)
            peer_ptr = out_peers[:, None, None] + slot[None, :, :]
            if HIDDEN % 16 == 0:
                peer_ptr = tl.multiple_of(peer_ptr, [1, 1, 128 // normed.dtype.primitive_bitwidth])
            tl.store(peer_ptr, code[None, :, :], mask=to_peers)
            if QUANT == 1:
                tl.store(QSCALES + rows, sc, mask=ok)
                sc_peers = (out_peers + sc_off).to(tl.pointer_type(tl.float32))
                tl.store(sc_peers[:, None] + (rank * slot_rows + j)[None, :], sc[None, :],
                         mask=peer_ok[:, None] & ok[None, :])

    @triton.jit
    def _copy_scales(SRC, src_base_row, DST, owner, pid, step, rows_per_rank, num_tokens,
                     BLOCK_ROWS: tl.constexpr, IDX64: tl.constexpr):
        """Phase 3 for the fp8 epilogue's row scales: ``owner``'s shard rows of this CTA, slot
        ``src_base_row + j`` of ``SRC`` -> global row of ``DST`` (the same rows per CTA as the
        copy phases, so the barriers pair them)."""
        for j0 in tl.range(pid * BLOCK_ROWS, rows_per_rank, step):
            j, rows, ok = shard_rows(j0, BLOCK_ROWS, owner, rows_per_rank, num_tokens, 1, step, IDX64)
            tl.store(DST + rows, tl.load(SRC + src_base_row + j, mask=ok), mask=ok)

    @triton.jit(do_not_specialize=["num_tokens", "rows_per_rank", "slot_rows", "rank", "pad_offset"])
    def push_allreduce_rmsnorm_kernel(
        PTR_TABLE,  # *i64: in[N], out[N], res[N], pad[N] addresses (regions used as [N, slot_rows, H])
        X,  # this rank's partial sums [T, H], any (non-symmetric) memory
        RESIDUAL,  # [T, H] or this rank's shard [S, H]
        BIAS, WEIGHT,  # [H]
        NORMED,  # [T, H] output: regular memory, or our output region's ring slot (OUT_IN_REGION)
        RESIDUAL_OUT,  # [T, H] or this rank's shard [S, H], regular memory
        STATUS,  # *i32 [1]: barrier timeouts
        num_tokens, rows_per_rank, slot_rows, rank, pad_offset,  # T, S, capacity / N, r, slot
        stride_x_row, stride_res_row, stride_out_row, stride_res_out_row, eps, weight_offset,
        out_ring_row,  # OUT_IN_REGION: first row of the ring slot NORMED is, in every out region
        WORLD_SIZE: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, COPY_UNROLL: tl.constexpr, COPY_STAGES: tl.constexpr,
        NORM_UNROLL: tl.constexpr, NORM_STAGES: tl.constexpr, NORM_PREFETCH: tl.constexpr,
        PEERS_P2: tl.constexpr, IN_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, RES_DTYPE: tl.constexpr,
        MID_DTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        HAS_WEIGHT: tl.constexpr, HAS_MID: tl.constexpr, RESIDUAL_IN_SHARDED: tl.constexpr,
        RESIDUAL_OUT_SHARDED: tl.constexpr, SPIN_LIMIT: tl.constexpr, FENCE_ASM: tl.constexpr,
        OUT_IN_REGION: tl.constexpr = False, PHASES: tl.constexpr = 7, SYNC: tl.constexpr = True,
        IDX64: tl.constexpr = True, NORM_CHUNK: tl.constexpr = 0,
        NORM_DEPTH: tl.constexpr = 1, EPS_PTR: tl.constexpr = False,
        NORM_BIAS=None,  # [H]: a LayerNorm's bias, added after the weight (HAS_NORM_BIAS only)
        IS_LAYERNORM: tl.constexpr = False, HAS_NORM_BIAS: tl.constexpr = False,
        RANK_ORDER: tl.constexpr = False,
        QSCALES=None,  # [T] fp32: our row scales (QUANT == 1)
        QSTATIC=None,  # [1] fp32: the static scale (QUANT == 2)
        QUANT: tl.constexpr = 0, Q_INV_MAX: tl.constexpr = 1.0, Q_FLOOR: tl.constexpr = 0.0,
        Q_RECIP: tl.constexpr = False, Q_SAT: tl.constexpr = 1.0, Q_SDTYPE: tl.constexpr = None,
        Q_MBITS: tl.constexpr = 3, Q_BIAS: tl.constexpr = 7, INTERPRET: tl.constexpr = False,
        Q_VEC: tl.constexpr = 0,  # NORMED's codes: rows aligned for that many a thread (fp8_rows.code_vector)
    ):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK_ROWS
        cols = tl.arange(0, BLOCK_H)
        col_ok = cols < HIDDEN
        in_base = _region(PTR_TABLE, 0, rank, IN_DTYPE, WORLD_SIZE)
        # QUANT: the row scales' byte offset in an output region, after the [N, slot_rows, H] codes
        # (16-byte aligned; the launcher checks that both fit the region)
        sc_off = 0
        if QUANT > 0:
            tl.static_assert(NORM_CHUNK == 0, "the fp8 epilogue runs in the tile loops, not one warp per row")
            sc_off = ((slot_rows.to(tl.int64) * WORLD_SIZE * HIDDEN + 15) // 16) * 16
        # Peers are visited as rank + 1, rank + 2, ... (mod N): no branch on the run-time
        # rank around an access, so the pipeliner can stage every load of a loop.

        # Entry: every peer finished its previous launch on this channel.
        if SYNC:
            block_barrier(PTR_TABLE, STATUS, rank, pad_offset, WORLD_SIZE, SPIN_LIMIT, FENCE_ASM)
        # 1. scatter: our partial of owner p's rows -> slot [rank] of p's input region.
        if PHASES & 1:
            for q in tl.static_range(1, WORLD_SIZE):
                p = (rank + q) % WORLD_SIZE
                _copy_phase(X, stride_x_row, True, _region(PTR_TABLE, 0, p, IN_DTYPE, WORLD_SIZE),
                            HIDDEN, False, 0, rank * slot_rows, p, pid, step, rows_per_rank,
                            num_tokens, cols, col_ok, BLOCK_ROWS, COPY_UNROLL, COPY_STAGES, IDX64)
        if SYNC:
            block_barrier(PTR_TABLE, STATUS, rank, pad_offset, WORLD_SIZE, SPIN_LIMIT, FENCE_ASM)

        # 2. reduce our rows locally, add, norm; keep our rows, push them to every peer.
        if PHASES & 2:
            if EPS_PTR:  # eps a 0-d device tensor (a graph input under dynamic shapes)
                eps = tl.load(eps).to(tl.float32)
            bias, w = norm_params(BIAS, WEIGHT, cols, col_ok, weight_offset, HAS_BIAS, HAS_WEIGHT)
            nb = None  # NORM_BIAS: None (a constexpr, no kernel argument) unless HAS_NORM_BIAS
            if HAS_NORM_BIAS and NORM_CHUNK == 0:  # the one-warp-per-row loop loads it per chunk
                nb = load_norm_bias(NORM_BIAS, cols, col_ok)
            if QUANT == 0:
                out_peers, peer_ok = _peer_regions(PTR_TABLE, 1, rank, OUT_DTYPE, WORLD_SIZE, PEERS_P2)
            else:  # the codes: bytes; the scales after them (sc_off)
                out_peers, peer_ok = _peer_regions(PTR_TABLE, 1, rank, tl.uint8, WORLD_SIZE, PEERS_P2)
            qstatic = 0.0
            if QUANT == 2:
                qstatic = tl.load(QSTATIC).to(tl.float32)
            res_peers, _ = _peer_regions(PTR_TABLE, 2, rank, RES_DTYPE, WORLD_SIZE, PEERS_P2)
            if NORM_CHUNK > 0:
                # One warp per row (rownorm.rowwise_group): groups of BLOCK_ROWS x NORM_UNROLL
                # rows, the same rows of this CTA as the copy phases' tiles.
                c = tl.arange(0, NORM_CHUNK)
                gstep = step * NORM_UNROLL
                j1 = pid * BLOCK_ROWS
                XR, PR, RR, m, pm = _rowwise_inputs(
                    X, stride_x_row, in_base, RESIDUAL, stride_res_row, j1, rank, slot_rows,
                    rows_per_rank, num_tokens, step, HIDDEN, BLOCK_ROWS, NORM_UNROLL, WORLD_SIZE,
                    PEERS_P2, RESIDUAL_IN_SHARDED, IDX64)
                pre = rowwise_first_loads(XR, PR, RR, m, pm, c, HIDDEN, NORM_CHUNK, NORM_DEPTH,
                                          HAS_RESIDUAL)
                for j0 in tl.range(j1, rows_per_rank, gstep, num_stages=1):
                    XR, PR, RR, m, pm = _rowwise_inputs(
                        X, stride_x_row, in_base, RESIDUAL, stride_res_row, j0, rank, slot_rows,
                        rows_per_rank, num_tokens, step, HIDDEN, BLOCK_ROWS, NORM_UNROLL,
                        WORLD_SIZE, PEERS_P2, RESIDUAL_IN_SHARDED, IDX64)
                    NXR, NPR, NRR, nm, npm = _rowwise_inputs(
                        X, stride_x_row, in_base, RESIDUAL, stride_res_row, j0 + gstep, rank,
                        slot_rows, rows_per_rank, num_tokens, step, HIDDEN, BLOCK_ROWS, NORM_UNROLL,
                        WORLD_SIZE, PEERS_P2, RESIDUAL_IN_SHARDED, IDX64)
                    j, rows, ok = shard_rows(j0, BLOCK_ROWS, rank, rows_per_rank, num_tokens,
                                             NORM_UNROLL, step, IDX64)
                    slot = ((rank * slot_rows + j) * HIDDEN)[None, :, None]
                    to_peers = (peer_ok[:, None] & ok[None, :])[:, :, None]
                    if RESIDUAL_OUT_SHARDED:
                        RO = RESIDUAL_OUT + (j * stride_res_out_row)[:, None]
                        ro_m = (j < rows_per_rank)[:, None]
                    else:
                        RO = RESIDUAL_OUT + (rows * stride_res_out_row)[:, None]
                        ro_m = m
                    if OUT_IN_REGION:  # the global row of the peers' ring slot: their output itself
                        out_at = ((out_ring_row + rows) * HIDDEN)[None, :, None]
                    else:
                        out_at = slot
                    pre = rowwise_group(
                        pre, XR, PR, RR, m, pm, NXR, NPR, NRR, nm, npm, RO, ro_m,
                        res_peers[:, None, None] + slot, to_peers,
                        NORMED + (rows * stride_out_row)[:, None], out_peers[:, None, None] + out_at,
                        to_peers, BIAS, WEIGHT, 1.0, eps, weight_offset, c,
                        BLOCK_ROWS * NORM_UNROLL, HIDDEN, NORM_CHUNK, NORM_DEPTH, RES_DTYPE,
                        OUT_DTYPE, MID_DTYPE, False, HAS_BIAS, HAS_RESIDUAL, HAS_WEIGHT, HAS_MID,
                        RESIDUAL_OUT_SHARDED and HAS_BIAS, not RESIDUAL_OUT_SHARDED, True, NORM_BIAS,
                        IS_LAYERNORM, HAS_NORM_BIAS)
            elif NORM_PREFETCH:
                # Registers double-buffered: the next tile's loads are issued before this tile's
                # math and stores, so they are in flight meanwhile (no shared-memory staging, no
                # wait and CTA barrier per stage as in the tl.range pipeline below).
                nx, nparts, nres = _norm_loads(
                    X, stride_x_row, in_base, RESIDUAL, stride_res_row, pid * BLOCK_ROWS, rank,
                    slot_rows, rows_per_rank, num_tokens, step, cols, col_ok, HIDDEN, BLOCK_ROWS,
                    NORM_UNROLL, WORLD_SIZE, PEERS_P2, HAS_RESIDUAL, RESIDUAL_IN_SHARDED, IDX64)
                for j0 in tl.range(pid * BLOCK_ROWS, rows_per_rank, step * NORM_UNROLL, num_stages=1):
                    cx = nx
                    cparts = nparts
                    cres = nres
                    nx, nparts, nres = _norm_loads(
                        X, stride_x_row, in_base, RESIDUAL, stride_res_row, j0 + step * NORM_UNROLL,
                        rank, slot_rows, rows_per_rank, num_tokens, step, cols, col_ok, HIDDEN,
                        BLOCK_ROWS, NORM_UNROLL, WORLD_SIZE, PEERS_P2, HAS_RESIDUAL,
                        RESIDUAL_IN_SHARDED, IDX64)
                    j, rows, ok = shard_rows(j0, BLOCK_ROWS, rank, rows_per_rank, num_tokens,
                                             NORM_UNROLL, step, IDX64)
                    m = ok[:, None] & col_ok[None, :]
                    acc = cx.to(tl.float32) + tl.sum(cparts.to(tl.float32), axis=0)
                    res, normed = norm_tile(acc, cres, bias, w, eps, HIDDEN, RES_DTYPE, OUT_DTYPE,
                                            MID_DTYPE, HAS_BIAS, HAS_RESIDUAL, HAS_WEIGHT, HAS_MID, nb,
                                            IS_LAYERNORM, HAS_NORM_BIAS)
                    _norm_store(out_peers, res_peers, peer_ok, NORMED, RESIDUAL_OUT, res, normed, j,
                                rows, m, col_ok, cols, rank, slot_rows, rows_per_rank,
                                stride_out_row, stride_res_out_row, out_ring_row, HIDDEN,
                                RESIDUAL_OUT_SHARDED, OUT_IN_REGION, HAS_BIAS, ok, QSCALES, qstatic, sc_off,
                                QUANT, Q_INV_MAX, Q_FLOOR, Q_RECIP, Q_SAT, Q_SDTYPE, Q_MBITS, Q_BIAS, INTERPRET,
                                Q_VEC)
            else:
                for j0 in tl.range(pid * BLOCK_ROWS, rows_per_rank, step * NORM_UNROLL,
                                   num_stages=NORM_STAGES):
                    j, rows, ok = shard_rows(j0, BLOCK_ROWS, rank, rows_per_rank, num_tokens,
                                             NORM_UNROLL, step, IDX64)
                    m = ok[:, None] & col_ok[None, :]
                    if RANK_ORDER:
                        # batch_invariant: ranks 0..N-1 in order, ours at its place; a select of
                        # the base pointer and the rows' offsets, not a branch on the run-time rank
                        # around a load (module doc), nor a select of a whole tile of 64-bit
                        # pointers (spills at fp32, H=8192)
                        acc = tl.zeros((BLOCK_ROWS * NORM_UNROLL, BLOCK_H), dtype=tl.float32)
                        for k in tl.static_range(WORLD_SIZE):  # (not `p`: a run-time value above)
                            mine = rank == k
                            base = tl.where(mine, X, in_base + k * slot_rows * HIDDEN)
                            row_at = tl.where(mine, rows * stride_x_row, j * HIDDEN)
                            term = tl.load(base + row_at[:, None] + cols[None, :], mask=m,
                                           other=0.0).to(tl.float32)
                            if k == 0:
                                acc = term
                            else:
                                acc += term
                    else:  # ours, then the peers from rank + 1 on
                        acc = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=m,
                                      other=0.0).to(tl.float32)
                        for q in tl.static_range(1, WORLD_SIZE):
                            p = (rank + q) % WORLD_SIZE
                            acc += tl.load(in_base + (p * slot_rows + j)[:, None] * HIDDEN + cols[None, :],
                                           mask=m, other=0.0).to(tl.float32)
                    res, normed = add_norm(acc, j, rows, m, cols, RESIDUAL, stride_res_row, bias, w,
                                           eps, HIDDEN, RES_DTYPE, OUT_DTYPE, MID_DTYPE, HAS_BIAS,
                                           HAS_RESIDUAL, HAS_WEIGHT, HAS_MID, RESIDUAL_IN_SHARDED, nb,
                                           IS_LAYERNORM, HAS_NORM_BIAS)
                    _norm_store(out_peers, res_peers, peer_ok, NORMED, RESIDUAL_OUT, res, normed, j,
                                rows, m, col_ok, cols, rank, slot_rows, rows_per_rank,
                                stride_out_row, stride_res_out_row, out_ring_row, HIDDEN,
                                RESIDUAL_OUT_SHARDED, OUT_IN_REGION, HAS_BIAS, ok, QSCALES, qstatic, sc_off,
                                QUANT, Q_INV_MAX, Q_FLOOR, Q_RECIP, Q_SAT, Q_SDTYPE, Q_MBITS, Q_BIAS, INTERPRET,
                                Q_VEC)
        if SYNC:
            block_barrier(PTR_TABLE, STATUS, rank, pad_offset, WORLD_SIZE, SPIN_LIMIT, FENCE_ASM)

        # 3. gather: the peers pushed their rows into our slots; copy them to the outputs
        # (the normed rows are in place already with OUT_IN_REGION).
        if PHASES & 4:
            if QUANT == 0:
                out_base = _region(PTR_TABLE, 1, rank, OUT_DTYPE, WORLD_SIZE)
            else:
                out_base = _region(PTR_TABLE, 1, rank, tl.uint8, WORLD_SIZE)
            res_base = _region(PTR_TABLE, 2, rank, RES_DTYPE, WORLD_SIZE)
            for q in tl.static_range(1, WORLD_SIZE):
                p = (rank + q) % WORLD_SIZE
                if not OUT_IN_REGION:
                    _copy_phase(out_base, HIDDEN, False, NORMED, stride_out_row, True,
                                p * slot_rows, 0, p, pid, step, rows_per_rank, num_tokens, cols,
                                col_ok, BLOCK_ROWS, COPY_UNROLL, COPY_STAGES, IDX64,
                                128 // OUT_DTYPE.primitive_bitwidth if QUANT > 0 and HIDDEN % 16 == 0 else 0,
                                Q_VEC)
                if QUANT == 1:
                    _copy_scales((out_base + sc_off).to(tl.pointer_type(tl.float32)), p * slot_rows, QSCALES, p,
                                 pid, step, rows_per_rank, num_tokens, BLOCK_ROWS, IDX64)
                if not RESIDUAL_OUT_SHARDED:
                    _copy_phase(res_base, HIDDEN, False, RESIDUAL_OUT, stride_res_out_row, True,
                                p * slot_rows, 0, p, pid, step, rows_per_rank, num_tokens, cols,
                                col_ok, BLOCK_ROWS, COPY_UNROLL, COPY_STAGES, IDX64)
else:  # pragma: no cover
    push_allreduce_rmsnorm_kernel = None
