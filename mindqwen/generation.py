"""Text generation with a static-shape KV cache: one prefill graph, one T=1 decode graph.

``generate(model, input_ids, max_new_tokens=…, do_sample=False, …)`` is the public entry and,
like HF, returns the prompt followed by the new tokens, [B, S+N] int32. ``Generator`` returns
per-row text and finish reasons; the compiled graphs stay with the model (``compiled_steps``),
so later calls and other generators over it do not recompile. Both run a
``SlotBatch``: rows join between decode steps and leave when they end (the server keeps one
running; ``generate`` joins every prompt at once).

Token choice happens on the host in numpy, in HF's order: repetition penalty → temperature →
top-k → top-p → greedy argmax or a draw. Prefill has a dynamic shape (it compiles once); decode
has static shapes (a dynamic decode graph runs ~4× slower on CPU) and compiles once per (rows,
cache length) bucket: rows are a power of two, the length a ``cache_length`` bucket.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops
from tqdm import tqdm

from mindqwen.config import QwenConfig
from mindqwen.models.graph import in_mode, kept_on_model
from mindqwen.models.kv_cache import (CachedLM, CachedStep, CacheLayout, ImageCachedStep, ImageConditionedLM,
                                      ImageKeysValues, linear_states)

CACHE_BLOCK = 64
PREFILL_BUCKET = 64  # a hybrid model's prompts pad to a multiple of this (its prefill compiles per shape)
FILTER_ACTIONS = ("drop", "mask", "stop")
# on_token(row, token_id, text_delta): text_delta is "" without a tokenizer or while a
# character (or a possible blocked pattern) is incomplete.
TokenCallback = Callable[[int, int, str], None]


@dataclass
class GenerationConfig:
    """How to choose tokens and when to stop (HF ``generate`` semantics).

    Attributes:
        max_new_tokens: tokens to add at most.
        do_sample: draw from the distribution instead of taking the argmax.
        temperature, top_k, top_p: sampling warpers (``top_k`` 0 and ``top_p`` 1.0 are off).
        repetition_penalty: > 1 discourages tokens already in the row (prompt included), as in
            CTRL: positive scores are divided by it, negative ones multiplied.
        eos_token_id: id or ids that end a row (kept in the output, like HF).
        stop_strings: a row ends once its generated text contains one (needs a tokenizer).
        pad_token_id: fills finished rows (default: the first eos id, else 0).
        seed: seeds the sampler; None draws fresh entropy.
        top_logprobs: None, or k >= 0: record each new token's log-probability under the
            model (log-softmax of the raw logits, before penalties and warpers) and the k most
            likely tokens' (``RowResult.logprobs``).
    """

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    eos_token_id: Optional[Union[int, Sequence[int]]] = None
    stop_strings: Sequence[str] = ()
    pad_token_id: Optional[int] = None
    seed: Optional[int] = None
    top_logprobs: Optional[int] = None
    eos_ids: Tuple[int, ...] = field(init=False, repr=False)
    pad_id: int = field(init=False, repr=False)  # pad_token_id, else the first eos id, else 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.top_logprobs is not None and (not isinstance(self.top_logprobs, int) or self.top_logprobs < 0):
            raise ValueError(f"top_logprobs must be None or an integer >= 0, got {self.top_logprobs!r}")
        if isinstance(self.stop_strings, str):
            self.stop_strings = (self.stop_strings,)
        eos = self.eos_token_id
        self.eos_ids = () if eos is None else tuple(int(e) for e in np.atleast_1d(eos))
        self.pad_id = self.pad_token_id if self.pad_token_id is not None else (self.eos_ids or (0,))[0]


def process_logits(logits: np.ndarray, seen: np.ndarray, config: GenerationConfig) -> np.ndarray:
    """HF's logits processors for one row: logits (V,) fp32, seen = ids already in the row.

    Returns scores where removed tokens are -inf.
    """
    scores = logits.astype(np.float32, copy=True)
    if config.repetition_penalty != 1.0 and len(seen):
        ids = np.unique(seen)
        s = scores[ids]
        scores[ids] = np.where(s < 0, s * config.repetition_penalty, s / config.repetition_penalty)
    if not config.do_sample:
        return scores
    scores = scores / np.float32(config.temperature)
    if 0 < config.top_k < scores.size:
        kth = np.partition(scores, -config.top_k)[-config.top_k]
        scores[scores < kth] = -np.inf
    if config.top_p < 1.0:
        order = np.argsort(scores, kind="stable")  # ascending, as HF's TopPLogitsWarper
        probs = softmax(scores[order])
        remove = np.cumsum(probs) <= 1 - config.top_p
        remove[-1] = False  # keep at least the most likely token
        scores[order[remove]] = -np.inf
    return scores


def softmax(scores: np.ndarray) -> np.ndarray:
    e = np.exp(scores - scores.max())
    return e / e.sum()


def choose_token(scores: np.ndarray, config: GenerationConfig, rng: np.random.Generator) -> int:
    """The argmax (greedy) or a draw from softmax(scores)."""
    if not config.do_sample:
        return int(np.argmax(scores))
    probs = softmax(scores.astype(np.float64))
    return int(rng.choice(probs.size, p=probs))


class OutputFilter:
    """A block-list applied to generated text: literal strings or ``re:``-prefixed patterns.

    Actions: ``mask`` replaces each match with ``*`` of its length, ``drop`` removes it,
    ``stop`` ends the row and cuts the text before the match (finish reason ``content_filter``).
    While streaming, the last ``holdback`` characters are held until they cannot start a match.

    Args:
        block: strings to block; ``re:<pattern>`` is a regular expression (case-sensitive).
        action: drop | mask | stop.
        holdback: characters held back while streaming; default the longest literal, or 64
            when patterns are present.
    """

    def __init__(self, block: Sequence[str], action: str = "mask", holdback: Optional[int] = None):
        if action not in FILTER_ACTIONS:
            raise ValueError(f"output filter action must be one of {FILTER_ACTIONS}, got {action!r}")
        if isinstance(block, str) or not all(isinstance(b, str) and b for b in block):
            raise ValueError(f"output filter block must be a list of non-empty strings, got {block!r}")
        parts = []
        for b in block:
            try:
                parts.append(re.compile(b[3:]).pattern if b.startswith("re:") else re.escape(b))
            except re.error as e:
                raise ValueError(f"output filter pattern {b!r}: {e}") from None
        self.regex = re.compile("|".join(f"(?:{p})" for p in parts)) if parts else None
        self.action = action
        literal = [len(b) for b in block if not b.startswith("re:")]
        self.holdback = holdback if holdback is not None else (
            64 if len(literal) < len(block) else max(literal, default=1) - 1)

    def apply(self, text: str) -> Tuple[str, bool]:
        """Filtered text, and whether a match ends the row (action ``stop``)."""
        if self.regex is None:
            return text, False
        if self.action == "stop":
            m = self.regex.search(text)
            return (text[:m.start()], True) if m else (text, False)
        repl = "" if self.action == "drop" else (lambda m: "*" * len(m.group(0)))
        return self.regex.sub(repl, text), False


class TokenLogprob(NamedTuple):
    """One new token's log-probabilities under the model (a tuple, so ``for tok, lp, top in …``
    still reads it).

    Attributes:
        token: the chosen id.
        logprob: its log-probability.
        top: (id, log-probability) of the most likely tokens, most likely first.
    """

    token: int
    logprob: float
    top: List[Tuple[int, float]]


@dataclass
class RowResult:
    """One row's generation: new token ids, their text (filtered), why it ended (``stop``
    eos/stop string, ``length`` max_new_tokens, ``content_filter`` a blocked string,
    ``cancelled``) and, with ``top_logprobs``, each token's log-probabilities."""

    tokens: List[int]
    text: Optional[str]
    finish_reason: str
    logprobs: Optional[List[TokenLogprob]] = None


