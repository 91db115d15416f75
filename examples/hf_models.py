"""Hugging Face models sharded with their own tensor-parallel plan: the zoo of ``hf_tp.py``, its tests and benchmarks.

:func:`build_model` makes a causal LM from a small (or real-sized) config with random weights, no
download, seeded the same on every rank, and shards it with the model's own ``tp_plan`` on the
current process group the way transformers 5.14+ does it for ``from_pretrained(...,
distributed_config=...)``::

    dc, _, mesh = Cls.prepare_distribute_model(DistributedConfig(tp_size=N, tp_plan="auto"))
    model = Cls.maybe_distribute_model(model, dc, mesh)

``maybe_distribute_model`` turns every planned parameter into a DTensor: ``distribute_tensor(..,
src_data_rank=None)`` keeps this rank's slice of the *full* tensor each rank built, so the TP
model and ``build_model(..., tp=False)`` with the same seed hold the same weights. It runs on CPU
with gloo and on GPUs with NCCL (checked with transformers 5.17).

Under ``torch.no_grad()`` the row-parallel ``Linear`` of the plan reduces with an in-place
``dist.all_reduce`` (then adds its bias), the row-parallel embedding (Gemma) and other
DTensor paths with ``funcol.all_reduce``; MoE experts (``moe_tp_experts``) with ``dist.all_reduce``
after the weighted sum of the experts.

Transformers 5.17's ``replicated_with_grad_allreduce`` plan entries (Qwen3's and Gemma3's per-head
q/k norms) register a module full backward hook that sums the norm weights' gradients; the model
keeps it: the backend traces it as the no-op it is under no_grad (:mod:`weave_compile.backward_hooks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------- presets


@dataclasses.dataclass(frozen=True)
class SizePreset:
    """Model dims shared by every architecture at this size (the arch adds its own extras)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int  # default layer count; ``--layers`` / ``layers=`` overrides it
    max_positions: int


SIZES: dict[str, SizePreset] = {
    # CPU tests: heads and kv heads divisible by tp=2, vocab small (and even: Gemma's embedding
    # is vocab-parallel).
    "tiny": SizePreset(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=128, layers=2,
                       max_positions=512),
    # Real dims. A full 70B does not fit when every rank first builds the full model: use fewer
    # layers (e.g. --layers 8); Llama-3-8B at 32 layers is 16 GB in bf16 per rank before sharding.
    "8b": SizePreset(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, layers=32,
                     max_positions=16384),
    "70b": SizePreset(hidden=8192, intermediate=28672, heads=64, kv_heads=8, head_dim=128, vocab=128256, layers=80,
                      max_positions=16384),
}


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """One Hugging Face architecture: its classes, its config extras, and its forms."""

    name: str
    config_cls: str
    model_cls: str
    #: config kwargs for every size (arch features) and for ``tiny`` only (small extras)
    extra: dict = dataclasses.field(default_factory=dict)
    tiny_extra: dict = dataclasses.field(default_factory=dict)
    #: Gemma: all_reduce -> RMSNorm -> add(residual) (post-attention / post-feedforward norms)
    sandwich: bool = False
    #: Gemma: the embedding output is scaled by sqrt(H) (a 0-d tensor) between its all_reduce
    #: and layer 0's input norm
    embed_scale: bool = False
    #: Qwen3 / Gemma3: per-head RMSNorm on q and k, no all_reduce before them
    qk_norm: bool = False
    #: the static cache has sliding-window layers, which keep a Python int position (Dynamo
    #: specializes on it: every decode step recompiles until it turns dynamic)
    sliding_cache: bool = False
    #: the plan to use when the installed transformers' config class has none
    tp_plan: Optional[dict] = None
    #: the config has no ``head_dim`` (DeepSeek's MLA sets its own head dims)
    no_head_dim: bool = False
    #: the model normalizes with a LayerNorm (mean subtracted), not an RMSNorm
    layernorm: bool = False
    #: parallel block: attention and MLP read the same normed input and each all-reduces its output;
    #: the merge pass makes the two one (one site per layer)
    parallel_block: bool = False
    note: str = ""


_GRANITE_MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                            logits_scaling=16.0)
#: transformers 5.17 has no plan for GraniteMoE (later releases shard only the experts): the
#: Mixtral plan under GraniteMoE's module names, used when the installed config has none.
_GRANITEMOE_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.block_sparse_moe.experts.gate_up_proj": "packed_colwise",
    "layers.*.block_sparse_moe.experts.down_proj": "rowwise",
    "layers.*.block_sparse_moe.experts": "moe_tp_experts",
}

