"""Cases for the ``batch_invariant`` tests of the symmetric-memory kernels (``p2p``, ``oneshot``), on the
CPU interpreter and on the GPU's emulated ranks.

One row whose per-rank partial sums cancel in part (ranks 0 and 1 carry ``big`` and ``-big``, 2**20
times the others): added in rank order the big ones meet first and the small partials survive
exactly; a rank that adds its own small partial first, or the peers as a tree, loses them to fp32
rounding far beyond a bf16 output's ulp. The row is run alone (T=1) and placed in calls of other
token counts (below the rank count, not divisible by it) at positions owned by every rank, with
other CTA counts; its normed and residual rows must be bitwise the same.
"""

from __future__ import annotations

import torch

BF16 = torch.bfloat16


def row_partials(seed: int, world: int, hidden: int, device="cpu") -> tuple[list[torch.Tensor], torch.Tensor]:
    """One row's bf16 partial sums, one per rank, and its residual row (module doc)."""
    g = torch.Generator().manual_seed(seed)
    big = (torch.randn(hidden, generator=g) * 2.0 ** 20).to(BF16)
    parts = [big, -big] + [torch.randn(hidden, generator=g).to(BF16) for _ in range(world - 2)]
    return [p.to(device) for p in parts], torch.randn(hidden, generator=g).to(BF16).to(device)


def rank_order_residual(parts: list[torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
    """The fp32 residual row the contract asks for with the partials added in rank order in fp32:
    ``((p0 + p1) + p2 ...) + residual``. Compared with an fp32 residual output (Triton's interpreter
    rounds fp32 to bf16 toward zero, the GPU to nearest: a bf16 residual would test the cast)."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc + residual.float()


def placements(world: int) -> list[tuple[int, int, int]]:
    """``(T, position, comm_ctas)`` of the row in the batched calls: T below the rank count and not
    divisible by it, the row owned by every rank somewhere (rank ``pos // ceil(T / world)``)."""
    out = [(2, 1, 1), (5, 4, 2), (7, 3, 3), (7, 6, 1), (17, 0, 2), (17, 8, 3), (17, 16, 1)]
    if world > 2:
        out.append((world - 1, world - 2, 2))
    return out


def owner(T: int, pos: int, world: int) -> int:
    return pos // -(-T // world)


def batch_with_row(parts, res_row, T: int, pos: int, seed: int, device="cpu"):
    """Every rank's partials [T, H] and the residual [T, H], random rows with ``parts``/``res_row`` at
    row ``pos``."""
    world, hidden = len(parts), parts[0].numel()
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T, hidden, generator=g).to(BF16).to(device) for _ in range(world)]
    residual = torch.randn(T, hidden, generator=g).to(BF16).to(device)
    for r in range(world):
        xs[r][pos] = parts[r]
    residual[pos] = res_row
    return xs, residual


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def check_placements(world: int, seed: int, same_as_alone, weight: torch.Tensor, marker: str) -> int:
    """Every :func:`placements` row of ``world`` ranks, the residual full and sharded, through a kernel's
    ``same_as_alone(world, seed, T, pos, ctas, sharded, batch_seed, weight, invariant)`` with the option
    on (``(bitwise the row alone, what else is wrong)``): a line each, then ``marker`` if every one held;
    the exit code (0: all held)."""
    torch.set_num_threads(1)
    fails = 0
    for i, (T, pos, ctas) in enumerate(placements(world)):
        for sharded in (False, True):
            same, errs = same_as_alone(world, seed + i, T, pos, ctas, sharded, seed + 100 + i, weight, True)
            if not same:
                errs.append("differs from the row alone")
            print(f"[world {world}] T={T:2d} row {pos:2d} (owner {owner(T, pos, world)}) ctas={ctas} "
                  f"sharded={sharded!s:5s} {'ok' if not errs else 'FAIL ' + '; '.join(errs)}", flush=True)
            fails += bool(errs)
    print(marker if fails == 0 else f"{fails} runs failed")
    return 1 if fails else 0
