"""What a user waits for before the first step: the random initialisation, and where compiled
kernels go. The initialisation is checked against the normal distribution's closed form."""
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import mindspore as ms
import numpy as np
import pytest
from mindspore.common.initializer import initializer

from conftest import fixture_path
from mindqwen import QwenForCausalLM
from mindqwen.models import heads, init, qwen
from mindqwen.models.graph import configure, in_mode
from mindqwen.models.init import RandomNormal

SIGMA = 0.02


def draw(shape, seed=0):
    ms.set_seed(seed)
    return initializer(RandomNormal(SIGMA), shape, ms.float32).init_data().asnumpy()


def test_random_init_is_normal_with_the_configured_sigma():
    x = draw((1200, 5000)).reshape(-1).astype(np.float64)  # 6 M values: two blocks of 4 M and 2 M
    n = x.size
    assert abs(x.mean()) < 5 * SIGMA / math.sqrt(n)
    assert abs(x.std() / SIGMA - 1) < 5 / math.sqrt(2 * n)
    # Kolmogorov-Smirnov distance to N(0, SIGMA²) on a sample: ~1.36/sqrt(m) at the 5% level.
    sample = np.sort(x[:: n // 100_000])
    cdf = 0.5 * (1 + np.vectorize(math.erf)(sample / (SIGMA * math.sqrt(2))))
    m = sample.size
    ks = max(np.max(np.arange(1, m + 1) / m - cdf), np.max(cdf - np.arange(m) / m))
    assert ks < 1.95 / math.sqrt(m), ks  # the 0.1% level
    # The blocks come from independent streams, not one stream repeated.
    block = RandomNormal.BLOCK
    assert abs(np.corrcoef(x[:1_000_000], x[block:block + 1_000_000])[0, 1]) < 0.01


def test_random_init_follows_the_seed_and_not_the_thread_count(monkeypatch):
    a, b, c = draw((300, 20000), 1), draw((300, 20000), 1), draw((300, 20000), 2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    monkeypatch.setattr(init, "_draw_pool", lambda: ThreadPoolExecutor(1))
    assert np.array_equal(draw((300, 20000), 1), a)


def test_random_init_casts_to_a_half_precision_dtype():
    ms.set_seed(0)
    x = initializer(RandomNormal(SIGMA), (256, 256), ms.float16).init_data()
    assert x.dtype == ms.float16 and abs(float(x.asnumpy().astype(np.float32).std()) / SIGMA - 1) < 0.02


def test_from_pretrained_draws_no_random_weights(monkeypatch):
    def refuse(*args):
        raise AssertionError("a weight the checkpoint replaces was drawn")
    monkeypatch.setattr(RandomNormal, "_draw", refuse)
    model = QwenForCausalLM.from_pretrained(fixture_path("qwen2_tiny", "base"))
    assert float(np.abs(model.model.embed_tokens.weight.asnumpy()).sum()) > 0


KERNELS = """
import mindqwen, mindspore as ms, numpy as np
from mindqwen import QwenConfig, QwenForCausalLM
ms.set_context(mode=ms.GRAPH_MODE)
model = QwenForCausalLM(QwenConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
ids = ms.Tensor(np.arange(12, dtype=np.int32).reshape(2, 6))
print(float(ms.value_and_grad(model, None, model.trainable_params())(ids, None, ids)[0]))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="CPU graph-kernel fusion is MindSpore's on Linux")
@pytest.mark.parametrize("inherited", [False, True])
def test_fused_kernels_build_into_the_cache_and_leave_the_working_directory_clean(tmp_path, inherited):
    """Also for a child of a mindqwen process, which inherits its kernel cache's path: AKG's log
    of a kernel built there must not stay behind either."""
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    env = {**os.environ, "GLOG_v": "3", "MINDQWEN_CACHE": str(cache)}
    env.pop("MS_COMPILER_CACHE_PATH", None)
    kernels = os.path.join(cache, f"kernels-ms{ms.__version__}")
    if inherited:
        env["MS_COMPILER_CACHE_PATH"] = kernels
    r = subprocess.run([sys.executable, "-c", KERNELS], cwd=work, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(os.listdir(work)) == []
    built = os.listdir(os.path.join(kernels, "akg_kernel_meta"))
    assert any(name.endswith(".o") for name in built)  # a cold cache: AKG built them here


def tiny(layers=3, compile_once=True, **overrides):
    ms.set_seed(0)
    config = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, qkv_bias=True, tie_word_embeddings=False)
    return QwenForCausalLM(qwen.QwenConfig(**{**config, **overrides}), compile_once=compile_once)


def test_layers_with_the_same_settings_share_one_compiled_graph():
    from mindqwen import LoraConfig, apply_lora
    for mode in (False, None):  # None, the default: only a model with frozen weights shares
        assert all(layer.compiled_once is None and layer.cached_once is None
                   for layer in tiny(compile_once=mode).model.layers)
    layers = apply_lora(tiny(compile_once=None), LoraConfig(r=2, target_modules=["q_proj"])).model.layers
    assert len({id(layer.compiled_once) for layer in layers}) == 1 and layers[0].compiled_once is not None
    assert all(layer.cached_once is None for layer in layers)  # generation stays inlined
    model = tiny()
    graphs = {id(layer.compiled_once) for layer in model.model.layers}
    assert len(graphs) == 1 and None not in {layer.compiled_once for layer in model.model.layers}
    sliding = tiny(use_sliding_window=True, sliding_window=4, max_window_layers=1)  # layer 0 full, 1-2 sliding
    layers = sliding.model.layers
    assert layers[1].compiled_once is layers[2].compiled_once is not layers[0].compiled_once


@pytest.mark.parametrize("lora", [False, True])
def test_compiled_once_layers_give_the_inlined_gradients(lora):
    """Full fine-tune and LoRA (frozen weights stopped inside the shared graph; the chunked loss,
    training mode), graph mode: the shared layer graph against the same layers inlined."""
    from mindqwen import LoraConfig, apply_lora
    ids = ms.Tensor(np.arange(20, dtype=np.int32).reshape(2, 10) % 96)
    out = []
    with in_mode(ms.GRAPH_MODE):
        for share in (True, False):
            model = tiny(compile_once=share)
            if lora:
                apply_lora(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
                for p in model.trainable_params():  # B ≠ 0, so A has a gradient
                    p.set_data(ms.Tensor(np.random.default_rng(0).normal(0, 0.1, p.shape).astype(np.float32)))
                configure(model, loss_chunk_rows=7)
                model.set_train(True)
            assert (model.model.layers[0].compiled_once is not None) == share
            loss, grads = ms.value_and_grad(model, None, model.trainable_params())(ids, None, ids)
            out.append((float(loss), [g.asnumpy() for g in grads]))
    assert out[0][0] == pytest.approx(out[1][0], abs=1e-6)
    assert max(float(np.abs(a - b).max()) for a, b in zip(out[0][1], out[1][1])) <= 1e-6


def test_surgery_regroups_the_layers():
    from mindqwen import LoraConfig, apply_lora
    from mindqwen.models.graph import sync_with_weights
    from mindqwen.train.recompute import apply_recompute
    model = tiny()
    before = model.model.layers[0].compiled_once
    apply_lora(model, LoraConfig(r=2, target_modules=["q_proj"], layers_to_transform=[1]))
    layers = model.model.layers
    assert layers[0].compiled_once is layers[2].compiled_once not in (None, before)  # frozen now
    assert layers[1].compiled_once not in (None, layers[0].compiled_once)  # its q_proj is a LoRALayer
    assert layers[0].cached_once is layers[2].cached_once is not None
    assert type(model.chunked_loss) is heads.ChunkedCrossEntropyInForward and not model.chunked_loss.weight_grad
    shared = layers[0].compiled_once
    for p in model.get_parameters():  # thawed behind the model's back: the Stepper regroups
        p.requires_grad = True
    assert sync_with_weights(model) and not sync_with_weights(model)
    assert layers[0].compiled_once is layers[2].compiled_once not in (None, shared)
    assert type(model.chunked_loss) is heads.ChunkedCrossEntropy and model.chunked_loss.weight_grad
    model = tiny()
    apply_recompute(model, "full", every=2)
    assert [layer.compiled_once is None for layer in model.model.layers] == [True, False, True]
    model.model.set_compile_once(False)
    assert all(layer.compiled_once is None and layer.cached_once is None for layer in model.model.layers)


def test_compiled_once_generation_gives_the_inlined_tokens_and_logits():
    from mindqwen import generate
    prompt = ms.Tensor(np.array([[5, 9, 17, 33, 2, 71]], np.int32))
    shared, inlined = tiny(), tiny(compile_once=False)
    assert shared.model.layers[0].cached_once is not None
    a, b = generate(shared, prompt, max_new_tokens=6), generate(inlined, prompt, max_new_tokens=6)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("name", ("qwen2_tiny", "qwen3_tiny"))
def test_compiled_once_logits_and_loss_match_hf(name):
    """The opt-in path against HF's golden outputs (tests/test_model_parity.py's tolerances)."""
    from conftest import reference
    ref = reference(name)
    model = QwenForCausalLM.from_pretrained(fixture_path(name, "base"))
    model.model.set_compile_once(True)
    assert all(layer.compiled_once is not None for layer in model.model.layers)
    ids = ms.Tensor(ref["input_ids"].astype(np.int32))
    with in_mode(ms.GRAPH_MODE):
        logits = model(ids).asnumpy()
        loss = float(model(ids, labels=ids).asnumpy())
    assert np.abs(logits - ref["logits"]).max() <= 5e-5
    assert abs(loss - float(ref["loss"])) <= 1e-5


def test_a_recipe_compiles_its_layers_once():
    from mindqwen.train.model import build_model
    from mindqwen.train.recipe import ModelSection
    config = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)
    for once in (False, True, None):  # None: only a model with frozen weights shares (this one has none)
        layers = build_model(ModelSection(config=config, compile_once=once)).model.layers
        assert (layers[0].compiled_once is layers[1].compiled_once is not None) == bool(once)