_LLAMA_NOTE = "2 per layer (o_proj -> +res -> post_attention_layernorm, down_proj -> +res -> next input norm)"

ARCHS: dict[str, ArchSpec] = {
    a.name: a
    for a in [
        ArchSpec("llama", "LlamaConfig", "LlamaForCausalLM", note=_LLAMA_NOTE + "; untied: embedding replicated"),
        # Tied embeddings (Llama-3.2-1B/3B): transformers 5.x makes the embedding vocab-parallel
        # (embedding_rowwise) for every tied model: all_reduce -> layer 0's input norm, the sum
        # becoming the residual.
        ArchSpec("llama_tied", "LlamaConfig", "LlamaForCausalLM", extra=dict(tie_word_embeddings=True),
                 note=_LLAMA_NOTE + "; +1 vocab-parallel (tied) embedding"),
        # attention_bias / mlp_bias: o_proj and down_proj get a bias, added after the all_reduce
        ArchSpec("llama_bias", "LlamaConfig", "LlamaForCausalLM", extra=dict(attention_bias=True, mlp_bias=True),
                 note="Llama with row-parallel biases: all_reduce -> +bias -> +res -> norm"),
        ArchSpec("mistral", "MistralConfig", "MistralForCausalLM", extra=dict(sliding_window=None),
                 note=_LLAMA_NOTE),
        ArchSpec("qwen2", "Qwen2Config", "Qwen2ForCausalLM", note=_LLAMA_NOTE + "; q/k/v biases (column-parallel)"),
        ArchSpec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", qk_norm=True,
                 note=_LLAMA_NOTE + "; q_norm/k_norm per head, no all_reduce before them: left alone"),
        ArchSpec("mixtral", "MixtralConfig", "MixtralForCausalLM", extra=dict(sliding_window=None),
                 tiny_extra=dict(num_local_experts=4, num_experts_per_tok=2),
                 note="2 per layer: o_proj, and the experts' all_reduce after their weighted sum (moe_tp_experts)"),
        ArchSpec("gemma2", "Gemma2Config", "Gemma2ForCausalLM", sandwich=True, embed_scale=True, sliding_cache=True,
                 note="2 per layer, sandwich: all_reduce -> (1+w) norm -> +res; +1 vocab-parallel (tied) "
                      "embedding"),
        ArchSpec("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", sandwich=True, embed_scale=True, qk_norm=True,
                 sliding_cache=True, note="as gemma2, plus per-head q/k norms (left alone)"),
        # IBM Granite 3.x multipliers (Granite-3.1-8B's values): the sublayer outputs are scaled by
        # residual_multiplier (a Python float) between their all_reduce and the residual add.
        ArchSpec("granite", "GraniteConfig", "GraniteForCausalLM", extra=_GRANITE_MULTIPLIERS,
                 note=_LLAMA_NOTE + ", each all_reduce -> * residual_multiplier (a float) -> +res"),
        ArchSpec("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", extra=_GRANITE_MULTIPLIERS,
                 tiny_extra=dict(num_local_experts=4, num_experts_per_tok=2), tp_plan=_GRANITEMOE_PLAN,
                 note="as mixtral (experts' all_reduce after their weighted sum), scaled as granite"),
        # Qwen2-MoE: routed experts + a sigmoid-gated shared expert that the plan leaves replicated;
        # 5.17 does not shard the experts (o_proj only), later releases do: experts' all_reduce ->
        # + shared (a replicated addend) -> view -> + residual -> norm.
        ArchSpec("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                 tiny_extra=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=64),
                 note="o_proj per layer; the experts' all_reduce where the plan shards them (after 5.17)"),
        # DeepSeek-V3: MLA attention (not in the plan: replicated, no all_reduce), dense MLP in the
        # first first_k_dense_replace layers, then routed experts + a shared expert, each reduced.
        ArchSpec("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", no_head_dim=True,
                 extra=dict(first_k_dense_replace=1, n_group=1, topk_group=1, rope_interleave=False),
                 tiny_extra=dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, num_key_value_heads=4,
                                 moe_intermediate_size=32, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                                 qk_nope_head_dim=8, v_head_dim=16),
                 note="1 per layer: the dense MLP's down_proj, or (MoE layers) the routed experts' and the "
                      "shared expert's all_reduces merged into one"),
        # LayerNorm families (transformers 5.25's plans; issue 47). Parallel blocks (attention and
        # MLP read one normed input, their reduced outputs summed with the residual): Cohere, Phi,
        # GPT-NeoX, GPT-J, CodeGen; the merge pass makes each layer's two all_reduces one.
        ArchSpec("cohere", "CohereConfig", "CohereForCausalLM", layernorm=True, parallel_block=True,
                 note="1 per layer: parallel block, o_proj's and down_proj's all_reduces merged -> +res -> "
                      "next layer's hand-written LayerNorm (no bias)"),
        ArchSpec("cohere2", "Cohere2Config", "Cohere2ForCausalLM", layernorm=True, parallel_block=True,
                 sliding_cache=True, tiny_extra=dict(sliding_window=8), note="as cohere, sliding-window layers"),
        ArchSpec("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", layernorm=True,
                 extra=dict(sliding_window=None),
                 note="2 per layer: o_proj and c_proj -> +bias -> +res -> nn.LayerNorm (+bias)"),
        ArchSpec("phi", "PhiConfig", "PhiForCausalLM", layernorm=True, parallel_block=True,
                 tiny_extra=dict(partial_rotary_factor=0.5),
                 note="1 per layer: parallel block, dense's and fc2's all_reduces (+biases) merged -> +res -> "
                      "next input_layernorm"),
        ArchSpec("phimoe", "PhimoeConfig", "PhimoeForCausalLM", layernorm=True, extra=dict(sliding_window=None),
                 tiny_extra=dict(num_local_experts=4, num_experts_per_tok=2),
                 note="2 per layer: o_proj, and the experts' all_reduce (EP plan) -> +res -> nn.LayerNorm"),
        ArchSpec("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", layernorm=True, parallel_block=True,
                 tiny_extra=dict(rotary_pct=0.5),
                 note="1 per layer: parallel block merged -> +res -> the next layer's two LayerNorms (one fused)"),
        ArchSpec("gptj", "GPTJConfig", "GPTJForCausalLM", layernorm=True, parallel_block=True, no_head_dim=True,
                 tiny_extra=dict(rotary_dim=8), note="1 per layer: parallel block merged -> +res -> next ln_1"),
        ArchSpec("codegen", "CodeGenConfig", "CodeGenForCausalLM", layernorm=True, parallel_block=True,
                 no_head_dim=True, tiny_extra=dict(rotary_dim=8),
                 note="1 per layer: parallel block merged -> +res -> next ln_1"),
        ArchSpec("jais2", "Jais2Config", "Jais2ForCausalLM", layernorm=True,
                 note="2 per layer: o_proj and down_proj -> +res -> nn.LayerNorm (+bias)"),
        ArchSpec("nemotron", "NemotronConfig", "NemotronForCausalLM", layernorm=True,
                 note="2 per layer: o_proj and down_proj -> +res -> LayerNorm1P (weight + 1, formed in the "
                      "weight's dtype)"),
        ArchSpec("olmo", "OlmoConfig", "OlmoForCausalLM", layernorm=True,
                 note="2 per layer: o_proj and down_proj -> +res -> LayerNorm without affine parameters"),
    ]
}


