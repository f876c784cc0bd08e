"""One declarative description per supported architecture (the registry the tests are generated from).

Each entry says how a transformers checkpoint of that `model_type` differs from the Llama decoder layer that
export/model.py writes once; the sizes, the windows and the soft-caps are read from the config there
(`args_from_config`). A mixture of experts (`experts_key`) replaces the MLP of its sparse layers by the routed
block of export/moe.py. `architecture_of` refuses, by name, what the graph does not implement: an unregistered
model type (a mixture of experts with shared experts among them; a hybrid of REFUSED, with its reason), a layer
type other than full or sliding-window attention (and LFM2's conv and Granite 4.0-H's Mamba-2, see
export/hybrid.py), an MLP activation it does not know, bidirectional attention, clipped q/k/v.
"""
from __future__ import annotations

from dataclasses import dataclass

from specrt.errors import UnknownSourceError

ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh")   # the MLP activations export/model.py implements
LAYER_TYPES = ("full_attention", "sliding_attention")
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")   # config fields of a mixture of experts
SHARED = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")   # ... with shared experts
# hybrid models refused by name, with the reason (docs/engines.md)
REFUSED = {"qwen3_next": "its gated DeltaNet layers (a recurrent state under a delta-rule update) are not "
                         "implemented; export a model of a supported architecture (LFM2's short convolutions and "
                         "Granite 4.0-H's Mamba-2 layers are)"}


@dataclass(frozen=True)
class Architecture:
    name: str                  # transformers `model_type`
    hf_class: str              # transformers class that holds the weights
    windows: str = "none"      # layers that attend within config.sliding_window: "none", "all" (Mistral, Phi-3),
    #                            or "layer_types": those config.layer_types marks "sliding_attention"
    qk_norm: bool = False      # an RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3)
    fused_projections: bool = False  # qkv_proj [q; k; v] and gate_up_proj [gate; up] (Phi-3), split at load
    norm_offset: float = 0.0   # RMSNorm scales by (norm_offset + weight): Gemma's (1 + weight), folded at load
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    sandwich_norms: bool = False  # a norm on the attention's output and norms before and after the MLP (Gemma)
    query_scale_key: str | None = None  # config field s: scores scaled by s ** -0.5, not head_dim ** -0.5 (Gemma)
    softcap: bool = False      # tanh soft-caps of attention scores and final logits, where the config sets them
    local_rope: bool = False   # windowed layers rotate by their own rope parameters (Gemma 3)
    act_key: str = "hidden_act"  # config field naming the MLP activation
    qk_norm_whole: bool = False  # the q/k norm is over the whole projection, not per head (OLMoE)
    multipliers: bool = False  # Granite's embedding, attention and residual multipliers and logits_scaling
    # a mixture of experts (export/moe.py): the config field of the expert count; None: a dense MLP
    experts_key: str | None = None
    moe_block: str = "mlp"     # the layer's MoE module: {moe_block}.{router}.weight, {moe_block}.experts.*
    router: str = "gate"
    moe_size_key: str = "intermediate_size"   # config field of each expert's intermediate size
    norm_topk_prob: bool | str = True   # the top-k weights renormalised to sum to 1: always, or as this field says
    sparse_step: bool = False  # Qwen3-MoE: mlp_only_layers and decoder_sparse_step say which layers have experts
    conv: bool = False         # LFM2: the layers config.layer_types marks "conv" are gated short convolutions
    #                            (export/hybrid.py)
    mamba: bool = False        # Granite 4.0-H: the layers config.layer_types marks "linear_attention" are Mamba-2
    #                            mixers (export/hybrid.py)
    shared_key: str | None = None   # config field of a dense MLP that every layer runs (beside its experts, if any)
    eps_key: str = "rms_norm_eps"   # config field of the norms' epsilon


