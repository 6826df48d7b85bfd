"""Preference tuning: the losses of DPO (sigmoid, robust, hinge), IPO, SimPO and ORPO as pure
functions of sequence log-probs, and the loss network that trains a causal LM on chosen /
rejected pairs.

A pair's rows are its prompt + chosen response and its prompt + rejected response; π is a
response's log-probability under the policy (the summed log-probs of its labelled tokens), ref
the same under the reference model, |y| its token count. With x = (π_c − ref_c) − (π_r − ref_r),
per pair:

    sigmoid  −(1−ε)·logσ(βx) − ε·logσ(−βx)          (ε = label_smoothing: conservative DPO)
    robust   (−(1−ε)·logσ(βx) + ε·logσ(−βx)) / (1−2ε)
    hinge    max(0, 1 − βx)
    ipo      (x̄ − 1/(2β))²,  x̄ the same margin on per-token averages π/|y|
    simpo    −(1−ε)·logσ(β(ā_c − ā_r) − γ) − ε·logσ(−β(ā_c − ā_r) + γ),  ā = π/|y|, no reference
    orpo     −β·logσ(log odds(ā_c) − log odds(ā_r)),  odds(ā) = e^ā / (1 − e^ā), no reference

and the batch loss is their mean, plus ORPO's negative log-likelihood of the chosen responses
(per token over the batch's chosen response tokens) and ``sft_weight`` times the same NLL for any
loss. Rewards are β·(π − ref) for the DPO family and IPO, β·ā for SimPO and ORPO.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops

from mindqwen.config import IGNORE_INDEX
from mindqwen.io.hf import no_init_parameters
from mindqwen.models.graph import invalidate_compiled_graphs
from mindqwen.models.qwen import QwenForCausalLM

LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo", "simpo", "orpo")
WITHOUT_REFERENCE = ("simpo", "orpo")
REFERENCES = ("adapter_off", "precompute", "model")
REPORTED = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected")


@dataclass
class PreferenceConfig:
    """Attributes:
        loss_type: sigmoid | robust | hinge | ipo | simpo | orpo.
        beta: β (IPO: the paper's τ; ORPO: the odds-ratio term's weight).
        label_smoothing: ε, the share of pairs taken as mislabelled (sigmoid, robust, simpo).
        simpo_gamma: SimPO's target reward margin γ.
        sft_weight: weight of the chosen responses' negative log-likelihood added to the loss.
        reference: where the reference log-probs come from: adapter_off (the LoRA model with
            its adapters off), precompute (one pass over the data before training, kept in the
            run's folder) or model (a frozen copy in memory); null: adapter_off with LoRA,
            precompute without. SimPO and ORPO use none.
        template: chat template the prompts and responses are rendered with (qwen2.5 | qwen3);
            null: the prompt text, then the response and EOS, as prompt/response SFT data.
    """

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    sft_weight: float = 0.0
    reference: Optional[str] = None
    template: Optional[str] = None

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"preference.loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        if self.beta <= 0 or self.sft_weight < 0:
            raise ValueError("preference: beta must be > 0 and sft_weight >= 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"preference.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust", "simpo"):
            raise ValueError(f"preference.label_smoothing applies to sigmoid, robust and simpo, not {self.loss_type}")
        if self.reference is not None and self.reference not in REFERENCES:
            raise ValueError(f"preference.reference must be one of {', '.join(REFERENCES)} or null, "
                             f"got {self.reference!r}")

    @property
    def uses_reference(self) -> bool:
        return self.loss_type not in WITHOUT_REFERENCE


def log_sigmoid(x):
    """log σ(x) without overflow for large |x| (fp32)."""
    return ops.minimum(x, 0.0) - ops.log1p(ops.exp(-ops.abs(x)))


def pair_losses(config: PreferenceConfig, chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len):
    """Per-pair losses and rewards (each (B,) fp32) from the summed response log-probs (B,) of
    the policy and the reference (ignored by SimPO and ORPO) and the responses' token counts."""
    beta, eps = config.beta, config.label_smoothing
    if config.loss_type in ("simpo", "orpo"):
        avg_c, avg_r = chosen / chosen_len, rejected / rejected_len
        rewards = beta * avg_c, beta * avg_r
        if config.loss_type == "simpo":
            z = beta * (avg_c - avg_r) - config.simpo_gamma
            return -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z), rewards
        log_odds = (avg_c - avg_r) - (ops.log1p(-ops.exp(avg_c)) - ops.log1p(-ops.exp(avg_r)))
        return -beta * log_sigmoid(log_odds), rewards
    rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    if config.loss_type == "ipo":
        x = (chosen - ref_chosen) / chosen_len - (rejected - ref_rejected) / rejected_len
        return (x - 1 / (2 * beta)) ** 2, rewards
    x = (chosen - ref_chosen) - (rejected - ref_rejected)
    if config.loss_type == "hinge":
        return ops.relu(1 - beta * x), rewards
    if config.loss_type == "robust":
        return (-(1 - eps) * log_sigmoid(beta * x) + eps * log_sigmoid(-beta * x)) / (1 - 2 * eps), rewards
    return -(1 - eps) * log_sigmoid(beta * x) - eps * log_sigmoid(-beta * x), rewards


