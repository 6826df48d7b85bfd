"""Packed rows that know their samples: the packer records each sample's positions, and a packed
conversation's per-token losses equal the conversation run alone, whatever the tokenizer's EOS
(an instruct tokenizer's <|im_end|> ends every turn; a base tokenizer's is not in chat data at
all); ``data.reset_positions`` carries them through a recipe's training."""
import json
import shutil
import textwrap

import mindspore as ms
import numpy as np
import pytest

from mindqwen import QwenConfig, QwenForCausalLM
from mindqwen.config import IGNORE_INDEX
from mindqwen.data.chat import encode_chat
from mindqwen.data.instruct import pack_text
from mindqwen.data.loader import TokenDataset
from mindqwen.data.preprocess import load_packed, preprocess
from mindqwen.data.tokenizer import QwenTokenizer
from test_tokenizer import hf_folder  # noqa: F401  (fixture: a Qwen-style byte-level BPE, EOS <|endoftext|>)

SEQ = 192
TOL = 1e-5


def chats(n: int) -> list:
    """Two-turn conversations of several lengths, 60 to 80 tokens: two or three fit in a row."""
    return [[{"role": "system", "content": "Be brief."},
             {"role": "user", "content": f"question {i} " + "words " * (i % 4)},
             {"role": "assistant", "content": f"answer {i}" + " more" * (i % 3)},
             {"role": "user", "content": f"and then {i}?"},
             {"role": "assistant", "content": "done " * (1 + i % 2)}] for i in range(n)]


def write_sft(folder, name: str, tokenizer_folder: str, records: list) -> str:
    path = folder / f"{name}.jsonl"
    path.write_text("\n".join(json.dumps({"messages": m}) for m in records) + "\n")
    preprocess([str(path)], str(folder / name), tokenizer_folder, SEQ, "sft", progress=False)
    return str(folder / name)


@pytest.fixture(scope="module")
def tokenizers(hf_folder, tmp_path_factory):  # noqa: F811
    """{"base": the fixture's folder, "instruct": the same vocabulary with EOS <|im_end|>}."""
    base = hf_folder[0]
    instruct = tmp_path_factory.mktemp("instruct_tok")
    for item in base.iterdir():
        shutil.copy(item, instruct / item.name)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.update(eos_token="<|im_end|>", pad_token="<|endoftext|>")  # as Qwen2.5-Instruct's
    (instruct / "tokenizer_config.json").write_text(json.dumps(config))
    return {"base": str(base), "instruct": str(instruct)}


def tiny_model(vocab_size: int) -> QwenForCausalLM:
    ms.set_seed(0)
    return QwenForCausalLM(QwenConfig(vocab_size=vocab_size, hidden_size=48, intermediate_size=80,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=SEQ))


def token_losses(model, ids, labels, positions=None) -> np.ndarray:
    """−log p(labels[t+1] | ids[:t+1]) (S−1,) float64 for one row, NaN where the label is ignored."""
    args = (None, None, ms.Tensor(positions[None])) if positions is not None else ()
    logits = model(ms.Tensor(ids[None]), *args).asnumpy()[0, :-1].astype(np.float64)  # (S−1, V)
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    target = labels[1:]
    out = -np.take_along_axis(log_probs, np.maximum(target, 0)[:, None], 1)[:, 0]
    return np.where(target == IGNORE_INDEX, np.nan, out)


@pytest.mark.parametrize("kind", ["instruct", "base"])
def test_a_packed_conversation_scores_as_it_does_alone(tokenizers, tmp_path, kind):
    tok = QwenTokenizer.from_pretrained(tokenizers[kind])
    data, _ = load_packed(write_sft(tmp_path, "sft", tokenizers[kind], chats(9)))
    ids, labels, positions = (np.asarray(a) for a in (data.input_ids, data.labels, data.position_ids))
    model = tiny_model(tok.vocab_size)
    eos = {int((encode_chat(c, tok)[0] == tok.eos_token_id).sum()) for c in chats(9)}
    assert eos == ({5} if kind == "instruct" else {0})  # an EOS guess would cut every turn, or nothing
    worst, differs, checked = 0.0, 0.0, 0
    for r in range(len(ids)):
        packed = token_losses(model, ids[r], labels[r], positions[r])
        plain = token_losses(model, ids[r], labels[r])
        starts = list(np.flatnonzero(positions[r] == 0)) + [SEQ]
        for a, b in zip(starts[:-1], starts[1:]):
            if (labels[r, a:b] == IGNORE_INDEX).all():  # the row's padding
                assert (ids[r, a:b] == tok.pad_token_id).all()
                continue
            np.testing.assert_array_equal(positions[r, a:b], np.arange(b - a))
            alone = token_losses(model, ids[r, a:b], labels[r, a:b])
            trained = ~np.isnan(alone)
            worst = max(worst, np.abs(packed[a:b - 1][trained] - alone[trained]).max())
            differs = max(differs, np.abs(plain[a:b - 1][trained] - alone[trained]).max())
            checked += 1
        # the training loss reads the same positions: the mean of the row's per-token losses
        loss = model(ms.Tensor(ids[r:r + 1]), None, ms.Tensor(labels[r:r + 1]), ms.Tensor(positions[r:r + 1]))
        assert abs(float(loss.asnumpy()) - np.nanmean(packed)) <= TOL
    print(f"{kind}: {checked} conversations in {len(ids)} rows; per-token loss packed vs alone "
          f"max |Δ| {worst:.1e}, without positions {differs:.1e}")
    assert checked == 9 and len(ids) < 9  # every conversation found, several to a row
    assert worst <= TOL and differs > 1e-3