REGISTRY: dict[str, Architecture] = {
    a.name: a for a in (
        Architecture("llama", "LlamaForCausalLM"),
        Architecture("qwen2", "Qwen2ForCausalLM", windows="layer_types"),
        Architecture("mistral", "MistralForCausalLM", windows="all"),
        Architecture("qwen3", "Qwen3ForCausalLM", windows="layer_types", qk_norm=True),
        Architecture("gemma2", "Gemma2ForCausalLM", windows="layer_types", norm_offset=1.0, embed_scale=True,
                     sandwich_norms=True, query_scale_key="query_pre_attn_scalar", softcap=True,
                     act_key="hidden_activation"),
        Architecture("gemma3_text", "Gemma3ForCausalLM", windows="layer_types", qk_norm=True, norm_offset=1.0,
                     embed_scale=True, sandwich_norms=True, query_scale_key="query_pre_attn_scalar", softcap=True,
                     local_rope=True, act_key="hidden_activation"),
        Architecture("phi3", "Phi3ForCausalLM", windows="all", fused_projections=True),
        Architecture("qwen3_moe", "Qwen3MoeForCausalLM", windows="all", qk_norm=True,
                     experts_key="num_experts", moe_size_key="moe_intermediate_size",
                     norm_topk_prob="norm_topk_prob", sparse_step=True),
        Architecture("mixtral", "MixtralForCausalLM", windows="all", experts_key="num_local_experts"),
        Architecture("olmoe", "OlmoeForCausalLM", qk_norm=True, qk_norm_whole=True, experts_key="num_experts",
                     norm_topk_prob="norm_topk_prob"),
        # the router's softmax over the top-k logits: the top-k of the softmax, renormalised
        Architecture("granitemoe", "GraniteMoeForCausalLM", multipliers=True, experts_key="num_local_experts",
                     moe_block="block_sparse_moe", router="router"),
        Architecture("lfm2", "Lfm2ForCausalLM", qk_norm=True, conv=True, eps_key="norm_eps"),
        # Mamba-2 beside attention (no rope unless position_embedding_type is "rope"), a shared MLP in every layer
        # and, where num_local_experts > 0, GraniteMoe's routed experts beside it
        Architecture("granitemoehybrid", "GraniteMoeHybridForCausalLM", multipliers=True,
                     experts_key="num_local_experts", moe_block="block_sparse_moe", router="router", mamba=True,
                     shared_key="shared_intermediate_size"),
    )
}


def architecture_of(config, name: str = "the model") -> Architecture:
    """The registry entry of a transformers config; UnknownSourceError naming what is not implemented."""
    arch = REGISTRY.get(config.model_type)
    experts = next((f"{k} = {getattr(config, k)}" for k in EXPERTS if getattr(config, k, None)), None)
    shared = next((f"{k} = {getattr(config, k)}" for k in SHARED
                   if getattr(config, k, None) and not (arch and k == arch.shared_key)), None)
    if arch is None and config.model_type in REFUSED:
        raise UnknownSourceError(f"{name} is a {config.model_type!r} model: {REFUSED[config.model_type]}")
    if arch is None:
        what = f" (a mixture of experts, {experts}{f', shared experts, {shared}' if shared else ''}: not " \
               "implemented)" if experts else ""
        raise UnknownSourceError(f"{name} is a {config.model_type!r} model{what}; supported architectures: "
                                 f"{', '.join(sorted(REGISTRY))}")
    if shared or experts and not arch.experts_key:
        what = f"shared experts ({shared})" if shared else f"a mixture of experts ({experts})"
        raise UnknownSourceError(f"{name} is a {config.model_type!r} model with {what}: not implemented; export a "
                                 "model of a supported architecture")
    if getattr(config, "clip_qkv", None):
        raise UnknownSourceError(f"{name}: clip_qkv = {config.clip_qkv} (q/k/v clipped) is not implemented; "
                                 "export a model without it")
    act = getattr(config, arch.act_key, "silu")
    if act not in ACTIVATIONS:
        raise UnknownSourceError(f"{name}: MLP activation {act!r} ({arch.act_key}) is not implemented; supported: "
                                 f"{', '.join(ACTIVATIONS)}")
    other = sorted({t for t in (getattr(config, "layer_types", None) or []) if t not in LAYER_TYPES})
    if arch.conv and set(config.layer_types) - {"full_attention", "conv"}:
        bad = sorted(set(config.layer_types) - {"full_attention", "conv"})
        raise UnknownSourceError(f"{name}: layer type {bad[0]!r} is not implemented (supported: full_attention, conv)")
    mixers = {"full_attention", "linear_attention"}
    if arch.mamba and set(config.layer_types) - mixers:
        bad = sorted(set(config.layer_types) - mixers)
        raise UnknownSourceError(f"{name}: layer type {bad[0]!r} is not implemented (supported: "
                                 f"{', '.join(sorted(mixers))})")
    if other and arch.windows == "layer_types":
        raise UnknownSourceError(f"{name}: layer type {other[0]!r} is not implemented (supported: "
                                 f"{', '.join(LAYER_TYPES)})")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnknownSourceError(f"{name}: use_bidirectional_attention (an encoder) is not implemented; specrt "
                                 "exports causal language models")
    return arch


def layer_windows(config, arch: Architecture) -> tuple[int, ...]:
    """Per layer, the positions each query attends to (itself and the W - 1 before it); 0: the whole prefix."""
    W = getattr(config, "sliding_window", None) or 0
    layers = config.num_hidden_layers
    if arch.windows == "none" or not W:
        return (0,) * layers
    if arch.windows == "all":
        return (W,) * layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    return tuple(W if t == "sliding_attention" else 0 for t in types[:layers])
