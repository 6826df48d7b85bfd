"""Gated DeltaNet (mindqwen/models/deltanet.py) against HF transformers' Qwen3.5 code run in float64
(fixtures/deltanet/make_deltanet_golden.py): the chunked and the recurrent rule, their gradients, the causal
convolution's three paths, and the whole layer (forward, padding mask, parameter gradients, prefill then
decode through its states), in GRAPH_MODE; the layer's forward in PyNative too, and LoRA on its projections.

Errors are max|Δ| / max|ref| per array; fp32 against the float64 reference must stay within TOL. HF's own
fp32 code, printed beside where the golden has it, is 1e-6 - 1.5e-5 off the same reference.
"""
import types

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from conftest import fixture_path
from mindqwen.config import ConfigError
from mindqwen.lora import LoraConfig, apply_lora, lora_layers
from mindqwen.models.deltanet import (GatedDeltaNet, causal_conv1d, causal_conv1d_update, chunk_gated_delta_rule,
                                      recurrent_gated_delta_rule)

TOL = 1e-5
RULE_INPUTS = ("q", "k", "v", "g", "beta", "h0")
HF_NAMES = {"in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
            "dt_bias", "A_log", "norm.weight", "out_proj.weight"}


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(fixture_path("deltanet", "golden.npz")))


@pytest.fixture(autouse=True)
def graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE)


def rel(actual, ref) -> float:
    actual = actual.asnumpy() if isinstance(actual, Tensor) else actual
    assert actual.shape == ref.shape
    return float(np.abs(actual - ref).max() / np.abs(ref).max())


def check(name: str, actual, ref, tol: float = TOL) -> None:
    err = rel(actual, ref)
    print(f"{name}: {err:.2e}")
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.1e}"


class ChunkRule(nn.Cell):
    def __init__(self, chunk_size):
        super().__init__()
        self.chunk_size = chunk_size

    def construct(self, q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, h0, self.chunk_size)


class RecurrentRule(nn.Cell):
    def construct(self, q, k, v, g, beta, h0):
        return recurrent_gated_delta_rule(q, k, v, g, beta, h0)


class RuleLoss(nn.Cell):
    """L = Σ out·w_out + Σ state·w_state of the chunked rule."""

    def __init__(self, chunk_size, w_out, w_state):
        super().__init__()
        self.rule = ChunkRule(chunk_size)
        self.w_out, self.w_state = Tensor(w_out), Tensor(w_state)

    def construct(self, q, k, v, g, beta, h0):
        out, state = self.rule(q, k, v, g, beta, h0)
        return (out * self.w_out).sum() + (state * self.w_state).sum()


class RuleGrads(nn.Cell):
    def __init__(self, loss):
        super().__init__()
        self.grad = ms.value_and_grad(loss, grad_position=(0, 1, 2, 3, 4, 5))

    def construct(self, *inputs):
        return self.grad(*inputs)


def rule_inputs(golden, prefix="rule", names=RULE_INPUTS):
    return [Tensor(golden[f"{prefix}/{name}"]) for name in names]


def test_chunked_rule_matches_hf(golden):
    out, state = ChunkRule(int(golden["chunk_size"]))(*rule_inputs(golden))  # T 150: three chunks, one padded
    check("chunked out", out, golden["rule/chunk_out"])
    check("chunked final state", state, golden["rule/chunk_state"])
    print(f"  (HF's fp32 code: {rel(golden['rule/chunk_out32'], golden['rule/chunk_out']):.2e}, "
          f"{rel(golden['rule/chunk_state32'], golden['rule/chunk_state']):.2e})")


def test_chunked_rule_is_stable_where_the_ut_powers_blow_up(golden):
    """Nearly parallel keys, β near 1, g near 0: the powers of the UT system reach 1e18 here, so an inverse
    through them (the Neumann product) fails; forward substitution and block doubling do not."""
    hard = rule_inputs(golden, "hard", RULE_INPUTS[:5])
    out, state = ChunkRule(int(golden["chunk_size"]))(*hard, None)
    check("hard out", out, golden["hard/out"])
    check("hard final state", state, golden["hard/state"])


def test_recurrent_rule_matches_hf_token_by_token(golden):
    """The decode form, one T = 1 graph stepped over the 150 tokens, carrying the state."""
    q, k, v, g, beta, state = rule_inputs(golden)
    step, outs = RecurrentRule(), []
    for t in range(q.shape[1]):
        out, state = step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], state)
        outs.append(out.asnumpy())
    check("recurrent out", np.concatenate(outs, 1), golden["rule/rec_out"])
    check("recurrent final state", state, golden["rule/rec_state"])


