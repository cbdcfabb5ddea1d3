"""Settings of one model worker: its model folder, device, engine and stream limits.

Read once at start through strata.settings (one entry of the YAML list `workers`, then STRATA_WORKER_*
variables; engine fields as STRATA_WORKER_ENGINE__<FIELD>). This module must not import torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from services.worker.engine.config import EngineConfig
from services.worker.engine.grammar_spec import DEFAULT_COMPILE_TIMEOUT_S, DEFAULT_GRAMMAR_CACHE_SIZE
from strata.rpc import MIB
from strata.settings import ServiceSettings, resolve_path


class WorkerSettings(ServiceSettings):
    """One worker's settings."""

    model_config = SettingsConfigDict(env_prefix="STRATA_WORKER_")
    section: ClassVar[str] = "workers"
    path_fields: ClassVar[tuple[str, ...]] = ("model_path",)

    listen: str = "127.0.0.1:0"
    """host:port to serve on; port 0 takes a free one (announced with --announce-file)."""
    model_name: str
    """The name gateways route by; must match the tokenizer service's name for the same folder."""
    model_path: Path
    """The model folder (config.json, safetensors, tokenizer files)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda when torch sees one, else cpu."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: float32 on cpu, bfloat16 on cuda."""
    quantization: Literal["none", "int8", "nf4", "dynamic-int8", "int8-weight-only"] = "none"
    """Weights of the decoder's projections: int8 or nf4 (bitsandbytes; the GPU path);
    dynamic-int8 (torch's dynamic quantization, with weight-only int8 copies for small batches; CPU
    and float32 only: what the default stack's fallback worker runs); or int8-weight-only (those
    copies at every batch size, so each request's greedy output is the same whatever runs next to it;
    CPU and float32 only, slower than dynamic-int8 at large batches)."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (docs/tensor-parallelism.md): this process is rank 0 and starts
    the others, unless WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT are set (torchrun, a LeaderWorkerSet),
    when it joins the group they describe. Float safetensors checkpoints only."""
    tensor_parallel_timeout_s: float = 60.0
    """Bound on every collective of a step between the ranks: a rank that hangs this long (or dies)
    makes the worker report NOT_SERVING and exit, so its supervisor restarts the group."""
    tensor_parallel_start_timeout_s: float = 600.0
    """Bound on forming the group and loading every rank's shard: a rank not started, joined and
    loaded this long after rank 0 began makes the worker fail to load (and exit)."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The continuous-batching engine's settings."""
    max_requests: int | None = None
    """Credits: requests held at most (running plus waiting); None is twice engine.max_num_seqs."""
    max_message_bytes: int = 16 * MIB
    """Largest message on the worker's streams."""
    max_submissions_per_message: int = 1024
    """Most submissions in one ConnectRequest."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long running requests may take to finish before they are aborted."""
    threads: int | None = None
    """torch CPU threads; None keeps torch's default (one per core)."""
    omp_wait_policy: Literal["PASSIVE", "ACTIVE"] | None = "PASSIVE"
    """OMP_WAIT_POLICY of this worker's process: PASSIVE threads sleep between parallel regions instead
    of spinning, so workers sharing the cores do not burn each other's time; None inherits the variable.
    OpenMP reads it once, when torch loads, so `strata up` puts it in the worker's environment; a worker
    started another way (a container, by hand) needs OMP_WAIT_POLICY set in its own environment."""
    grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    """How long a request's output constraint may take to compile before it is refused with
    INVALID_ARGUMENT; compiles run off the engine thread, so a slow one never stalls a step."""
    grammar_cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE
    """Compiled constraints kept (by hash, least recently used dropped first)."""
    adapters: dict[str, Path] = Field(default_factory=dict)
    """LoRA adapters (PEFT folders) served from the start, by name (docs/lora.md); needs
    engine.lora.max_loras > 0. A folder that cannot be served stops the worker, naming it."""
    admin_token: SecretStr | None = None
    """The bearer token LoadAdapter and UnloadAdapter calls must carry; None refuses both."""

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests={self.max_requests} must be >= 1 (or unset for 2 x max_num_seqs)")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s={self.drain_timeout_s} must be >= 0, e.g. 30")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(
                f"grammar_compile_timeout_s={self.grammar_compile_timeout_s} must be > 0, e.g. 2.0"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1, e.g. 2")
        if self.tensor_parallel_size > 1 and self.quantization != "none":
            raise ValueError(
                f"quantization={self.quantization!r} with tensor_parallel_size={self.tensor_parallel_size}: "
                "the ranks split float weights only; set quantization: none, or tensor_parallel_size: 1"
            )
        if not self.tensor_parallel_timeout_s > 0:
            raise ValueError(
                f"tensor_parallel_timeout_s={self.tensor_parallel_timeout_s} must be > 0, e.g. 60"
            )
        if not self.tensor_parallel_start_timeout_s > 0:
            start = self.tensor_parallel_start_timeout_s
            raise ValueError(f"tensor_parallel_start_timeout_s={start} must be > 0, e.g. 600")
        if self.adapters and not self.engine.lora.max_loras:
            raise ValueError(
                f"adapters {', '.join(self.adapters)} need adapter slots: set engine.lora.max_loras, e.g. 8"
            )
        if self.admin_token is not None and not self.admin_token.get_secret_value().strip():
            raise ValueError("admin_token must not be empty: set a secret, or unset it to refuse admin calls")
        if self.grammar_cache_size < 1:
            raise ValueError(f"grammar_cache_size={self.grammar_cache_size} must be >= 1, e.g. 256")
        return self

    @classmethod
    def resolve_nested_paths(cls, data: dict[str, Any], base: Path) -> dict[str, Any]:
        adapters = data.get("adapters")
        if isinstance(adapters, dict):
            data["adapters"] = {name: resolve_path(path, base) for name, path in adapters.items()}
        return data

    @property
    def credit_limit(self) -> int:
        return self.max_requests if self.max_requests is not None else 2 * self.engine.max_num_seqs
