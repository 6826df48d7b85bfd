"""Weights written into a model after it ran (a resume after an evaluation) are the ones its next forward
uses, also through the decoder layers compiled once (``no_inline``), which MindSpore 2.10 would otherwise keep
reading the old values through."""
import mindspore as ms
import numpy as np
from mindspore import Tensor

from mindqwen.config import QwenConfig
from mindqwen.lora import LoraConfig, apply_lora
from mindqwen.models.graph import invalidate_compiled_graphs
from mindqwen.models.qwen import QwenForCausalLM


def test_set_data_after_a_forward_is_seen_once_graphs_are_invalidated():
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    cfg = QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=32)
    model = apply_lora(QwenForCausalLM(cfg), LoraConfig(r=4))  # frozen base: the layers are compiled once
    assert model.model.layers[0].compiled_once is not None
    x = Tensor(np.arange(16, dtype=np.int32).reshape(2, 8))
    before = model(x).asnumpy()
    b = next(p for p in model.get_parameters() if p.name.endswith("layers.0.self_attn.q_proj.lora_b"))
    b.set_data(Tensor(np.full(b.shape, 0.5, np.float32)))
    invalidate_compiled_graphs(model)
    after = model(x).asnumpy()
    assert np.abs(after - before).max() > 1e-3