class _Row:
    """Host-side state of one row while generating; ``owner`` is the caller's name for it (an
    index, a serving job)."""

    def __init__(self, prompt: Sequence[int], config: GenerationConfig, owner, tokenizer, output_filter,
                 image: Optional[np.ndarray] = None):
        self.prompt, self.config, self.owner = [int(t) for t in prompt], config, owner
        self.image = image  # a multimodal model's pixel values for this row, or None
        self.sees_image = False  # the image token has been read: later tokens attend to the image
        self.tokenizer, self.filter = tokenizer, output_filter
        self.rng = np.random.default_rng(config.seed)
        self.seen = list(self.prompt)
        self.tokens: List[int] = []
        self.cached = 0  # tokens of this row in the KV cache (its next position id)
        self.slot = 0  # the cache slot its next token's keys/values go to
        self.finish: Optional[str] = None
        self.error: Optional[Exception] = None  # choosing a token failed: the row ends with it
        self.text, self.emitted = "", 0
        self.logprobs: Optional[List[TokenLogprob]] = [] if config.top_logprobs is not None else None

    def step(self, logits: np.ndarray) -> Tuple[int, str]:
        """Choose the next token; returns it and the newly final text."""
        tok = choose_token(process_logits(logits, np.asarray(self.seen), self.config), self.config, self.rng)
        if self.logprobs is not None:
            lp = logits.astype(np.float64) - logits.max()
            lp -= np.log(np.exp(lp).sum())
            top = np.argsort(-lp, kind="stable")[:self.config.top_logprobs]
            self.logprobs.append(TokenLogprob(tok, float(lp[tok]), [(int(i), float(lp[i])) for i in top]))
        self.tokens.append(tok)
        self.seen.append(tok)
        delta = self._update_text() if self.tokenizer is not None else ""
        if self.finish is None and tok in self.config.eos_ids:
            self.finish = "stop"
        elif self.finish is None and len(self.tokens) >= self.config.max_new_tokens:
            self.finish = "length"
        if self.finish is not None and self.tokenizer is not None:
            delta += self._flush()
        return tok, delta

    def _update_text(self) -> str:
        raw = self.tokenizer.decode([t for t in self.tokens if t not in self.config.eos_ids])
        for s in self.config.stop_strings:
            at = raw.find(s)
            if at >= 0:
                raw, self.finish = raw[:at + len(s)], "stop"
        if self.filter is not None:
            raw, blocked = self.filter.apply(raw)
            if blocked:
                self.finish = "content_filter"
        self.text = raw
        hold = 0 if self.finish else (self.filter.holdback if self.filter is not None else 0)
        end = len(raw) - hold
        while end > 0 and raw[end - 1] == "\ufffd" and not self.finish:  # an unfinished character
            end -= 1
        return self._emit(max(end, self.emitted))

    def _flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        delta, self.emitted = self.text[self.emitted:end], max(self.emitted, end)
        return delta

    def result(self) -> RowResult:
        return RowResult(self.tokens, self.text if self.tokenizer is not None else None, self.finish or "length",
                         self.logprobs)

    def writes_left(self) -> int:
        """Cache slots this row still writes: every token it will choose but the last."""
        return self.config.max_new_tokens - max(len(self.tokens), 1)