def resolved_plan(model_or_config) -> dict:
    """The tensor-parallel plan as the model applies it (module pattern -> style).

    A model's own plan (``model.tp_plan``) is the config's ``base_model_tp_plan`` plus what the
    model class and transformers add; a config alone gives only the latter's base part.
    """
    plan = dict(getattr(getattr(model_or_config, "config", model_or_config), "base_model_tp_plan", None) or {})
    if hasattr(model_or_config, "config"):
        plan.update({k.removeprefix("model."): v for k, v in (getattr(model_or_config, "tp_plan", None) or {}).items()})
        if _ep_size(model_or_config) > 1:  # the expert-parallel plan (5.25's MoE experts) wins where both name a module
            plan.update({k.removeprefix("model."): v
                         for k, v in (getattr(model_or_config, "ep_plan", None) or {}).items()})
    return plan


def _ep_size(model) -> int:
    dc = getattr(model, "distributed_config", None) or getattr(model.config, "distributed_config", None)
    return int(getattr(dc, "ep_size", None) or 1)


def vocab_parallel_embedding(model_or_config) -> bool:
    """The plan shards the embedding by vocab: one all_reduce after it.

    Transformers 5.17 does it for tied models (their config's plan names ``embed_tokens``) and in
    a few plans of its own (Cohere, StarCoder2); later releases (checked: 5.24) add
    ``embed_tokens: embedding_rowwise`` to every model's plan (GPT-NeoX's ``embed_in``, GPT-J's and
    CodeGen's ``wte`` on 5.25).
    """
    return "embedding_rowwise" in resolved_plan(model_or_config).values()