def preference_loss(config: PreferenceConfig, chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len):
    """The batch loss (fp32 scalar) and the reported means (``REPORTED``'s order)."""
    losses, (reward_c, reward_r) = pair_losses(config, chosen, rejected, ref_chosen, ref_rejected, chosen_len,
                                               rejected_len)
    loss = losses.mean()
    nll_weight = config.sft_weight + (1.0 if config.loss_type == "orpo" else 0.0)
    if nll_weight:  # per token over the batch's chosen responses
        loss = loss - nll_weight * chosen.sum() / ops.maximum(chosen_len.sum(), 1.0)
    reward_c, reward_r = ops.stop_gradient(reward_c), ops.stop_gradient(reward_r)
    return (loss, reward_c.mean(), reward_r.mean(), (reward_c > reward_r).astype(ms.float32).mean(),
            (reward_c - reward_r).mean(), ops.stop_gradient(chosen).mean(), ops.stop_gradient(rejected).mean())


class SequenceLogProbs(nn.Cell):
    """(input_ids, labels) (B, 2, S) → each response's summed log-prob under ``model`` (B, 2)
    fp32, and its token count (B, 2): a forward pass, no gradient."""

    def __init__(self, model: QwenForCausalLM):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, labels):
        b = input_ids.shape[0]
        ids, lab = input_ids.reshape(2 * b, -1), labels.reshape(2 * b, -1)
        logps = self.model.token_log_probs(ids, lab, False).sum(-1).reshape(b, 2)
        return logps, (lab[:, 1:] != IGNORE_INDEX).astype(ms.float32).sum(-1).reshape(b, 2)


class PreferenceLoss(nn.Cell):
    """``fit``'s loss network for preference pairs: (input_ids, labels[, reference_logps]) →
    (loss, *``REPORTED``).

    A batch holds B pairs: input_ids and labels (B, 2, S), chosen row first, labels -100 outside
    the responses, and the reference log-probs (B, 2). One forward runs the 2B rows together and
    takes their log-probs block by block (``QwenForCausalLM.token_log_probs``): the (2B, S, V)
    logits are never whole.

    Args:
        policy: the model that trains.
        config: the loss.
        reference: a model whose log-probs are the reference (``reference_view`` for the
            adapters off, or a frozen copy): ``prepare`` adds them to each batch before the step,
            from a graph of their own (no backward, and its memory is free again when the step
            runs); None: the batch brings them (computed before training), or the loss needs
            none (SimPO, ORPO). A loss that needs them refuses a batch without them
            (``ValueError``, naming the loss type), never reading them as zeros.
    """

    reported = REPORTED

    def __init__(self, policy: nn.Cell, config: PreferenceConfig, reference: Optional[nn.Cell] = None):
        super().__init__(auto_prefix=False)
        self.policy, self.config = policy, config
        self.reference = SequenceLogProbs(reference) if reference is not None and config.uses_reference else None
        # Why a batch without reference log-probs is refused (None: it is not): a loss that compares
        # with a reference, built without a reference model, never stands in zeros for one.
        self.missing_reference = None if self.reference is not None or not config.uses_reference else (
            f"preference loss {config.loss_type!r} needs reference log-probs, and this PreferenceLoss has no "
            "reference model to compute them: give the data reference_logps (N, 2) (sequence_log_probs under "
            "the reference, for every split it trains or evaluates on), or PreferenceLoss(policy, config, "
            "reference) with reference_view(model) (LoRA: the adapters off) or frozen_copy(model); simpo and "
            "orpo need none")

    def check_reference(self, *splits) -> None:
        """Refuse, before training, data this loss would find no reference log-probs for.

        Raises:
            ValueError: a split (a ``TokenDataset``; None is skipped) has no ``reference_logps``
                and the loss needs them (``missing_reference``).
        """
        if self.missing_reference and any(d is not None and d.reference_logps is None for d in splits):
            raise ValueError(self.missing_reference)

    def prepare(self, batch: tuple) -> tuple:
        """Host side, before each step (``Stepper``) and evaluation: ``batch`` with its pairs'
        reference log-probs, when this loss computes them.

        Raises:
            ValueError: the loss needs reference log-probs, and neither this loss nor ``batch`` has them.
        """
        if len(batch) > 2:
            return batch
        if self.missing_reference:
            raise ValueError(self.missing_reference)
        return batch if self.reference is None else tuple(batch) + (self.reference(*batch[:2])[0],)

    def construct(self, input_ids, labels, reference_logps=None):
        b = input_ids.shape[0]
        ids = input_ids.swapaxes(0, 1).reshape(2 * b, -1)  # (2B, S): the chosen rows, then the rejected
        lab = labels.swapaxes(0, 1).reshape(2 * b, -1)
        logps = self.policy.token_log_probs(ids, lab).sum(-1)  # (2B,)
        counts = ops.maximum((lab[:, 1:] != IGNORE_INDEX).astype(ms.float32).sum(-1), 1.0)
        if reference_logps is None:
            if self.missing_reference:  # a call that skipped ``prepare`` (compile-time constant)
                raise ValueError(self.missing_reference)
            ref = ops.zeros_like(logps)  # SimPO, ORPO: not read
        else:
            ref = reference_logps.swapaxes(0, 1).reshape(-1).astype(ms.float32)
        return preference_loss(self.config, logps[:b], logps[b:], ref[:b], ref[b:], counts[:b], counts[b:])