@dataclass(frozen=True)
class ImageSteps:
    """What a multimodal model's rows need beside the text steps.

    Attributes:
        keys_values: the graph from pixel values (B, *pixel_shape) to every cross-attention
            block's image keys and values, each (C, B, heads, Nv, D) (``ImageKeysValues``).
        token_id: the image token: a row's tokens from it on attend to the row's image.
        pixel_shape: one image's pixel values: (3, S, S), or (T, 3, S, S) for a video model.
        kv_shape: one image's keys (or values), (C, 1, heads, Nv, D).
    """

    keys_values: Callable
    token_id: int
    pixel_shape: Tuple[int, ...]
    kv_shape: Tuple[int, ...]

    @classmethod
    def of(cls, model: ImageConditionedLM, keys_values: Callable) -> "ImageSteps":
        v = model.vision_config
        frames = (v.num_frames,) if v.num_frames > 1 else ()
        return cls(keys_values, model.image_token_id, frames + (v.num_channels, v.image_size, v.image_size),
                   tuple(model.cross_kv_shape(1)))

    def check(self, prompt: Sequence[int], image, owner) -> Optional[np.ndarray]:
        """A row's image as float32 pixels, checked against the model and its prompt."""
        if image is None:
            if self.token_id in prompt:
                raise ValueError(f"prompt {owner!r} holds the image token {self.token_id} but no image was given")
            return None
        image = np.asarray(image.asnumpy() if isinstance(image, Tensor) else image, np.float32)
        if image.shape != self.pixel_shape:
            raise ValueError(f"prompt {owner!r}: pixel values of shape {image.shape}, the model takes "
                             f"{self.pixel_shape} (mindqwen.multimodal.data.image_transforms)")
        if self.token_id not in prompt:
            raise ValueError(f"prompt {owner!r} comes with an image but holds no image token "
                             f"({self.token_id}): nothing would attend to it")
        return image

    def rows_keys_values(self, images: Sequence[Optional[np.ndarray]], dtype) -> Tuple[Tensor, Tensor]:
        """The keys and values of one image per row; a row without one gets zeros (masked out).
        When no row has an image the ViT does not run at all."""
        if any(image is not None for image in images):
            zeros = np.zeros(self.pixel_shape, np.float32)
            return tuple(self.keys_values(Tensor(np.stack([zeros if i is None else i for i in images]))))
        zeros = ops.zeros((self.kv_shape[0], len(images)) + self.kv_shape[2:], dtype)
        return zeros, zeros