#: plan styles whose module output is reduced with one all_reduce (row-parallel Linear, the
#: experts' weighted sum; with ``ep_size`` equal to the TP size, 5.25's expert dispatch is an
#: all_reduce of each rank's experts' outputs, ``AllReduceEP``)
_REDUCING_STYLES = ("rowwise", "moe_tp_experts", "ep_dispatch_experts")


def reduced_modules(model) -> list[str]:
    """The modules whose output the plan all-reduces, in model order (embedding included)."""
    import re

    plan = resolved_plan(model)
    out = []
    for name, _ in model.named_modules():
        key = re.sub(r"\.\d+(?=\.|$)", ".*", name.removeprefix("model."))
        style = plan.get(key)
        if style is not None and (style in _REDUCING_STYLES or style == "embedding_rowwise"):
            out.append(name)
    return out


def parallel_block(model_or_config) -> bool:
    """Attention and MLP read the same normed input and their outputs meet in one add with the
    residual (``ArchSpec.parallel_block``; GPT-NeoX only with ``use_parallel_residual``)."""
    config = getattr(model_or_config, "config", model_or_config)
    spec = next((a for a in ARCHS.values() if a.config_cls == type(config).__name__), None)
    return spec is not None and spec.parallel_block and getattr(config, "use_parallel_residual", True)


def merged_pairs(model) -> int:
    """Reductions the merge pass makes one with another: per layer, the shared expert(s)' with the
    routed experts' (DeepSeek-V3), or, in a parallel block, every reduced module's but the first
    (attention's and MLP's row-parallel outputs, summed with the residual)."""
    import re

    names = reduced_modules(model)
    if parallel_block(model):
        per_layer: dict[str, int] = {}
        for n in names:
            layer = re.match(r"(.*\.\d+)\.", n)
            if layer is not None:
                per_layer[layer[1]] = per_layer.get(layer[1], 0) + 1
        return sum(k - 1 for k in per_layer.values())
    layers = {n.rsplit(".mlp.", 1)[0] for n in names if n.endswith(".mlp.experts")}
    return sum(any(n.startswith(layer + ".mlp.shared_expert") for n in names) for layer in layers)


def expected_all_reduces(model) -> int:
    """All_reduces in the graph before the passes: one per reduced module (:func:`reduced_modules`)."""
    return len(reduced_modules(model))


def expected_fused_sites(model) -> int:
    """All_reduce sites the rewrites must fuse, from the plan the model was sharded with.

    Every reduced module's output reaches an RMSNorm through (linear ops: views, a float scale,
    bias and residual adds): the Llama family's o_proj and down_proj -> +residual -> the next norm,
    Gemma's sandwich (all_reduce -> norm directly), the experts' weighted sum, a vocab-parallel
    embedding -> layer 0's input norm; a LayerNorm in place of the RMSNorm the same. A layer whose
    routed experts and shared expert are reduced separately (DeepSeek-V3), or a parallel block's
    attention and MLP (Cohere, Phi, GPT-NeoX, GPT-J, CodeGen), has one site after the merge pass.
    Which modules are reduced depends on the transformers release: 5.17 shards the embedding of
    tied models only and no GraniteMoE (the fallback plan in ``ARCHS`` does) nor Qwen2-MoE experts;
    5.24 shards every embedding and those experts, and GraniteMoE's experts but not its attention;
    5.25 shards experts through the expert-parallel plan only (with ``ep_size`` > 1) and
    GraniteMoE's attention too.
    """
    return expected_all_reduces(model) - merged_pairs(model)


def make_config(arch: str, size: str = "tiny", *, layers: Optional[int] = None, **overrides: Any):
    """A transformers config for ``arch`` at ``size`` dims; ``overrides`` win."""
    import transformers

    spec, s = ARCHS[arch], SIZES[size]
    kw: dict[str, Any] = dict(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
        num_hidden_layers=layers if layers is not None else s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
        max_position_embeddings=s.max_positions,
    )
    if spec.name.startswith("gemma"):
        kw["query_pre_attn_scalar"] = s.head_dim  # Gemma's default (256) belongs to its own head_dim
    if spec.no_head_dim:
        del kw["head_dim"]
    kw.update(spec.extra)
    if size == "tiny":
        kw.update(spec.tiny_extra)
    kw.update(overrides)
    config = getattr(transformers, spec.config_cls)(**kw)
    if spec.tp_plan is not None and not getattr(config, "base_model_tp_plan", None):
        config.base_model_tp_plan = dict(spec.tp_plan)
    return config


