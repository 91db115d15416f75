"""The ``tokenweave`` torch.compile backend.

``torch.compile(model, backend="tokenweave", options={...})`` reaches :func:`tokenweave_backend`
through the ``torch_dynamo_backends`` entry point. It hands the Dynamo graph to Inductor with the
tokenweave passes installed as Inductor's post-grad custom pass, so Inductor still compiles all
compute. Without an initialized process group it is exactly the default Inductor backend.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from weave_compile import report as report_mod
from weave_compile.config import TokenWeaveConfig
from weave_compile.passes.pass_manager import WeavePassManager

log = logging.getLogger(__name__)


def tokenweave_backend(gm: torch.fx.GraphModule, example_inputs: list[Any],
                       options: Optional[dict[str, Any]] = None, mode: Optional[str] = None):
    """``torch.compile`` hands us ``options=`` or ``mode=`` (Inductor's modes: "reduce-overhead"
    turns on CUDA graphs, "max-autotune" autotuning), never both."""
    config = TokenWeaveConfig.from_options(options)
    inductor_patches: dict[str, Any] = {}
    if mode is not None and mode != "default":
        from torch._inductor import list_mode_options

        inductor_patches = dict(list_mode_options(mode))
    # Registers weave::allreduce_add_rmsnorm before any graph can contain it.
    import weave_compile.kernels.allreduce_rmsnorm  # noqa: F401

    if not (dist.is_available() and dist.is_initialized()):
        report_mod.new_graph(config.compiler, note="no process group initialized: passes not run")
        log.info("tokenweave: no process group; compiling with plain %s", config.compiler)
        return _compile(gm, example_inputs, config, None, inductor_patches)
    return _compile(gm, example_inputs, config, WeavePassManager(config, config.compiler), inductor_patches)


def _compile(gm, example_inputs, config: TokenWeaveConfig, passes: Optional[WeavePassManager],
             inductor_patches: dict[str, Any]):
    if config.compiler == "aot_eager":
        return _aot_eager(gm, example_inputs, passes)
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    if passes is None:
        return compile_fx(gm, example_inputs, config_patches=inductor_patches or None)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    compiled = compile_fx(gm, example_inputs,
                          config_patches={**inductor_patches, "post_grad_custom_post_pass": passes})
    if not passes.graph_reports and counters["inductor"]["fxgraph_cache_hit"] > hits:
        report_mod.new_graph("inductor", note=(
            "served from Inductor's FX graph cache: the passes ran when it was first compiled and "
            "their site list is not stored; set TORCHINDUCTOR_FX_GRAPH_CACHE=0 to see it"))
    return compiled


def _aot_eager(gm, example_inputs, passes: Optional[WeavePassManager]):
    """AOT-autograd with Inductor's decompositions, our passes, then the ATen graph run as is."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def fw_compiler(fw_gm: torch.fx.GraphModule, fw_inputs):
        if passes is not None:
            passes(fw_gm.graph)
            fw_gm.recompile()
        return make_boxed_func(fw_gm)

    backend = aot_autograd(fw_compiler=fw_compiler, decompositions=select_decomp_table(),
                           keep_inference_input_mutations=True)
    return backend(gm, example_inputs)
