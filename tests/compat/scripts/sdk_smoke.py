"""SFT, sampling and checkpoints through whichever tinker SDK runs this script (0.22.2 .. 0.38.0).

Uses only calls every SDK since 0.22 has, in their plain form (no ``.result()`` on client
creation unless the SDK returns a future). Prints one JSON line with what it saw; the compat test
decides what is right.

usage: python sdk_smoke.py BASE_URL BASE_MODEL
"""

from __future__ import annotations

import json
import sys
from importlib import metadata

import tinker
from tinker import types
from clean_exit import finish  # noqa: E402 - the script's own folder is on sys.path

TIMEOUT = 120
PATTERN = [17, 101, 33, 250, 7, 64, 199, 42]  # a short cycle the adapter learns in a few steps


def resolve(x):
    """Newer SDKs return a future of the client (usable as the client, with a deprecation warning);
    older ones return the client itself, which has no ``result``."""
    return x.result(timeout=TIMEOUT) if hasattr(x, "result") else x


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def logprobs(out) -> list[list[float]]:
    return [[float(v) for v in o["logprobs"].tolist()] for o in out.loss_fn_outputs]


def main() -> None:
    base_url, base_model = sys.argv[1], sys.argv[2]
    out: dict = {"sdk_version": metadata.version("tinker")}
    sc = tinker.ServiceClient(base_url=base_url, api_key="tml-compat-sdk")
    tc = resolve(sc.create_lora_training_client(base_model=base_model, rank=4))
    seqs = [(PATTERN * 4)[i: i + 20] for i in range(4)]
    data = [datum(s) for s in seqs]

    losses = []
    for _ in range(8):
        fb = tc.forward_backward(data, "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        lps = logprobs(fb.result(timeout=TIMEOUT))
        op.result(timeout=TIMEOUT)
        losses.append(-sum(sum(lp) for lp in lps) / sum(len(lp) for lp in lps))
    out["losses"] = losses
    out["shapes"] = [len(lp) for lp in lps]
    trained = logprobs(tc.forward(data, "cross_entropy").result(timeout=TIMEOUT))
    out["forward_logprobs"] = trained

    sampler = resolve(tc.save_weights_and_get_sampling_client(name="sdk-smoke"))
    prompt = types.ModelInput.from_ints(PATTERN[:4])
    # No stop tokens: an unseeded draw of an end-of-sequence token would end a sample early.
    res = sampler.sample(prompt=prompt, num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, stop=[])).result(timeout=TIMEOUT)
    out["samples"] = [{"tokens": list(s.tokens), "logprobs": s.logprobs, "stop_reason": s.stop_reason}
                      for s in res.sequences]
    greedy = [sampler.sample(prompt=prompt, num_samples=1,
                             sampling_params=types.SamplingParams(max_tokens=8, temperature=0.0)) for _ in range(2)]
    out["greedy"] = [list(g.result(timeout=TIMEOUT).sequences[0].tokens) for g in greedy]
    full = types.ModelInput.from_ints(seqs[0])
    out["sampler_prompt_logprobs"] = sampler.compute_logprobs(full).result(timeout=TIMEOUT)

    state_path = tc.save_state("sdk-smoke").result(timeout=TIMEOUT).path
    sampler_path = tc.save_weights_for_sampler("sdk-smoke-sampler").result(timeout=TIMEOUT).path
    out["paths"] = [state_path, sampler_path]
    tc2 = resolve(sc.create_training_client_from_state(state_path))
    out["loaded_forward_logprobs"] = logprobs(tc2.forward(data, "cross_entropy").result(timeout=TIMEOUT))
    s2 = resolve(sc.create_sampling_client(model_path=sampler_path))
    out["loaded_sampler_prompt_logprobs"] = s2.compute_logprobs(full).result(timeout=TIMEOUT)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
    finish()