# ----------------------------------------------------------------------------- build and shard


def build_model(arch: str, size: str = "tiny", *, layers: Optional[int] = None, tp: bool = True, seed: int = 0,
                dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None,
                **config_overrides: Any):
    """A causal LM with random weights from ``seed``, sharded over the default process group if ``tp``.

    Every rank must call it with the same arguments (same seed: the same full weights, of which
    each rank keeps its slice). ``tp=False`` builds the unsharded model with the same weights.
    The model is in eval mode; run it under ``torch.no_grad()`` (the inference path of the plan).
    """
    import transformers

    spec = ARCHS[arch]
    cls = getattr(transformers, spec.model_cls)
    config = make_config(arch, size, layers=layers, **config_overrides)
    torch.manual_seed(seed)  # seeds CUDA too: same weights on every rank and device
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = cls._from_config(config, dtype=dtype)
    if tp and dist.is_initialized() and dist.get_world_size() > 1:
        model = shard_with_tp_plan(model, device=device)
    return model.eval()


def shard_with_tp_plan(model, device: Optional[torch.device] = None):
    """Shard ``model`` with its own ``tp_plan`` over every rank of the default process group."""
    from transformers.distributed import DistributedConfig

    cls = type(model)
    if device is not None and torch.device(device).type != "cpu":
        # transformers binds the mesh to LOCAL_RANK's device; torchrun sets it, spawned ranks do not.
        os.environ.setdefault("LOCAL_RANK", str(torch.device(device).index or 0))
    dc, _, mesh = cls.prepare_distribute_model(DistributedConfig(tp_size=dist.get_world_size(), tp_plan="auto"))
    untie_output_embedding(model)
    try:
        return cls.maybe_distribute_model(model, dc, mesh)
    except KeyError as e:
        import transformers

        raise RuntimeError(f"transformers {transformers.__version__} could not apply {cls.__name__}'s tp_plan: "
                           f"its plan names {e}, which is not a module or parameter of the model") from e


def untie_output_embedding(model) -> bool:
    """Give a tied ``lm_head`` its own copy of the embedding weight; True if it was tied.

    Transformers 5.18+ (checked: 5.24) fail on tied models inside ``apply_tensor_parallelism`` with
    ``KeyError: 'lm_head.weight'``: the expanded plan lists the head's weight by its module, but
    ``named_parameters()`` lists a tied weight once, under the embedding. 5.17 shards the shared
    Parameter twice (once per module) and so ends with two DTensors anyway: untying first gives
    the same sharded model on every version (same values, the embedding's memory twice).
    """
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or out.weight is not inp.weight:
        return False
    out.weight = torch.nn.Parameter(inp.weight.detach().clone(), requires_grad=inp.weight.requires_grad)
    return True


def prompt(batch: int, tokens: int, vocab: int, seed: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """Token ids, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, tokens), generator=g).to(device)


def is_sharded(model) -> bool:
    """True if any parameter is a DTensor (the plan was applied)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


# ----------------------------------------------------------------------------- nocomm


@contextlib.contextmanager
def without_all_reduce() -> Iterator[None]:
    """Every all_reduce is the identity while inside: the "nocomm" ceiling (wrong results).

    Patches ``torch.distributed.all_reduce`` (row-parallel Linear and MoE experts under
    no_grad) and ``funcol.all_reduce`` (DTensor Partial -> Replicate: the vocab-parallel
    embedding). Dynamo reads both at trace time, so compile *and* run the model inside; all
    other collectives (the lm_head's all_gather) are kept.
    """
    import torch.distributed._functional_collectives as funcol

    orig_dist, orig_funcol = dist.all_reduce, funcol.all_reduce

    def all_reduce_noop(tensor, op=None, group=None, async_op=False):
        return None

    def funcol_all_reduce_identity(self, reduceOp="sum", group=None, tag=""):
        return self

    dist.all_reduce, funcol.all_reduce = all_reduce_noop, funcol_all_reduce_identity
    try:
        yield
    finally:
        dist.all_reduce, funcol.all_reduce = orig_dist, orig_funcol
