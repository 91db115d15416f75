"""Module backward hooks are no-ops in a forward that runs with grad disabled: Dynamo is told so.

A module with a full backward hook (``register_full_backward_hook``) runs ``nn.Module._call_impl``
with a ``torch.utils.hooks.BackwardHook``, whose ``setup_input_hook`` / ``setup_output_hook`` wrap
the tensors in an autograd function only when one requires grad *and* grad is enabled: under
``torch.no_grad()`` or ``torch.inference_mode()`` they return their arguments unchanged, and the
hook can never fire. Dynamo (torch 2.11 and 2.13) does not look at grad mode there: it refuses
every module backward hook without compiled autograd ("Module-level backwards hooks require
compiled autograd"), a hard error under ``fullgraph=True`` and a graph break at every such module
otherwise, which cuts the all_reduce sites around it apart (nothing fuses across a break).

Transformers 5.17's tensor-parallel plans put such a hook on Qwen3's and Gemma3's per-head q/k
norms (``replicated_with_grad_allreduce``: it sums the norm weights' gradients in training), so a
model loaded with ``from_pretrained(..., tp_plan="auto")`` could not compile whole for inference
(later releases, checked 5.24, hook the parameters instead, only while grad is enabled).

:func:`install` wraps Dynamo's ``BackwardHookVariable.create``: while Dynamo traces a frame *for
this backend* with grad disabled, a module backward hook traces as what it is then, the identity
on the module's inputs and outputs; in every other case (grad enabled, another backend) Dynamo's
own handling runs unchanged. The rule is exact, not an approximation: the hooks cannot fire in
that forward, and Dynamo guards every graph on the grad mode, so a call with grad enabled
retraces and meets Dynamo's own handling. The alternatives were worse: setting
``torch._dynamo.config.compiled_autograd`` turns on compiled autograd for every backward of the
process; removing the hooks from the model (what a user could do by hand) breaks training with
the same model; and ``torch.compile`` gives a backend no per-call context for a string backend
(``backend_ctx_ctor`` is dropped by its wrapper). The backend module installs it when imported,
which ``torch.compile(..., backend="tokenweave")`` does before it traces anything.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

#: the backends whose frames trace module backward hooks as no-ops with grad disabled
_backends: list[Callable[..., Any]] = []
_logged = False


def install(backend: Callable[..., Any]) -> bool:
    """Make Dynamo trace module backward hooks as no-ops in frames it compiles for ``backend``
    with grad disabled. Idempotent; False (logged) where this torch's Dynamo lacks the entry.

    The backend module installs it for ``tokenweave_backend``; a benchmark's plain-Inductor
    baseline may install it for its own backend function, so that both compile the same graph.
    """
    if any(b is backend for b in _backends):
        return True
    try:
        from torch._dynamo.variables import distributed as dynamo_distributed

        hook_variable = dynamo_distributed.BackwardHookVariable
        original = hook_variable.create
    except (ImportError, AttributeError) as e:
        log.warning("tokenweave: torch %s: cannot teach Dynamo that module backward hooks are no-ops under "
                    "no_grad (%s); a module with one (Qwen3's q/k norms on transformers 5.17) stops "
                    "fullgraph compilation", torch.__version__, e)
        return False
    if not _backends:
        _wrap(hook_variable, original)
    _backends.append(backend)
    return True


def _wrap(hook_variable, original) -> None:
    class NoGradBackwardHookVariable(hook_variable):
        """A ``BackwardHook`` traced where grad is disabled: its setup methods return their argument."""

        def call_method(self, tx, name, args, kwargs):
            if name in ("setup_input_hook", "setup_output_hook") and len(args) == 1 and not kwargs:
                return args[0]
            return super().call_method(tx, name, args, kwargs)

    def create(tx, module, user_hooks, user_pre_hooks):
        if torch.is_grad_enabled() or not _compiling_for_ours(tx):
            return original(tx, module, user_hooks, user_pre_hooks)
        _log_once(module)
        return NoGradBackwardHookVariable(None, module, user_hooks, user_pre_hooks)

    hook_variable.create = staticmethod(create)


def _compiling_for_ours(tx) -> bool:
    """Whether ``tx``'s graph goes to an installed backend: Dynamo wraps the backend (its debug
    wrapper's ``_torchdynamo_orig_backend``, ``torch.compile``'s wrapper's ``compiler_fn``)."""
    fn = getattr(getattr(tx, "output", None), "compiler_fn", None)
    for _ in range(8):
        if fn is None:
            return False
        if any(fn is b for b in _backends):
            return True
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
    return False


def _log_once(module) -> None:
    global _logged
    name = type(getattr(module, "value", module)).__name__
    if not _logged:
        _logged = True
        log.info("tokenweave: grad is disabled, so the backward hooks of %s (and any other module) are traced "
                 "as no-ops", name)
    else:
        log.debug("tokenweave: backward hooks of %s traced as no-ops (grad disabled)", name)