@dataclass(frozen=True)
class StepGraphs:
    """What a ``SlotBatch`` runs: a model's compiled step graphs and the facts about the model
    that shape their inputs (``Generator`` builds it; ``compiled_steps`` keeps the graphs).

    Attributes:
        prefill: the step over whole prompts (dynamic shapes: it compiles once).
        decode: the T=1 step (static shapes: it compiles per (rows, cache length) bucket).
        config: the model's config: the cache layout (``CacheLayout.of``) and the positions a
            row may use.
        dtype: the dtype the KV cache (and image keys/values) is kept in.
        image: a multimodal model's image steps; None for a text model.
    """

    prefill: Callable
    decode: Callable
    config: QwenConfig
    dtype: object
    image: Optional[ImageSteps] = None

    @classmethod
    def of(cls, model: CachedLM) -> "StepGraphs":
        """The model's graphs (compiled once per model: ``compiled_steps``) and facts."""
        prefill, decode, image_step = compiled_steps(model)
        image = None if image_step is None else ImageSteps.of(model, image_step)
        return cls(prefill, decode, model.config, model.cache_dtype, image)

    @property
    def image_token_id(self) -> Optional[int]:
        """The image token; None for a text model (no token is)."""
        return None if self.image is None else self.image.token_id

    def check_image(self, prompt: Sequence[int], image, owner) -> Optional[np.ndarray]:
        """A row's image as float32 pixels (None without one), checked against the model."""
        if self.image is not None:
            return self.image.check(prompt, image, owner)
        if image is not None:
            raise ValueError(f"prompt {owner!r} comes with an image, but the model has no vision tower")
        return None

    def zero_cache(self, rows: int, length: int) -> Tensor:
        """Keys (or values) of an empty cache: (L, rows, KV, length, D)."""
        return CacheLayout.of(self.config, rows, length).zeros(self.dtype)

    @property
    def state_count(self) -> int:
        """How many linear-attention state tensors travel beside the cache (``linear_states``)."""
        return 2 if "linear_attention" in self.config.layer_types else 0

    def zero_states(self, rows: int) -> Tuple[Tensor, ...]:
        """A hybrid model's empty linear-attention states (``linear_states``); () for other models."""
        return linear_states(self.config, rows)


class _Prefilled(NamedTuple):
    """Joining rows after prefill: the last positions' logits (R, V), their state (k, v, a hybrid
    model's linear-attention states and, multimodal, the image keys and values: rows on axis 1 of
    each) and their slot mask (R, C)."""

    logits: Tensor
    state: Tuple[Tensor, ...]
    mask: np.ndarray


