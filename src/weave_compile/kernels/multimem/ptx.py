"""``multimem`` PTX primitives (NVLink SHARP through the multicast address): compile-checked only.

``multimem.ld_reduce`` sums one 16-byte vector over every rank in the switch and
``multimem.st`` broadcasts one to every rank.  bf16/fp16 are summed with ``.acc::f32`` but
the sum comes back rounded to the input dtype (hardware limitation), ~1 ulp less exact than
the p2p fp32 accumulation.  This project never launches them (NVLink multicast stays off on
the shared machines): CI compiles them for sm_90 with Triton's bundled ptxas, and the CPU
tests run the addressing/pack/unpack helpers with plain loads standing in for the instructions.
"""

from __future__ import annotations

from ..shared.common import HAS_TRITON, tl, triton


def _asm(body: str, pred_operand: int) -> str:
    """Predicated inline PTX: ``body`` runs only where operand ``pred_operand`` is non-zero."""
    return ("{\n.reg .pred %mm_p;\n"
            f"setp.ne.s32 %mm_p, ${pred_operand}, 0;\n{body}\n}}")


_LD = "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;\n" \
      "@%mm_p multimem.ld_reduce.relaxed.sys.global.add.{} {{$0, $1, $2, $3}}, [$4];"
_ST = "@%mm_p multimem.st.relaxed.sys.global.{} [$1], {{$2, $3, $4, $5}};\nmov.b32 $0, 0;"
#: ``multimem`` type suffix per element type (16-bit types accumulate in fp32).
SUFFIX = {"fp32": ("v4.f32", "v4.f32"), "bf16": ("acc::f32.v4.bf16x2", "v4.bf16x2"),
          "fp16": ("acc::f32.v4.f16x2", "v4.f16x2")}

if HAS_TRITON:
    # Globals a @triton.jit function reads must be constexpr.
    LD_F32 = tl.constexpr(_asm(_LD.format(SUFFIX["fp32"][0]), 5))
    LD_BF16 = tl.constexpr(_asm(_LD.format(SUFFIX["bf16"][0]), 5))
    LD_F16 = tl.constexpr(_asm(_LD.format(SUFFIX["fp16"][0]), 5))
    ST_F32 = tl.constexpr(_asm(_ST.format(SUFFIX["fp32"][1]), 6))
    ST_BF16 = tl.constexpr(_asm(_ST.format(SUFFIX["bf16"][1]), 6))
    ST_F16 = tl.constexpr(_asm(_ST.format(SUFFIX["fp16"][1]), 6))

    @triton.jit
    def mm_vec_addr(mc_base, rows, row_ok, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
                    VEC: tl.constexpr):
        """Byte address and predicate of every 16-byte vector of the [R, BLOCK_H] tile."""
        vi = tl.arange(0, BLOCK_H // VEC)
        elem = rows[:, None] * HIDDEN + (vi * VEC)[None, :]
        addr = mc_base + elem * (16 // VEC)
        pred = (row_ok[:, None] & ((vi * VEC) < HIDDEN)[None, :]).to(tl.int32)
        return addr, pred

    @triton.jit
    def mm_unpack(u0, u1, u2, u3, DTYPE: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_ROWS: tl.constexpr, VEC: tl.constexpr):
        """4 x [R, NV] 32-bit words (word k of 16-byte vector n) -> fp32 [R, BLOCK_H]."""
        # join(join(u0, u2), join(u1, u3)) is [R, NV, 2, 2] with [.., j, i] = u_{2j+i}:
        # flattening gives word 4n + k in memory order.
        words = tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)),
                           (BLOCK_ROWS, BLOCK_H // VEC * 4))
        if DTYPE == tl.float32:
            out = words.to(tl.float32, bitcast=True)
        else:  # little endian: element 2m in the low half of word m
            lo = (words & 0xFFFF).to(tl.uint16).to(DTYPE, bitcast=True).to(tl.float32)
            hi = (words >> 16).to(tl.uint16).to(DTYPE, bitcast=True).to(tl.float32)
            out = tl.reshape(tl.join(lo, hi), (BLOCK_ROWS, BLOCK_H))
        return out

    @triton.jit
    def mm_pack(val, DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                VEC: tl.constexpr):
        """[R, BLOCK_H] values (already DTYPE) -> 4 x [R, NV] 32-bit words (inverse of
        :func:`mm_unpack`)."""
        if DTYPE == tl.float32:
            words = val.to(tl.uint32, bitcast=True)
        else:
            lo, hi = tl.split(tl.reshape(val, (BLOCK_ROWS, BLOCK_H // 2, 2)))
            lo = lo.to(tl.uint16, bitcast=True).to(tl.uint32)
            hi = hi.to(tl.uint16, bitcast=True).to(tl.uint32)
            words = lo | (hi << 16)
        even, odd = tl.split(tl.reshape(words, (BLOCK_ROWS, BLOCK_H // VEC, 2, 2)))
        u0, u2 = tl.split(even)
        u1, u3 = tl.split(odd)
        return u0, u1, u2, u3

    @triton.jit
    def _ld_reduce_v4(addr, pred, ASM: tl.constexpr):
        return tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,l,r", [addr, pred],
                                         dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                         is_pure=False, pack=1)

    @triton.jit
    def _st_v4(addr, u0, u1, u2, u3, pred, ASM: tl.constexpr):
        tl.inline_asm_elementwise(ASM, "=r,l,r,r,r,r,r", [addr, u0, u1, u2, u3, pred],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def mm_load_reduce(mc_base, rows, row_ok, IN_DTYPE: tl.constexpr, HIDDEN: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr, VEC: tl.constexpr):
        """``multimem.ld_reduce ... add`` of one 16-byte vector per thread-slot; fp32 out."""
        addr, pred = mm_vec_addr(mc_base, rows, row_ok, HIDDEN, BLOCK_H, VEC)
        if IN_DTYPE == tl.float32:
            u0, u1, u2, u3 = _ld_reduce_v4(addr, pred, LD_F32)
        elif IN_DTYPE == tl.bfloat16:
            u0, u1, u2, u3 = _ld_reduce_v4(addr, pred, LD_BF16)
        else:
            u0, u1, u2, u3 = _ld_reduce_v4(addr, pred, LD_F16)
        return mm_unpack(u0, u1, u2, u3, IN_DTYPE, BLOCK_H, BLOCK_ROWS, VEC)

    @triton.jit
    def mm_store_bcast(mc_base, rows, row_ok, val, DTYPE: tl.constexpr, HIDDEN: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr, VEC: tl.constexpr):
        """``multimem.st`` of the [R, BLOCK_H] tile ``val`` (already DTYPE) to all ranks."""
        addr, pred = mm_vec_addr(mc_base, rows, row_ok, HIDDEN, BLOCK_H, VEC)
        u0, u1, u2, u3 = mm_pack(val, DTYPE, BLOCK_H, BLOCK_ROWS, VEC)
        if DTYPE == tl.float32:
            _st_v4(addr, u0, u1, u2, u3, pred, ST_F32)
        elif DTYPE == tl.bfloat16:
            _st_v4(addr, u0, u1, u2, u3, pred, ST_BF16)
        else:
            _st_v4(addr, u0, u1, u2, u3, pred, ST_F16)
