"""Tensor / pipeline parallel layout (semi-auto parallel runs on Ascend only; CPU checks the layout).

MindSpore's CPU backend refuses semi-auto parallel ("Invalid communication backend: CPU for
semi_auto_parallel"), so the sharded step cannot execute here. What CPU can check: the shard
strategies ``shard_model`` sets, interpreted by hand (a numpy simulation of every device's slice),
reproduce the unsharded layer, and the layout rules fail with clear errors.
"""
import mindspore as ms
import numpy as np
import pytest

from conftest import fixture_path
from mindqwen import LoraConfig, QwenConfig, QwenForCausalLM, apply_lora, from_pretrained
from mindqwen.train.distributed import (ParallelConfig, assign_pipeline_stages, check_layout, check_model_layout,
                                        init_parallel, setup_model_parallel, shard_model)

DP, TP = 3, 2  # distinct, so a strategy entry tells which axis each one splits


def strategy(linear):
    return linear.matmul.attrs["in_strategy"]


def local(a, axis_factors, d, t):
    """Device (d, t)'s slice of ``a`` under one operand strategy."""
    for axis, f in enumerate(axis_factors):
        if f > 1:
            a = np.split(a, f, axis)[t if f == TP else d]
    return a


def test_strategies_follow_megatron_layout():
    model = from_pretrained(fixture_path("qwen2_tiny", "base"))
    shard_model(model, DP, TP)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    column, row = ((DP, 1), (TP, 1)), ((DP, TP), (1, TP))
    for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
        assert strategy(linear) == column
    for linear in (attn.o_proj, mlp.down_proj):
        assert strategy(linear) == row
    assert attn.bmm_qk.attrs["in_strategy"] == ((DP, TP, 1, 1),) * 2
    assert model.head_matmul.attrs["in_strategy"] == column


