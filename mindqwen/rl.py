"""Reinforcement learning from verifiable rewards: the GRPO family (GRPO, Dr. GRPO, DAPO, BNPO, and GSPO's
sequence-level ratio) as pure functions of log-probs, rewards and advantages.

A generation batch holds N = P·G completions, G per prompt. Rewards come from Python functions, one column
each (None: the function does not score that completion); a completion's reward is the weighted sum of its
columns (a None counts 0; a completion no function scores is *unscorable*). Its advantage compares it with
its group (``scale_rewards``):

    group   A = (r − mean_group) / (std_group + 1e-4)
    batch   A = (r − mean_group) / (std_batch + 1e-4)
    none    A = r − mean_group

(std with Bessel's correction; unscorable completions leave their group's mean and std and get A = 0.)
With π the policy's log-prob of a completion token, π_old the same when the completion was sampled
(π detached when each batch is used once) and π_ref the reference's, per token:

    ρ = exp(π − π_old)                      (importance_sampling_level "sequence", GSPO: exp of the
                                             completion's mean π − π_old, one ρ for all its tokens)
    ℓ = −min(ρ·A, clip(ρ, 1 − ε, 1 + ε_high)·A)   (ρ capped at ``delta`` after the clip, if set)
      + β·ρ·(exp(π_ref − π) − (π_ref − π) − 1)     (the KL's k3 estimate; ρ·: the importance correction)

and the loss of a micro-batch of B completions with token mask m:

    grpo     mean over completions of Σ_t ℓ·m / Σ_t m
    bnpo     Σ ℓ·m / Σ m
    dr_grpo  Σ ℓ·m / (B · max_completion_length)
    dapo     Σ ℓ·m / (tokens of the whole generation batch)

The first three are divided by the number of micro-batches a step accumulates; DAPO's normaliser already
counts them. ``GRPOLoss`` takes the policy's log-probs of the sampled completions in the training graph;
``load_reward_funcs`` / ``score`` run the user's reward functions on the host.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindqwen.config import IGNORE_INDEX

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_LEVELS = ("token", "sequence")
STD_EPS = 1e-4  # added to the std that scales advantages
# What the loss reports per micro-batch: token-weighted means (sequence-weighted under GSPO for the clips).
LOSS_METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@dataclass
class GRPOConfig:
    """The ``grpo:`` recipe section.

    Attributes:
        reward_funcs: ``path/to/file.py:function`` or ``module:function``, called as
            ``f(completions, prompts=..., **columns) -> list[float | None]``.
        reward_weights: one per function; None: all 1.
        num_generations: G, completions sampled per prompt (≥ 2: an advantage compares within a group).
        max_completion_length: new tokens at most per completion (Dr. GRPO's normaliser too).
        temperature, top_p, top_k: sampling (top_k 0: off); the log-probs are of the tempered distribution.
        loss_type: grpo | dr_grpo | dapo | bnpo.
        beta: weight of the KL to the reference (0: no reference pass).
        epsilon, epsilon_high: the ratio's clip range [1 − epsilon, 1 + epsilon_high]; None: epsilon.
        delta: an upper cap on the ratio (two-sided clipping); None: none.
        kl_importance_correction: multiply the KL estimate by the ratio.
        num_iterations: μ, updates per generation batch (π_old recorded at sampling when μ > 1).
        scale_rewards: group | batch | none.
        importance_sampling_level: token | sequence (GSPO).
        mask_truncated_completions: completions cut at max_completion_length add nothing to the loss.
    """

    reward_funcs: List[str] = field(default_factory=list)
    reward_weights: Optional[List[float]] = None
    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    delta: Optional[float] = None
    kl_importance_correction: bool = True
    num_iterations: int = 1
    scale_rewards: str = "group"
    importance_sampling_level: str = "token"
    mask_truncated_completions: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (("loss_type", LOSS_TYPES), ("scale_rewards", SCALE_REWARDS),
                              ("importance_sampling_level", IMPORTANCE_LEVELS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"grpo.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"grpo.reward_weights has {len(self.reward_weights)} entries for "
                             f"{len(self.reward_funcs)} reward_funcs")
        if not isinstance(self.num_generations, int) or self.num_generations < 2:
            raise ValueError(f"grpo.num_generations must be an integer >= 2 (advantages compare completions of "
                             f"one prompt), got {self.num_generations!r}")
        for name in ("max_completion_length", "num_iterations"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"grpo.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not self.temperature > 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"grpo sampling: temperature > 0, 0 < top_p <= 1, top_k >= 0; got {self.temperature}, "
                             f"{self.top_p}, {self.top_k}")
        if self.beta < 0 or not 0 <= self.epsilon < 1 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError(f"grpo: beta >= 0, 0 <= epsilon < 1, epsilon_high >= 0; got {self.beta}, {self.epsilon}, "
                             f"{self.epsilon_high}")
        if self.delta is not None and not self.delta > 1 + self.clip_high:
            raise ValueError(f"grpo.delta {self.delta} must exceed 1 + epsilon_high ({1 + self.clip_high})")

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def weights(self) -> np.ndarray:
        return np.ones(len(self.reward_funcs), np.float32) if self.reward_weights is None else \
            np.asarray(self.reward_weights, np.float32)


# ---------------------------------------------------------------------------- rewards → advantages
def nanstd(x: np.ndarray, axis=None) -> np.ndarray:
    """The standard deviation with Bessel's correction over the non-NaN entries (NaN for fewer than two)."""
    count = np.sum(~np.isnan(x), axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.nanmean(x, axis=axis, keepdims=True)
        return np.sqrt(np.nanmean((x - mean) ** 2, axis=axis) * count / (count - 1))


def advantages(rewards_per_func: np.ndarray, weights: np.ndarray, num_generations: int,
               scale_rewards: str = "group") -> Tuple[np.ndarray, Dict[str, float]]:
    """The advantages of a generation batch and its reward metrics.

    Args:
        rewards_per_func: (N, F) float32, N = prompts × ``num_generations`` in prompt order, NaN where a
            function gave None.
        weights: (F,) the functions' weights.

    Returns:
        advantages (N,) float32 and ``reward``, ``reward_std``, ``frac_reward_zero_std`` (per-function
        metrics: ``reward_func_metrics``).
    """
    unscorable = np.isnan(rewards_per_func).all(1)
    rewards = np.nansum(rewards_per_func * weights[None], 1).astype(np.float32)
    rewards[unscorable] = np.nan
    grouped = rewards.reshape(-1, num_generations)
    with np.errstate(invalid="ignore"):  # an all-unscorable group: NaN, then 0 below
        mean = np.repeat(np.nanmean(grouped, 1), num_generations)
    std = np.repeat(nanstd(grouped, 1), num_generations) if scale_rewards != "batch" else \
        np.full_like(rewards, nanstd(rewards))
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + STD_EPS)
    metrics = {"reward": float(np.nanmean(rewards)), "reward_std": float(nanstd(rewards)),
               "frac_reward_zero_std": float(np.mean(np.isclose(std, 0.0, rtol=1e-5, atol=1e-8)))}
    return np.nan_to_num(adv, nan=0.0).astype(np.float32), metrics


def reward_func_metrics(rewards_per_func: np.ndarray, names: Sequence[str]) -> Dict[str, float]:
    """``rewards/<name>/mean`` and ``/std`` of each function's column (unweighted; Nones left out)."""
    out = {}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = float(np.nanmean(rewards_per_func[:, i]))
        out[f"rewards/{name}/std"] = float(nanstd(rewards_per_func[:, i]))
    return out


def completion_metrics(lengths: Sequence[int], truncated: Sequence[bool]) -> Dict[str, float]:
    """``completions/*``: lengths (EOS included) over the batch, and the share cut at the length limit."""
    lengths = np.asarray(lengths, np.float64)
    return {"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(np.mean(np.asarray(truncated, bool)))}


# ---------------------------------------------------------------------------- the loss
def _masked_mean(x, mask):
    return (x * mask).sum() / ops.maximum(mask.sum(), 1.0)


def grpo_loss(config: GRPOConfig, logps, old_logps, ref_logps, advantages, mask, num_items=None,
              accumulation: int = 1) -> Tuple:
    """The loss of one micro-batch and its ``LOSS_METRICS`` (see the module docstring).

    Args:
        logps: (B, T) fp32, the policy's log-prob of each completion token (differentiable).
        old_logps: (B, T) at sampling, or None (each batch used once: ``logps`` detached).
        ref_logps: (B, T) under the reference, or None (β = 0).
        advantages: (B,) fp32.
        mask: (B, T) fp32, 1 on completion tokens that count.
        num_items: DAPO's normaliser, a scalar tensor: the generation batch's counted tokens divided by
            the micro-batches a step accumulates per generation batch (``accumulation`` ones per step).
        accumulation: micro-batches accumulated per step (grpo, bnpo, dr_grpo divide by it).

    Returns:
        (loss, kl, low, high, region): the loss and the metrics as scalars (kl 0 when β = 0).
    """
    old = ops.stop_gradient(logps) if old_logps is None else old_logps
    log_ratio = logps - old
    adv = advantages.reshape(-1, 1)
    if config.importance_sampling_level == "sequence":  # GSPO: one ratio per completion
        log_ratio = ((log_ratio * mask).sum(-1) / ops.maximum(mask.sum(-1), 1.0)).reshape(-1, 1)
    ratio = ops.exp(log_ratio)
    clipped = ops.clamp(ratio, 1 - config.epsilon, 1 + config.clip_high)
    capped = ratio if config.delta is None else ops.minimum(ratio, config.delta)
    per_token = -ops.minimum(capped * adv, clipped * adv)
    kl = ops.zeros((), ms.float32)
    if config.beta != 0:
        gap = ref_logps - logps
        per_token_kl = ops.exp(gap) - gap - 1
        if config.kl_importance_correction:
            per_token_kl = per_token_kl * ratio
        per_token = per_token + config.beta * per_token_kl
        kl = _masked_mean(per_token_kl, mask)
    if config.loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / ops.maximum(mask.sum(-1), 1.0)).mean() / accumulation
    elif config.loss_type == "bnpo":
        loss = _masked_mean(per_token, mask) / accumulation
    elif config.loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (mask.shape[0] * config.max_completion_length) / accumulation
    else:  # dapo
        loss = (per_token * mask).sum() / ops.maximum(num_items, 1.0)
    low = ops.logical_and(capped < 1 - config.epsilon, adv < 0).astype(ms.float32)
    high = ops.logical_and(capped > 1 + config.clip_high, adv > 0).astype(ms.float32)
    if config.importance_sampling_level == "sequence":
        clips = tuple(c.mean() for c in (low, high, ops.maximum(low, high)))
    else:
        clips = tuple(_masked_mean(c, mask) for c in (low, high, ops.maximum(low, high)))
    return (loss, kl) + clips


class GRPOLoss(nn.Cell):
    """The policy's loss on a micro-batch of sampled completions: rows of [left-padded prompt | completion,
    right-padded] → the loss and ``LOSS_METRICS`` (``grpo_loss``), the completion tokens' log-probs taken
    block by block (``QwenForCausalLM.token_log_probs``) from the tempered distribution they were sampled from.

    Args:
        policy: the model that trains (``QwenForCausalLM``, LoRA or not).
        config: the ``grpo`` section.
    """

    def __init__(self, policy: nn.Cell, config: GRPOConfig):
        super().__init__(auto_prefix=False)
        self.policy, self.config = policy, config

    def construct(self, input_ids, attention_mask, completion_mask, advantages, old_logps=None, ref_logps=None,
                  num_items=None, accumulation: int = 1):
        """input_ids, attention_mask (B, P + T) int32; completion_mask (B, T), 1 on tokens that count;
        advantages (B,); old_logps, ref_logps (B, T) or None; num_items: DAPO's normaliser (``grpo_loss``)."""
        b, t = completion_mask.shape
        mask = completion_mask.astype(ms.float32)
        completion = ops.where(completion_mask > 0, input_ids[:, -t:], IGNORE_INDEX)
        labels = ops.cat((ops.full((b, input_ids.shape[1] - t), IGNORE_INDEX, dtype=input_ids.dtype), completion), 1)
        logps = self.policy.token_log_probs(input_ids, labels, True, attention_mask, self.config.temperature)[:, -t:]
        return grpo_loss(self.config, logps, old_logps, ref_logps, advantages, mask, num_items, accumulation)


# ---------------------------------------------------------------------------- reward functions
class RewardError(ValueError):
    """A reward function that cannot be loaded, or whose call cannot be used: one line naming it."""


def load_reward_funcs(specs: Sequence[str], base: str = ".") -> List[Tuple[str, Callable]]:
    """(name, function) for each ``path/to/file.py:function`` (a path relative to ``base``, the recipe's folder)
    or ``module:function`` (importable). The name is the function's, as the metrics spell it.

    Raises:
        RewardError: naming the entry (``grpo.reward_funcs[i]``) and what is wrong with it.
    """
    loaded = []
    for i, spec in enumerate(specs):
        where = f"grpo.reward_funcs[{i}] {spec!r}"
        source, _, name = str(spec).rpartition(":")
        if not source or not name.isidentifier():
            raise RewardError(f"{where}: expected path/to/file.py:function or module:function")
        try:
            if source.endswith(".py"):
                path = source if os.path.isabs(source) else os.path.join(base, source)
                if not os.path.isfile(path):
                    raise RewardError(f"{where}: {path} not found")
                spec_ = importlib.util.spec_from_file_location(f"mindqwen_reward_{i}", path)
                module = importlib.util.module_from_spec(spec_)
                spec_.loader.exec_module(module)
            else:
                module = importlib.import_module(source)
        except RewardError:
            raise
        except Exception as e:  # the user's module failed to import: its own error, in one line
            raise RewardError(f"{where}: importing it failed: {type(e).__name__}: {e}") from None
        fn = getattr(module, name, None)
        if not callable(fn):
            raise RewardError(f"{where}: {source} has no function {name!r}")
        loaded.append((name, fn))
    return loaded


def score(funcs: Sequence[Tuple[str, Callable]], completions: list, prompts: list, columns: Dict[str, list],
          timeout: Optional[float] = None) -> np.ndarray:
    """Each function on the whole batch, called as ``f(completions, prompts=prompts, **columns)``: (N, F)
    float32, NaN where a function returned None. ``timeout``: seconds per call (None: no limit).

    Raises:
        RewardError: a function raised, took longer than ``timeout``, returned a count other than N, or a value
            that is neither a finite number nor None; naming the function and the first completion concerned.
    """
    out = np.full((len(completions), len(funcs)), np.nan, np.float32)
    for j, (name, fn) in enumerate(funcs):
        first = _show(completions[0]) if completions else "none"
        try:
            values = _call(fn, timeout, completions, prompts=prompts, **columns)
        except _Hung:
            raise RewardError(f"reward function {name}: no answer within {timeout} s for a batch of "
                              f"{len(completions)} completions (the first: {first})") from None
        except Exception as e:
            raise RewardError(f"reward function {name} raised {type(e).__name__}: {e} (a batch of "
                              f"{len(completions)} completions; the first: {first})") from None
        if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(completions):
            count = len(values) if hasattr(values, "__len__") else type(values).__name__
            raise RewardError(f"reward function {name} returned {count} values for {len(completions)} completions")
        for i, v in enumerate(values):
            if v is None:
                continue
            try:
                out[i, j] = v
            except (TypeError, ValueError):
                out[i, j] = np.nan
            if not np.isfinite(out[i, j]):
                raise RewardError(f"reward function {name} returned {v!r} for completion {i}: {_show(completions[i])}"
                                  " (a reward is a finite number, or None for a completion it does not score)")
    return out


class _Hung(Exception):
    """A call given up on (``_call``)."""


def _call(fn: Callable, timeout: Optional[float], *args, **kwargs):
    """fn(*args, **kwargs) in a daemon thread, given up after ``timeout`` seconds (``_Hung``): a reward
    function that hangs is left behind, and neither the run nor the interpreter's exit waits for it."""
    result = {}

    def run():
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller's thread
            result["error"] = e
    thread = threading.Thread(target=run, daemon=True, name="mindqwen-reward")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise _Hung
    if "error" in result:
        raise result["error"]
    return result["value"]


def _show(completion, width: int = 60) -> str:
    text = completion if isinstance(completion, str) else str(completion)
    return repr(text if len(text) <= width else text[:width] + "…")


# ---------------------------------------------------------------------------- rollouts
@dataclass
class Rollout:
    """A generation batch: each prompt's ``num_generations`` completions, as the training graph takes them.

    Attributes:
        input_ids, attention_mask: (N, P + T) int32, the prompt left-padded to P, the completion right-padded to T.
        completion_mask: (N, T) int32, 1 on the completion's tokens (its EOS included); 0 on a truncated
            completion's with ``mask_truncated_completions``.
        completions: each completion's token ids (EOS included).
        truncated: (N,) bool, cut at ``max_completion_length`` without an EOS.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    completion_mask: np.ndarray
    completions: List[List[int]]
    truncated: np.ndarray


def rollout(model, prompts: Sequence[Sequence[int]], config: GRPOConfig, eos_token_id, pad_token_id: int = 0,
            seed: int = 0, step: int = 0) -> Rollout:
    """Sample ``config.num_generations`` completions of each prompt (token ids) with the model's live weights,
    through the KV-cache generator, all rows in one continuous batch. Row i's sampler is seeded from
    (``seed``, ``step``, i): the same step of a resumed run draws the same completions."""
    from mindqwen.generation import GenerationConfig, Generator
    rows = [list(p) for p in prompts for _ in range(config.num_generations)]
    base = GenerationConfig(max_new_tokens=config.max_completion_length, do_sample=True,
                            temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
                            eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    seeds = np.random.SeedSequence([seed, step]).generate_state(len(rows))
    results = Generator(model).run(rows, [dataclasses.replace(base, seed=int(s)) for s in seeds])
    completions = [list(r.tokens) for r in results]
    truncated = np.array([not c or c[-1] not in base.eos_ids for c in completions])
    p, t = max(len(r) for r in rows), max(max(len(c) for c in completions), 1)
    ids = np.full((len(rows), p + t), pad_token_id, np.int32)
    mask = np.zeros_like(ids)
    for i, (prompt, c) in enumerate(zip(rows, completions)):
        ids[i, p - len(prompt):p], ids[i, p:p + len(c)] = prompt, c
        mask[i, p - len(prompt):p + len(c)] = 1
    completion_mask = mask[:, p:].copy()
    if config.mask_truncated_completions:
        completion_mask[truncated] = 0
    return Rollout(ids, mask, completion_mask, completions, truncated)
