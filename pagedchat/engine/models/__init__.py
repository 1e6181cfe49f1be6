"""The model families pagedchat runs, one module each, behind one registry: a config's `model_type` names the
transformers class that loads its weights and the forward that runs them. Mistral's and Qwen2's layers are
Llama's (Qwen2's q/k/v biases are the fused product's bias)."""

from pagedchat.engine.models.llama import LlamaModel
from pagedchat.engine.models.qwen3 import Qwen3Model

# model_type -> (transformers architecture, pagedchat's forward)
REGISTRY: dict[str, tuple[str, type[LlamaModel]]] = {
    "llama": ("LlamaForCausalLM", LlamaModel),
    "mistral": ("MistralForCausalLM", LlamaModel),
    "qwen2": ("Qwen2ForCausalLM", LlamaModel),
    "qwen3": ("Qwen3ForCausalLM", Qwen3Model),
}
# rotary scalings whose frequencies depend on the sequence's length, which a table made once cannot follow
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def forward_for(model_type: str) -> type[LlamaModel]:
    return REGISTRY[model_type][1]


def config_problem(config) -> str | None:
    """Why pagedchat's forward cannot run a model of this (transformers) config, before its weights load."""
    if config.model_type not in REGISTRY:
        return f"unsupported architecture {config.model_type!r}; supported: {', '.join(REGISTRY)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not run here (only silu)"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type in LENGTH_DEPENDENT_ROPE:
        return (f"rope scaling {rope_type!r} depends on the sequence's length, which a rotary table made once "
                "cannot follow")
    return None
