"""What the ranks' fork server imports once, so that every forked rank starts with it.

:func:`weave_compile.testing.multiprocess.run_ranks` forks its ranks from a server process that
imports this module. Importing torch's compile stack (Dynamo, AOTAutograd, Inductor, DTensor) and
transformers' model machinery, and Inductor's first CPU compile (toolchain and vector-ISA probes,
code generators), cost each fresh process several seconds of CPU, and the suite starts hundreds
of ranks on two cores. A server pays that once, started in the environment of the ranks it
serves (Inductor and Triton read some of it at import), then forgets what it compiled. Ranks
fork from it only where no GPU driver is present (``multiprocess.start_method``); elsewhere they
are spawned and this server is not started.
"""

import torch
import torch._dynamo  # noqa: F401
import torch._functorch.aot_autograd  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed._functional_collectives  # noqa: F401
import torch.distributed.tensor  # noqa: F401

try:  # the Hugging Face models' machinery (modeling, generation, tensor-parallel plans), where installed
    import transformers

    transformers.LlamaForCausalLM  # noqa: B018 - its lazy import loads what every causal LM shares
except ImportError:
    pass


def _warm_up() -> None:
    """Inductor's first CPU compile, where no GPU driver is present: a compile may query CUDA, and
    ranks must not fork from a process that has touched the driver."""
    from weave_compile.testing.multiprocess import gpu_driver_present

    if gpu_driver_present():
        return
    x = torch.randn(8, 16)
    for backend in ("aot_eager", "inductor"):
        torch.compile(lambda t: torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * t, backend=backend)(x)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


_warm_up()