class SlotBatch:
    """The running decode batch: rows join between steps and leave as soon as they end.

    Each row of the cache (L, R, KV, C, D) holds one request: its prompt in slots [S - n, S)
    (left-padded to the longest prompt S it was prefilled with), then one slot per decode step
    at its own write pointer ``row.slot`` (``cache_position`` is per row), so rows that joined at
    different times share one static shape. Position ids count a row's own tokens: a row in a
    batch computes what it computes alone. Joining prompts are prefilled together into a fresh
    cache and gathered into free rows.

    R is a power of two (at most ``max_rows``) and C a ``cache_length`` bucket that every row can
    finish in, so the decode graph compiles once per (R, C); with ``shrink`` both shrink when rows
    leave (a long-lived batch; a one-off batch keeps its shape rather than compile more graphs).

    With a multimodal model each row may carry an image: joining rows' images become the
    cross-attention keys and values once, in prefill (``ImageKeysValues``), and are held beside
    the KV cache (C, R, heads, Nv, D), moving with their rows; tokens from the image token on
    attend to them.

    Args:
        steps: the model's step graphs and the facts that shape their inputs
            (``Generator.steps``).
        max_rows: rows at most.
        shrink: rebuild the cache smaller when rows leave.
        tokenizer: optional; turns each row's tokens into text (``stop_strings``, streaming).
        output_filter: optional block-list applied to each row's text.
    """

    def __init__(self, steps: StepGraphs, max_rows: int, shrink: bool = True, tokenizer=None,
                 output_filter: Optional[OutputFilter] = None):
        self.steps, self.max_rows, self.shrink = steps, max_rows, shrink
        self.tokenizer, self.filter = tokenizer, output_filter
        self.rows: List[Optional[_Row]] = []  # one per cache row; None = free
        self.k = self.v = None  # (L, R, KV, C, D) in the model's dtype
        self.states = ()  # a hybrid model's linear-attention states (``linear_states``), rows on axis 1
        self.images = ()  # multimodal: cross-attention keys and values (C, R, heads, Nv, D)
        self.mask = np.zeros((0, 0), np.int32)  # (R, C): 1 = a real token in that slot
        self.done: List[_Row] = []

    @property
    def active(self) -> List[_Row]:
        return [r for r in self.rows if r is not None]

    @property
    def room(self) -> int:
        return self.max_rows - len(self.active)

    def join(self, prompts: Sequence[Sequence[int]], configs: Sequence[GenerationConfig], owners: Sequence,
             on_token: Optional[TokenCallback] = None, images: Optional[Sequence] = None) -> None:
        """Prefill ``prompts`` into free rows and choose their first tokens (``on_token(owner, …)``).

        Args:
            images: a multimodal model's pixel values per prompt ((3, S, S) or (T, 3, S, S),
                transformed as in training), None for a prompt without an image.

        Raises ValueError, before anything changes, if a prompt is empty or does not fit the
        model's positions with its ``max_new_tokens``, if there is no room, or if an image and
        the prompt's image token do not come together.
        """
        images = list(images) if images is not None else [None] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images for {len(prompts)} prompts")
        rows = [_Row(p, c, owner, self.tokenizer, self.filter, self.steps.check_image(p, image, owner))
                for p, c, owner, image in zip(prompts, configs, owners, images)]
        for row in rows:
            n, m = len(row.prompt), row.config.max_new_tokens
            if n == 0:
                raise ValueError(f"prompt {row.owner!r} is empty: every prompt needs at least one token")
            model_config = self.steps.config
            if n + m > model_config.context_length:
                raise ValueError(f"prompt {row.owner!r}: {n} tokens + max_new_tokens {m} = {n + m} exceeds the model's "
                                 f"{model_config.context_length} positions ({model_config.context_rule})")
        if sum(r.config.max_new_tokens > 0 for r in rows) > self.room:
            raise ValueError(f"{len(rows)} prompts cannot join: room for {self.room}")
        self.done += [r for r in rows if r.config.max_new_tokens == 0]
        rows = [r for r in rows if r.config.max_new_tokens > 0]
        if not rows:
            return
        s = max(len(r.prompt) for r in rows)
        if self.steps.state_count:  # static prefill shapes (compiled_steps): prompts padded to a bucket
            s = _round_up(s, PREFILL_BUCKET)
        length = cache_length(max([s + r.writes_left() for r in rows] +
                                  [r.slot + r.writes_left() for r in self.active]))
        joining = self._prefill(rows, s, length)  # first: a failure changes nothing
        self._relayout(self.active + rows, length, joining)
        logits = joining.logits.asnumpy()
        for i, row in enumerate(rows):
            row.cached, row.slot = len(row.prompt), s
            self._choose(row, logits[i], on_token)
        self._leave()

    def step(self, on_token: Optional[TokenCallback] = None, cancelled: Optional[Callable] = None) -> None:
        """One decode step for every row; ``cancelled(owner)`` is asked first and ends a row."""
        for row in self.active:
            if cancelled is not None and cancelled(row.owner):
                row.finish = "cancelled"
        self._leave()
        if not self.active:
            return
        ids, positions, slots = (np.zeros((len(self.rows), 1), np.int32) for _ in range(3))
        sees = np.zeros((len(self.rows), 1, 1), np.float32)
        for i, row in enumerate(self.rows):
            if row is not None:  # free rows write slot 0 of their (masked-out) copy
                ids[i, 0], positions[i, 0], slots[i, 0] = row.tokens[-1], row.cached, row.slot
                self.mask[i, row.slot] = 1
                row.sees_image |= row.tokens[-1] == self.steps.image_token_id
                sees[i] = row.sees_image
        images = (*self.images, Tensor(sees)) if self.images else ()
        logits, self.k, self.v, *states = self.steps.decode(Tensor(ids), Tensor(positions), Tensor(self.mask),
                                                            Tensor(slots), self.k, self.v, *self.states, *images)
        self.states = tuple(states)
        logits = logits.asnumpy()
        for i, row in enumerate(self.rows):
            if row is not None:
                row.cached, row.slot = row.cached + 1, row.slot + 1
                self._choose(row, logits[i], on_token)
        self._leave()

    def pop_finished(self) -> List[_Row]:
        """Rows that ended since the last call (``row.owner``, ``row.result()``, ``row.error``)."""
        done, self.done = self.done, []
        return done

    def _choose(self, row: _Row, logits: np.ndarray, on_token: Optional[TokenCallback]) -> None:
        try:
            tok, delta = row.step(logits)
        except Exception as e:  # noqa: BLE001 - host-side: the row's own failure, not the batch's
            row.error, row.finish = e, "error"
            return
        if on_token is not None:
            on_token(row.owner, tok, delta)

    def _prefill(self, rows: List[_Row], s: int, length: int) -> _Prefilled:
        """Prefill ``rows`` left-padded into slots [0, s) of a fresh (L, k, KV, length, D) cache."""
        ids = np.zeros((len(rows), s), np.int32)
        positions = np.zeros_like(ids)
        mask = np.zeros((len(rows), length), np.int32)
        sees = np.zeros((len(rows), s, 1), np.float32)  # multimodal: from the image token on
        image = self.steps.image
        for i, row in enumerate(rows):
            n = len(row.prompt)
            ids[i, s - n:], positions[i, s - n:], mask[i, s - n:s] = row.prompt, np.arange(n), 1
            if image is not None:
                sees[i, s - n:, 0] = np.cumsum(np.asarray(row.prompt) == image.token_id) > 0
                row.sees_image = bool(sees[i, -1, 0])
        slots = np.tile(np.arange(s, dtype=np.int32), (len(rows), 1))
        images = () if image is None else image.rows_keys_values([r.image for r in rows], self.steps.dtype)
        logits, k, v, *states = self.steps.prefill(Tensor(ids), Tensor(positions), Tensor(mask), Tensor(slots),
                                                   self.steps.zero_cache(len(rows), length),
                                                   self.steps.zero_cache(len(rows), length),
                                                   *self.steps.zero_states(len(rows)),
                                                   *(images + (Tensor(sees),) if images else ()))
        return _Prefilled(logits, (k, v, *states) + images, mask)

    def _leave(self) -> None:
        """Move ended rows to ``done``; shrink the cache if the rows left need less."""
        for i, row in enumerate(self.rows):
            if row is not None and row.finish is not None:
                self.done.append(row)
                self.rows[i], self.mask[i] = None, 0
        live = self.active
        if not live:
            self.rows, self.k, self.v, self.mask, self.images = [], None, None, np.zeros((0, 0), np.int32), ()
            self.states = ()
            return
        if not self.shrink:
            return
        length = cache_length(max(r.slot + r.writes_left() for r in live))
        if _rows_bucket(len(live), self.max_rows) < len(self.rows) or length < self.mask.shape[1]:
            self._relayout(live, length)

    def _relayout(self, live: List[_Row], length: int, joining: Optional[_Prefilled] = None) -> None:
        """Rebuild the cache with the rows ``live`` (those present, then the ``joining`` ones)
        first, ``length`` slots each."""
        rows = _rows_bucket(len(live), self.max_rows) if self.shrink else self.max_rows
        present = [i for i, r in enumerate(self.rows) if r is not None]
        states, mask = [], []  # per source: (k, v, linear-attention states, image keys, values), rows on axis 1
        if present:
            states.append((_fit_slots(self.k, length, 3), _fit_slots(self.v, length, 3)) + self.states + self.images)
            mask.append(_fit_slots(self.mask, length, 1))
        if joining is not None:
            states.append(joining.state), mask.append(joining.mask)
        offset = len(self.rows) if present else 0
        take = present + list(range(offset, offset + len(live) - len(present)))
        take += [take[0]] * (rows - len(take))  # free rows: any data, masked out
        index = Tensor(np.array(take, np.int32))
        state = [ops.gather(ops.cat(parts, 1) if len(parts) > 1 else parts[0], index, 1) for parts in zip(*states)]
        n = self.steps.state_count
        self.k, self.v = state[0], state[1]
        self.states, self.images = tuple(state[2:2 + n]), tuple(state[2 + n:])
        self.mask = np.concatenate(mask)[take]
        self.mask[len(live):] = 0
        self.rows = live + [None] * (rows - len(live))


