"""Model architectures, registered lazily by the architecture name a checkpoint declares.

Keys are HF `config.json` `architectures[0]` names and GGUF `general.architecture` names. Values
are "module:Class" strings, imported only when a checkpoint asks for them; the runner never
imports a model class directly.
"""

from __future__ import annotations

import importlib

from tokenmill.errors import UnsupportedModelError

_REGISTRY: dict[str, str] = {
    # Llama family: one implementation, features switched by the config.
    "LlamaForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "llama": "tokenmill.models.llama:LlamaForCausalLM",
    "qwen2": "tokenmill.models.llama:LlamaForCausalLM",
    "qwen3": "tokenmill.models.llama:LlamaForCausalLM",
    # Phi-3 / Phi-3.5: fused q/k/v and gate/up, longrope.
    "Phi3ForCausalLM": "tokenmill.models.phi3:Phi3ForCausalLM",
    "phi3": "tokenmill.models.phi3:Phi3ForCausalLM",
    # Gemma 2 and 3 (text).
    "Gemma2ForCausalLM": "tokenmill.models.gemma:GemmaForCausalLM",
    "Gemma3ForCausalLM": "tokenmill.models.gemma:GemmaForCausalLM",
    "Gemma3ForConditionalGeneration": "tokenmill.models.gemma:GemmaForCausalLM",  # its language model
    "gemma2": "tokenmill.models.gemma:GemmaForCausalLM",
    "gemma3": "tokenmill.models.gemma:GemmaForCausalLM",
    # Mixtures of experts ("mixtral": a GGUF "llama" with experts, see models/loader.py).
    "MixtralForCausalLM": "tokenmill.models.mixtral:MoEForCausalLM",
    "mixtral": "tokenmill.models.mixtral:MoEForCausalLM",
    "Qwen2MoeForCausalLM": "tokenmill.models.mixtral:MoEForCausalLM",
    "Qwen3MoeForCausalLM": "tokenmill.models.mixtral:MoEForCausalLM",
    "qwen2moe": "tokenmill.models.mixtral:MoEForCausalLM",
    "qwen3moe": "tokenmill.models.mixtral:MoEForCausalLM",
    # GPT-2.
    "GPT2LMHeadModel": "tokenmill.models.gpt2:GPT2LMHeadModel",
    "gpt2": "tokenmill.models.gpt2:GPT2LMHeadModel",
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type:
    target = _REGISTRY.get(architecture)
    if target is None:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported (supported: {', '.join(supported_architectures())})"
        )
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)
