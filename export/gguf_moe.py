"""GGUF files of the mixtures of experts that transformers' GGUF loader does not read: Mixtral (a llama file with
experts), OLMoE (`olmoe`) and Granite MoE (`granitemoe`). Read as llama.cpp's converter wrote them
(convert_hf_to_gguf.py: LlamaModel for Mixtral, OlmoeModel, GraniteMoeModel) into the transformers model of the
same architecture: the config from the metadata, each tensor dequantized by the `gguf` package and renamed; the
q/k rows un-permuted where the converter permuted them for llama.cpp's rotary layout (the llama and Granite
converters; not OLMoE's); each layer's stacked experts ffn_{gate,up,down}_exps [E, N, K] as transformers'
gate_up_proj [E, 2I, d] ([gate; up]) and down_proj [E, d, I]. The int4 build keeps the experts' own blocks from the
same file (export/quantize.py's gguf_tensors, which reads the rows in the same order).

Routing, as llama.cpp computes it for each architecture (a file does not say): Mixtral and Granite MoE renormalise
the top-k weights, OLMoE does not (OLMoE-1B-7B's norm_topk_prob is false too). Files from older converters that keep
one tensor per expert (`blk.N.ffn_gate.E.weight`) and Granite MoE files with shared experts are refused by name.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specrt.errors import UnknownSourceError
from specrt.export.gguf_files import GGUFHeader, MOE_ARCHITECTURES as ARCHITECTURES, check_moe

QK_PERMUTED = {"llama", "granitemoe"}   # converters that permute q/k rows for llama.cpp's rotary layout
# transformers' name (a layer's part after `model.layers.{i}.`) -> the file's (after `blk.{i}.`); the experts apart
LAYER = {"self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
         "self_attn.o_proj.weight": "attn_output", "self_attn.q_norm.weight": "attn_q_norm",
         "self_attn.k_norm.weight": "attn_k_norm", "input_layernorm.weight": "attn_norm",
         "post_attention_layernorm.weight": "ffn_norm"}
TOP = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}


def config(header: GGUFHeader):
    """The transformers config of the file's model."""
    import transformers
    from specrt.export.architectures import REGISTRY
    m, arch = header.metadata, header.architecture
    kind = ARCHITECTURES[arch]
    heads, layers = int(m[f"{arch}.attention.head_count"]), int(m[f"{arch}.block_count"])
    hidden = int(m[f"{arch}.embedding_length"])
    vocab = next((t.shape[0] for t in header.tensors if t.name == "token_embd.weight"), None)
    fields = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=int(m.get(f"{arch}.attention.head_count_kv", heads)),
                  intermediate_size=int(m.get(f"{arch}.expert_feed_forward_length",
                                              m[f"{arch}.feed_forward_length"])),
                  max_position_embeddings=int(m[f"{arch}.context_length"]),
                  rms_norm_eps=float(m[f"{arch}.attention.layer_norm_rms_epsilon"]),
                  rope_theta=float(m.get(f"{arch}.rope.freq_base", 10000.0)),
                  num_experts_per_tok=int(m[f"{arch}.expert_used_count"]),
                  tie_word_embeddings=all(t.name != "output.weight" for t in header.tensors),
                  bos_token_id=m.get("tokenizer.ggml.bos_token_id"), eos_token_id=m.get("tokenizer.ggml.eos_token_id"),
                  pad_token_id=m.get("tokenizer.ggml.padding_token_id"))
    fields[REGISTRY[kind].experts_key] = int(m[f"{arch}.expert_count"])
    if f"{arch}.attention.key_length" in m:
        fields["head_dim"] = int(m[f"{arch}.attention.key_length"])
    if kind == "olmoe":
        fields["norm_topk_prob"] = False   # llama.cpp's OLMoE graph does not renormalise the top-k weights
    if kind == "mixtral":
        fields["sliding_window"] = None   # llama.cpp's llama graph attends to the whole prefix
    if kind == "granitemoe":
        fields.update(embedding_multiplier=float(m.get(f"{arch}.embedding_scale", 1.0)),
                      attention_multiplier=float(m.get(f"{arch}.attention.scale", 1.0)),
                      residual_multiplier=float(m.get(f"{arch}.residual_scale", 1.0)),
                      logits_scaling=float(m.get(f"{arch}.logit_scale", 1.0)))
        fields.pop("head_dim", None)   # Granite's config has none: hidden / heads (llama.cpp's converter drops it)
    cls = getattr(transformers, REGISTRY[kind].hf_class.replace("ForCausalLM", "Config"))
    return cls(**fields)


def state_dict(header: GGUFHeader, config) -> dict[str, torch.Tensor]:
    """The file's tensors dequantized (float32) under transformers' names, q/k rows un-permuted where the converter
    permuted them, the experts' stacked projections as transformers stacks them."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    from specrt.export.architectures import REGISTRY
    unpermute = LlamaTensorProcessor({"num_attention_heads": config.num_attention_heads,
                                      "num_key_value_heads": config.num_key_value_heads})
    permuted = header.architecture in QK_PERMUTED
    tensors = {}
    for t in header.tensors:
        w = gguf.quants.dequantize(header.rows(t), gguf.GGMLQuantizationType[t.type]).reshape(t.shape)
        if permuted:
            w = unpermute.process(w, t.name).weights
        tensors[t.name.removesuffix(".weight")] = torch.from_numpy(np.array(w, np.float32))
    state = {}
    for hf, mine in TOP.items():
        if mine in tensors:
            state[hf] = tensors[mine]
    a = REGISTRY[config.model_type]
    for i in range(config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        state.update({p + hf: tensors[b + mine] for hf, mine in LAYER.items() if b + mine in tensors})
        moe = f"{p}{a.moe_block}."
        if b + "ffn_gate_inp" in tensors:
            state[f"{moe}{a.router}.weight"] = tensors[b + "ffn_gate_inp"]                  # (E, d)
        if b + "ffn_gate_exps" in tensors and b + "ffn_up_exps" in tensors:
            state[moe + "experts.gate_up_proj"] = torch.cat([tensors[b + "ffn_gate_exps"],
                                                            tensors[b + "ffn_up_exps"]], dim=1)   # (E, 2I, d)
        if b + "ffn_down_exps" in tensors:
            state[moe + "experts.down_proj"] = tensors[b + "ffn_down_exps"]                # (E, d, I)
    return state


def load(path: Path, name: str):
    """(model in float32, tokenizer) of a file of one of this module's architectures."""
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast
    from transformers.initialization import no_init_weights
    from specrt.export.gguf_files import read_header
    header = read_header(path)
    check_moe(header, name)
    cfg = config(header)
    with no_init_weights():   # every weight is the file's
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = state_dict(header, cfg)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    mine = set(model.state_dict())
    missing, unknown = sorted(mine - set(state) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())), \
        sorted(set(state) - mine)
    if missing or unknown:
        raise UnknownSourceError(f"{name}: its tensors do not make a {cfg.model_type} model (missing {missing[:4]}, "
                                 f"not placed {unknown[:4]}); the file is not one llama.cpp's converter writes")
    model.load_state_dict(state, strict=False)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = GenerationConfig.from_model_config(cfg)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer
