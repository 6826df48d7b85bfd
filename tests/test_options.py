"""Execution options: given at build or changed by ``configure``, they take effect in the next
compiled graph; bad values are refused by name; building a model leaves the process alone."""
import os

import mindspore as ms
import numpy as np
import pytest

from mindqwen import QwenConfig, QwenForCausalLM
from mindqwen.config import ConfigError, ExecutionOptions
from mindqwen.models.graph import configure, in_mode

CONFIG = QwenConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=32)
ROW = ms.Tensor(np.array([[11, 12, 13, 5, 21, 22, 23, 24]], np.int32))


def _model(options=None):
    ms.set_seed(0)
    return QwenForCausalLM(CONFIG, options=options)


def test_options_given_at_build_equal_the_same_options_configured_after():
    with in_mode(ms.GRAPH_MODE):
        built = _model(ExecutionOptions(compute_dtype="float16"))(ROW).asnumpy()
        model = _model()
        plain = model(ROW).asnumpy()
        configure(model, compute_dtype="float16")
        configured = model(ROW).asnumpy()
    np.testing.assert_array_equal(built, configured)
    assert np.abs(plain - configured).max() > 0  # the option acts: fp16 matmuls round differently
    assert model.options == ExecutionOptions(compute_dtype="float16")
    assert all(layer.self_attn.q_proj.compute_dtype == ms.float16 for layer in model.model.layers)


def test_configure_recompiles_the_graphs_it_changes():
    """A stale compiled graph would give the fp32 logits again after the change."""
    with in_mode(ms.GRAPH_MODE):
        model = _model()
        fp32 = model(ROW).asnumpy()
        configure(model, compute_dtype="float16")
        fp16 = model(ROW).asnumpy()
        configure(model, compute_dtype=None)
        again = model(ROW).asnumpy()
    assert 0 < np.abs(fp16 - fp32).max() < 1e-2  # fp16 matmuls: a rounding difference, not another model
    np.testing.assert_array_equal(again, fp32)
    assert all(layer.self_attn.q_proj.compute_dtype is None for layer in model.model.layers)


def test_bad_options_are_refused_by_name_and_change_nothing():
    model = _model()
    with pytest.raises(ConfigError, match="compute_dtype"):
        configure(model, compute_dtype="float64")
    with pytest.raises(ConfigError, match="capacity_multiple"):
        configure(model, capacity_multiple=0)
    with pytest.raises(TypeError, match="fusion"):
        configure(model, fusion=True)
    assert model.options == ExecutionOptions()


def test_building_a_model_leaves_the_process_environment_alone():
    before = dict(os.environ)
    _model(ExecutionOptions(compute_dtype="float16"))
    assert dict(os.environ) == before
