"""Parameter-name maps between HF (= mindqwen) and mindformers' two namings, and their fused
tensors: data only (``mindqwen.io.convert`` applies them).

Each map lists HF template → foreign template once; ``{i}`` is a layer index and ``{p}`` a
parameter kind (weight | bias). Reverse maps are derived by inversion. After renaming, q/k/v and
gate/up can be fused into one tensor (``FUSIONS``), contiguously ``[Q; K; V]`` or interleaved per
KV group ``[Q_g0; K_g0; V_g0; Q_g1; …]`` (gate/up: ``[gate; up]`` or alternating rows). Sources:
../shared/notes/anchors.md §2.4–2.5 (mindformers r1.8 ``convert_weight.py``, ``qwen3/utils.py``,
``TrainModelMixin.concat_qkv_*``).
"""

LEGACY = {  # mindformers LlamaForCausalLM (research/qwen2_5, use_legacy: True)
    "model.embed_tokens.weight": "model.tok_embeddings.embedding_weight",
    "model.layers.{i}.input_layernorm.weight": "model.layers.{i}.attention_norm.weight",
    "model.layers.{i}.self_attn.q_proj.{p}": "model.layers.{i}.attention.wq.{p}",
    "model.layers.{i}.self_attn.k_proj.{p}": "model.layers.{i}.attention.wk.{p}",
    "model.layers.{i}.self_attn.v_proj.{p}": "model.layers.{i}.attention.wv.{p}",
    "model.layers.{i}.self_attn.o_proj.{p}": "model.layers.{i}.attention.wo.{p}",
    "model.layers.{i}.self_attn.q_norm.weight": "model.layers.{i}.attention.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "model.layers.{i}.attention.k_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "model.layers.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "model.layers.{i}.feed_forward.w1.weight",
    "model.layers.{i}.mlp.down_proj.weight": "model.layers.{i}.feed_forward.w2.weight",
    "model.layers.{i}.mlp.up_proj.weight": "model.layers.{i}.feed_forward.w3.weight",
    "model.norm.weight": "model.norm_out.weight",
    "lm_head.weight": "lm_head.weight",
    # Qwen2-MoE (research/qwen2/convert_moe_weight.py); the routed experts: EXPERTS
    "model.layers.{i}.mlp.gate.weight": "model.layers.{i}.feed_forward.routed_experts.router.dense.weight",
    "model.layers.{i}.mlp.shared_expert.gate_proj.weight": "model.layers.{i}.feed_forward.shared_experts.w1.weight",
    "model.layers.{i}.mlp.shared_expert.down_proj.weight": "model.layers.{i}.feed_forward.shared_experts.w2.weight",
    "model.layers.{i}.mlp.shared_expert.up_proj.weight": "model.layers.{i}.feed_forward.shared_experts.w3.weight",
    "model.layers.{i}.mlp.shared_expert_gate.weight": "model.layers.{i}.feed_forward.shared_experts_gate.weight",
}
MCORE = {  # mindformers Qwen2/Qwen3 "Mcore" (use_legacy: False), before q/k/v and gate/up fusion
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.layers.{i}.input_layernorm.weight": "decoder.layers.{i}.input_layernorm.weight",
    "model.layers.{i}.self_attn.q_proj.{p}": "decoder.layers.{i}.self_attention.linear_q.{p}",
    "model.layers.{i}.self_attn.k_proj.{p}": "decoder.layers.{i}.self_attention.linear_k.{p}",
    "model.layers.{i}.self_attn.v_proj.{p}": "decoder.layers.{i}.self_attention.linear_v.{p}",
    "model.layers.{i}.self_attn.o_proj.{p}": "decoder.layers.{i}.self_attention.linear_proj.{p}",
    "model.layers.{i}.self_attn.q_norm.weight": "decoder.layers.{i}.self_attention.q_layernorm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "decoder.layers.{i}.self_attention.k_layernorm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "decoder.layers.{i}.pre_mlp_layernorm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "decoder.layers.{i}.mlp.gating.weight",
    "model.layers.{i}.mlp.up_proj.weight": "decoder.layers.{i}.mlp.hidden.weight",
    "model.layers.{i}.mlp.down_proj.weight": "decoder.layers.{i}.mlp.linear_fc2.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
    # Qwen3-MoE (mindformers/models/qwen3_moe/utils.py ``weight_mapping``); the routed experts: EXPERTS
    "model.layers.{i}.mlp.gate.weight": "decoder.layers.{i}.mlp.router.weight",
}
QWEN1 = {  # the original Qwen's own layout (modeling_qwen.py); c_attn fuses q/k/v contiguously
    "model.embed_tokens.weight": "transformer.wte.weight",
    "model.layers.{i}.input_layernorm.weight": "transformer.h.{i}.ln_1.weight",
    "model.layers.{i}.self_attn.q_proj.{p}": "transformer.h.{i}.attn.q.{p}",
    "model.layers.{i}.self_attn.k_proj.{p}": "transformer.h.{i}.attn.k.{p}",
    "model.layers.{i}.self_attn.v_proj.{p}": "transformer.h.{i}.attn.v.{p}",
    "model.layers.{i}.self_attn.o_proj.weight": "transformer.h.{i}.attn.c_proj.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "transformer.h.{i}.ln_2.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "transformer.h.{i}.mlp.w2.weight",  # a1 * silu(a2), a2 = w2(x)
    "model.layers.{i}.mlp.up_proj.weight": "transformer.h.{i}.mlp.w1.weight",
    "model.layers.{i}.mlp.down_proj.weight": "transformer.h.{i}.mlp.c_proj.weight",
    "model.norm.weight": "transformer.ln_f.weight",
    "lm_head.weight": "lm_head.weight",
}
MAPS = {"mindformers": LEGACY, "mindformers-mcore": MCORE, "qwen": QWEN1}
# format → [(fused template, [part templates], kind)]; kind "qkv" splits by KV group, "mlp" by rows
FUSIONS = {
    "mindformers": [("model.layers.{i}.attention.w_qkv.{p}", ["model.layers.{i}.attention.wq.{p}",
                     "model.layers.{i}.attention.wk.{p}", "model.layers.{i}.attention.wv.{p}"], "qkv"),
                    ("model.layers.{i}.feed_forward.w_gate_hidden.weight", ["model.layers.{i}.feed_forward.w1.weight",
                     "model.layers.{i}.feed_forward.w3.weight"], "mlp")],
    "mindformers-mcore": [("decoder.layers.{i}.self_attention.linear_qkv.{p}", [
                              "decoder.layers.{i}.self_attention.linear_q.{p}", "decoder.layers.{i}.self_attention.linear_k.{p}",
                              "decoder.layers.{i}.self_attention.linear_v.{p}"], "qkv"),
                          ("decoder.layers.{i}.mlp.linear_fc1.weight", ["decoder.layers.{i}.mlp.gating.weight",
                           "decoder.layers.{i}.mlp.hidden.weight"], "mlp")],
    "qwen": [("transformer.h.{i}.attn.c_attn.{p}", ["transformer.h.{i}.attn.q.{p}", "transformer.h.{i}.attn.k.{p}",
                                                    "transformer.h.{i}.attn.v.{p}"], "qkv")],
}

# Routed experts: HF stores each expert's projections (``mlp.experts.{e}.gate_proj.weight`` [I, H] …);
# mindformers stacks all experts of a layer into one tensor per entry below, each expert's HF parts
# concatenated along rows (gate before up) and transposed to [in, out]: [E, in, out] ("stack"), or
# flattened to [E·in, out] ("flat"). Sources: legacy, research/qwen2/convert_moe_weight.py
# (``use_gmm``); Mcore, mindformers r1.8 ``qwen3_moe`` ``concat_expert_weight`` and
# toolkit/weight_convert/qwen3_moe/reverse_mcore_qwen3_moe_weight_to_hf.py.
EXPERTS = {
    "qwen": [],
    # mindqwen's own parameters and .ckpt: one tensor per projection, [E, out, in] as HF's per expert
    "stacked": [("model.layers.{i}.mlp.experts.gate_proj.weight", ["gate_proj"], "own"),
                ("model.layers.{i}.mlp.experts.up_proj.weight", ["up_proj"], "own"),
                ("model.layers.{i}.mlp.experts.down_proj.weight", ["down_proj"], "own")],
    "mindformers": [("model.layers.{i}.feed_forward.routed_experts.ffn.w1.weight", ["gate_proj"], "stack"),
                    ("model.layers.{i}.feed_forward.routed_experts.ffn.w2.weight", ["down_proj"], "stack"),
                    ("model.layers.{i}.feed_forward.routed_experts.ffn.w3.weight", ["up_proj"], "stack")],
    "mindformers-mcore": [("decoder.layers.{i}.mlp.experts.weight1", ["gate_proj", "up_proj"], "flat"),
                          ("decoder.layers.{i}.mlp.experts.weight2", ["down_proj"], "flat")],
}
# The mindformers format of each mixture-of-experts family: the one mindformers has a model for
# (no Mcore Qwen2-MoE, no legacy Qwen3-MoE).
MOE_FORMATS = {"qwen2_moe": "mindformers", "qwen3_moe": "mindformers-mcore"}
