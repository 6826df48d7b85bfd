"""The graph-mode trainer: step, accumulation, overflow skip, AMP, schedules, resume, data parallel."""
import json
import os
import shutil
import signal
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from conftest import fixture_path
from mindqwen import LoraConfig, apply_lora, from_pretrained
from mindqwen.data.loader import BatchLoader, TokenDataset
from mindqwen.train import checkpoint
from mindqwen.train.config import TrainerConfig
from mindqwen.train.loop import TrainingDiverged, fit
from mindqwen.train.optim import WarmupSchedule, make_optimizer, param_groups, schedule_values
from mindqwen.train.precision import PrecisionConfig, apply_precision, make_loss_scaler
from mindqwen.train.step import Stepper

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "run_fit.py")
RNG_DATA = np.random.default_rng(0).integers(0, 512, (64, 24))


def lora_model(r=4):
    ms.set_seed(0)  # the same LoRA A init for every model a test compares
    return apply_lora(from_pretrained(fixture_path("qwen2_tiny", "base")), LoraConfig(r=r, lora_alpha=2 * r))


def batch(n=8, seq=24, seed=1):
    ids = np.random.default_rng(seed).integers(0, 512, (n, seq)).astype(np.int32)
    return ids


def run_steps(model, steps, micro, optimizer=None, precision=None, clip=1.0, ids=None, labels=None, lr=3e-3):
    precision = precision or PrecisionConfig()
    apply_precision(model, precision)
    optimizer = optimizer or make_optimizer(model.trainable_params(), WarmupSchedule("constant", lr, 100))
    scaler = make_loss_scaler(precision)
    stepper = Stepper(model, optimizer, scaler, micro, clip, precision.uses_loss_scaling)
    ids = batch() if ids is None else ids
    labels = ids if labels is None else labels
    chunks = zip(np.split(ids, micro), np.split(labels, micro))
    batches = [(ms.Tensor(i), ms.Tensor(l)) for i, l in chunks]
    out = [stepper(batches) for _ in range(steps)]
    return out, scaler


def unequal_labels(ids):
    """Labels of ``ids`` whose first half of rows carry 2 label tokens each and the rest all of
    theirs: micro-batches cut from them hold very different numbers of label tokens."""
    labels = ids.copy()
    labels[: len(ids) // 2, :-3] = -100
    return labels


def test_graph_steps_decrease_the_loss_and_match_pynative():
    losses = {}
    for mode in (ms.GRAPH_MODE, ms.PYNATIVE_MODE):
        ms.set_context(mode=mode)
        out, _ = run_steps(lora_model(), 5, 1)
        losses[mode] = np.array([o[0] for o in out])
    ms.set_context(mode=ms.PYNATIVE_MODE)
    g = losses[ms.GRAPH_MODE]
    assert g[-1] < g[0] - 0.1  # overfits the one batch
    print("graph vs pynative losses over 5 steps, max diff:", np.abs(g - losses[ms.PYNATIVE_MODE]).max())
    assert np.abs(g - losses[ms.PYNATIVE_MODE]).max() <= 1e-5


def test_accumulating_four_micro_batches_equals_one_full_batch(mode):
    """Micro-batches with unequal label counts: accumulation weighs every label token alike, so
    losses and weights equal one batch of the same rows. SGD isolates the accumulation (update =
    lr·g); AdamW's first steps divide by |g|, which magnifies last-bit differences of near-zero
    gradients, so it gets a looser bound."""
    ids = batch()
    labels = unequal_labels(ids)
    params, losses = {}, {}
    for micro in (1, 4):
        model = lora_model()
        out, _ = run_steps(model, 3, micro, optimizer=nn.SGD(model.trainable_params(), learning_rate=0.5),
                           ids=ids, labels=labels)
        params[micro] = {p.name: p.asnumpy() for p in model.trainable_params()}
        losses[micro] = np.array([o[0] for o in out])
        assert all(o[1] for o in out)
    sgd = max(np.abs(params[1][k] - params[4][k]).max() for k in params[1])
    loss = np.abs(losses[1] - losses[4]).max()
    params = {}
    for micro in (1, 4):
        model = lora_model()
        run_steps(model, 3, micro, ids=ids, labels=labels)
        params[micro] = {p.name: p.asnumpy() for p in model.trainable_params()}
    adam = max(np.abs(params[1][k] - params[4][k]).max() for k in params[1])
    print(f"4×B2 vs B8 after 3 steps: loss {loss:.1e}, SGD {sgd:.1e}, AdamW {adam:.1e}")
    assert loss <= 1e-5 and sgd <= 1e-6 and adam <= 1e-5


def test_forced_overflow_skips_the_update_and_halves_the_scale(mode):
    model = lora_model()
    apply_precision(model, PrecisionConfig(level="O1", dtype="float16"))
    optimizer = make_optimizer(model.trainable_params(), WarmupSchedule("constant", 1e-3, 100))
    # At 2**24 the fp16 backward overflows (as at 2**40, 16 back-off steps sooner); it first fits at 2**18.
    scaler = make_loss_scaler(PrecisionConfig(level="O1", dtype="float16", loss_scale=2.0 ** 24))
    stepper = Stepper(model, optimizer, scaler, 1, 1.0, dynamic_scaling=True)
    ids = ms.Tensor(batch())
    before = {p.name: p.asnumpy().copy() for p in model.trainable_params()}
    loss, finite, _ = stepper([(ids, ids)])
    assert not finite
    assert float(scaler.scale_value.asnumpy()) == 2.0 ** 23
    assert all(np.array_equal(before[p.name], p.asnumpy()) for p in model.trainable_params())
    assert int(optimizer.global_step.asnumpy()[0]) == 0
    for _ in range(40):  # the scale backs off until the gradients fit in fp16
        loss, finite, _ = stepper([(ids, ids)])
        if finite:
            break
    assert finite and np.isfinite(loss)
    assert any(not np.array_equal(before[p.name], p.asnumpy()) for p in model.trainable_params())


def test_overflows_are_counted_in_metrics(tmp_path):
    config = TrainerConfig(max_steps=3, micro_batch_size=4, output_dir=str(tmp_path), progress=False,
                           precision=PrecisionConfig(level="O2", dtype="float16", loss_scale=2.0 ** 60))
    with pytest.raises(TrainingDiverged, match="step 3: no step of this run updated the model"):
        fit(lora_model(), TokenDataset(RNG_DATA), config)  # three skipped steps are not a trained model
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["overflow"] for r in records] == [True, True, True]
    assert [r["loss_scale"] for r in records] == [2.0 ** 59, 2.0 ** 58, 2.0 ** 57]
    assert records[-1]["overflow_count"] == 3


