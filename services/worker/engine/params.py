"""Per-request generation parameters and the one validation error the engine raises for them.

This module owns the rules for what a request may ask of the engine; the limits, and the rule each
scalar's range is checked by, are strata/sampling.py's, the one table of sampling parameters, which
the gateway checks by too. It must not import torch: the scheduler validates with it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.sampling import BOUNDS, MAX_LOGIT_BIAS, out_of_bounds

# The engine's scalar fields checked by the table's rule, and the table's name of each: `logprobs`
# here is the count of alternatives, common.proto's top_logprobs; the others share the table's name.
_BOUNDED = {{"top_logprobs": "logprobs"}.get(name, name): name for name in BOUNDS}


class InvalidRequestError(ValueError):
    """A request parameter is out of range. Names the field, the value and the limit it broke."""

    def __init__(self, field_name: str, value: object, limit: str) -> None:
        self.field = field_name
        self.value = value
        self.limit = limit
        super().__init__(f"{field_name}={value!r} is invalid: {limit}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token. Defaults are greedy decoding with no penalties.

    temperature 0 means greedy; top_k 0 and top_p 1.0 mean no filtering; seed None lets the engine
    pick one at admission, so every request draws from the same counter-based noise.

    The OpenAI/vLLM processors (logits_processors.py) are off at their defaults: presence and
    frequency penalties 0, min_p 0, typical_p 1, no logit_bias, min_tokens 0. logprobs None returns no log
    probabilities; N >= 0 returns each sampled token's and its N most likely alternatives'.
    prompt_logprobs likewise for the prompt's tokens. prior_output_tokens counts the trailing prompt
    ids that are a failed worker's output, which the penalties and min_tokens count as output.
    speculate False keeps the request out of speculative decoding where the engine has it on (its
    tokens are the same either way; only its steps' shape changes).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    typical_p: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prior_output_tokens: int = 0
    speculate: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, prompt_len: int, max_model_len: int) -> None:
        """Raise InvalidRequestError for the first parameter out of range."""
        if prompt_len <= 0:
            raise InvalidRequestError("prompt", "<empty>", "the prompt must hold at least one token")
        if prompt_len >= max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{prompt_len} tokens",
                f"must be shorter than the model's context of {max_model_len} tokens",
            )
        room = max_model_len - prompt_len
        if self.max_new_tokens < 1 or self.max_new_tokens > room:
            raise InvalidRequestError(
                "max_new_tokens",
                self.max_new_tokens,
                f"must be in [1, {room}] (context {max_model_len} minus the prompt's {prompt_len} tokens)",
            )
        for name, table_name in _BOUNDED.items():
            value = getattr(self, name)
            problem = None if value is None else out_of_bounds(table_name, value)
            if problem is not None:
                raise InvalidRequestError(name, value, problem)
        for token in self.stop_token_ids:
            if token < 0:
                raise InvalidRequestError("stop_token_ids", token, "token ids must be >= 0")
        self._validate_processors()

    def _validate_processors(self) -> None:
        for token, bias in self.logit_bias:
            if token < 0:
                raise InvalidRequestError("logit_bias", token, "token ids must be >= 0")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias[{token}]", bias, f"must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                )
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidRequestError(
                "min_tokens", self.min_tokens, f"must be in [0, max_new_tokens={self.max_new_tokens}]"
            )
        if self.prior_output_tokens < 0:
            raise InvalidRequestError("prior_output_tokens", self.prior_output_tokens, "must be >= 0")