def test_packers_record_where_every_sample_starts(tokenizers, tmp_path):
    """Text is cut into rows: a document restarts at 0, and so does a row it continues in; the
    padding at the end is a sample of its own. A recipe's ``.txt`` text is packed alike."""
    tok = QwenTokenizer.from_pretrained(tokenizers["base"])
    docs = ["Hello world! " * (1 + i % 5) for i in range(12)]
    path = tmp_path / "text.jsonl"
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    preprocess([str(path)], str(tmp_path / "text"), tokenizers["base"], 32, "text", progress=False)
    data, _ = load_packed(str(tmp_path / "text"))
    document = np.concatenate([[i] * (len(tok.encode(d)) + 1) for i, d in enumerate(docs)])  # + EOS
    document = np.concatenate([document, [-1] * (data.input_ids.size - len(document))]).reshape(-1, 32)
    expected = np.zeros_like(document)
    for r, t in np.ndindex(*document.shape):  # tokens of the same document before it, in its row
        expected[r, t] = expected[r, t - 1] + 1 if t and document[r, t] == document[r, t - 1] else 0
    assert (expected[1:, 0] == 0).all() and (document[1:, 0] == document[:-1, -1]).any()  # a cut document
    np.testing.assert_array_equal(data.position_ids, expected)
    text = pack_text(docs, tok, 32)  # a recipe's .txt pretraining text: the same rows, the tail dropped
    np.testing.assert_array_equal(text.position_ids, expected[:len(text)])
    assert data.columns == ["input_ids", "labels", "position_ids"]
    assert [a.shape for a in data.rows(np.arange(2))] == [(2, 32)] * 3


RECIPE = textwrap.dedent("""\
    model:
      config: {vocab_size: VOCAB, hidden_size: 48, intermediate_size: 80, num_hidden_layers: 2,
               num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 192}
    data: {train: TRAIN, eval: TRAIN, seq_length: 192, reset_positions: true}
    trainer: {max_steps: 2, micro_batch_size: 2, lr: 1.0e-3, warmup_steps: 0, progress: false, output_dir: OUT}
    """)


def test_reset_positions_trains_a_recipe_on_the_packed_samples(tokenizers, tmp_path):
    """``mindqwen train`` of a recipe with packed chat data: the first step's loss is the loss
    of its batch with the recorded positions (and not the loss without them)."""
    from mindqwen.data.loader import BatchLoader
    from mindqwen.tasks import task_for, train_recipe, validate_recipe
    from mindqwen.train.recipe import RecipeError, load_recipe
    tok = QwenTokenizer.from_pretrained(tokenizers["instruct"])
    folder = write_sft(tmp_path, "sft", tokenizers["instruct"], chats(12))
    path = tmp_path / "packed.yaml"
    path.write_text(RECIPE.replace("VOCAB", str(tok.vocab_size)).replace("TRAIN", folder)
                    .replace("OUT", str(tmp_path / "run")))
    recipe = load_recipe(str(path))
    summary = train_recipe(recipe, source=str(path))
    first = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert np.isfinite(summary["train"]["eval_loss"])

    ms.set_seed(recipe.trainer.seed)  # the run's model before its first step, and its first batch
    model = task_for(recipe).build(None)
    data, _ = load_packed(folder)
    batch = BatchLoader(data, 2, recipe.trainer.seed).batch(0)
    ids, labels, positions = (ms.Tensor(a) for a in batch)
    with_positions = float(model(ids, None, labels, positions).asnumpy())
    without = float(model(ids, None, labels).asnumpy())
    print(f"step 1 loss {first['loss']:.6f}; the batch's loss with positions {with_positions:.6f}, "
          f"without {without:.6f}")
    assert abs(first["loss"] - with_positions) <= 1e-5 < abs(first["loss"] - without)

    # rows that record no sample boundaries are refused in one line, naming the file
    np.save(tmp_path / "rows.npy", np.asarray(data.input_ids))
    with pytest.raises(RecipeError, match=r"packed\.yaml: data\.train: .*rows\.npy: these rows record no "
                                          r"sample boundaries"):
        validate_recipe(str(path), [f"data.train={tmp_path / 'rows.npy'}", f"trainer.output_dir={tmp_path / 'again'}"])
    assert TokenDataset(np.zeros((2, 4), np.int32)).columns == ["input_ids", "labels"]