def test_o2_fp16_tracks_fp32_over_50_steps(tmp_path):
    curves = {}
    for level in ("O0", "O2"):
        config = TrainerConfig(max_steps=50, micro_batch_size=4, lr=3e-3, schedule="constant", progress=False,
                               output_dir=str(tmp_path / level), precision=PrecisionConfig(level=level))
        fit(lora_model(8), TokenDataset(RNG_DATA[:16]), config)
        curves[level] = np.array([json.loads(line)["loss"] for line in open(tmp_path / level / "metrics.jsonl")])
    rel = np.abs(curves["O2"] - curves["O0"]) / curves["O0"]
    print(f"O2 fp16 vs fp32 loss: max relative gap {rel.max():.4f}; fp32 {curves['O0'][0]:.3f} -> {curves['O0'][-1]:.3f}")
    assert curves["O0"][-1] < curves["O0"][0] - 3.0  # it does learn
    assert rel.max() <= 0.02


def test_bf16_compute_on_cpu_fails_early():
    with pytest.raises(ValueError, match="bfloat16 cannot run on CPU"):
        apply_precision(lora_model(), PrecisionConfig(level="O1", dtype="bfloat16"))


def test_fp32_divergence_names_the_step_and_checkpoint(tmp_path):
    model = lora_model()
    for p in model.trainable_params():
        p.set_data(ms.Tensor(np.full(p.shape, np.nan, np.float32)))
    with pytest.raises(TrainingDiverged, match=r"step 1: loss is nan .*last good checkpoint: none"):
        fit(model, TokenDataset(RNG_DATA), TrainerConfig(max_steps=2, output_dir=str(tmp_path), progress=False))


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine", "wsd"])
def test_schedules_match_closed_forms(kind):
    total, warm, lr, min_lr = 20, 4, 1.0, 0.1
    got = schedule_values(WarmupSchedule(kind, lr, total, warm, min_lr, decay_fraction=0.25), total + 1)
    expected = []
    for s in range(total + 1):
        if s < warm:
            expected.append(lr * s / warm)
            continue
        t = (s - warm) / (total - warm)
        expected.append({"constant": lr, "linear": lr + (min_lr - lr) * t,
                         "cosine": min_lr + (lr - min_lr) * 0.5 * (1 + np.cos(np.pi * t)),
                         "wsd": lr if s < 15 else lr + (min_lr - lr) * (s - 15) / 5}[kind])
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_no_weight_decay_on_norms_biases_and_vectors():
    model = from_pretrained(fixture_path("qwen2_tiny", "base"))
    decay, no_decay = param_groups(model.trainable_params(), 0.1)
    assert all(len(p.shape) == 2 for p in decay["params"])
    names = {p.name for p in no_decay["params"]}
    assert "model.norm.weight" in names and "model.layers.0.self_attn.q_proj.bias" in names
    assert no_decay["weight_decay"] == 0.0