def test_recurrent_rule_over_several_tokens_matches_hf(golden):
    """The same form given T = 8 tokens at once (the loop inside the graph), from the initial state."""
    out, _ = RecurrentRule()(*[x[:, :8] for x in rule_inputs(golden)])
    # The float64 reference's first 8 outputs (a causal rule: later tokens do not change them).
    check("recurrent out, 8 tokens at once", out, golden["rule/rec_out"][:, :8])


def test_chunked_rule_gradients_match_hf(golden):
    loss = RuleLoss(int(golden["chunk_size"]), golden["rule/w_out"], golden["rule/w_state"])
    value, grads = RuleGrads(loss)(*rule_inputs(golden))
    ref = ((golden["rule/chunk_out"] * golden["rule/w_out"]).sum()
           + (golden["rule/chunk_state"] * golden["rule/w_state"]).sum())
    assert abs(float(value.asnumpy()) / ref - 1) <= TOL
    for name, grad in zip(RULE_INPUTS, grads):
        check(f"d/d{name}", grad, golden[f"rule/grad_{name}"])


class ConvPaths(nn.Cell):
    def construct(self, x, weight, state):
        """x (B, T, C), weight (C, 1, K), state (B, C, K-1)."""
        out, new_state = causal_conv1d(x, weight)
        out_cached, cached_state = causal_conv1d(x, weight, state)
        out_step, step_state = causal_conv1d_update(x[:, :1], weight, state)
        return out, new_state, out_cached, cached_state, out_step, step_state


def test_causal_conv_paths_match_hf(golden):
    x = golden["conv/x"]  # (B, C, T), HF's layout
    weight, state = golden["conv/weight"], golden["conv/state"]  # (C, K), (B, C, K): HF keeps K inputs
    out, new_state, out_cached, cached_state, out_step, step_state = ConvPaths()(
        Tensor(x.transpose(0, 2, 1)), Tensor(weight[:, None]), Tensor(state[..., 1:]))
    check("conv, zero history", out.asnumpy().transpose(0, 2, 1), golden["conv/out"])
    check("conv, with state", out_cached.asnumpy().transpose(0, 2, 1), golden["conv/out_cached"])
    check("conv, one step", out_step.asnumpy().transpose(0, 2, 1), golden["conv/out_step"])
    check("conv state, one step", step_state, golden["conv/state_step"][..., 1:], 0.0)  # copies, exact
    history = weight.shape[-1] - 1
    check("conv state, sequence", new_state, x[..., -history:], 0.0)  # the last K-1 inputs
    check("conv state, sequence with state", cached_state, x[..., -history:], 0.0)


def tiny_layer(golden) -> GatedDeltaNet:
    layer = GatedDeltaNet(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
    params = dict(layer.parameters_and_names())
    assert set(params) == HF_NAMES  # an HF state dict loads by name
    for name, param in params.items():
        param.set_data(Tensor(golden[f"module/{name}"]))
    return layer


class Forward(nn.Cell):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x, mask):
        return self.layer(x), self.layer(x, mask)


class LayerGrads(nn.Cell):
    def __init__(self, layer, w_out):
        super().__init__()
        self.layer, self.w_out = layer, Tensor(w_out)
        self.grad = ms.value_and_grad(self.loss, grad_position=0, weights=layer.trainable_params())

    def loss(self, x):
        return (self.layer(x) * self.w_out).sum()

    def construct(self, x):
        return self.grad(x)


class Cached(nn.Cell):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x, conv_state, recurrent_state):
        return self.layer.cached(x, conv_state, recurrent_state)


@pytest.fixture(scope="module")
def layer_forward(golden):
    """The tiny layer and its whole-sequence outputs, without and with the padding mask (one graph)."""
    ms.set_context(mode=ms.GRAPH_MODE)
    layer = tiny_layer(golden)
    out, out_masked = Forward(layer)(Tensor(golden["module/x"]), Tensor(golden["module/mask"]))
    return layer, out.asnumpy(), out_masked.asnumpy()


def test_layer_forward_and_mask_match_hf(golden, layer_forward):
    _, out, out_masked = layer_forward
    check("layer out", out, golden["module/out"])
    check("layer out, padding mask", out_masked, golden["module/out_masked"])
    print(f"  (HF's fp32 code: {rel(golden['module/out32'], golden['module/out']):.2e})")