def reference_view(model: QwenForCausalLM) -> QwenForCausalLM:
    """``model`` with its adapters off: a second Cell tree over the same frozen base weights (the
    very Parameters, no copy), the reference of LoRA preference tuning.

    Raises:
        ValueError: a base weight trains (a full fine-tune has no adapters to switch off).
    """
    with no_init_parameters():  # every weight is the model's own
        view = QwenForCausalLM(model.config, options=model.options, compile_once=model.model.compile_once)
    weights = {p.name: p for p in model.get_parameters()}
    for _, cell in view.cells_and_names():
        for attr in ("weight", "bias"):
            own = getattr(cell, attr, None)
            if not isinstance(own, Parameter):
                continue
            shared = weights.get(own.name)
            if shared is None or shared.requires_grad:
                raise ValueError(f"reference adapter_off needs a model whose base weights are frozen (LoRA): "
                                 f"{own.name} {'trains' if shared is not None else 'is not in the model'}; "
                                 "use reference precompute or model")
            cell.insert_param_to_cell(attr, shared)
    return view


def frozen_copy(model: QwenForCausalLM) -> QwenForCausalLM:
    """``model`` as a frozen reference beside the policy: parameters renamed ``reference.<name>``
    (the two models' weights share a process and a checkpoint's names), none trained."""
    for p in model.get_parameters():
        p.name, p.requires_grad = f"reference.{p.name}", False
    invalidate_compiled_graphs(model)  # frozen now: its layers regroup (compile once) as a LoRA base's do
    return model


def default_preference_loss(model: QwenForCausalLM, data, config: Optional[PreferenceConfig] = None) -> PreferenceLoss:
    """``fit``'s loss for preference pairs: ``config`` (default sigmoid DPO) against the
    reference the data or the model offers: ``data.reference_logps``, else the adapters off.

    Raises:
        ValueError: no reference there (a full fine-tune without precomputed log-probs).
    """
    config = config or PreferenceConfig()
    if not config.uses_reference or data.reference_logps is not None:
        return PreferenceLoss(model, config)
    if all(p.requires_grad for p in model.get_parameters()):
        raise ValueError("preference pairs without reference_logps train with the adapters off as the reference, "
                         "and this model has none: apply LoRA, give reference_logps (precompute_reference), "
                         "or a loss_net with a reference model")
    return PreferenceLoss(model, config, reference_view(model))


def sequence_log_probs(model: QwenForCausalLM, data, batch_size: int = 8):
    """Every pair's (summed log-probs, token counts) under ``model``, each (N, 2) float32 numpy;
    one graph (the last batch is padded with the first rows)."""
    net = SequenceLogProbs(model)
    was = model.training
    net.set_train(False)
    logps, counts = [], []
    for start in range(0, len(data), batch_size):
        index = np.arange(start, start + batch_size) % len(data)
        n = min(batch_size, len(data) - start)
        lp, c = net(*(ms.Tensor(a) for a in data.rows(index)[:2]))
        logps.append(lp.asnumpy()[:n])
        counts.append(c.asnumpy()[:n])
    model.set_train(was)
    return np.concatenate(logps), np.concatenate(counts)


def preference_accuracy(model: QwenForCausalLM, data, batch_size: int = 8) -> float:
    """Share of pairs whose chosen response the model finds likelier than the rejected one, per
    token (the reference-free view of what preference tuning teaches)."""
    logps, counts = sequence_log_probs(model, data, batch_size)
    average = logps / np.maximum(counts, 1)
    return float(np.mean(average[:, 0] > average[:, 1]))