def test_sharded_mlp_slices_reproduce_the_layer():
    """Each device computes silu(gate)·up on its slice, down-projects it, and the all-reduce (sum)
    over tensor-parallel devices gives the unsharded MLP: no communication between the layers."""
    model = from_pretrained(fixture_path("qwen2_tiny", "base"))
    shard_model(model, DP, TP)
    mlp = model.model.layers[0].mlp
    x = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float64)  # (T, H), T divisible by DP
    wg, wu, wd = (p.weight.asnumpy().astype(np.float64) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    full = (silu(x @ wg.T) * (x @ wu.T)) @ wd.T
    sg, su, sd = strategy(mlp.gate_proj), strategy(mlp.up_proj), strategy(mlp.down_proj)
    for d in range(DP):
        y = 0
        for t in range(TP):
            h = silu(local(x, sg[0], d, t) @ local(wg, sg[1], d, t).T) * (local(x, su[0], d, t) @ local(wu, su[1], d, t).T)
            h_full = silu(x @ wg.T) * (x @ wu.T)
            np.testing.assert_array_equal(h, local(h_full, sd[0], d, t))  # down_proj's input slice is local
            y = y + h @ local(wd, sd[1], d, t).T
        np.testing.assert_allclose(y, np.split(full, DP)[d], atol=1e-12)
    # the same MLP through MindSpore, unsharded, as the end-to-end reference
    ms_out = mlp(ms.Tensor(x.astype(np.float32))).asnumpy()
    np.testing.assert_allclose(ms_out, full, atol=1e-5)


def test_sharded_attention_keeps_each_query_head_with_its_kv_head():
    """The strategies ``shard_model`` sets, read back and applied to feature indices: q/k/v row
    slices and o_proj's column slice select whole heads, the attention batch-matmuls split the
    KV-head axis the same way, and device t's query heads use exactly device t's KV heads (head h
    reads KV head h // n_rep, as HF's repeat_kv)."""
    model = from_pretrained(fixture_path("qwen2_tiny", "base"))
    shard_model(model, DP, TP)
    attn, cfg = model.model.layers[0].self_attn, model.config
    n, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def heads(linear, features, axis):  # the heads of the W slice device (0, t) holds
        index = np.expand_dims(np.arange(features), 1 - axis)  # feature index along W's ``axis``
        return set(local(index, strategy(linear)[1], 0, t).ravel() // d)

    for t in range(TP):
        q_heads, k_heads, v_heads = heads(attn.q_proj, n * d, 0), heads(attn.k_proj, kv * d, 0), heads(attn.v_proj, kv * d, 0)
        o_heads = heads(attn.o_proj, n * d, 1)  # row-parallel: W (out, in) split by input columns
        kv_axis = np.broadcast_to(np.arange(kv)[None, :, None, None], (DP, kv, 1, 1))  # (B, KV, ·, ·)
        bmm_heads = {set(local(kv_axis, s, 0, t).ravel()) == k_heads for s in attn.bmm_qk.attrs["in_strategy"]
                     + attn.bmm_pv.attrs["in_strategy"]}
        assert {h // (n // kv) for h in q_heads} == k_heads == v_heads and bmm_heads == {True}
        assert len(q_heads) == n // TP and o_heads == q_heads  # whole heads: no head is cut in two


def test_layout_errors_are_clear():
    model = from_pretrained(fixture_path("qwen2_tiny", "base"))  # 4 heads, 2 KV heads, tied
    with pytest.raises(ValueError, match="tensor_parallel=4 must divide num_key_value_heads=2"):
        shard_model(model, 1, 4)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        assign_pipeline_stages(model, 2)
    with pytest.raises(ValueError, match=r"= 8, but 4 devices"):
        check_layout(ParallelConfig(2, 2, 2, 2), 4)
    with pytest.raises(ValueError, match="pipeline_micro_batches=2 must be at least pipeline_parallel=4"):
        ParallelConfig(1, 2, 4, 2)
    with pytest.raises(ValueError, match="need Ascend"):
        init_parallel(ParallelConfig(1, 2, 1))
    lora = apply_lora(from_pretrained(fixture_path("qwen2_tiny", "base")), LoraConfig(r=3, lora_alpha=6))
    with pytest.raises(ValueError, match="LoRA rank 3"):
        shard_model(lora, 1, 2)


def test_pipeline_stages_split_layers_contiguously():
    cfg = QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = QwenForCausalLM(cfg)
    assign_pipeline_stages(model, 4)
    assert [layer.pipeline_stage for layer in model.model.layers] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert model.model.embed_tokens.pipeline_stage == 0
    assert model.model.norm.pipeline_stage == model.lm_head.pipeline_stage == 3
    with pytest.raises(ValueError, match="pipeline_parallel=9 exceeds num_hidden_layers=8"):
        assign_pipeline_stages(model, 9)


def test_moe_experts_are_split_by_expert_and_like_the_mlp_and_routers_kept_whole():
    """Stacked experts: x (E, C, in) · W (E, out, in)ᵀ split by expert (EP groups over the
    data-parallel replicas), a group's tokens over its dp/ep devices, and like the MLP within an
    expert."""
    dp, tp, ep = 4, 2, 2
    model = apply_lora(from_pretrained(fixture_path("qwen2_moe_tiny", "base")),
                       LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "up_proj"]))
    shard_model(model, dp, tp, ep)
    mlp = model.model.layers[1].mlp
    experts = [mlp.experts.gate_proj, mlp.experts.up_proj, mlp.experts.down_proj]
    assert [p.bmm.attrs["in_strategy"] for p in experts] == [((ep, dp // ep, 1), (ep, tp, 1))] * 2 + [
        ((ep, dp // ep, tp), (ep, 1, tp))]
    assert mlp.batched  # the exact path uses the same batched matmuls: one layout of the weights
    assert mlp.capacity_multiple == model.capacity_multiple == dp // ep  # C splits over a group's devices
    shared = mlp.shared_expert
    assert (strategy(shared.gate_proj), strategy(shared.up_proj), strategy(shared.down_proj)) == (
        ((dp, 1), (tp, 1)), ((dp, 1), (tp, 1)), ((dp, tp), (1, tp)))
    assert mlp.gate.matmul.attrs["in_strategy"] == ((dp, 1), (1, 1))
    assert strategy(mlp.shared_expert_gate) == ((dp, 1), (1, 1))
    with pytest.raises(ValueError, match="expert_parallel=3 must divide num_experts=4"):
        shard_model(model, 3, 1, 3)
    with pytest.raises(ValueError, match="expert_parallel=2 must divide data_parallel=3"):
        ParallelConfig(3, expert_parallel=2)
    with pytest.raises(ValueError, match="this model is dense"):
        check_model_layout(QwenConfig(), ParallelConfig(2, expert_parallel=2))
    odd = apply_lora(from_pretrained(fixture_path("qwen3_moe_tiny", "base")), LoraConfig(r=3, target_modules=["up_proj"]))
    with pytest.raises(ValueError, match="must divide the LoRA rank 3"):  # only the experts have LoRA
        shard_model(odd, 2, 2)
    config = QwenConfig.from_hf(fixture_path("qwen2_moe_tiny", "base"))
    config.moe_intermediate_size = 33
    with pytest.raises(ValueError, match="tensor_parallel=2 must divide moe_intermediate_size=33"):
        check_model_layout(config, ParallelConfig(tensor_parallel=2))


@pytest.mark.parametrize("kind", ["tied", "untied", "moe"])
def test_setup_model_parallel_up_to_the_compile(kind, tmp_path):
    """Everything ``setup_model_parallel`` does before MindSpore needs Ascend (the compile): the
    strategies, the stages, the strategy file's path, on tied, untied and MoE models."""
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=kind == "tied")
    if kind == "moe":
        config.update(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      head_dim=8, qkv_bias=False, qk_norm=True)
    model = QwenForCausalLM(QwenConfig(**config))
    pp = 1 if kind == "tied" else 2  # a tied head cannot leave the embedding's stage
    parallel = ParallelConfig(data_parallel=2, tensor_parallel=2, pipeline_parallel=pp, pipeline_micro_batches=pp,
                              expert_parallel=2 if kind == "moe" else 1)
    try:
        folder = setup_model_parallel(model, parallel, str(tmp_path), rank=3)
        saved = ms.get_auto_parallel_context("strategy_ckpt_config")["save_file"]
    finally:
        ms.reset_auto_parallel_context()
    assert folder == str(tmp_path / "rank_3") and saved == str(tmp_path / "rank_3" / "strategy.ckpt")
    layers = model.model.layers
    assert [layer.pipeline_stage for layer in layers] == ([0, 0, 0, 0] if pp == 1 else [0, 0, 1, 1])
    assert model.model.embed_tokens.pipeline_stage == 0 and model.model.norm.pipeline_stage == pp - 1
    attn = layers[0].self_attn
    assert strategy(attn.q_proj) == ((2, 1), (2, 1)) and strategy(attn.o_proj) == ((2, 2), (1, 2))
    head = model.head_matmul if model.tied else model.lm_head.matmul
    assert head.attrs["in_strategy"] == ((2, 1), (2, 1)) and model.chunked_loss.rows == 0
    if kind == "untied":
        assert model.lm_head.pipeline_stage == pp - 1
    if kind == "moe":
        experts = layers[0].mlp.experts
        assert experts.gate_proj.bmm.attrs["in_strategy"] == ((2, 1, 1), (2, 2, 1))  # (E, C, in), (E, out, in)

