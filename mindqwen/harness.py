"""Standard benchmarks through lm-evaluation-harness: ``MindQwenLM`` answers the harness's three
kinds of request with a mindqwen model, and ``evaluate_tasks`` runs named tasks on it.

- ``loglikelihood``: (context, continuation) → (log p(continuation | context), whether greedy
  decoding gives exactly the continuation). Text is tokenised whole and split where the
  context's tokens end (the context's trailing spaces go with the continuation); a row is
  ``(context + continuation)[-(L+1):][:-1]`` for the context length L. Rows run longest first,
  ``batch_size`` at a time, through one forward graph per length bucket (``length_bucket``);
  requests with the same row (one-token answers such as MMLU's letters) share it.
- ``loglikelihood_rolling``: a document's log-likelihood over disjoint windows of L tokens.
- ``generate_until``: KV-cache generation (``Generator``) grouped by generation settings; a row
  ends at the end-of-text token, a stop sequence or ``max_gen_toks``, and its text is cut before
  the first stop sequence.

Needs the ``eval`` extra (``pip install mindqwen[eval]``).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
from typing import Dict, List, Optional, Sequence, Tuple, Union

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn
from tqdm import tqdm

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(f"evaluation with lm-evaluation-harness needs the eval extra: pip install 'mindqwen[eval]' "
                      f"({e})") from None

from mindqwen.config import IGNORE_INDEX
from mindqwen.data.chat import folder_chat_template, render, render_jinja
from mindqwen.data.tokenizer import model_tokenizer
from mindqwen.generation import GenerationConfig, Generator
from mindqwen.models.graph import in_mode, kept_on_model
from mindqwen.models.qwen import QwenForCausalLM

# Row lengths compiled for: steps of at most ~1.25× from 64 on (padding under a quarter of a row,
# ~3 graphs per doubling of the length; each graph compiles once per model).
BUCKETS = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
           1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096)
Request = Tuple[Optional[Tuple[str, str]], List[int], List[int]]  # (strings, context ids, continuation ids)


def length_bucket(n: int, max_length: int) -> int:
    """The padded length of a row of ``n`` tokens: the first bucket that holds it (past the
    last one, the next multiple of it), never beyond ``max_length``."""
    for b in BUCKETS:
        if n <= b:
            return min(b, max_length)
    return min(-(-n // BUCKETS[-1]) * BUCKETS[-1], max_length)


class TokenScores(nn.Cell):
    """(input_ids, targets, last) → ``QwenForCausalLM.score_tokens``: one forward graph per row
    length, no gradient; kept on the model, so every ``MindQwenLM`` over it reuses the graphs."""

    def __init__(self, model: QwenForCausalLM):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, targets, last):
        return self.model.score_tokens(input_ids, targets, last)


@register_model("mindqwen")
class MindQwenLM(TemplateLM):
    """An lm-evaluation-harness model backed by a mindqwen model.

    Args:
        pretrained: an HF folder, a ``QwenForCausalLM``, or a ``MultimodalQwen`` (its text path:
            prompts without an image, which its cross-attention blocks leave unchanged).
        tokenizer: a tokenizer object, or the path of one (HF folder, ``qwen.tiktoken``,
            SentencePiece ``.model``); default: the one in the ``pretrained`` folder.
        adapter: a PEFT LoRA adapter folder loaded on top (unmerged).
        batch_size: rows per forward pass (and generation batch).
        max_length: the context length L (default: the model's ``context_length``).
        max_gen_toks: tokens to generate when a task does not say.
        seed: seeds sampling (the i-th generation batch draws from seed + i).
        device, max_batch_size: accepted from the harness's command line and ignored (the device
            is MindSpore's: CPU, or Ascend where mindqwen runs on one).
    """

    def __init__(self, pretrained: Union[str, nn.Cell], tokenizer=None, adapter: Optional[str] = None,
                 batch_size: Union[int, str] = 8, max_length: Optional[int] = None, max_gen_toks: int = 256,
                 seed: int = 0, device: Optional[str] = None, max_batch_size: Optional[int] = None):
        super().__init__()
        if tokenizer is None and not isinstance(pretrained, str):
            raise ValueError("a model object needs its tokenizer: MindQwenLM(model, tokenizer=...)")
        self.tokenizer = tokenizer if tokenizer is not None and not isinstance(tokenizer, str) else \
            model_tokenizer(pretrained, tokenizer)  # before the model: a missing tokenizer fails fast
        self.model = text_model(load_model(pretrained, adapter) if isinstance(pretrained, str) else pretrained)
        folder = tokenizer if isinstance(tokenizer, str) and os.path.isdir(tokenizer) else pretrained
        self.template = folder_chat_template(folder) if isinstance(folder, str) and os.path.isdir(folder) else None
        try:
            self._batch_size = int(batch_size)
        except ValueError:
            raise ValueError(f"batch_size must be a whole number of rows, got {batch_size!r}") from None
        if self._batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self._batch_size}")
        config = self.model.config
        self._max_length = int(max_length or config.context_length)
        if not 1 < self._max_length <= config.context_length:
            raise ValueError(f"max_length must be in 2..{config.context_length} (the model's "
                             f"{config.context_rule}), got {self._max_length}")
        self._max_gen_toks, self.seed = int(max_gen_toks), int(seed)
        self.model.set_train(False)

    # ------------------------------------------------------------------ what the harness reads
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name", type(self.tokenizer).__name__).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        return list(self.tokenizer.encode(string))

    def chat_template(self, chat_template: Union[bool, str] = False) -> Optional[str]:
        """The template ``apply_chat_template`` renders (the folder's Jinja text, else the
        built-in one's name), or None when chat templates are off."""
        return (self.template or self._builtin_template()) if chat_template else None

    def apply_chat_template(self, chat_history: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation in the model's template: the folder's own Jinja template, else the
        built-in one of the model's family. Without a generation prompt the text stops where the
        last message ends (the harness continues a prefilled answer). A template that refuses the
        conversation is tried again without its system turns, as the harness's own backend does."""
        import jinja2
        try:
            return self._render(chat_history, add_generation_prompt)
        except jinja2.exceptions.TemplateError:
            return self._render([m for m in chat_history if m["role"] != "system"], add_generation_prompt)

    def _render(self, chat: List[Dict[str, str]], add_generation_prompt: bool) -> str:
        if self.template is not None:
            return render_jinja(self.template, chat, add_generation_prompt, not add_generation_prompt,
                                eos_token=self.tokenizer.decode([self.eot_token_id]))
        if add_generation_prompt or not chat:
            return render(chat, self._builtin_template(), add_generation_prompt=add_generation_prompt)[0]
        tag = "\x00CONTINUE\x00"  # where the final message's text ends, whatever the template does around it
        text, _ = render(chat[:-1] + [dict(chat[-1], content=chat[-1]["content"] + tag)], self._builtin_template())
        return text[:text.index(tag)]

    def _builtin_template(self) -> str:
        return "qwen3" if self.model.config.model_type.startswith("qwen3") else "qwen2.5"

    # ------------------------------------------------------------------ log-likelihoods
    def _loglikelihood_tokens(self, requests: Sequence[Request],
                              disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
        """Each request's (summed log-prob of its continuation, whether it is all greedy)."""
        rows: Dict[tuple, List[int]] = {}  # the row a request runs on → the requests on it
        results: List[Optional[Tuple[float, bool]]] = [None] * len(requests)
        for i, (_, context, continuation) in enumerate(requests):
            if not continuation:  # nothing to score (the context's tokens took it): log 1, greedy
                results[i] = (0.0, True)
                continue
            whole = (context + continuation)[-(self.max_length + 1):]
            rows.setdefault(tuple(whole[:-1]), []).append(i)
        order = sorted(rows, key=len, reverse=True)  # longest first: a batch's first row sets its length
        with tqdm(total=sum(map(len, rows.values())), desc="loglikelihood", disable=disable_tqdm) as bar:
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                values, greedy, after = self._score_rows(batch)
                for row, v, g, a in zip(batch, values, greedy, after):
                    for i in rows[row]:
                        results[i] = self._answer(row, requests[i], v, g, a)
                        if requests[i][0] is not None:
                            self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
                        bar.update()
        return results

    def _score_rows(self, rows: List[tuple]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``score_tokens`` of rows (longest first), padded to ``batch_size`` × a length bucket:
        at every position but the last the next input token is the target; the last position's
        whole distribution comes back."""
        length = length_bucket(len(rows[0]), self.max_length)
        ids = np.full((self.batch_size, length), self.eot_token_id, np.int32)
        targets = np.full((self.batch_size, length), IGNORE_INDEX, np.int32)
        last = np.zeros(self.batch_size, np.int32)
        for r, row in enumerate(rows):
            n = len(row)
            ids[r, :n], targets[r, :n - 1], last[r] = row, row[1:], n - 1
        scores = kept_on_model(self.model, "_mindqwen_scores", lambda: TokenScores(self.model))
        with in_mode(ms.GRAPH_MODE):
            values, greedy, after = scores(Tensor(ids), Tensor(targets), Tensor(last))
        return values.asnumpy(), greedy.asnumpy(), after.asnumpy()

    @staticmethod
    def _answer(row: tuple, request: Request, values: np.ndarray, greedy: np.ndarray,
                after: np.ndarray) -> Tuple[float, bool]:
        """A request's answer from its row's scores: positions n-k..n-2 predict the continuation's
        tokens inside the row, the distribution after the last position its final token."""
        n, k = len(row), len(request[2])
        k = min(k, n)  # a truncated context leaves at least the continuation's last n tokens
        token = (request[1] + request[2])[-1]
        logp = float(np.sum(values[n - k:n - 1], dtype=np.float64)) + float(after[token])
        return logp, bool(np.all(greedy[n - k:n - 1]) and int(np.argmax(after)) == token)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """Each document's log-likelihood: disjoint windows of ``max_length`` tokens, each after
        one token of context (the end-of-text token before the first)."""
        windows, owners = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += logp
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """Each request's generated text, cut before its first stop sequence."""
        eos = self.tokenizer.decode([self.eot_token_id])
        groups = Collator([r.args for r in requests], sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
                          group_by="gen_kwargs", group_fn=lambda a: a[1])
        out, generator = [], Generator(self.model, self.tokenizer)  # the model's kept step graphs
        with tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm) as bar:
            for n, chunk in enumerate(groups.get_batched(n=self.batch_size)):
                contexts, settings = zip(*chunk)
                config, until = self._generation_config(settings[0], eos, n)
                prompts = [self.tok_encode(c)[-(self.max_length - config.max_new_tokens):] or [self.prefix_token_id]
                           for c in contexts]  # an empty context: the end-of-text token before the answer
                for context, result in zip(contexts, generator.run(prompts, config, rows=self.batch_size)):
                    text = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
                    out.append(postprocess_generated_text(text, until, None))
                    self.cache_hook.add_partial("generate_until", (context, settings[0]), out[-1])
                    bar.update()
        return groups.get_original(out)

    def _generation_config(self, settings: dict, eos: str, batch: int) -> Tuple[GenerationConfig, List[str]]:
        """A task's generation settings as a ``GenerationConfig`` (and its stop sequences, the
        end-of-text token's text among them)."""
        kwargs = normalize_gen_kwargs(settings, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_new = int(kwargs.pop("max_gen_toks"))
        if max_new >= self.max_length:
            raise ValueError(f"max_gen_toks {max_new} leaves no room for a prompt in a context of {self.max_length}")
        sample = bool(kwargs.pop("do_sample", False)) and float(kwargs.get("temperature", 0.0)) > 0
        temperature = float(kwargs.pop("temperature", 0.0)) if sample else 1.0
        config = GenerationConfig(max_new_tokens=max_new, do_sample=sample, temperature=temperature,
                                  top_k=int(kwargs.pop("top_k", 0) or 0), top_p=float(kwargs.pop("top_p", 1.0) or 1.0),
                                  repetition_penalty=float(kwargs.pop("repetition_penalty", 1.0)),
                                  eos_token_id=self.eot_token_id, stop_strings=tuple(s for s in until if s),
                                  seed=self.seed + batch if sample else None)
        return config, until


def load_model(folder: str, adapter: Optional[str] = None) -> QwenForCausalLM:
    """An HF folder's model, with a PEFT LoRA adapter on top when given; a folder that does not
    load raises ValueError naming it."""
    from mindqwen import from_pretrained, load_adapter
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"{folder}: not a model folder (no config.json)")
    model = from_pretrained(folder)
    return load_adapter(model, adapter) if adapter else model


def text_model(model: nn.Cell) -> QwenForCausalLM:
    """The causal LM a harness scores: the model itself, or a multimodal model's text path."""
    if isinstance(model, QwenForCausalLM):
        return model
    lm = getattr(model, "lm", None)
    if isinstance(lm, QwenForCausalLM):
        if getattr(model, "image_token_id", 0) is None:
            raise ValueError("a multimodal model without an image token lets all text see the image: it has no "
                             "text-only path to evaluate")
        return lm
    raise TypeError(f"expected a QwenForCausalLM or a MultimodalQwen, got {type(model).__name__}")


def evaluate_tasks(lm: MindQwenLM, tasks: Sequence[str], num_fewshot: Optional[int] = None,
                   limit: Optional[float] = None, include_path: Optional[str] = None,
                   apply_chat_template: bool = False, fewshot_as_multiturn: bool = False,
                   log_samples: bool = False) -> dict:
    """lm-evaluation-harness's ``simple_evaluate`` of ``tasks`` on ``lm``: its results dict
    (``results``: each task's scores; ``samples`` with ``log_samples``). Unknown task names
    and a ``limit`` that is not positive are refused before anything runs."""
    import lm_eval
    if fewshot_as_multiturn and not apply_chat_template:
        raise ValueError("fewshot_as_multiturn puts few-shot examples in chat turns: it needs apply_chat_template")
    manager = check_tasks(tasks, include_path, limit)
    with _quiet_git_probe():
        return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                       task_manager=manager, apply_chat_template=apply_chat_template,
                                       fewshot_as_multiturn=fewshot_as_multiturn, log_samples=log_samples)


@contextlib.contextmanager
def _quiet_git_probe():
    """``simple_evaluate`` records the working directory's git commit (its results' ``git_hash``)
    by running ``git describe`` with git's stderr left on the terminal: outside a repository the
    user sees ``fatal: not a git repository`` (lm-eval 0.4.13, ``evaluator.get_git_commit_hash``).
    Within this block the same probe runs with git's stderr discarded."""
    from lm_eval import evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def git_hash() -> Optional[str]:  # lm-eval's, with stderr=DEVNULL
        try:
            return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())

    probe = getattr(evaluator, "get_git_commit_hash", None)  # None: another lm-eval, left alone
    if probe is not None:
        evaluator.get_git_commit_hash = git_hash
    try:
        yield
    finally:
        if probe is not None:
            evaluator.get_git_commit_hash = probe


def check_tasks(tasks: Sequence[str], include_path: Optional[str] = None, limit: Optional[float] = None):
    """Refuse an empty or unknown task list (naming the unknown ones), a missing include_path
    and a ``limit`` that is not positive, before anything loads; returns the task index."""
    if not tasks:
        raise ValueError("no tasks to evaluate")
    if limit is not None and not limit > 0:
        raise ValueError(f"limit must be > 0 (examples per task, or a fraction of them), got {limit:g}")
    if include_path is not None and not os.path.isdir(include_path):
        raise ValueError(f"{include_path}: include_path is not a folder of task YAML files")
    manager = _task_manager(include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown task{'s' * (len(unknown) > 1)}: {', '.join(unknown)} (lm-evaluation-harness "
                         "names or groups, or YAML tasks in include_path; `lm_eval ls tasks` lists them)")
    return manager


@functools.lru_cache(maxsize=8)
def _task_manager(include_path: Optional[str]):
    """The harness's task index (seconds to build: its thousands of task files), once per process."""
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=include_path)


def evaluate_section(section, model: nn.Cell, tokenizer: str) -> Dict[str, Dict[str, float]]:
    """A recipe's ``eval`` section (``EvalSection``) run on its trained ``model``: the scores
    (``scores``), and their table printed."""
    from lm_eval.utils import make_table
    lm = MindQwenLM(model, tokenizer=tokenizer, batch_size=section.batch_size)
    results = evaluate_tasks(lm, section.tasks, section.num_fewshot, section.limit, section.include_path,
                             section.apply_chat_template, section.fewshot_as_multiturn)
    print(make_table(results))
    return scores(results)


def scores(results: dict) -> Dict[str, Dict[str, float]]:
    """{task: {metric: value}} from a results dict: the figures, without aliases and sample counts."""
    return {task: {k.replace(",none", ""): float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "sample_len"}
            for task, metrics in results["results"].items()}


def write_results(path: str, results: dict) -> None:
    """The results dict as JSON (what the harness cannot write as JSON becomes its text)."""
    from mindqwen.io.jsonfile import write_json
    write_json(path, json.loads(json.dumps(results, default=str)))