def test_loader_resume_and_sharding():
    data = TokenDataset(np.arange(40 * 3).reshape(40, 3))
    loader = BatchLoader(data, 4, seed=3)
    straight = [b[0] for b in loader.iterate(0, 25)]  # crosses two epoch boundaries
    resumed = [b[0] for b in BatchLoader(data, 4, seed=3).iterate(13, 25)]
    assert all(np.array_equal(a, b) for a, b in zip(straight[13:], resumed))
    shards = [BatchLoader(data, 2, seed=3, rank=r, world=2).batch(0)[0] for r in (0, 1)]
    assert not set(shards[0][:, 0]) & set(shards[1][:, 0])
    assert set(np.concatenate(shards)[:, 0]) == set(straight[0][:, 0])  # the same global batch


def _fit_subprocess(out, *args, **popen):
    env = {**os.environ, "GLOG_v": "3"}
    return subprocess.run([sys.executable, SCRIPT, str(out), *args], env=env, capture_output=True, text=True,
                          timeout=600, **popen)


def _losses(out):
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]


def test_resume_after_sigkill_is_bit_identical(tmp_path):
    straight = _fit_subprocess(tmp_path / "a", "--steps", "8", "--save-every", "3")
    assert straight.returncode == 0, straight.stderr[-2000:]
    killed = _fit_subprocess(tmp_path / "b", "--steps", "8", "--save-every", "3", "--kill-at-step", "5")
    assert killed.returncode == -signal.SIGKILL
    assert [os.path.basename(c) for c in checkpoint.complete_checkpoints(str(tmp_path / "b"))] == ["step_00000003"]
    resumed = _fit_subprocess(tmp_path / "b", "--steps", "8", "--save-every", "3", "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")  # exact float equality, all 8 steps
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert open(tmp_path / "a" / "checkpoints" / "step_00000008" / name, "rb").read() == \
            open(tmp_path / "b" / "checkpoints" / "step_00000008" / name, "rb").read()


def test_compile_cache_loads_the_same_graphs_and_keys_a_changed_network_apart(tmp_path):
    """A run that loads its graphs from the cache trains like the run that compiled them (to 1e-6:
    measured once 9.621451 against 9.621450 at one step, the rest bit-identical); a full fine-tune
    on the same cache root compiles its own. Both failures were measured: frozen weights unbound
    in the loaded graph (loss stuck at ln(vocab)), and MindSpore loading the LoRA graph for the
    full fine-tune (NaN)."""
    cache = str(tmp_path / "cache")
    runs = {}
    for name, extra in (("compiles", []), ("loads", []), ("full", ["--full"])):
        out = tmp_path / name
        done = subprocess.run([sys.executable, SCRIPT, str(out), "--steps", "4", "--compile-cache", cache, *extra],
                              capture_output=True, text=True, timeout=600, env={**os.environ, "GLOG_v": "2"})
        assert done.returncode == 0, done.stderr[-2000:]
        runs[name] = (_losses(out), "Use the compilation cache" in done.stderr)
    plain = runs["compiles"][0]
    assert not runs["compiles"][1]
    assert runs["loads"][0] == pytest.approx(plain, rel=1e-6) and runs["loads"][1]
    assert len(os.listdir(cache)) == 2  # LoRA and full: separate keys
    full, loaded = runs["full"]
    assert not loaded and all(np.isfinite(full))
    assert full[0] == pytest.approx(plain[0], abs=1e-5)  # LoRA B = 0: the same initial loss
    assert full[-1] != pytest.approx(plain[-1], abs=1e-3)  # but the full model trains differently


