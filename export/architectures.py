"""One declarative description per supported architecture (the registry the tests are generated from)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    name: str                  # transformers `model_type`
    hf_class: str              # transformers class that holds the weights
    qkv_bias: bool = False     # q/k/v projections carry a bias (Qwen2)
    sliding_window_key: str | None = None  # config field that limits attention span, if any


REGISTRY: dict[str, Architecture] = {
    a.name: a for a in (
        Architecture("llama", "LlamaForCausalLM"),
        Architecture("qwen2", "Qwen2ForCausalLM", qkv_bias=True),
        Architecture("mistral", "MistralForCausalLM", sliding_window_key="sliding_window"),
    )
}