def cache_length(n: int) -> int:
    """The cache length bucket for ``n`` slots: multiples of CACHE_BLOCK up to 256, then a
    quarter of the power of two below (320, 384, …, 640, 768, …): at most 25% unused."""
    return _round_up(n, max(CACHE_BLOCK, 1 << max((n - 1).bit_length() - 3, 0)))


def _rows_bucket(n: int, max_rows: int) -> int:
    return min(1 << max(n - 1, 0).bit_length(), max_rows)


def _fit_slots(x, length: int, axis: int):
    """``x`` (numpy or MindSpore) cut or zero-padded to ``length`` slots along ``axis`` (the
    slots cut are past every row's write pointer: empty)."""
    n = x.shape[axis]
    if n > length:
        return x[(slice(None),) * axis + (slice(0, length),)]
    if n == length:
        return x
    cat, zeros = (np.concatenate, np.zeros) if isinstance(x, np.ndarray) else (ops.cat, ops.zeros)
    return cat((x, zeros(x.shape[:axis] + (length - n,) + x.shape[axis + 1:], dtype=x.dtype)), axis)


class Generator:
    """Batched KV-cache generation over one model (whose compiled graphs stay with it).

    Args:
        model: a ``QwenForCausalLM``, or a ``MultimodalQwen`` (prompts may then come with
            images); put in inference mode.
        tokenizer: optional; needed for text, ``stop_strings`` and ``output_filter``.
        output_filter: optional block-list applied to generated text.

    Attributes:
        steps: the model's step graphs and facts (``StepGraphs``), built once: every batch
            this generator makes (``batch``) runs them.
    """

    def __init__(self, model: CachedLM, tokenizer=None, output_filter: Optional[OutputFilter] = None):
        if not isinstance(model, CachedLM):
            raise TypeError(f"a Generator runs a model with a KV-cache step (CachedLM), not a {type(model).__name__}")
        model.set_train(False)
        self.model, self.tokenizer, self.filter = model, tokenizer, output_filter
        self.steps = StepGraphs.of(model)

    @property
    def image_token_id(self) -> Optional[int]:
        """A multimodal model's image token; None for a text model."""
        return self.steps.image_token_id

    def batch(self, max_rows: int, shrink: bool = True) -> SlotBatch:
        """An empty ``SlotBatch`` over this generator's graphs, tokenizer and output filter."""
        return SlotBatch(self.steps, max_rows, shrink, self.tokenizer, self.filter)

    def run(self, prompts: Sequence[Sequence[int]], configs: Union[GenerationConfig, Sequence[GenerationConfig]],
            on_token: Optional[TokenCallback] = None, progress: bool = False,
            cancelled: Optional[Callable[[int], bool]] = None, images: Optional[Sequence] = None,
            rows: int = 0) -> List[RowResult]:
        """Generate for each prompt (lists of ids, any lengths) in one ``SlotBatch``.

        ``on_token(row, token, text)`` streams; ``cancelled(row)`` is asked before every decode
        step, and a row it answers True for ends there (finish reason ``cancelled``). ``images``:
        a multimodal model's pixel values per prompt (see ``SlotBatch.join``). ``rows``: cache
        rows to hold at least (free ones masked out): calls with fewer prompts then run the
        decode graph already compiled for that many (in the same cache-length bucket).
        """
        if not len(prompts):
            raise ValueError("no prompts to generate for")
        if isinstance(configs, GenerationConfig):
            configs = [configs] * len(prompts)
        if self.tokenizer is None and (self.filter is not None or any(c.stop_strings for c in configs)):
            raise ValueError("stop_strings and output filters work on text: pass a tokenizer")
        batch = self.batch(max(rows, len(prompts)), shrink=False)  # one decode graph for the whole run
        with self.graph_mode(), tqdm(total=max(c.max_new_tokens for c in configs), desc="generating",
                                     unit="tok", disable=not progress) as bar:
            batch.join(prompts, configs, range(len(prompts)), on_token, images)
            bar.update()
            while batch.active:
                batch.step(on_token, cancelled)
                bar.update()
        rows = sorted(batch.pop_finished(), key=lambda r: r.owner)
        for row in rows:
            if row.error is not None:
                raise row.error
        return [row.result() for row in rows]

    def graph_mode(self):
        """The step graphs compile whatever mode the caller is in; the caller's mode comes back."""
        return in_mode(ms.GRAPH_MODE)


