"""lm-evaluation-harness through mindqwen (``MindQwenLM``), against the harness's own ``hf`` backend
running transformers + PEFT on the same golden model (tests/fixtures/harness/make_hf_golden.py):
per-request log-likelihoods and is_greedy flags, rolling log-likelihoods, generated texts and the
scores, on local tasks (multiple choice, one-token letters, greedy continuations, rolling
perplexity, generate-until with a stop sequence), zero-shot, few-shot, with the PEFT adapter and
with the chat template and few-shot as multi-turn."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local JSON tasks only; never the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="mindqwen-test-datasets-"))

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from conftest import fixture_path  # noqa: E402
from mindqwen import from_pretrained, load_adapter  # noqa: E402
from mindqwen.harness import BUCKETS, MindQwenLM, evaluate_tasks, length_bucket, scores  # noqa: E402
from mindqwen.lora import merge_and_unload  # noqa: E402

sys.path.insert(0, fixture_path("harness"))
from make_hf_golden import TASKS, task_folder  # noqa: E402

with open(fixture_path("harness", "hf_golden.json"), encoding="utf-8") as f:
    GOLDEN = json.load(f)
TOKENIZER = fixture_path("harness", "tokenizer")
BASE, ADAPTER = fixture_path("qwen2_tiny", "base"), fixture_path("qwen2_tiny", "lora_adapter")
LL_TOL = 1e-4  # a request's summed log-prob (a few tokens): fp32 noise is ~1e-5
ROLLING_TOL = 1e-4  # relative, for a document's sum over up to ~1,000 tokens
RUNS = {"base": {}, "fewshot": {"num_fewshot": 2},
        "chat": {"num_fewshot": 2, "apply_chat_template": True, "fewshot_as_multiturn": True}}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return task_folder(str(tmp_path_factory.mktemp("tasks")), stop=GOLDEN["stop"])


@pytest.fixture(scope="module")
def base_lm():
    return MindQwenLM(BASE, tokenizer=TOKENIZER, batch_size=4)


@pytest.fixture(scope="module")
def adapter_results(tasks):
    lm = MindQwenLM(BASE, tokenizer=TOKENIZER, adapter=ADAPTER, batch_size=4)
    return evaluate_tasks(lm, list(TASKS), include_path=tasks, log_samples=True)


def responses(results) -> dict:
    """{task: [each request's response, per doc]} in doc order."""
    return {task: [[r[0] if isinstance(r, list) and len(r) == 1 else r for r in s["resps"]]
                   for s in sorted(samples, key=lambda s: s["doc_id"])] for task, samples in results["samples"].items()}


def assert_same(ours: dict, ref: dict, ours_scores: dict, ref_scores: dict) -> None:
    """Every request and score of ``ours`` as ``ref`` (the golden's key spelling: ``acc,none``)."""
    for task, docs in ref.items():
        kind = TASKS[task]["output_type"]
        for doc, (mine, theirs) in enumerate(zip(ours[task], docs)):
            where = f"{task} doc {doc}"
            if kind == "generate_until":
                assert mine == theirs, where
            elif kind == "loglikelihood_rolling":
                assert abs(mine[0] - theirs[0]) <= ROLLING_TOL * abs(theirs[0]), (where, mine, theirs)
            else:
                assert len(mine) == len(theirs), where
                for (ll, greedy), (ll_ref, greedy_ref) in zip(mine, theirs):
                    assert abs(ll - ll_ref) <= LL_TOL and greedy == greedy_ref, (where, mine, theirs)
        for metric, value in ours_scores[task].items():
            expected = ref_scores[task].get(metric + ",none", ref_scores[task].get(metric))
            if "perplexity" in metric or "bits" in metric:
                assert value == pytest.approx(expected, rel=1e-4), (task, metric)
            elif expected is not None:
                assert value == expected, (task, metric)  # accuracies: the same answers


@pytest.mark.parametrize("run", RUNS)
def test_requests_and_scores_equal_the_hf_backend(run, base_lm, tasks):
    names = [t for t in TASKS if run == "base" or t != "mq_rolling"]  # few-shot and chat leave documents as is
    results = evaluate_tasks(base_lm, names, include_path=tasks, log_samples=True, **RUNS[run])
    gold = GOLDEN["runs"][run]
    assert_same(responses(results), {t: gold["requests"][t] for t in names}, scores(results), gold["scores"])
    if run == "base":  # the golden's is_greedy flags are not all alike: the check can fail
        flags = [g for doc in gold["requests"]["mq_greedy"] for _, g in doc]
        assert any(flags) and not all(flags)


def test_adapter_requests_equal_hf_with_peft(adapter_results):
    gold = GOLDEN["runs"]["adapter"]
    assert_same(responses(adapter_results), gold["requests"], scores(adapter_results), gold["scores"])


def test_an_adapter_scores_as_its_merge(adapter_results, tasks):
    merged = merge_and_unload(load_adapter(from_pretrained(BASE), ADAPTER))
    names = ["mq_greedy", "mq_until"]  # log-likelihoods and generation, on short rows (few graphs)
    results = evaluate_tasks(MindQwenLM(merged, tokenizer=TOKENIZER, batch_size=4), names,
                             include_path=tasks, log_samples=True)
    assert_same(responses(results), {t: responses(adapter_results)[t] for t in names}, scores(results),
                {t: {k + ",none": v for k, v in m.items()} for t, m in scores(adapter_results).items()})


def test_the_harness_finds_mindqwen_by_name():
    from lm_eval.api.registry import get_model
    lm = get_model("mindqwen").create_from_arg_string(f"pretrained={BASE},tokenizer={TOKENIZER},adapter={ADAPTER}",
                                                      {"batch_size": 4, "device": "cpu"})
    assert isinstance(lm, MindQwenLM) and lm.batch_size == 4 and lm.max_length == 256
    assert any(p.name.endswith("lora_a") for p in lm.model.get_parameters())  # the adapter is on


def test_sampling_follows_the_seed(base_lm):
    settings = {"until": ["\n\n"], "do_sample": True, "temperature": 1.0, "max_gen_toks": 12}
    requests = [Instance("generate_until", {}, (f"Say: word {i}\n", dict(settings)), i) for i in range(3)]
    first, again = base_lm.generate_until(requests, True), base_lm.generate_until(requests, True)
    greedy = base_lm.generate_until([Instance("generate_until", {}, (r.args[0], {"until": ["\n\n"],
                                     "max_gen_toks": 12}), 0) for r in requests], True)
    base_lm.seed += 1
    other = base_lm.generate_until(requests, True)
    base_lm.seed -= 1
    assert first == again and other != first and greedy != first


def test_a_multimodal_model_is_scored_on_its_text_path():
    from mindqwen.multimodal.fusion import MultimodalQwen
    from mindqwen.multimodal.vision import VisionConfig
    lm = from_pretrained(BASE)
    vision = VisionConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=32)
    model = MultimodalQwen(lm, vision, [0], image_token_id=3)
    assert MindQwenLM(model, tokenizer=TOKENIZER).model is lm
    ids = ms.Tensor(np.array([[5, 9, 40, 7, 200, 11]], np.int32))
    pixels = ms.Tensor(np.random.default_rng(0).normal(size=(1, 3, 8, 8)).astype(np.float32))
    with _pynative():  # the cross-attention leaves image-free text as is
        np.testing.assert_array_equal(model(ids, pixels).asnumpy(), lm(ids).asnumpy())
    with pytest.raises(ValueError, match="no text-only path"):
        MindQwenLM(MultimodalQwen(lm, vision, [0], image_token_id=None), tokenizer=TOKENIZER)


def _pynative():
    from mindqwen.models.graph import in_mode
    return in_mode(ms.PYNATIVE_MODE)


def test_outside_a_git_repository_evaluation_prints_no_git_error(base_lm, tasks, tmp_path, monkeypatch, capfd):
    """lm-eval probes the working directory's git commit with ``git describe``; outside a
    repository git's ``fatal: not a git repository`` must not reach the user's terminal."""
    from lm_eval import evaluator
    monkeypatch.chdir(tmp_path)
    probe = evaluator.get_git_commit_hash
    probe()  # the harness's own probe prints it here (the check below is not vacuous)
    assert "not a git repository" in capfd.readouterr().err
    results = evaluate_tasks(base_lm, ["mq_greedy"], limit=2, include_path=tasks)
    assert "not a git repository" not in capfd.readouterr().err
    assert results["git_hash"] is None and evaluator.get_git_commit_hash is probe  # recorded as before; restored


def test_rows_are_padded_to_few_lengths():
    assert [length_bucket(n, 256) for n in (1, 32, 33, 100, 200, 256)] == [16, 32, 48, 112, 224, 256]
    assert length_bucket(5000, 32768) == 8192 and length_bucket(300, 300) == 300
    steps = [b / a for a, b in zip(BUCKETS, BUCKETS[1:]) if a >= 64]
    assert max(steps) <= 1.25 and list(BUCKETS) == sorted(BUCKETS)


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "mindqwen", "eval", *args], capture_output=True, text=True,
                          env={**os.environ, "GLOG_v": "3"}, timeout=600, cwd=cwd)


