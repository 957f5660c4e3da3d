"""A patched transformers model under ``torch.compile``: the loss of stock transformers, and no Dynamo warning.

Dynamo warns when it traces through a ``functools.lru_cache``-wrapped function; the patched forward once looked up
the family's signature through one. Dynamo's ``"eager"`` backend traces exactly as any backend does (the warnings
come from tracing) without spending a minute in Inductor's code generation on 2 CPU cores.
"""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from vpce.integrations.transformers import apply  # noqa: E402


def test_compiled_patched_llama_matches_stock_without_dynamo_warnings():
    config = transformers.LlamaConfig(vocab_size=509, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    stock = transformers.LlamaForCausalLM(config)
    model = apply(copy.deepcopy(stock))
    input_ids = torch.randint(0, config.vocab_size, (2, 16))
    labels = input_ids.clone()
    labels[:, :3] = -100

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = torch.compile(model, backend="eager")(input_ids=input_ids, labels=labels).loss
        loss.backward()
    dynamo = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "_dynamo" in w.filename]
    assert not dynamo, "Dynamo warned while tracing the patched forward:\n" + "\n".join(dynamo)

    want = stock(input_ids=input_ids, labels=labels).loss
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(model.lm_head.weight.grad, stock.lm_head.weight.grad)