def compiled_steps(model) -> tuple:
    """The model's (prefill, decode, image step or None) Cells, kept on the model
    (``kept_on_model``): every ``Generator`` made over it (another tokenizer or filter, each
    evaluation, each ``generate`` call) runs the graphs compiled so far, until the model changes
    (the step Cells above the model keep their own stamps, so their graphs would be stale). A
    ``Generator`` made before the change keeps the old Cells."""
    def build() -> tuple:
        multimodal = isinstance(model, ImageConditionedLM)
        step = ImageCachedStep if multimodal else CachedStep
        prefill, decode = step(model), step(model)
        # A hybrid model's chunked delta rule unrolls one state update per chunk of the prompt: its
        # prefill compiles per prompt bucket (PREFILL_BUCKET) instead of once for any shape.
        if "linear_attention" not in model.config.layer_types:
            prefill.set_inputs(*_dynamic_prefill_inputs(model.cache_dtype, multimodal))
        return prefill, decode, ImageKeysValues(model) if multimodal else None
    return kept_on_model(model, "_mindqwen_steps", build)


def _dynamic_prefill_inputs(dtype, multimodal: bool = False) -> tuple:
    """Input signature of the prefill graph: any batch, sequence and cache length (and, for a
    multimodal model, its image keys/values and vision mask)."""
    i32 = ms.int32
    inputs = (Tensor(shape=[None, None], dtype=i32), Tensor(shape=[None, None], dtype=i32),
              Tensor(shape=[None, None], dtype=i32), Tensor(shape=[None, None], dtype=i32),
              Tensor(shape=[None] * 5, dtype=dtype), Tensor(shape=[None] * 5, dtype=dtype))
    if not multimodal:
        return inputs
    return inputs + (Tensor(shape=[None] * 5, dtype=dtype), Tensor(shape=[None] * 5, dtype=dtype),
                     Tensor(shape=[None, None, 1], dtype=ms.float32))


