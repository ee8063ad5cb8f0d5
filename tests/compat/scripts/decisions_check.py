"""The cookbook's ``decisions`` recipe scoring a routing question (``target_prompt_logprobs``).

``sample_decision`` (unmodified cookbook code) sends one sparse ``target_prompt_logprobs``
request and softmaxes the label tokens' logprobs at the answer position. As a reference, the
same logprobs are read a second way: the prompt with each label token written at the answer
position, scored by ``include_prompt_logprobs``. Prints one JSON line; the test compares.

usage: python decisions_check.py --model NAME
"""

from __future__ import annotations

import argparse
import asyncio
import json

import tinker
from tinker_cookbook import model_info, renderers
from tinker_cookbook.recipes.decisions import Decision, DecisionRenderer, sample_decision
from tinker_cookbook.tokenizer_utils import get_tokenizer
from clean_exit import finish  # noqa: E402 - the script's own folder is on sys.path

TEAMS = [  # as in tinker_cookbook.recipes.decisions.demo
    ("billing", "Charges, invoices, credits, payment methods and pricing"),
    ("sdk", "The tinker Python package: installation, API errors, training and sampling calls"),
    ("console", "The web console: signing in, API keys, viewing runs and checkpoints"),
    ("cookbook", "The Tinker Cookbook recipes: training loops, renderers, evaluations and docs"),
]


async def main(model: str) -> None:
    sc = tinker.ServiceClient()
    sampler = await sc.create_sampling_client_async(base_model=model)
    renderer = renderers.get_renderer(model_info.get_recommended_renderer_name(model), get_tokenizer(model))
    rendering = DecisionRenderer(renderer).render(Decision(
        "A user asked: How do I pick a learning rate for LoRA? Which team should answer it?", TEAMS))
    probabilities = await sample_decision(sampler, rendering)
    reference = {}
    for label in rendering.labels:
        tokens = list(rendering.tokens)
        tokens[rendering.choice_pos] = rendering.label_tokens[label]
        r = await sampler.sample_async(tinker.ModelInput.from_ints(tokens), 1, tinker.SamplingParams(max_tokens=1),
                                       include_prompt_logprobs=True)
        reference[label] = r.prompt_logprobs[rendering.choice_pos]
    print(json.dumps({"probabilities": probabilities, "reference_logprobs": reference}))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    asyncio.run(main(p.parse_args().model))
    finish()
