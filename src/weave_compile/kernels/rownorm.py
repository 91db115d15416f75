"""The one add + RMSNorm device body every all-reduce kernel of this package runs on its rows.

Given the fp32 all-reduced sum of a [BLOCK_ROWS, BLOCK_H] tile, :func:`norm_tile` adds the bias
and the residual, rounds to the residual dtype (that rounded value *is* the new residual, as
in the unfused model), RMS-normalises in fp32 registers, optionally rounds to ``MID_DTYPE``
(Hugging Face Llama normalises in fp32 and casts before the weight) and applies the weight
(``weight + weight_offset``: Gemma's ``1 + w``); :func:`add_norm` is :func:`load_residual` then
:func:`norm_tile` (the prefetching loops load the residual a tile ahead and call
:func:`norm_tile` themselves).  Keeping one body means the kernels cannot drift apart in the
add+norm; how a kernel sums the ranks' partials before it (the order of the fp32 adds) is the
kernel's own.
"""

from __future__ import annotations

from .common import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def shard_rows(j0, BLOCK_ROWS: tl.constexpr, owner, rows_per_rank, num_tokens,
                   UNROLL: tl.constexpr = 1, step=0, IDX64: tl.constexpr = True):
        """Shard-local indices ``j`` and global rows of ``owner``'s shard, with validity
        (rows past the shard or past T are masked: padded rows are never read).

        ``UNROLL`` tiles of ``BLOCK_ROWS`` rows, ``step`` rows apart: one iteration of a
        grid-stride loop unrolled ``UNROLL`` times (the rows a CTA visits stay the same, only
        more of them are in flight at once).  ``IDX64``: int64 indices, so element offsets
        computed from them cannot overflow; a launcher that has checked every offset fits in
        int32 passes False (less address arithmetic: the push kernel's add+norm loop at H=4096
        is 327 SASS instructions per tile with 32-bit indices, 389 with 64-bit)."""
        a = tl.arange(0, UNROLL * BLOCK_ROWS)
        j = j0 + (a // BLOCK_ROWS) * step + a % BLOCK_ROWS
        rows = owner * rows_per_rank + j
        # j < S and owner * S + j < T as one compare per row (the bound is one scalar)
        ok = j < tl.minimum(rows_per_rank, num_tokens - owner * rows_per_rank)
        if IDX64:  # widened after the checks (the 32-bit values are exact: rows < 2**31)
            j = j.to(tl.int64)
            rows = rows.to(tl.int64)
        return j, rows, ok

    @triton.jit
    def norm_params(BIAS, WEIGHT, cols, col_ok, weight_offset, HAS_BIAS: tl.constexpr,
                    HAS_WEIGHT: tl.constexpr):
        """fp32 bias and ``weight + weight_offset`` rows (zeros where absent; then unused)."""
        bias = tl.zeros(cols.shape, dtype=tl.float32)
        w = tl.zeros(cols.shape, dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            w = tl.load(WEIGHT + cols, mask=col_ok, other=0.0).to(tl.float32) + weight_offset
        return bias, w

    @triton.jit
    def load_residual(RESIDUAL, j, rows, mask, cols, stride_res_row, RESIDUAL_IN_SHARDED: tl.constexpr):
        """The residual rows of a tile, as stored (a sharded residual is indexed by ``j``)."""
        if RESIDUAL_IN_SHARDED:
            r_off = j[:, None] * stride_res_row + cols[None, :]
        else:
            r_off = rows[:, None] * stride_res_row + cols[None, :]
        return tl.load(RESIDUAL + r_off, mask=mask, other=0.0)

    @triton.jit
    def norm_tile(acc, resid, bias, w, eps, HIDDEN: tl.constexpr, RES_DTYPE: tl.constexpr,
                  OUT_DTYPE: tl.constexpr, MID_DTYPE: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_MID: tl.constexpr):
        """``(residual_out, normed)`` of the reduced fp32 tile ``acc`` and the residual tile
        ``resid`` already loaded (ignored without ``HAS_RESIDUAL``); see module doc."""
        if HAS_BIAS:
            acc = acc + bias[None, :]
        if HAS_RESIDUAL:
            acc = acc + resid.to(tl.float32)
        res = acc.to(RES_DTYPE)
        r = res.to(tl.float32)
        var = tl.sum(r * r, axis=1) / HIDDEN
        y = r * tl.rsqrt(var + eps)[:, None]
        if HAS_MID:
            y = y.to(MID_DTYPE).to(tl.float32)
        if HAS_WEIGHT:
            y = y * w[None, :]
        return res, y.to(OUT_DTYPE)

    @triton.jit
    def add_norm(acc, j, rows, mask, cols, RESIDUAL, stride_res_row, bias, w, eps,
                 HIDDEN: tl.constexpr, RES_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                 MID_DTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 HAS_WEIGHT: tl.constexpr, HAS_MID: tl.constexpr,
                 RESIDUAL_IN_SHARDED: tl.constexpr):
        """``(residual_out, normed)`` of the reduced fp32 tile ``acc``, loading the residual.

        ``j``/``rows``: shard-local and global row indices (a sharded residual is indexed
        by ``j``); ``mask``: the valid [R, BLOCK_H] elements."""
        resid = acc
        if HAS_RESIDUAL:
            resid = load_residual(RESIDUAL, j, rows, mask, cols, stride_res_row, RESIDUAL_IN_SHARDED)
        return norm_tile(acc, resid, bias, w, eps, HIDDEN, RES_DTYPE, OUT_DTYPE, MID_DTYPE, HAS_BIAS,
                         HAS_RESIDUAL, HAS_WEIGHT, HAS_MID)

    @triton.jit
    def store_residual_shard(RESIDUAL_OUT, j, res, mask, col_ok, cols, rows_per_rank,
                             stride_res_out_row, ZERO_PAST_T: tl.constexpr = True):
        """This rank's [S, H] residual shard: rows past T inside the shard are written as 0
        (``ZERO_PAST_T``: made so here; without it the caller guarantees ``res`` is 0 there,
        e.g. every input of those rows was loaded as 0 and no bias was added)."""
        if ZERO_PAST_T:
            res = tl.where(mask, res, tl.zeros_like(res))
        tl.store(RESIDUAL_OUT + j[:, None] * stride_res_out_row + cols[None, :], res,
                 mask=(j < rows_per_rank)[:, None] & col_ok[None, :])