def test_layer_in_pynative_mode_matches_hf(golden):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    x = Tensor(golden["module/x"][:, :80])  # two chunks, the second padded
    check("layer out, PyNative, 80 tokens", tiny_layer(golden)(x), golden["module/out"][:, :80])


def test_lora_targets_the_projections(golden):
    """apply_lora finds the layer's Linear projections; B = 0 leaves the output HF's, B ≠ 0 changes it."""
    model = nn.SequentialCell([tiny_layer(golden)])
    apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=["in_proj_qkv", "in_proj_z", "out_proj"]))
    assert sorted(lora_layers(model)) == ["0.in_proj_qkv", "0.in_proj_z", "0.out_proj"]
    x = Tensor(golden["module/x"])
    check("layer out, LoRA with B = 0", model(x), golden["module/out"])
    for adapter in lora_layers(model).values():
        adapter.lora_b.set_data(Tensor(np.full(adapter.lora_b.shape, 0.05, np.float32)))
    assert rel(model(x), golden["module/out"]) > 1e-2


def test_layer_gradients_match_hf(golden):
    """HF's own fp32 code is printed beside: its gradients of dt_bias and A_log (sums of dL/dg over every
    token of a head) are 1.2e-5 / 1.5e-5 off, from its decays exp(Γ_i − Γ_j) (deltanet.py sums each
    exponent over its own tokens instead)."""
    layer = tiny_layer(golden)
    names = {id(param): name for name, param in layer.parameters_and_names()}  # the layer's own names
    _, (grad_x, grads) = LayerGrads(layer, golden["module/w_out"])(Tensor(golden["module/x"]))
    check(f"layer d/dx (HF fp32 {rel(golden['module/grad32_x'], golden['module/grad_x']):.2e})", grad_x,
          golden["module/grad_x"])
    names = [names[id(param)] for param in layer.trainable_params()]
    assert sorted(names) == sorted(HF_NAMES)
    for name, grad in zip(names, grads):
        hf32 = rel(golden[f"module/grad32/{name}"], golden[f"module/grad/{name}"])
        check(f"layer d/d{name} (HF fp32 {hf32:.2e})", grad, golden[f"module/grad/{name}"])


def test_prefill_then_decode_matches_hf_and_the_whole_sequence(golden, layer_forward):
    """Prefill 100 tokens from empty states, a second chunk of 40 with them, then 10 single tokens: HF's
    outputs and cache states at each point, and the layer's own whole-sequence forward."""
    layer, whole, _ = layer_forward
    x = Tensor(golden["module/x"])
    prefill, second = (int(i) for i in golden["module/split"])
    b, t = x.shape[:2]
    step = Cached(layer)
    conv_state = Tensor(np.zeros((b, layer.conv_dim, layer.conv_kernel_size - 1), np.float32))
    state = Tensor(np.zeros((b, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim), np.float32))
    outs = []
    for start, stop, tag in ((0, prefill, "_P"), (prefill, second, "_C")):
        out, conv_state, state = step(x[:, start:stop], conv_state, state)
        outs.append(out.asnumpy())
        check(f"conv state after {stop}", conv_state, golden[f"module/conv_state{tag}"][..., 1:])
        check(f"recurrent state after {stop}", state, golden[f"module/state{tag}"])
    for i in range(second, t):
        out, conv_state, state = step(x[:, i:i + 1], conv_state, state)
        outs.append(out.asnumpy())
    cached = np.concatenate(outs, 1)
    check("cached outputs", cached, golden["module/cached_out"])
    check("final conv state", conv_state, golden["module/conv_state"][..., 1:])
    check("final recurrent state", state, golden["module/state"])
    check("cached outputs vs the whole-sequence forward", cached, whole)


def test_from_config_reads_hf_names_and_names_what_is_missing():
    config = types.SimpleNamespace(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                   linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                   rms_norm_eps=1e-6)
    layer = GatedDeltaNet.from_config(config)
    assert (layer.conv_dim, layer.value_dim, layer.conv1d.weight.shape) == (2 * 2 * 16 + 4 * 8, 32, (96, 1, 4))
    del config.linear_conv_kernel_dim
    with pytest.raises(ConfigError, match="linear_conv_kernel_dim"):
        GatedDeltaNet.from_config(config)
    with pytest.raises(ConfigError, match="multiple of linear_num_key_heads 3"):
        GatedDeltaNet(32, 3, 4, 16, 8, 4)
    with pytest.raises(ConfigError, match="chunk_size 48"):
        GatedDeltaNet(32, 2, 4, 16, 8, 4, chunk_size=48)
