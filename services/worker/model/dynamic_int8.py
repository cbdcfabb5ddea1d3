"""CPU int8 weights for the decoder's projections through torch's dynamic quantization: the CPU fallback.

`quantize_dynamic_int8` is the one function in Strata that touches `torch.ao.quantization`. torch
deprecated that package (its import warns that it "will be removed"), yet in torch 2.13 its dynamic
quantization is still the only int8 CPU matmul (fbgemm) that torch ships without extra packages, and on
a small model it is what makes the fallback cheaper per token than the float32 primary. It is isolated
here, behind one function, so that replacing it (torchao's int8 dynamic-activation, int8-weight
layout, say) touches this module only; its deprecation warnings are silenced around the call, on
purpose and nowhere else, and its absence in a future torch is a clear ModelLoadError.

What is quantized: the fused q/k/v, o and fused gate/up projections of every decoder layer, weights
int8 (one scale per tensor), activations quantized on the fly (one scale per call, so per step). down_proj
stays float32: its input is the SwiGLU product, whose few outlier channels an 8-bit per-tensor
activation scale flattens (on SmolLM2-135M, quantizing down_proj as well tripled perplexity on the
quality gate's text, 21.4 to 65; without it 25.9). Embeddings, norms and the vocabulary projection
stay float32 too. No layer is ever removed. This is CPU only (the loader refuses CUDA; bitsandbytes
nf4 is the GPU fallback). It must not read checkpoints nor move the model between devices.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from services.worker.model.config import ModelLoadError

DYNAMIC_INT8 = "dynamic-int8"
# down_proj is left out on purpose: see the module docstring.
DYNAMIC_INT8_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj")


def quantize_dynamic_int8(model: nn.Module) -> int:
    """Swap each decoder projection named in DYNAMIC_INT8_LAYERS for its int8 twin, in place.

    The model must be float32 on the CPU. Returns how many layers were replaced; raises
    ModelLoadError when this torch has no dynamic quantization or nothing was replaced.
    """
    targets = {
        name
        for name, module in model.named_modules()
        if name.rpartition(".")[2] in DYNAMIC_INT8_LAYERS and isinstance(module, nn.Linear)
    }
    if not targets:
        raise ModelLoadError(
            f"quantization={DYNAMIC_INT8!r} found none of the projections {', '.join(DYNAMIC_INT8_LAYERS)} "
            "to quantize: the model is not a Llama-family decoder"
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
