"""The add + RMSNorm device bodies every all-reduce kernel of this package runs on its rows.

Given the fp32 all-reduced sum of a [BLOCK_ROWS, BLOCK_H] tile, :func:`norm_tile` adds the bias
and the residual, rounds to the residual dtype (that rounded value *is* the new residual, as
in the unfused model), RMS-normalises in fp32 registers, optionally rounds to ``MID_DTYPE``
(Hugging Face Llama normalises in fp32 and casts before the weight) and applies the weight
(``weight + weight_offset``: Gemma's ``1 + w``); :func:`add_norm` is :func:`load_residual` then
:func:`norm_tile` (the prefetching loops load the residual a tile ahead and call
:func:`norm_tile` themselves).  Keeping one body means the kernels cannot drift apart in the
add+norm; how a kernel sums the ranks' partials before it (the order of the fp32 adds) is the
kernel's own.  :func:`rowwise_group` is the same math over one warp per row in column chunks
(the push and copy-engine kernels at 2 ranks, 2048 <= H <= 4096): the same cast order, the
row's sum of squares added up in another order (so the normed rows can differ by an ulp, the
residual cannot).

LayerNorm (``IS_LAYERNORM``, the contract's ``norm="layernorm"``) subtracts the row's mean from
the fp32 row after the residual's rounding and takes the variance as the mean square of the
centred row: two passes over the row held in registers (the tile, or the kept chunks of
:func:`rowwise_group`), never E[x^2] - mean^2, which cancels where the mean is large against the
spread.  ``HAS_NORM_BIAS`` adds the LayerNorm's bias after the weight.  Both are constexpr
flags that default off, so the RMSNorm bodies compile as they did; the push, pull and one-shot
kernels pass them for a LayerNorm (or a norm bias) only.
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
    def load_norm_bias(NORM_BIAS, cols, col_ok):
        """The fp32 LayerNorm bias row (added after the weight; loaded only with ``HAS_NORM_BIAS``)."""
        return tl.load(NORM_BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)

    @triton.jit
    def centre_rows(r, HIDDEN: tl.constexpr):
        """``r`` [R, BLOCK_H] minus each row's mean over its first ``HIDDEN`` columns; the
        padding columns (0 in ``r``: every input loads 0 there) stay 0, so a sum of squares of
        the result is the centred row's alone."""
        BLOCK_H: tl.constexpr = r.shape[1]
        c = r - (tl.sum(r, axis=1) / HIDDEN)[:, None]
        if BLOCK_H != HIDDEN:
            c = tl.where((tl.arange(0, BLOCK_H) < HIDDEN)[None, :], c, 0.0)
        return c

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
                  HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_MID: tl.constexpr,
                  nb=None, IS_LAYERNORM: tl.constexpr = False, HAS_NORM_BIAS: tl.constexpr = False):
        """``(residual_out, normed)`` of the reduced fp32 tile ``acc`` and the residual tile
        ``resid`` already loaded (ignored without ``HAS_RESIDUAL``); ``nb``: the LayerNorm bias
        row (:func:`load_norm_bias`); see module doc."""
        if HAS_BIAS:
            acc = acc + bias[None, :]
        if HAS_RESIDUAL:
            acc = acc + resid.to(tl.float32)
        res = acc.to(RES_DTYPE)
        r = res.to(tl.float32)
        if IS_LAYERNORM:
            r = centre_rows(r, HIDDEN)
        var = tl.sum(r * r, axis=1) / HIDDEN
        y = r * tl.rsqrt(var + eps)[:, None]
        if HAS_MID:
            y = y.to(MID_DTYPE).to(tl.float32)
        if HAS_WEIGHT:
            y = y * w[None, :]
        if HAS_NORM_BIAS:
            y = y + nb[None, :]
        return res, y.to(OUT_DTYPE)

    @triton.jit
    def add_norm(acc, j, rows, mask, cols, RESIDUAL, stride_res_row, bias, w, eps,
                 HIDDEN: tl.constexpr, RES_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                 MID_DTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 HAS_WEIGHT: tl.constexpr, HAS_MID: tl.constexpr,
                 RESIDUAL_IN_SHARDED: tl.constexpr, nb=None, IS_LAYERNORM: tl.constexpr = False,
                 HAS_NORM_BIAS: tl.constexpr = False):
        """``(residual_out, normed)`` of the reduced fp32 tile ``acc``, loading the residual.

        ``j``/``rows``: shard-local and global row indices (a sharded residual is indexed
        by ``j``); ``mask``: the valid [R, BLOCK_H] elements."""
        resid = acc
        if HAS_RESIDUAL:
            resid = load_residual(RESIDUAL, j, rows, mask, cols, stride_res_row, RESIDUAL_IN_SHARDED)
        return norm_tile(acc, resid, bias, w, eps, HIDDEN, RES_DTYPE, OUT_DTYPE, MID_DTYPE, HAS_BIAS,
                         HAS_RESIDUAL, HAS_WEIGHT, HAS_MID, nb, IS_LAYERNORM, HAS_NORM_BIAS)

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

    # ----------------------------------------------------------------- one warp per row
    # A group of ROWS rows (one per warp: the [ROWS, CH] chunks' layout puts the warps along the
    # rows) walks its H columns in NCH = ceil(H / CH) unrolled chunks.  Pass 1 loads x, the
    # partials and the residual of each chunk DEPTH chunks ahead of its math, stores the
    # rounded residual and keeps it in registers; the row's sum of squares is a reduction
    # inside the warp (shuffles, no shared memory, no CTA barrier); pass 2 scales the kept
    # chunks and stores them.  Without barriers the warps drift apart, so one warp's loads
    # overlap another's stores: faster than the prefetched tile with its barrier per tile where
    # both run (docs/performance.md, "Launch shapes").  Rows are given as pointer
    # tensors ([ROWS, 1], or [P, ROWS, 1] for the partials and the peers' copies) with masks of
    # the same shapes, so the push and copy-engine kernels share the body.

    @triton.jit
    def rowwise_loads(XR, PR, RR, m, pm, k: tl.constexpr, c, HIDDEN: tl.constexpr,
                      CH: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """Chunk ``k`` (columns ``k*CH ..``) of x, the partials and the residual, as loaded."""
        off = k * CH + c
        if HIDDEN % CH == 0:
            xm = m
            pmm = pm
        else:
            cm = (off < HIDDEN)[None, :]
            xm = m & cm
            pmm = pm & cm[None, :, :]
        x = tl.load(XR + off[None, :], mask=xm, other=0.0)
        parts = tl.load(PR + off[None, None, :], mask=pmm, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(RR + off[None, :], mask=xm, other=0.0)
        else:
            r = tl.zeros((1,), dtype=tl.float32)
        return x, parts, r

    @triton.jit
    def rowwise_first_loads(XR, PR, RR, m, pm, c, HIDDEN: tl.constexpr, CH: tl.constexpr,
                            DEPTH: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """The first ``DEPTH`` chunks of a group (a tuple of :func:`rowwise_loads` results)."""
        NCH: tl.constexpr = (HIDDEN + CH - 1) // CH
        pre = ()
        for k in tl.static_range(DEPTH):
            if k < NCH:
                pre = pre + (rowwise_loads(XR, PR, RR, m, pm, k, c, HIDDEN, CH, HAS_RESIDUAL),)
        return pre

    @triton.jit
    def _broadcast_row(PTR, off, cm, ROWS: tl.constexpr, CH: tl.constexpr,
                       FULL: tl.constexpr):
        """A [CH] parameter chunk loaded as [ROWS, CH] (every warp its own copy, an L1 hit): a
        [CH] load gets a layout of its own, and converting it costs a CTA barrier."""
        p = tl.broadcast_to(PTR + off[None, :], (ROWS, CH))
        if FULL:
            return tl.load(p).to(tl.float32)
        return tl.load(p, mask=tl.broadcast_to(cm, (ROWS, CH)), other=0.0).to(tl.float32)

    @triton.jit
    def _store_chunk(LOCAL, m, PEERS, pm, v, off, cm, FULL: tl.constexpr, TO_PEERS: tl.constexpr):
        """Store chunk ``v`` [ROWS, CH] at the rows ``LOCAL`` [ROWS, 1] where ``m``, and with
        ``TO_PEERS`` at ``PEERS`` [P, ROWS, 1] where ``pm``; columns past H (``cm``) masked
        unless every chunk is ``FULL``."""
        if not FULL:
            m = m & cm
            pm = pm & cm[None, :, :]
        tl.store(LOCAL + off[None, :], v, mask=m)
        if TO_PEERS:
            tl.store(PEERS + off[None, None, :], v[None, :, :], mask=pm)

    @triton.jit
    def rowwise_group(pre, XR, PR, RR, m, pm, NXR, NPR, NRR, nm, npm, RO, ro_m, RP, rp_m, NO, NP,
                      np_m, BIAS, WEIGHT, scale, eps, weight_offset, c, ROWS: tl.constexpr,
                      HIDDEN: tl.constexpr, CH: tl.constexpr, DEPTH: tl.constexpr,
                      RES_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, MID_DTYPE: tl.constexpr,
                      HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                      HAS_MID: tl.constexpr, ZERO_PAST_T: tl.constexpr,
                      RES_PEERS: tl.constexpr, OUT_PEERS: tl.constexpr, NORM_BIAS=None,
                      IS_LAYERNORM: tl.constexpr = False, HAS_NORM_BIAS: tl.constexpr = False):
        """One group: ``acc = x + sum(partials) (* scale) (+ bias) (+ residual)``, rounded to
        the residual dtype and stored (``RO``/``ro_m``; also to the peers, ``RP``/``rp_m``, with
        ``RES_PEERS``), then RMS-normalised and stored (``NO`` where ``m``; the peers'
        ``NP``/``np_m`` with ``OUT_PEERS``); the cast order of :func:`norm_tile`.  ``pre``: the
        group's first ``DEPTH`` chunks (loaded by the previous group); returns the next group's
        (``NXR``.. ``npm``), loaded before this group's normed stores: a load after a store in
        program order is not hoisted above it (the compiler cannot prove they do not alias).
        ``ZERO_PAST_T``: residual rows outside ``m`` are written as 0 (else they are 0 because
        every input of theirs loaded as 0).  ``IS_LAYERNORM``: pass 1 adds up the row's sum
        instead of its squares; the mean known, a second pass over the kept chunks adds up the
        centred squares, and pass 2 scales the centred chunks (then adds ``NORM_BIAS`` with
        ``HAS_NORM_BIAS``)."""
        NCH: tl.constexpr = (HIDDEN + CH - 1) // CH
        FULL: tl.constexpr = HIDDEN % CH == 0
        buf = pre
        kept = ()
        sq = tl.zeros((ROWS, CH), dtype=tl.float32)
        for k in tl.static_range(NCH):
            if k + DEPTH < NCH:
                buf = buf + (rowwise_loads(XR, PR, RR, m, pm, k + DEPTH, c, HIDDEN, CH, HAS_RESIDUAL),)
            x, parts, r = buf[k]
            off = k * CH + c
            cm = (off < HIDDEN)[None, :]
            acc = x.to(tl.float32) + tl.sum(parts.to(tl.float32), axis=0)
            if HAS_SCALE:
                acc = acc * scale
            if HAS_BIAS:
                acc = acc + _broadcast_row(BIAS, off, cm, ROWS, CH, FULL)
            if HAS_RESIDUAL:
                acc = acc + r.to(tl.float32)
            res = acc.to(RES_DTYPE)
            if ZERO_PAST_T:
                res = tl.where(m, res, tl.zeros_like(res))
            _store_chunk(RO, ro_m, RP, rp_m, res, off, cm, FULL, RES_PEERS)
            rf = res.to(tl.float32)
            if IS_LAYERNORM:
                sq += rf  # the row's sum first: its mean centres the squares below
            else:
                sq += rf * rf
            kept = kept + (res,)
        if IS_LAYERNORM:
            mean = (tl.sum(sq, axis=1) / HIDDEN)[:, None]
            sq = tl.zeros((ROWS, CH), dtype=tl.float32)
            for k in tl.static_range(NCH):
                d = kept[k].to(tl.float32) - mean
                if (k + 1) * CH > HIDDEN:  # the last chunk's columns past H hold -mean: not the row's
                    d = tl.where(((k * CH + c) < HIDDEN)[None, :], d, 0.0)
                sq += d * d
        rstd = tl.rsqrt(tl.sum(sq, axis=1) / HIDDEN + eps)[:, None]
        nxt = rowwise_first_loads(NXR, NPR, NRR, nm, npm, c, HIDDEN, CH, DEPTH, HAS_RESIDUAL)
        if HAS_WEIGHT:  # each weight chunk loaded one chunk before its use (an L1 hit, not waited on)
            wts = (_broadcast_row(WEIGHT, c, (c < HIDDEN)[None, :], ROWS, CH, FULL),)
        if HAS_NORM_BIAS:  # likewise
            nbs = (_broadcast_row(NORM_BIAS, c, (c < HIDDEN)[None, :], ROWS, CH, FULL),)
        for k in tl.static_range(NCH):
            off = k * CH + c
            cm = (off < HIDDEN)[None, :]
            if IS_LAYERNORM:
                y = (kept[k].to(tl.float32) - mean) * rstd
            else:
                y = kept[k].to(tl.float32) * rstd
            if HAS_MID:
                y = y.to(MID_DTYPE).to(tl.float32)
            if HAS_WEIGHT:
                if k + 1 < NCH:
                    wts = wts + (_broadcast_row(WEIGHT, off + CH, (off + CH < HIDDEN)[None, :], ROWS, CH, FULL),)
                y = y * (wts[k] + weight_offset)
            if HAS_NORM_BIAS:
                if k + 1 < NCH:
                    nbs = nbs + (_broadcast_row(NORM_BIAS, off + CH, (off + CH < HIDDEN)[None, :], ROWS, CH,
                                                FULL),)
                y = y + nbs[k]
            y = y.to(OUT_DTYPE)
            _store_chunk(NO, m, NP, np_m, y, off, cm, FULL, OUT_PEERS)
        return nxt
