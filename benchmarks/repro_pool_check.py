"""Reproduce and diagnose cudagraph trees' pool check with a symbolic token count (issue 15).

One GPU, fake process group (world size 2: collectives are no-ops, shapes are the real ones).
Each variant compiles with ``mode="reduce-overhead"``, a token count marked dynamic, and runs
several token counts; it prints PASS or the error (with allocation origins:
``cudagraph_trees_history_recording``).

Variants: plain Inductor (control), tokenweave without fusion (control), tokenweave with the
fused op (``kernel="reference"``), with the token split, and the mechanism found: a custom op
that grows a cached device buffer on a larger token count during the warm-up (what the
symmetric-memory workspaces do), with and without :func:`run_outside_graph_pool`.

    python benchmarks/repro_pool_check.py [--variants ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch
import torch.distributed as dist

VARIANTS = ("lazy_grow", "lazy_grow_fixed", "reference", "split", "nofuse", "inductor")
_CACHE: dict = {}


def _init_fake(world: int = 2) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _model():
    from weave_compile.testing.models import LlamaDims, TPLlama

    d = LlamaDims(hidden=256, heads=4, kv_heads=2, intermediate=512, layers=2, vocab=512)
    return TPLlama(d, tp=2, rank=0, group=dist.group.WORLD, dtype=torch.bfloat16, device="cuda"), d


def _run(compiled, vocab: int, token_counts) -> None:
    for t in token_counts:
        tokens = torch.randint(0, vocab, (1, t), device="cuda")
        torch._dynamo.mark_dynamic(tokens, 1)
        for _ in range(3):  # warm-up, record, replay
            out = compiled(tokens)
        torch.cuda.synchronize()
        assert torch.isfinite(out.float()).all()


def _grow_op(fixed: bool):
    """A custom op that keeps a lazily grown device buffer in a module-level cache."""
    name = f"repro_pool::scale_{'fixed' if fixed else 'plain'}"

    @torch.library.custom_op(name, mutates_args=())
    def scale(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        buf = _CACHE.get(name)
        if buf is None or buf.shape[0] < n:
            if torch.cuda.is_current_stream_capturing():
                return x * 2  # cannot grow while capturing: the op's fallback
            if fixed:
                from weave_compile.kernels.outside_pool import run_outside_graph_pool

                buf = run_outside_graph_pool(lambda: torch.full((n,), 2.0, device=x.device), x.device)
            else:
                buf = torch.full((n,), 2.0, device=x.device)
            _CACHE[name] = buf
        return x * buf[:n, None].to(x.dtype)

    @scale.register_fake
    def _(x):
        return torch.empty_like(x)

    return scale


def variant(name: str) -> None:
    torch._dynamo.reset()
    if name in ("lazy_grow", "lazy_grow_fixed"):
        op = _grow_op(name == "lazy_grow_fixed")
        w = torch.randn(64, 64, device="cuda")

        def f(x):
            return op(x @ w) + 1

        c = torch.compile(f, mode="reduce-overhead")
        for t in (8, 16, 32):  # each larger count grows the cache during its warm-up
            x = torch.randn(t, 64, device="cuda")
            torch._dynamo.mark_dynamic(x, 0)
            for _ in range(3):
                out = c(x)
            torch.testing.assert_close(out, (x @ w) * 2 + 1, rtol=1e-4, atol=1e-4)
        return
    model, d = _model()
    if name == "inductor":
        c = torch.compile(model, mode="reduce-overhead")
    else:
        opts = {"mode": "reduce-overhead", "kernel": "reference", "fuse": name != "nofuse"}
        if name == "split":
            opts.update(split=True, split_threshold=64)
        c = torch.compile(model, backend="tokenweave", options=opts)
    _run(c, d.vocab, (64, 96, 128, 160))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch._inductor.config.triton.cudagraph_trees_history_recording = True
    _init_fake()
    lines = [f"torch {torch.__version__}, {torch.cuda.get_device_name()}"]
    for name in args.variants:
        try:
            variant(name)
            lines.append(f"{name}: PASS")
        except Exception as e:  # report every variant
            tb = traceback.format_exc()
            lines.append(f"{name}: FAIL {type(e).__name__}: {str(e)[:4000]}\n{tb[-3000:]}")
        print(lines[-1][:6000], flush=True)
        if args.out:  # after every variant: a time limit keeps what was done
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
