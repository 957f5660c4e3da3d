"""Tiny random transformers causal LMs of every family the transformers integration is tested on (CPU, fp32).

``FAMILIES`` maps a short name to ``(model class, config class, config keywords)``; ``config`` builds a config with
the shared tiny sizes, dropout off (Trainer trains in train mode; both runs must see the same function), and
``initializer_range=0.2`` so the logits reach ~6 and a soft cap or a logit scale changes the loss by far more than
the tolerances. The MoE families route with 4 experts, 2 per token, and add the router aux loss to their loss
(``output_router_logits=True``, ``router_aux_loss_coef=AUX_COEF``).
"""

from __future__ import annotations

import copy

import torch

transformers = __import__("pytest").importorskip("transformers")

V, D = 509, 32
SOFTCAP = 3.0
SCALE = 2.5
AUX_COEF = 0.5
TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # inside the tiny vocab
LLAMA_LIKE = dict(hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=AUX_COEF)

FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": 8}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 8}),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", {"head_dim": 8}),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config",
               {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 8, "final_logit_softcapping": SOFTCAP}),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               {"head_dim": 8, "sliding_window": 8, "final_logit_softcapping": SOFTCAP}),
    "cohere": ("CohereForCausalLM", "CohereConfig", {"logit_scale": SCALE, **TOKENS}),
    "cohere2": ("Cohere2ForCausalLM", "Cohere2Config", {"logit_scale": SCALE, "head_dim": 8, "sliding_window": 8,
                                                        **TOKENS}),
    "granite": ("GraniteForCausalLM", "GraniteConfig", {"logits_scaling": 1 / SCALE}),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", TOKENS),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", TOKENS),
    "phi": ("PhiForCausalLM", "PhiConfig", {}),  # Phi-1/1.5/2: lm_head with a bias
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", {}),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {"n_embd": D, "n_layer": 2, "n_head": 4, "n_positions": 64}),
    "falcon": ("FalconForCausalLM", "FalconConfig", {"hidden_size": D, "num_hidden_layers": 2,
                                                     "num_attention_heads": 4}),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 4, **MOE}),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", {"num_experts": 4, "moe_intermediate_size": 16,
                                                            "shared_expert_intermediate_size": 32, **MOE}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {"num_experts": 4, "moe_intermediate_size": 16,
                                                            "head_dim": 8, **MOE}),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", {"num_experts": 4, **MOE, **TOKENS}),
    "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig", {"num_local_experts": 4,
                                                                 "logits_scaling": 1 / SCALE, **MOE}),
}
SOFTCAPPED = ["gemma2", "gemma3"]
SCALED = ["cohere", "cohere2", "granite", "granitemoe"]
MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe"]
NOT_LLAMA_SIZES = {"gpt2", "falcon"}  # their configs name the sizes differently


def config(family: str, *, vocab: int = V, tie: bool = False, **overrides):
    _, config_cls, extra = FAMILIES[family]
    sizes = {} if family in NOT_LLAMA_SIZES else LLAMA_LIKE
    cfg = getattr(transformers, config_cls)(vocab_size=vocab, initializer_range=0.2, tie_word_embeddings=tie,
                                            **{**sizes, **extra, **overrides})
    cfg._attn_implementation = "eager"
    for name, value in list(vars(cfg).items()):  # every dropout off: patched and stock must compute one function
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            setattr(cfg, name, 0.0)
    return cfg


def model(family: str, *, seed: int = 0, **config_kwargs):
    """A tiny fp32 model of ``family`` with weights from ``seed``."""
    torch.manual_seed(seed)
    return getattr(transformers, FAMILIES[family][0])(config(family, **config_kwargs)).float()


def pair(family: str, **config_kwargs):
    """(model, stock): two tiny models of ``family`` with the same weights; neither is patched yet."""
    m = model(family, **config_kwargs)
    return m, copy.deepcopy(m)