_CACHE_RULES = """
import os, sys, warnings
import mindqwen
import mindspore as ms
import numpy as np
from mindspore import nn
from mindqwen.train.compile_cache import compile_cache

class Affine(nn.Cell):
    def __init__(self, k):
        super().__init__()
        self.k = k

    def construct(self, x):
        return x * self.k + 1

first, second, fusion = sys.argv[1], sys.argv[2], sys.argv[3] == "fusion"
if fusion:
    mindqwen.backend.use_cpu_fusion()  # as building a model on the CPU does
else:
    mindqwen.backend.disable_cpu_fusion()
ms.set_device("CPU")
ms.set_context(mode=ms.GRAPH_MODE)
x = ms.Tensor(np.ones(3, np.float32))
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    with compile_cache(first):
        assert Affine(2.0)(x).asnumpy().tolist() == [3.0] * 3
    with compile_cache(second):
        assert Affine(3.0)(x).asnumpy().tolist() == [4.0] * 3
assert "MS_COMPILER_CACHE_ENABLE" not in os.environ
print("|".join(str(w.message) for w in seen))
"""


@pytest.mark.parametrize("fusion", ["no-fusion", "fusion"])
def test_compile_cache_uses_one_folder_per_process_and_never_with_fusion(tmp_path, fusion):
    """MindSpore fixes the cache folder at its first use and numbers graphs by compile order, so
    graphs of a second, different block must not land in the first folder (nor in the second).
    With CPU fusion on, the first fused compile fixes the folder to the working directory, so
    nothing is cached at all."""
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    script = tmp_path / "rules.py"  # a file: MindSpore's cache hashes the entry script
    script.write_text(_CACHE_RULES)
    r = subprocess.run([sys.executable, str(script), first, second, fusion], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env={**os.environ, "GLOG_v": "3"})
    assert r.returncode == 0, r.stderr[-2000:]
    cached = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".mindir")]
    assert not os.path.exists(second)
    if fusion == "fusion":
        assert cached == [] and r.stdout.count("graph-kernel fusion, which MindSpore cannot cache") == 2
    else:
        assert cached == ["compile_cache_0.mindir"] and os.listdir(first) == ["rank_0"]
        assert "compile without the cache" in r.stdout


