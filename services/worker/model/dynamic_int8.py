"""The CPU int8 variant's projections, in two modes: dynamic-int8 and int8-weight-only.

`quantize_dynamic_int8` is the one function in Strata that touches `torch.ao.quantization`. torch
deprecated that package (its import warns that it "will be removed"), yet in torch 2.13 its dynamic
quantization is still the only int8 CPU matmul (fbgemm) that torch ships without extra packages, and on
a small model it is what makes the int8 variant cheaper per token than float32 (the default stack's
fallback route serves it). It is isolated
here, behind one function, so that replacing it (torchao's int8 dynamic-activation, int8-weight
layout, say) touches this module only; its deprecation warnings are silenced around the call, on
purpose and nowhere else, and its absence in a future torch is a clear ModelLoadError.

What is quantized, for batches of more than small_linear.MAX_ROWS rows (prefill, many decodes): the
fused q/k/v, o and fused gate/up projections of every decoder layer, weights int8 (one scale per
tensor), activations quantized on the fly (one scale per call, so per step). down_proj stays float32
there: its input is the SwiGLU product, whose few outlier channels an 8-bit per-tensor activation
scale flattens (on SmolLM2-135M, quantizing down_proj as well raised perplexity on the quality gate's
text several-fold; tests/integration/test_fallback_model.py bounds it and prints what it measures).
The embeddings, norms and the vocabulary projection stay float32.
Small batches (a few decodes) are bound by the bytes of the weights, not by arithmetic: every
projection, down_proj and the vocabulary projection included, is wrapped in small_int8's
`SmallBatchInt8`, which reads a weight-only int8 copy (one scale per row, float32 activations, so the
outliers are kept) at up to small_linear.MAX_ROWS rows. No layer is ever removed. This is CPU only
(the loader refuses CUDA; on a GPU bitsandbytes' int8 and nf4 play this part). It must not read
checkpoints nor move the model between devices.

`quantize_weight_only_int8` (`int8-weight-only`) wraps the same projections, down_proj and the
vocabulary projection included, in small_int8's `WeightOnlyInt8` at every batch size and keeps no
float32 copy of their weights: each row's result is then the same whatever rows share its batch, so
its greedy output does not depend on the requests next to it (the chaos soak checks its tokens
exactly). Above small_linear.MAX_ROWS rows it computes on float32 activations where torch's dynamic
path computes on int8 ones, so it is the slower of the two at large batches (prefill, many decodes):
dynamic-int8 stays what the default stack's fallback route runs.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from services.worker.model.config import ModelLoadError
from services.worker.model.small_int8 import SmallBatchInt8, WeightOnlyInt8

DYNAMIC_INT8 = "dynamic-int8"
WEIGHT_ONLY_INT8 = "int8-weight-only"
CPU_INT8_MODES = (DYNAMIC_INT8, WEIGHT_ONLY_INT8)
"""The CPU int8 variant's modes: both CPU only and float32 only (the loader checks)."""
# down_proj is left out on purpose: see the module docstring.
DYNAMIC_INT8_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj")
SMALL_BATCH_INT8_LAYERS = (*DYNAMIC_INT8_LAYERS, "down_proj")


def quantize_dynamic_int8(model: nn.Module) -> int:
    """Quantize the model's projections in place, as the module docstring says.

    Each projection named in SMALL_BATCH_INT8_LAYERS, and the vocabulary projection, gets its
    small-batch int8 copy; then each named in DYNAMIC_INT8_LAYERS gets its dynamic int8 twin for larger
    batches. The model must be float32 on the CPU. Returns how many dynamic twins were made; raises
    ModelLoadError when this torch has no dynamic quantization or nothing was replaced.
    """
    wrapped = _wrap_small_batch(model)
    targets = {f"{name}.large" for name in wrapped if name.rpartition(".")[2] in DYNAMIC_INT8_LAYERS}
    if not targets:
        raise ModelLoadError(
            f"quantization={DYNAMIC_INT8!r} found none of the projections {', '.join(DYNAMIC_INT8_LAYERS)} "
            "to quantize: the model names its projections otherwise"
        )
    with warnings.catch_warnings():
        # torch's deprecation notices for torch.ao.quantization, raised at import and per call.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        try:
            from torch.ao.quantization import quantize_dynamic
        except ImportError as err:
            raise ModelLoadError(
                f"quantization={DYNAMIC_INT8!r} needs torch.ao.quantization.quantize_dynamic, which torch "
                f"{torch.__version__} no longer has: load without quantization or use nf4 (bitsandbytes)"
            ) from err
        # torch ships this function without annotations.
        quantize_dynamic(model, qconfig_spec=targets, dtype=torch.qint8, inplace=True)  # type: ignore[no-untyped-call]
    replaced = sum(
        1 for name, module in model.named_modules() if name in targets and not isinstance(module, nn.Linear)
    )
    if replaced != len(targets):
        raise ModelLoadError(
            f"quantization={DYNAMIC_INT8!r} replaced {replaced} of {len(targets)} projections: this torch's "
            "dynamic quantization does not support them; load without quantization"
        )
    return replaced


def quantize_weight_only_int8(model: nn.Module) -> int:
    """Replace each SMALL_BATCH_INT8_LAYERS projection and the vocabulary projection by its
    weight-only int8 copy, used at every batch size (the module docstring says why). The model must be
    float32 on the CPU. Returns how many decoder projections were replaced; raises ModelLoadError when
    there were none."""
    wrapped = _wrap(model, WeightOnlyInt8)
    if not wrapped:
        raise ModelLoadError(
            f"quantization={WEIGHT_ONLY_INT8!r} found none of the projections "
            f"{', '.join(SMALL_BATCH_INT8_LAYERS)} to quantize: the model names its projections otherwise"
        )
    return len(wrapped)


def _wrap_small_batch(model: nn.Module) -> list[str]:
    """Wrap each SMALL_BATCH_INT8_LAYERS projection and the vocabulary projection; return their names."""
    return _wrap(model, SmallBatchInt8)


def _wrap(model: nn.Module, kind: type[WeightOnlyInt8]) -> list[str]:
    """Replace each SMALL_BATCH_INT8_LAYERS projection and the vocabulary projection by `kind` of it;
    return the projections' qualified names."""
    targets = [
        (parent, name, f"{prefix}.{name}" if prefix else name, child)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if name in SMALL_BATCH_INT8_LAYERS and isinstance(child, nn.Linear)
    ]
    for parent, name, _, linear in targets:
        setattr(parent, name, kind(linear))
    _wrap_vocabulary_projection(model, kind)
    return [qualified for _, _, qualified, _ in targets]


def _wrap_vocabulary_projection(model: nn.Module, kind: type[WeightOnlyInt8]) -> None:
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        model.lm_head = kind(head)
        return
    embedding = getattr(model, "embed_tokens", None)
    if head is None and isinstance(embedding, nn.Embedding):
        # Tied: SmallBatchInt8's larger batches keep projecting on the embedding matrix itself, shared,
        # not copied; WeightOnlyInt8 keeps only its int8 copy.
        tied = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False, device="meta")
        tied.weight = embedding.weight
        model.lm_head = kind(tied)