def test_eval_command_writes_results(tasks, tmp_path):
    out = tmp_path / "results.json"
    r = cli(BASE, "--tokenizer", TOKENIZER, "--tasks", "mq_greedy", "--include-path", tasks,
            "--batch-size", "4", "--output", str(out), "--log-samples")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mq_greedy" in r.stdout and "acc" in r.stdout
    results = json.loads(out.read_text())
    gold = GOLDEN["runs"]["base"]
    assert results["results"]["mq_greedy"]["acc,none"] == gold["scores"]["mq_greedy"]["acc,none"]
    assert_same(responses(results), {"mq_greedy": gold["requests"]["mq_greedy"]}, scores(results), gold["scores"])


@pytest.mark.parametrize("args, message", [
    (["--tasks", "mq_choice,no_such_task"], "unknown task: no_such_task"),
    (["--tasks", "mq_choice", "--limit", "0"], "limit must be > 0"),
    (["--tasks", "mq_choice", "MODEL=broken"], "broken"),
])
def test_eval_command_refuses_bad_input_in_one_line(args, message, tasks, tmp_path):
    model = BASE
    if "MODEL=broken" in args:  # a folder whose weights do not load
        model = str(tmp_path / "broken")
        shutil.copytree(BASE, model)
        (tmp_path / "broken" / "model.safetensors").write_bytes(b"not a safetensors file")
        args = [a for a in args if a != "MODEL=broken"]
    r = cli(model, "--tokenizer", TOKENIZER, "--include-path", tasks, *args)
    lines = [line for line in r.stderr.splitlines() if line.startswith("mindqwen eval: error:")]
    assert r.returncode == 1 and len(lines) == 1 and message in lines[0], r.stderr[-2000:]


