"""Published shapes of the Qwen2.5, Qwen3 and Qwen3.5 models, dense and mixture-of-experts (plain data).

Qwen2.5 and Qwen3 sources, cross-checked: the HF ``config.json`` files, torchtune ``_model_builders.py``, litgpt
``config.py``, NeMo. All use rope_theta 1e6 and no sliding window. Instruct checkpoints can
differ in ``max_position_embeddings`` and ``rms_norm_eps``: load their own ``config.json``
(``QwenConfig.from_hf``) rather than a preset when you have it.

Qwen3.5 (hybrid: three Gated DeltaNet layers, then one gated full-attention layer, repeated) is
published as a vision-language checkpoint; its preset is the language model (``text_config``).
Sources, cross-checked: the published ``config.json`` files as copied by checkpoint validators,
a training framework's Megatron model arguments, the model cards, and the checkpoints' parameter
counts, which every preset reproduces exactly (tests/test_qwen3_5_presets.py). All sizes: head_dim
256 with a quarter rotary, rope_theta 1e7, linear attention with 16 key heads and value heads of
128, a causal convolution of 4, 262144 positions, rms_norm_eps 1e-6.
"""
_QWEN25 = dict(model_type="qwen2", qkv_bias=True, o_bias=False, qk_norm=False, rope_theta=1e6)
_QWEN3 = dict(model_type="qwen3", qkv_bias=False, o_bias=False, qk_norm=True, rope_theta=1e6,
              head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6)


_QWEN3_MOE = dict(_QWEN3, model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                  decoder_sparse_step=1, router_aux_loss_coef=0.001, tie_word_embeddings=False)


_QWEN35 = dict(model_type="qwen3_5", qkv_bias=False, o_bias=False, qk_norm=True, rope_theta=1e7,
               partial_rotary_factor=0.25, head_dim=256, vocab_size=248320, max_position_embeddings=262144,
               rms_norm_eps=1e-6, full_attention_interval=4, linear_num_key_heads=16, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4)


def _q25(vocab, hidden, inter, layers, heads, kv, max_pos, eps, tie):
    return dict(_QWEN25, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                max_position_embeddings=max_pos, rms_norm_eps=eps, tie_word_embeddings=tie)


def _q3(hidden, inter, layers, heads, kv, tie):
    return dict(_QWEN3, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tie)


def _q35(hidden, inter, layers, heads, kv, value_heads, tie):
    return dict(_QWEN35, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, linear_num_value_heads=value_heads,
                tie_word_embeddings=tie)


def _q35_moe(hidden, layers, heads, kv, value_heads, experts, k, expert_inter):
    # every layer is a mixture (intermediate_size unused); the shared expert is as wide as a routed one
    return dict(_q35(hidden, expert_inter, layers, heads, kv, value_heads, False), model_type="qwen3_5_moe",
                num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=expert_inter,
                shared_expert_intermediate_size=expert_inter, norm_topk_prob=True, decoder_sparse_step=1,
                router_aux_loss_coef=0.001)


PRESETS = {
    #                       vocab   hidden inter  L   heads kv max_pos eps   tie
    "qwen2.5-0.5b": _q25(151936, 896, 4864, 24, 14, 2, 32768, 1e-6, True),
    "qwen2.5-1.5b": _q25(151936, 1536, 8960, 28, 12, 2, 131072, 1e-6, True),
    "qwen2.5-3b": _q25(151936, 2048, 11008, 36, 16, 2, 32768, 1e-6, True),
    "qwen2.5-7b": _q25(152064, 3584, 18944, 28, 28, 4, 131072, 1e-6, False),
    "qwen2.5-14b": _q25(152064, 5120, 13824, 48, 40, 8, 131072, 1e-5, False),
    "qwen2.5-32b": _q25(152064, 5120, 27648, 64, 40, 8, 131072, 1e-5, False),
    "qwen2.5-72b": _q25(152064, 8192, 29568, 80, 64, 8, 131072, 1e-5, False),
    #                  hidden inter  L   heads kv tie
    "qwen3-0.6b": _q3(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _q3(2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _q3(2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _q3(4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _q3(5120, 17408, 40, 40, 8, False),
    "qwen3-32b": _q3(5120, 25600, 64, 64, 8, False),
    # Qwen3 mixtures of experts: 128 experts, 8 per token (intermediate_size: unused, no dense layer)
    "qwen3-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4),
    "qwen3-235b-a22b": dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4),
    # Qwen3.5 (hybrid): every 4th layer gated full attention, the others Gated DeltaNet with 16 key
    # heads and value_heads value heads, all of 128
    #                    hidden inter  L   heads kv value_heads tie
    "qwen3.5-0.8b": _q35(1024, 3584, 24, 8, 2, 16, True),
    "qwen3.5-2b": _q35(2048, 6144, 24, 8, 2, 16, True),
    "qwen3.5-4b": _q35(2560, 9216, 32, 16, 4, 32, True),
    "qwen3.5-9b": _q35(4096, 12288, 32, 16, 4, 32, False),
    "qwen3.5-27b": _q35(5120, 17408, 64, 24, 4, 48, False),
    #                               hidden L   heads kv value_heads experts k  expert_inter
    "qwen3.5-35b-a3b": _q35_moe(2048, 40, 16, 2, 32, 256, 8, 512),
    "qwen3.5-122b-a10b": _q35_moe(3072, 48, 32, 2, 64, 256, 8, 1024),
    "qwen3.5-397b-a17b": _q35_moe(4096, 60, 32, 2, 64, 512, 10, 1024),
}