def _round_up(n: int, block: int) -> int:
    return int(math.ceil(n / block) * block)


def generate(model, input_ids, max_new_tokens: int = 32, do_sample: bool = False,
             attention_mask=None, tokenizer=None, output_filter: Optional[OutputFilter] = None,
             on_token: Optional[TokenCallback] = None, progress: bool = False, pixel_values=None,
             **kwargs) -> np.ndarray:
    """Continue ``input_ids`` [B, S] (a left-padded batch with ``attention_mask``, or a list of
    prompts of any lengths); returns prompt + new tokens [B, S+N] int32, like HF. A
    ``MultimodalQwen`` takes ``pixel_values`` (B, 3, S, S) or (B, T, 3, S, S), one image per row.

    Keyword arguments are ``GenerationConfig`` fields (temperature, top_k, top_p,
    repetition_penalty, eos_token_id, stop_strings, pad_token_id, seed). Rows that end early
    are padded with ``pad_token_id``. The compiled graphs are kept per model, so later calls
    with the same shapes do not recompile.
    """
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample, **kwargs)
    prompts, padded = _prompts(input_ids, attention_mask)
    gen = Generator(model, tokenizer, output_filter)  # the model keeps its compiled graphs (compiled_steps)
    results = gen.run(prompts, config, on_token, progress, images=None if pixel_values is None else list(
        pixel_values.asnumpy() if isinstance(pixel_values, Tensor) else pixel_values))
    n = max(len(r.tokens) for r in results)
    new = np.full((len(results), n), config.pad_id, np.int32)
    for i, r in enumerate(results):
        new[i, :len(r.tokens)] = r.tokens
    return np.concatenate([padded, new], 1)


def _prompts(input_ids, attention_mask) -> Tuple[List[np.ndarray], np.ndarray]:
    """Rows without their padding, and the [B, S] array they came from."""
    if isinstance(input_ids, ms.Tensor):
        input_ids = input_ids.asnumpy()
    if isinstance(input_ids, (list, tuple)) and input_ids and not np.isscalar(input_ids[0]) \
            and len({len(p) for p in input_ids}) > 1:
        s = max(len(p) for p in input_ids)
        padded = np.zeros((len(input_ids), s), np.int32)
        for i, p in enumerate(input_ids):
            padded[i, s - len(p):] = p
        return [np.asarray(p, np.int32) for p in input_ids], padded
    ids = np.asarray(input_ids, dtype=np.int32)
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seq] with seq > 0, got shape {ids.shape}")
    if attention_mask is None:
        return list(ids), ids
    mask = np.asarray(attention_mask.asnumpy() if isinstance(attention_mask, ms.Tensor) else attention_mask)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask shape {mask.shape} differs from input_ids {ids.shape}")
    if not np.all(np.diff(mask, axis=1) >= 0) or not mask[:, -1].all():
        raise ValueError("attention_mask must be left padding (zeros, then ones) with a token in every row")
    return [row[m.astype(bool)] for row, m in zip(ids, mask)], ids


__all__ = ["GenerationConfig", "Generator", "OutputFilter", "RowResult", "generate"]
