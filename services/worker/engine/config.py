"""The engine's tuning knobs: KV cache geometry, batch limits and scheduling policy.

Every engine default is declared here once, and an invalid value fails at start with a message that
names the value and how to fix it. This module only describes settings: it must not import torch,
read files or the environment (the worker's settings model does that and builds an EngineConfig).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

# Where an operator overrides engine settings; the worker's settings model maps these onto the fields.
ENV_PREFIX = "STRATA_WORKER_ENGINE__"
# engine.kv_cache_dtype's values (services/worker/model/kv_format.py owns what each stores).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8_e4m3")


def _invalid(name: str, value: object, rule: str, example: str) -> ValueError:
    return ValueError(
        f"{name}={value!r} is invalid: {rule}; set {ENV_PREFIX}{name.upper()} "
        f"(engine.{name} in the worker config) to e.g. {example}"
    )


SPECULATIVE_METHODS = ("off", "ngram", "draft")


class SpeculativeConfig(BaseModel):
    """engine.speculative: drafting tokens that one forward pass checks (speculation.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str = "off"
    """"off"; "ngram": prompt lookup, drafting what followed the latest earlier occurrence of a
    sequence's last tokens in its prompt and output (ngram.py); or "draft": a smaller model with the
    same tokenizer, draft_model_path, drafts them (draft_model.py)."""
    num_tokens: int = 4
    """Most tokens a sequence drafts in one step; the draft-length rule (docs/speculative-decoding.md)
    drafts fewer where they would not pay."""
    ngram_max: int = 4
    """Longest tail of a sequence that prompt lookup matches."""
    ngram_min: int = 2
    """Shortest tail it matches: one token matches too often to guess well."""
    draft_model_path: str | None = None
    """The draft model's folder (method "draft"): loaded into the same worker on the same device, its
    KV cache inside the worker's memory budget; its tokenizer must be the served model's."""

    @field_validator("method")
    @classmethod
    def _method(cls, value: str) -> str:
        if value not in SPECULATIVE_METHODS:
            raise _invalid(
                "speculative__method", value, f"must be one of {', '.join(SPECULATIVE_METHODS)}", "ngram"
            )
        return value

    @field_validator("num_tokens", "ngram_max", "ngram_min")
    @classmethod
    def _positive(cls, value: int, info: ValidationInfo) -> int:
        if value < 1:
            name = str(info.field_name)
            raise _invalid(f"speculative__{name}", value, "must be >= 1", str(cls.model_fields[name].default))
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeConfig:
        if (self.method == "draft") != (self.draft_model_path is not None):
            raise _invalid(
                "speculative__draft_model_path",
                self.draft_model_path,
                f'is needed by method "draft" and by no other (method is {self.method!r})',
                "models/Qwen2.5-Coder-0.5B-Instruct with method draft",
            )
        if self.ngram_max < self.ngram_min:
            raise _invalid(
                "speculative__ngram_max",
                self.ngram_max,
                f"must be >= ngram_min ({self.ngram_min})",
                str(self.ngram_min),
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "off"


class LoraConfig(BaseModel):
    """engine.lora: memory slots for LoRA adapters of the served model (docs/lora.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_loras: int = 0
    """Adapters resident at once, each in a slot of its own: every slot's memory is taken at start
    and counted in the memory budget; 0 serves no adapters. More adapters may be loaded: they wait on
    disk (at most max_loras of them in host memory), and each takes, at its first request, the least
    recently used slot that no running request's adapter holds; an evicted one is read from disk again
    when next wanted."""
    max_lora_rank: int = 16
    """The highest adapter rank a slot holds (an adapter of lower rank fills part of it)."""

    @field_validator("max_loras")
    @classmethod
    def _slots(cls, value: int) -> int:
        if value < 0:
            raise _invalid("lora__max_loras", value, "must be >= 0 (0 serves no adapters)", "8")
        return value

    @field_validator("max_lora_rank")
    @classmethod
    def _rank(cls, value: int) -> int:
        if value < 1:
            raise _invalid("lora__max_lora_rank", value, "must be >= 1", "16")
        return value


class EngineConfig(BaseModel):
    """Settings of one continuous-batching engine. Immutable once built."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: int = 16
    """Tokens per KV cache block."""
    num_blocks: int | None = None
    """KV cache blocks; None sizes the cache from kv_cache_memory_bytes, or else memory_utilization."""
    kv_cache_memory_bytes: int | None = None
    """Bytes of KV cache when num_blocks is None; None sizes the cache from memory_utilization."""
    kv_cache_dtype: str = "auto"
    """How the KV cache stores keys and values: "auto" (the model's dtype: float32 on the CPU),
    "float32", "bfloat16", "int8" (one float32 scale per token and KV head; about 3.8x the tokens of
    float32 in the same memory at head_dim 64), or "fp8_e4m3" (CUDA only). docs/engine.md says what
    each costs."""
    memory_utilization: float = 0.8
    """Fraction of the memory the worker may use (the smallest of the machine's available memory and
    its cgroup limit, or the GPU's) that it plans to use in all: weights, the measured peak of the
    largest step, and a KV cache of what is left. Workers sharing one machine split it between them."""
    max_num_seqs: int = 64
    """Most sequences running at once."""
    max_num_batched_tokens: int = 512
    """Most tokens computed in one engine step (decodes count one each)."""
    decode_cost_tokens: float = 2.0
    """What one decode costs a step's time, in prompt tokens of prefill: a step's prefill gets
    max_num_batched_tokens less this per decode (at least one block), so that a step's length stays
    bounded however many sequences decode in it. Measured 2.2 on a 2-core CPU with SmolLM2-135M
    (docs/engine.md); 1 gives every token of the budget to prefill."""
    max_model_len: int | None = None
    """Context limit in tokens (prompt plus output); None uses the model's."""
    chunked_prefill: bool = True
    """Split a prompt longer than the step's remaining budget across steps."""
    mixed_batches: bool = True
    """Mix decodes with prefill chunks in one step; False alternates prefill-only and decode-only steps."""
    enable_prefix_caching: bool = True
    """Keep full KV blocks after their request ends and share them, by content, with every request
    of the same cache salt (tenant) whose prompt starts with the same tokens; False prefills all."""
    cuda_graphs: bool = True
    """On CUDA, replay decode-only steps from captured graphs (eager when False; ignored on CPU)."""
    enable_fault_injection: bool = False
    """Test mode only: let tests make the runner fail steps on purpose."""
    fault_step_delay_s: float = 0.0
    """Test mode only (needs enable_fault_injection): sleep this long before every step, so that a
    test driving a worker process from outside can act while its requests are still running."""
    shed_recovery_steps: int = 16
    """After load shedding, successful steps between each +1 of the running limit."""
    speculative: SpeculativeConfig = SpeculativeConfig()
    """Speculative decoding, off by default (docs/speculative-decoding.md)."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapter slots, none by default (docs/lora.md)."""

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value < 1 or value & (value - 1):
            raise _invalid("block_size", value, "must be a power of two >= 1", "16")
        return value

    @field_validator("num_blocks")
    @classmethod
    def _positive_or_auto(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise _invalid("num_blocks", value, "must be >= 1, or unset to size it from memory", "1024")
        return value

    @field_validator("kv_cache_memory_bytes")
    @classmethod
    def _bytes_or_auto(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise _invalid(
                "kv_cache_memory_bytes", value, "must be >= 1, or unset to size it from memory", "536870912"
            )
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _cache_dtype(cls, value: str) -> str:
        if value not in KV_CACHE_DTYPES:
            raise _invalid("kv_cache_dtype", value, f"must be one of {', '.join(KV_CACHE_DTYPES)}", "int8")
        return value

    @field_validator("memory_utilization")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise _invalid("memory_utilization", value, "must be in (0, 1]", "0.8")
        return value

    @field_validator("max_num_seqs", "max_num_batched_tokens", "shed_recovery_steps")
    @classmethod
    def _positive(cls, value: int, info: ValidationInfo) -> int:
        if value < 1:
            name = str(info.field_name)
            default = cls.model_fields[name].default
            raise _invalid(name, value, "must be >= 1", str(default))
        return value

    @field_validator("decode_cost_tokens")
    @classmethod
    def _cost(cls, value: float) -> float:
        if value < 1:
            raise _invalid("decode_cost_tokens", value, "must be >= 1 (a decode is at least a token)", "2.0")
        return value

    @field_validator("fault_step_delay_s")
    @classmethod
    def _delay(cls, value: float, info: ValidationInfo) -> float:
        if value < 0:
            raise _invalid("fault_step_delay_s", value, "must be >= 0", "0.05")
        if value > 0 and not info.data.get("enable_fault_injection", False):
            raise _invalid(
                "fault_step_delay_s", value, "needs enable_fault_injection: true (test mode only)", "0"
            )
        return value

    @field_validator("max_model_len")
    @classmethod
    def _context(cls, value: int | None) -> int | None:
        if value is not None and value < 2:
            raise _invalid(
                "max_model_len", value, "must be >= 2 (a prompt token and one new token), or unset", "2048"
            )
        return value

    def resolve_max_model_len(self, model_max_len: int) -> int:
        """The context limit to enforce: the configured one, which may not exceed the model's."""
        if self.max_model_len is None:
            return model_max_len
        if self.max_model_len > model_max_len:
            raise _invalid(
                "max_model_len",
                self.max_model_len,
                f"the model's context is {model_max_len} tokens",
                f"{model_max_len} or unset",
            )
        return self.max_model_len
