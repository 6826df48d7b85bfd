"""File conversion through every format: bit-exact round trips on the reference models, logits of
the converted model, bf16 rounding against numpy, and bad input that leaves nothing behind."""
import os

import mindspore as ms
import numpy as np
import pytest

from conftest import MODELS, fixture_path, reference
from mindqwen import from_pretrained
from mindqwen.io.convert import convert, read_state
from mindqwen.models.qwen import QwenForCausalLM
from mindqwen.io.safetensors import CheckpointError, SafetensorsFile

ROUTES = [("mindqwen", "x", None, None), ("ms-ckpt", "x.ckpt", None, None), ("mindformers", "x.ckpt", None, None),
          ("mindformers", "x.ckpt", "interleaved", "interleaved"),
          ("mindformers-mcore", "x.safetensors", "contiguous", "contiguous"),
          ("mindformers-mcore", "x.safetensors", "interleaved", "interleaved")]


def tensors(folder):
    return {k: t.load() for k, t in read_state(folder).items()}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("fmt,file,qkv,mlp", ROUTES)
def test_round_trip_through_a_file_is_bit_exact(name, fmt, file, qkv, mlp, tmp_path):
    base = fixture_path(name, "base")
    convert(base, str(tmp_path / file), "hf", fmt, base, qkv=qkv, mlp=mlp)
    convert(str(tmp_path / file), str(tmp_path / "back"), fmt, "hf", base, qkv=qkv, mlp=mlp)
    original, back = tensors(base), tensors(str(tmp_path / "back"))
    original = {k: v for k, v in original.items() if k in back}  # a stored tied head is dropped
    assert set(back) == set(original) and all(np.array_equal(back[k], original[k]) for k in original)
    ref = reference(name)
    ids = ms.Tensor(ref["input_ids"].astype(np.int32))
    direct = from_pretrained(base)(ids).asnumpy()
    # the model loaded straight from the intermediate format computes what the HF-loaded one does,
    # bit for bit; that one is within test_model_parity's 5e-5 of HF (fp32 summation order)
    from_intermediate = QwenForCausalLM.from_checkpoint(str(tmp_path / file), fmt, base, qkv, mlp)(ids).asnumpy()
    assert np.array_equal(from_intermediate, direct)
    assert np.array_equal(from_pretrained(str(tmp_path / "back"))(ids).asnumpy(), direct)
    assert np.abs(direct - ref["logits"]).max() <= 5e-5


def test_bf16_rounds_to_nearest_even_and_widens_exactly(tmp_path):
    base = fixture_path("qwen2_tiny", "base")
    convert(base, str(tmp_path / "bf16"), "hf", "hf", base, dtype="bf16")
    convert(str(tmp_path / "bf16"), str(tmp_path / "fp32"), "hf", "hf", dtype="fp32")
    f = SafetensorsFile(str(tmp_path / "bf16" / "model.safetensors"))
    for k, x in tensors(base).items():
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        expected = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest, ties to even
        assert f.dtype(k) == "BF16" and np.array_equal(f.raw(k).view(np.uint16), expected), k
        widened = tensors(str(tmp_path / "fp32"))[k]
        assert np.array_equal(widened.view(np.uint32), expected.astype(np.uint32) << 16), k


def test_bad_input_names_the_problem_and_writes_nothing(tmp_path):
    base = fixture_path("qwen2_tiny", "base")
    with pytest.raises(CheckpointError, match=r"missing \[.*q_norm.*unexpected \[.*q_proj\.bias"):
        convert(base, str(tmp_path / "out"), "hf", "hf", fixture_path("qwen3_tiny", "base"))  # Qwen3 config, Qwen2 weights
    import json
    cfg = json.load(open(os.path.join(base, "config.json")))
    (tmp_path / "wrong.json").write_text(json.dumps(dict(cfg, intermediate_size=96)))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight has shape \[128, 64\], the config implies \[96, 64\]"):
        convert(base, str(tmp_path / "out"), "hf", "hf", str(tmp_path / "wrong.json"))
    with pytest.raises(KeyError, match="match no name map entry"):  # HF names read as mindformers
        convert(base, str(tmp_path / "out"), "mindformers", "hf", base)
    with pytest.raises(ValueError, match="unknown format"):
        convert(base, str(tmp_path / "out"), "hf", "megatron", base)
    truncated = tmp_path / "t.safetensors"
    truncated.write_bytes(open(os.path.join(base, "model.safetensors"), "rb").read()[:5000])
    with pytest.raises(CheckpointError, match="truncated"):
        convert(str(truncated), str(tmp_path / "out"), "mindformers-mcore", "hf", base)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-8b", "qwen3-o-bias"])
def test_config_tensor_shapes_are_the_models_parameters(name):
    """``QwenConfig.tensor_shapes`` (what conversion checks a checkpoint against, without building
    a model) lists exactly the model's parameters: tied and untied heads, qkv bias, q/k-norm."""
    from mindqwen.config import QwenConfig
    from mindqwen.io.hf import no_init_parameters
    if name == "qwen3-o-bias":
        config = QwenConfig.from_preset("qwen3-0.6b", num_hidden_layers=2, qkv_bias=True, o_bias=True)
    else:
        config = QwenConfig.from_preset(name, num_hidden_layers=3)
    with no_init_parameters():
        model = QwenForCausalLM(config)
    assert config.tensor_shapes() == {p.name: tuple(p.shape) for p in model.get_parameters()}
