"""The OpenAI request bodies ``mindqwen serve`` accepts, as typed models (pydantic).

Every field a client may send is declared with its type and range, so a bad value is a 400
naming the field, never a 500. Fields of the OpenAI API that are not supported yet are refused
by name (``UNSUPPORTED``) unless they carry their neutral value; unknown fields are ignored, as
OpenAI-compatible servers do. ``top_k`` and ``repetition_penalty`` are extensions (as in vLLM).
"""
from __future__ import annotations

from typing import List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STOP = 4  # stop sequences per request, as OpenAI
MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # as OpenAI
# field → (its neutral values, why it is refused otherwise)
UNSUPPORTED = {
    "best_of": ((None, 1), "best_of is not supported"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
    "presence_penalty": ((None, 0, 0.0), "presence_penalty is not supported (repetition_penalty is)"),
    "frequency_penalty": ((None, 0, 0.0), "frequency_penalty is not supported (repetition_penalty is)"),
    "tools": ((None, []), "tools (function calling) are not supported"),
    "tool_choice": ((None, "none"), "tool_choice is not supported"),
    "functions": ((None, []), "functions are not supported"),
    "function_call": ((None, "none"), "function_call is not supported"),
    "response_format": ((None, {"type": "text"}), "response_format other than text is not supported"),
}


class UnsupportedField(ValueError):
    """A known OpenAI field this server does not implement: a 400 naming ``field``."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """What both endpoints share: sampling, stopping, streaming."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = Field(None, ge=0)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=10, allow_inf_nan=False)
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = Field(None, ge=0, le=2 ** 63 - 1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=MAX_N)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name, (neutral, why) in UNSUPPORTED.items():
                if name in data and not any(data[name] == v and type(data[name]) is type(v) or data[name] is v
                                            for v in neutral):
                    raise UnsupportedField(name, why)
        return data

    @model_validator(mode="after")
    def _check_stop(self):
        stops = self.stop_list()
        if len(stops) > MAX_STOP or not all(stops):
            raise ValueError(f"stop must be a string or a list of at most {MAX_STOP} non-empty strings")
        return self

    def stop_list(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def top_logprobs_wanted(self) -> Optional[int]:
        """None: no log-probabilities; k: the chosen token's and the k most likely."""
        raise NotImplementedError

    def _no_streamed_logprobs(self):
        if self.stream and self.top_logprobs_wanted() is not None:
            raise UnsupportedField("logprobs", "logprobs with stream are not supported yet")
        return self


class CompletionRequest(Sampling):
    """POST /v1/completions: a prompt (text or token ids), or a list of them (one choice each)."""

    prompt: Union[str, List[int], List[str], List[List[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)  # the chosen token's and this many more
    echo: bool = False

    @model_validator(mode="after")
    def _check_prompt(self):
        if not self.prompts() or not all(len(p) for p in self.prompts()):
            raise ValueError("prompt must be non-empty (a string, token ids, or a list of them)")
        if self.echo and self.logprobs is not None:
            raise UnsupportedField("echo", "echo with logprobs (the prompt's log-probabilities) is not supported")
        return self._no_streamed_logprobs()

    def top_logprobs_wanted(self) -> Optional[int]:
        return self.logprobs

    def prompts(self) -> List[Union[str, List[int]]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: dict


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, List[Union[TextPart, ImagePart]]]

    def text(self, image: Optional[str] = None) -> str:
        """The content as text; image parts become ``image`` (a multimodal model's placeholder)."""
        if isinstance(self.content, str):
            return self.content
        if image is None and any(isinstance(p, ImagePart) for p in self.content):
            raise UnsupportedField("messages", "image content parts need a multimodal model; this one is text-only")
        return "".join(p.text if isinstance(p, TextPart) else image for p in self.content)

    def image_urls(self) -> List[str]:
        """The ``image_url.url`` of each image part."""
        if isinstance(self.content, str):
            return []
        return [p.image_url.get("url") for p in self.content if isinstance(p, ImagePart)]


class ChatRequest(Sampling):
    """POST /v1/chat/completions."""

    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self._no_streamed_logprobs()

    def top_logprobs_wanted(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def rendered_messages(self, image: Optional[str] = None) -> List[dict]:
        """{role, content} strings for the chat template (``developer`` is OpenAI's new ``system``);
        image parts become ``image`` (None: refused, the model is text-only)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(image)}
                for m in self.messages]
