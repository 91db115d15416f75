"""Tiny Hugging Face checkpoints saved and loaded the way users do it, for the tests in this folder.

:func:`save` writes ``save_pretrained`` of a tiny random model of one ``testing.hf.ARCHS``
architecture; :func:`load_tp` is the call README shows, ``from_pretrained(path,
distributed_config=DistributedConfig(tp_size=N, tp_plan="auto"))``, which transformers 5.17 and
later accept (the standalone ``tp_plan=``/``tp_size=`` arguments are deprecated there); MoE
models on releases whose experts are in the expert-parallel plan only add ``ep_size=N``
(:func:`experts_outside_tp_plan`). Nothing is prepared afterwards: the model keeps every hook and
parameter transformers gives it.
"""

from __future__ import annotations

import os

import torch


def save(arch: str, path: str, *, layers: int, seed: int) -> str:
    """``save_pretrained`` of a tiny random ``arch`` model (``seed``) into ``path``; returns ``path``."""
    from examples.hf_models import build_model

    model = build_model(arch, layers=layers, seed=seed, tp=False)
    model.generation_config.pad_token_id = 0  # generate() without a tokenizer
    model.save_pretrained(path)
    return path


def load_tp(path: str, world_size: int, dtype: torch.dtype = torch.float32):
    """The checkpoint at ``path`` sharded over the default process group by its own tp_plan.

    Where the installed transformers has no plan for the architecture (GraniteMoE on 5.17), the
    plan ``testing.hf.ARCHS`` holds for it is given as a user would, ``DistributedConfig(tp_plan=
    {...})``: a config's plan is not saved with the checkpoint.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, DistributedConfig

    from examples.hf_models import ARCHS

    plan = "auto"
    config = AutoConfig.from_pretrained(path)
    if not getattr(config, "base_model_tp_plan", None):
        spec = next((a for a in ARCHS.values() if a.config_cls == type(config).__name__ and a.tp_plan), None)
        plan = {f"model.{k}": v for k, v in spec.tp_plan.items()} if spec is not None else plan
    extra = {"ep_size": world_size} if experts_outside_tp_plan(config) else {}
    return AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_size=world_size, tp_plan=plan, **extra), dtype=dtype).eval()


def experts_outside_tp_plan(config) -> bool:
    """Whether a MoE config shards its experts only through the expert-parallel plan (transformers
    5.25 moved them there from the TP plans): then a user sharding the model over N ranks sets
    ``ep_size=N`` too (transformers' ``AllReduceEP``: each rank runs its experts, an all_reduce sums
    them), else every rank holds and runs every expert."""
    tp = getattr(config, "base_model_tp_plan", None) or {}
    ep = getattr(config, "base_model_ep_plan", None) or {}
    # The modules the EP plan dispatches to (5.24+'s EP style; 5.17's plans differ), named by no TP
    # rule (DeepSeek-V3's shared_experts stay in the TP plan).
    return "ep_dispatch_experts" in ep.values() and not any(k in tp for k in ep)


def load_unsharded(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def save_all(archs, root: str, *, layers: int, seed: int) -> dict[str, str]:
    """One checkpoint per architecture under ``root``: ``{arch: path}``."""
    return {a: save(a, os.path.join(root, a), layers=layers, seed=seed) for a in archs}