def test_a_kill_during_checkpoint_write_leaves_no_valid_looking_checkpoint(tmp_path):
    code = f"""
import os, signal, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
import mindspore as ms
from conftest import fixture_path
from mindqwen import LoraConfig, apply_lora, from_pretrained
from mindqwen.io import safetensors
from mindqwen.train import checkpoint
from mindqwen.train.optim import WarmupSchedule, make_optimizer
from mindqwen.train.precision import PrecisionConfig, make_loss_scaler
model = apply_lora(from_pretrained(fixture_path("qwen2_tiny", "base")), LoraConfig(r=4))
opt = make_optimizer(model.trainable_params(), WarmupSchedule("constant", 1e-3, 10))
scaler = make_loss_scaler(PrecisionConfig())
checkpoint.save({str(tmp_path)!r}, 1, model, opt, scaler, {{}})
original = safetensors.save_file
def die_midway(tensors, path, **kw):
    original(tensors, path, **kw)
    os.kill(os.getpid(), signal.SIGKILL)   # after the first file of checkpoint 2
checkpoint.save_file = die_midway
checkpoint.save({str(tmp_path)!r}, 2, model, opt, scaler, {{}})
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "GLOG_v": "3"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert [os.path.basename(c) for c in checkpoint.complete_checkpoints(str(tmp_path))] == ["step_00000001"]
    assert checkpoint.resolve("auto", str(tmp_path)).endswith("step_00000001")
    leftovers = os.listdir(tmp_path / "checkpoints")
    assert any(".tmp-" in n for n in leftovers)  # the partial write is there, but never a checkpoint
    with pytest.raises(Exception, match="not a complete mindqwen checkpoint"):
        checkpoint.resolve(str(tmp_path / "checkpoints" / [n for n in leftovers if ".tmp-" in n][0]), str(tmp_path))


@pytest.mark.skipif(shutil.which("msrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "msrun")),
                    reason="msrun (MindSpore's launcher) not found")
def test_data_parallel_two_workers_match_one_process(tmp_path):
    msrun = shutil.which("msrun") or os.path.join(os.path.dirname(sys.executable), "msrun")
    port = str(20000 + os.getpid() % 20000)
    r = subprocess.run([msrun, "--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1",
                        f"--master_port={port}", f"--log_dir={tmp_path / 'logs'}", "--join=True",
                        SCRIPT, str(tmp_path / "dp"), "--steps", "3", "--global-batch", "4",
                        "--dump", str(tmp_path / "dp_params_RANK.npz")],
                       capture_output=True, text=True, timeout=900, cwd=str(tmp_path),
                       env={**os.environ, "GLOG_v": "3",  # workers run `python`: this interpreter
                            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]})
    logs = "".join(open(tmp_path / "logs" / f).read()[-3000:] for f in os.listdir(tmp_path / "logs")) \
        if (tmp_path / "logs").exists() else ""
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:] + logs
    single = _fit_subprocess(tmp_path / "single", "--steps", "3", "--global-batch", "4",
                             "--dump", str(tmp_path / "single.npz"))
    assert single.returncode == 0, single.stderr[-2000:]
    ranks = [np.load(tmp_path / f"dp_params_{r}.npz") for r in (0, 1)]
    reference = np.load(tmp_path / "single.npz")
    assert sorted(ranks[0].files) == sorted(reference.files)
    for k in reference.files:
        assert np.array_equal(ranks[0][k], ranks[1][k]), k  # the ranks stay in lock-step
    worst = max(np.abs(ranks[0][k] - reference[k]).max() for k in reference.files)
    print(f"2-worker data parallel vs one process, max param diff after 3 steps: {worst:.1e}")
    assert worst <= 1e-5
    assert _losses(tmp_path / "dp")[0] == pytest.approx(_losses(tmp_path / "single")[0], abs=1e-5)


def test_out_of_memory_names_the_knobs():
    from mindqwen.train.loop import explain_out_of_memory
    config = TrainerConfig(micro_batch_size=8, gradient_accumulation=2)
    err = explain_out_of_memory(RuntimeError("Malloc for kernel output failed, Memory isn't enough"), config)
    assert isinstance(err, MemoryError)
    assert "trainer.micro_batch_size=4 with trainer.gradient_accumulation=4" in str(err)
    assert "trainer.recompute=full" in str(err)
    other = RuntimeError("shape mismatch")
    assert explain_out_of_memory(other, config) is other


def test_tensorboard_scalars_equal_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboardX", reason="tensorboardX not installed (optional)")
    import struct
    from tensorboardX.proto import event_pb2
    config = TrainerConfig(max_steps=3, micro_batch_size=4, output_dir=str(tmp_path), progress=False,
                           tensorboard=True)
    fit(lora_model(), TokenDataset(RNG_DATA), config)
    losses = []
    for name in os.listdir(tmp_path / "tensorboard"):  # TFRecord: length, crc, payload, crc
        data = open(tmp_path / "tensorboard" / name, "rb").read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 16 + n
            losses += [v.simple_value for v in event.summary.value if v.tag == "train/loss"]
    logged = [json.loads(line)["loss"] for line in open(tmp_path / "metrics.jsonl")]
    assert losses == pytest.approx(logged, rel=1e-6)


def test_the_update_takes_more_gradients_than_graph_modes_call_depth():
    """700 gradient tensors (LoRA on every projection of Qwen3-30B-A3B's 48 layers is 672): the
    clipped update compiles (a comprehension over them exceeded MindSpore's depth limit of 1000)
    and its norm is the closed form √Σg², the update SGD's p − lr·g·min(1, c/‖g‖)."""
    from mindspore import Parameter, Tensor
    from mindqwen.train.step import ApplyGrads
    rng = np.random.default_rng(0)
    params = [Parameter(Tensor(rng.normal(size=3).astype(np.float32)), name=f"p{i}") for i in range(700)]
    grads = [rng.normal(size=3).astype(np.float32) for _ in params]
    before = [p.asnumpy().copy() for p in params]
    update = ApplyGrads(nn.SGD(params, learning_rate=0.1), make_loss_scaler(PrecisionConfig()), clip_norm=1.0,
                        dynamic_scaling=False)
    finite, norm = ms.jit(update)(tuple(Tensor(g) for g in grads), None)
    expected = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads))
    assert bool(finite) and abs(float(norm) - expected) <= 1e-5 * expected
    factor = min(1.0, 1.0 / expected)
    assert max(np.abs(p.asnumpy() - (b - 0.1 * g * factor)).max() for p, b, g in zip(params, before, grads)) <= 1e-6
