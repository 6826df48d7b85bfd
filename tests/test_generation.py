"""KV-cache generation: cache logits vs full recomputation (itself checked against HF), batching,
HF's logits processors in closed form, stop strings, the output filter and streaming."""
import functools

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from conftest import MODELS, fixture_path, reference
from mindqwen import QwenConfig, QwenForCausalLM, apply_lora, from_pretrained, merge_lora
from mindqwen.generation import (GenerationConfig, Generator, OutputFilter, SlotBatch, cache_length,
                                 choose_token, generate, process_logits, softmax)
from mindqwen.lora import LoraConfig, lora_layers
from mindqwen.models.kv_cache import CachedStep, CacheLayout


@functools.lru_cache(maxsize=None)
def shared_base(name):
    """The fixture model, loaded once for the tests here that only generate from it (generation
    changes no weight or cell; it leaves the model in inference mode), so they also share its
    compiled graphs; a test that changes a model loads its own."""
    return from_pretrained(fixture_path(name, "base"))


def _cached_logits(model, ids, mask, new_tokens):
    """Prefill a left-padded batch, then feed ``new_tokens`` (B, N) one at a time: logits per step."""
    b, s = ids.shape
    layout = CacheLayout.of(model.config, b, s + new_tokens.shape[1] + 3)
    slots = np.zeros((b, layout.max_len), np.int32)
    slots[:, :s] = mask
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    step = CachedStep(model)
    out, k, v = step(Tensor(ids), Tensor(pos), Tensor(slots), Tensor(np.tile(np.arange(s, dtype=np.int32), (b, 1))),
                     layout.zeros(), layout.zeros())
    logits = [out.asnumpy()]
    nxt = pos[:, -1:] + 1
    for i in range(new_tokens.shape[1]):
        slots[:, s + i] = 1
        out, k, v = step(Tensor(new_tokens[:, i:i + 1]), Tensor(nxt + i), Tensor(slots),
                         Tensor(np.full((b, 1), s + i, np.int32)), k, v)
        logits.append(out.asnumpy())
    return logits


def _full_logits(model, ids, mask, new_tokens):
    logits = []
    for i in range(new_tokens.shape[1] + 1):
        full = np.concatenate([ids, new_tokens[:, :i]], 1)
        full_mask = np.concatenate([mask, np.ones((len(ids), i), np.int32)], 1)
        logits.append(model(Tensor(full), Tensor(full_mask)).asnumpy()[:, -1])
    return logits


def _padded_batch(vocab, rng):
    ids = rng.integers(0, vocab, (3, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :8] = 0  # a one-token prompt
    return ids, mask


@pytest.mark.parametrize("name", MODELS)
def test_kv_cache_logits_equal_full_recompute(name):
    """Graph-mode cache steps (what ``generate`` runs) vs the eager full forward."""
    model = from_pretrained(fixture_path(name, "base"))
    rng = np.random.default_rng(3)
    ids, mask = _padded_batch(model.config.vocab_size, rng)
    new = rng.integers(0, model.config.vocab_size, (3, 5)).astype(np.int32)
    full = _full_logits(model, ids, mask, new)
    ms.set_context(mode=ms.GRAPH_MODE)
    cached = _cached_logits(model, ids, mask, new)
    diff = max(float(np.abs(c - f).max()) for c, f in zip(cached, full))
    print(f"{name}: KV cache vs full recompute, max |Δlogit| over 6 steps = {diff:.1e}")
    assert diff <= 1e-5


def test_kv_cache_sliding_window_equals_full_recompute():
    cfg = QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     use_sliding_window=True, sliding_window=4, max_window_layers=1)
    model = QwenForCausalLM(cfg)
    model.set_train(False)
    rng = np.random.default_rng(4)
    ids, mask = _padded_batch(cfg.vocab_size, rng)
    new = rng.integers(0, cfg.vocab_size, (3, 6)).astype(np.int32)
    cached, full = _cached_logits(model, ids, mask, new), _full_logits(model, ids, mask, new)
    assert max(float(np.abs(c - f).max()) for c, f in zip(cached, full)) <= 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_batched_left_padded_generation_equals_rows(name):
    model = shared_base(name)
    ref = reference(name)["input_ids"]
    prompts = [ref[0, :16].tolist(), ref[1, :5].tolist(), ref[1, 7:16].tolist()]
    batched = generate(model, prompts, max_new_tokens=8)
    assert batched.shape == (3, 16 + 8) and batched.dtype == np.int32
    for i, p in enumerate(prompts):
        alone = generate(model, [p], max_new_tokens=8)
        assert np.array_equal(batched[i, 16 - len(p):], alone[0]), i
        assert (batched[i, :16 - len(p)] == 0).all()


@pytest.mark.parametrize("name", MODELS)
def test_rows_joining_and_leaving_a_running_batch_compute_what_they_compute_alone(name):
    """Continuous batching: A decodes; B (a prompt longer than A's tokens so far, so the two
    rows write at different slots) joins after two steps; C and D join one step later; D is cancelled after
    three tokens. A reproduces HF's greedy tokens, C's first log-probabilities HF's logits, and B
    and C every token and log-probability of their single-row runs (≤ 1e-5)."""
    model = shared_base(name)
    ref = reference(name)
    ids, hf_tokens = ref["input_ids"], ref["gen_ids"][0, 16:].tolist()
    prompts = {"A": ref["gen_ids"][0, :16].tolist(), "B": np.concatenate([ids[1], ids[0], ids[1, :8]]).tolist(),
               "C": ids[1, :5].tolist(), "D": ids[1, :9].tolist()}
    configs = {"A": GenerationConfig(max_new_tokens=len(hf_tokens)),
               "B": GenerationConfig(max_new_tokens=6, top_logprobs=2),
               "C": GenerationConfig(max_new_tokens=12, top_logprobs=2), "D": GenerationConfig(max_new_tokens=30)}
    generator, tokens = Generator(model), {k: [] for k in prompts}
    batch = generator.batch(max_rows=4)

    def join(*keys):
        batch.join([prompts[k] for k in keys], [configs[k] for k in keys], keys,
                   lambda key, tok, _text: tokens[key].append(tok))

    def step():
        batch.step(lambda key, tok, _text: tokens[key].append(tok), lambda key: key == "D" and len(tokens["D"]) == 3)
        rows = len(batch.rows)
        assert rows == 0 or (rows & (rows - 1) == 0 and batch.mask.shape[1] == cache_length(batch.mask.shape[1]))
    with generator.graph_mode():
        join("A")
        step(), step()
        join("B")
        assert {r.owner: r.slot for r in batch.active} == {"A": 18, "B": len(prompts["B"])}  # own pointers
        step()
        join("C", "D")
        while batch.active:
            step()
    done = {row.owner: row for row in batch.pop_finished()}
    assert sorted(done) == ["A", "B", "C", "D"] and not batch.rows
    assert done["A"].tokens == tokens["A"] == hf_tokens
    assert done["D"].finish == "cancelled" and done["D"].tokens == tokens["D"] and len(tokens["D"]) == 3
    hf_first = ref["logits"][1, 4].astype(np.float64)
    hf_first = hf_first - hf_first.max() - np.log(np.exp(hf_first - hf_first.max()).sum())
    assert abs(done["C"].logprobs[0][1] - hf_first[done["C"].tokens[0]]) < 1e-4
    for key in "BC":
        alone = generator.run([prompts[key]], configs[key])[0]
        assert done[key].tokens == tokens[key] == alone.tokens, key
        for (tok, lp, top), (tok_a, lp_a, top_a) in zip(done[key].logprobs, alone.logprobs):
            assert tok == tok_a and abs(lp - lp_a) < 1e-5 and [t for t, _ in top] == [t for t, _ in top_a], key
            assert np.allclose([p for _, p in top], [p for _, p in top_a], atol=1e-5), key


def test_lora_generation_equals_merged():
    model = from_pretrained(fixture_path("qwen2_tiny", "base"))
    apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    rng = np.random.default_rng(0)
    for layer in lora_layers(model).values():  # B is zero at init: make the adapter count
        layer.lora_b.set_data(Tensor(rng.normal(0, 0.2, layer.lora_b.shape).astype(np.float32)))
    prompt = reference("qwen2_tiny")["input_ids"][:1, :12]
    unmerged = generate(model, prompt, max_new_tokens=6)
    merge_lora(model)
    assert np.array_equal(generate(model, prompt, max_new_tokens=6), unmerged)


def test_generators_over_one_model_share_its_compiled_steps_until_surgery():
    """A second Generator (another tokenizer or filter) runs the graphs the first compiled; after
    surgery anywhere in the model (new LoRA cells, a merge, a re-stamped layer) a new Generator
    gets fresh ones (test_lora_generation_equals_merged checks what they compute)."""
    from mindqwen.models.graph import invalidate_compiled_graphs
    model = from_pretrained(fixture_path("qwen2_tiny", "base"))
    first = Generator(model)
    again = Generator(model, LetterTokenizer(), OutputFilter(["x"]))
    assert again.steps.prefill is first.steps.prefill and again.steps.decode is first.steps.decode
    seen = [first.steps.prefill]
    for surgery in (lambda: apply_lora(model, LoraConfig(r=4)), lambda: merge_lora(model),
                    lambda: invalidate_compiled_graphs(model.model.layers[1])):
        surgery()
        fresh = Generator(model)
        assert all(fresh.steps.prefill is not old for old in seen)
        assert Generator(model).steps.decode is fresh.steps.decode
        seen.append(fresh.steps.prefill)


def test_evaluation_batches_of_equal_rows_answer_what_each_prompt_answers_alone(monkeypatch):
    """Five prompts at batch_size 2: three batches of two cache rows (the last one's second row
    free), so one decode shape; each answer is the prompt's own greedy continuation, cut at its
    first EOS."""
    from mindqwen.data.tokenizer import ByteTokenizer
    from mindqwen.evaluate import answer
    model, tok = shared_base("qwen2_tiny"), ByteTokenizer()
    prompts = ["ab", "hello", "xyz q", "0", "tiny model"]
    rows, step = set(), SlotBatch.step
    monkeypatch.setattr(SlotBatch, "step", lambda self, *a, **k: (rows.add(len(self.rows)), step(self, *a, **k))[1])
    answers = answer(model, tok, prompts, max_new_tokens=5, batch_size=2)
    assert rows == {2}
    monkeypatch.undo()
    for prompt, got in zip(prompts, answers):
        alone = generate(model, [tok.encode(prompt)], max_new_tokens=5)[0, len(tok.encode(prompt)):].tolist()
        assert got == tok.decode(alone[:alone.index(0)] if 0 in alone else alone), prompt
    assert answer(model, tok, [], max_new_tokens=5) == []


def test_eos_stops_each_row_and_pads():
    model = shared_base("qwen2_tiny")
    gen = reference("qwen2_tiny")["gen_ids"]
    eos = int(gen[0, 16 + 2])
    out = generate(model, gen[:1, :16], max_new_tokens=8, eos_token_id=[999, eos], pad_token_id=7)
    assert np.array_equal(out[0, :19], gen[0, :19]) and out.shape[1] == 19


# HF's processors in closed form on a 6-token vocabulary.
LOGITS = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], np.float32)


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    out = process_logits(LOGITS, np.array([0, 1, 1]), GenerationConfig(repetition_penalty=2.0))
    assert np.allclose(out, [1.0, -2.0, 0.5, 3.0, -2.0, 1.0])


def test_top_k_and_top_p_keep_the_closed_form_sets():
    keep = np.isfinite(process_logits(LOGITS, np.array([]), GenerationConfig(do_sample=True, top_k=2)))
    assert keep.tolist() == [True, False, False, True, False, False]
    p = softmax(LOGITS.astype(np.float64))
    order = np.argsort(-p)  # 3, 0, 5, 2, 1, 4
    top_p = float(p[order[:2]].sum()) - 1e-6  # the two most likely tokens already exceed it
    keep = np.isfinite(process_logits(LOGITS, np.array([]), GenerationConfig(do_sample=True, top_p=top_p)))
    assert sorted(np.flatnonzero(keep)) == sorted(order[:2])
    keep = np.isfinite(process_logits(LOGITS, np.array([]), GenerationConfig(do_sample=True, top_p=1e-3)))
    assert np.flatnonzero(keep).tolist() == [3]  # at least one token is always kept


def test_sampling_follows_the_tempered_distribution():
    config = GenerationConfig(do_sample=True, temperature=2.0)
    rng = np.random.default_rng(0)
    scores = process_logits(LOGITS, np.array([]), config)
    draws = np.bincount([choose_token(scores, config, rng) for _ in range(20000)], minlength=6) / 20000
    expected = softmax(LOGITS.astype(np.float64) / 2.0)
    assert np.abs(draws - expected).max() < 0.015  # ~4 standard errors at n = 20000
    greedy_like = GenerationConfig(do_sample=True, top_k=1)
    assert choose_token(process_logits(LOGITS, np.array([]), greedy_like), greedy_like, rng) == 3


def test_seeded_sampling_is_reproducible_and_greedy_with_top_k_1():
    model = shared_base("qwen3_tiny")
    ref = reference("qwen3_tiny")
    prompt = ref["input_ids"][:1, :16]
    a = generate(model, prompt, max_new_tokens=8, do_sample=True, temperature=1.5, seed=11)
    b = generate(model, prompt, max_new_tokens=8, do_sample=True, temperature=1.5, seed=11)
    assert np.array_equal(a, b)
    assert np.array_equal(generate(model, prompt, max_new_tokens=8, do_sample=True, top_k=1, seed=5),
                          ref["gen_ids"])


def test_generation_names_what_it_needs_of_a_model():
    from mindspore import nn
    from mindqwen.models.kv_cache import CachedLM, ImageConditionedLM
    model = shared_base("qwen2_tiny")
    assert isinstance(model, CachedLM) and not isinstance(model, ImageConditionedLM)
    assert model.cache_dtype == ms.float32
    with pytest.raises(TypeError, match="CachedLM"):
        Generator(nn.Dense(2, 2))


def test_invalid_generation_config_names_the_field():
    for kwargs, field in (({"top_p": 0.0}, "top_p"), ({"temperature": 0}, "temperature"),
                          ({"max_new_tokens": -1}, "max_new_tokens"), ({"top_k": -2}, "top_k")):
        with pytest.raises(ValueError, match=field):
            GenerationConfig(**kwargs)


class LetterTokenizer:
    """Test double: token i is the letter chr(97 + i % 26); id 0 is EOS."""

    eos_token_id = 0

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def _texts(model, tokenizer, output_filter=None, **kwargs):
    deltas = []
    gen = Generator(model, tokenizer, output_filter)
    row = gen.run([reference("qwen2_tiny")["input_ids"][0, :16].tolist()],
                  GenerationConfig(max_new_tokens=8, **kwargs), on_token=lambda r, t, d: deltas.append(d))[0]
    return row, "".join(deltas)


def test_stop_strings_and_streaming():
    model = shared_base("qwen2_tiny")
    full, streamed = _texts(model, LetterTokenizer())
    assert streamed == full.text and len(full.tokens) == 8 and full.finish_reason == "length"
    stop = full.text[3:5]
    row, streamed = _texts(model, LetterTokenizer(), stop_strings=[stop])
    assert row.text == full.text[:full.text.index(stop) + 2] == streamed
    assert row.finish_reason == "stop" and row.tokens == full.tokens[:len(row.text)]


@pytest.mark.parametrize("action", ["mask", "drop", "stop"])
def test_output_filter_actions(action):
    model = shared_base("qwen2_tiny")
    full, _ = _texts(model, LetterTokenizer())
    blocked = full.text[2:4]
    row, streamed = _texts(model, LetterTokenizer(), OutputFilter([blocked], action))
    expected = {"mask": full.text.replace(blocked, "**"), "drop": full.text.replace(blocked, ""),
                "stop": full.text[:full.text.index(blocked)]}[action]
    assert row.text == expected and streamed == expected
    assert row.finish_reason == ("content_filter" if action == "stop" else "length")


def test_output_filter_patterns_and_errors():
    f = OutputFilter(["re:[0-9]{3}", "secret"], "mask")
    assert f.apply("call 555 now, secret!") == ("call *** now, ******!", False)
    with pytest.raises(ValueError, match="action"):
        OutputFilter(["x"], "erase")
    with pytest.raises(ValueError, match=r"re:\("):
        OutputFilter(["re:("])
