"""Sampling cases shared by the sampler's CPU tests (tests/unit) and its CUDA tests (tests/gpu).

TARGETS are the parameter sets whose seeded draws must not depend on the batch, the position in it,
or the device: greedy, temperatures, top-k, top-p, min_p, penalties, logit bias and n-gram bans, alone and
combined.
"""

from __future__ import annotations

import torch

from strata.sampling import SamplingParams

CPU = torch.device("cpu")

TARGETS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=2.5),  # flat enough that some draws go to the tail
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=3.0, top_p=0.99),  # wide: needs more than one candidate round
    SamplingParams(temperature=1.0, top_k=50, top_p=0.8, repetition_penalty=1.3),
    SamplingParams(temperature=0.9, no_repeat_ngram_size=2),
    SamplingParams(temperature=1.2, min_p=0.05),
    SamplingParams(temperature=0.8, top_k=40, min_p=0.1, logit_bias=((3, 4.0), (9, -100.0))),
    SamplingParams(logit_bias=((5, 100.0),)),
    SamplingParams(),
]