def test_eval_on_own_data_reads_any_tokenizer(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say: word {i}\n", "response": "word"}) + "\n" for i in range(4)))
    r = cli(BASE, "--data", str(data), "--tokenizer", TOKENIZER, "--seq-length", "32")
    assert r.returncode == 0 and "loss" in r.stdout and "exact match" in r.stdout, r.stderr[-2000:]
    r = cli(BASE, "--data", str(data))  # the model folder has no tokenizer, and none is given
    assert r.returncode == 1 and "needs a tokenizer" in r.stderr.splitlines()[-1], r.stderr[-2000:]


def test_a_recipe_eval_section_scores_the_trained_model(tasks, tmp_path):
    """Training at lr 1e-9 leaves the base model's answers: the summary's scores are the golden's
    on the first 4 documents (the limit)."""
    from mindqwen.tasks import train_recipe
    from mindqwen.train.recipe import RecipeError, load_recipe
    checkpoint = tmp_path / "model"
    shutil.copytree(BASE, checkpoint)
    for name in os.listdir(TOKENIZER):  # the checkpoint's own tokenizer: what eval reads text with
        shutil.copy(os.path.join(TOKENIZER, name), checkpoint / name)
    np.save(tmp_path / "train.npy", np.random.default_rng(0).integers(3, 500, (4, 16)).astype(np.int32))
    settings = [f"model.checkpoint={checkpoint}", f"data.train={tmp_path / 'train.npy'}", "data.eval=null",
                "data.synthetic=null", "data.seq_length=16", "pretrain=null", "model.config={}", "export.enabled=false",
                "trainer.max_steps=1", "trainer.lr=1e-9", "trainer.warmup_steps=0", "trainer.micro_batch_size=2",
                "trainer.progress=false", f"trainer.output_dir={tmp_path / 'run'}",
                f"eval={{tasks: [mq_choice, mq_greedy], include_path: {tasks}, limit: 4, batch_size: 4}}"]
    summary = train_recipe(load_recipe("demo/demo", settings))
    gold = GOLDEN["runs"]["base"]["requests"]
    with open(fixture_path("harness", "data", "choice_test.jsonl")) as f:
        labels = [json.loads(line)["label"] for line in f][:4]
    choice = np.mean([np.argmax([ll for ll, _ in doc]) == label for doc, label in zip(gold["mq_choice"], labels)])
    greedy = np.mean([doc[0][1] for doc in gold["mq_greedy"][:4]])
    assert summary["eval"]["mq_choice"]["acc"] == choice and summary["eval"]["mq_greedy"]["acc"] == greedy
    with open(tmp_path / "run" / "summary.json") as f:
        assert json.load(f)["eval"] == summary["eval"]
    with pytest.raises(RecipeError, match="eval: unknown task: nope"):
        train_recipe(load_recipe("demo/demo", settings + ["eval.tasks=[nope]"]))


def test_one_token_answers_share_one_row(base_lm, monkeypatch):
    """Four one-token answers after one context: one row scored, each answer read off the
    distribution after its last position; the values are those of each request alone."""
    batches = []
    score_rows = base_lm._score_rows
    monkeypatch.setattr(base_lm, "_score_rows", lambda rows: batches.append(len(rows)) or score_rows(rows))
    context = base_lm.tok_encode("Question: which one?\nAnswer:")
    answers = [base_lm.tok_encode(w) for w in (" A", " B", " the", " a")]
    assert all(len(a) == 1 for a in answers)
    together = base_lm._loglikelihood_tokens([(None, context, a) for a in answers], True)
    assert batches == [1]
    alone = [base_lm._loglikelihood_tokens([(None, context, a)], True)[0] for a in answers]
    assert [g for _, g in together] == [g for _, g in alone]
    np.testing.assert_allclose([ll for ll, _ in together], [ll for ll, _ in alone], rtol=0, atol=1e-5)


def test_edge_requests_templates_and_lengths(base_lm):
    """An empty continuation scores log 1 and greedy; a continued final message stops where its
    text ends in the built-in template; a template that refuses system turns is tried without
    them; a context length past the model's positions is refused."""
    assert base_lm._loglikelihood_tokens([(None, [5, 6], [])], True) == [(0.0, True)]
    plain = MindQwenLM(base_lm.model, tokenizer=base_lm.tokenizer)  # no folder: the built-in template
    chat = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Sure"}]
    assert plain.apply_chat_template(chat, add_generation_prompt=False).endswith("<|im_start|>assistant\nSure")
    plain.template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
                      "{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    assert plain.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == "U|"
    with pytest.raises(ValueError, match="max_length must be in 2..256"):
        MindQwenLM(base_lm.model, tokenizer=base_lm.tokenizer, max_length=1024)
