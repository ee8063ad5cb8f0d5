"""tinker-cookbook's weights lifecycle on a checkpoint trained through the server (cookbook venv).

Trains a LoRA adapter a few steps, exports it with ``save_weights_external``, downloads it with
``tinker_cookbook.weights.download``, merges it into the base model with ``weights.build_hf_model``
and converts it with ``weights.build_lora_adapter``; then compares the merged model's logprobs
(plain transformers) with the server's ``forward``. With ``--from-state`` it instead downloads a
``save_state`` checkpoint: the cookbook exports it encrypted to an age identity it makes for the
download, and decrypts the ``.age`` files it gets back; the names of the files the server listed
are reported as ``listed_files``.

usage: python weights_roundtrip.py OUT_DIR [--from-state]     (model from TINKER_BASE_URL's mirror)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import tinker
import torch
from tinker import types
from tinker_cookbook import weights
from transformers import AutoModelForCausalLM
from clean_exit import finish  # noqa: E402 - the script's own folder is on sys.path

MODEL = "Qwen/Qwen3.5-9B-Base"


def main() -> None:
    out = Path(sys.argv[1])
    from_state = "--from-state" in sys.argv[2:]
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    toks = list(range(10, 40))
    data = [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)})]
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    server_lp = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    path = (tc.save_state("roundtrip") if from_state else tc.save_weights_external("roundtrip")).result().path
    listed: list[str] = []
    signed = tinker.RestClient.get_external_weights_urls

    def recording(self, tinker_path, *a, **kw):  # what the server hands the cookbook, unchanged
        fut = signed(self, tinker_path, *a, **kw)
        listed.extend(fut.result().urls)
        return fut

    tinker.RestClient.get_external_weights_urls = recording
    adapter = weights.download(tinker_path=path, output_dir=str(out / "adapter"))
    weights.build_hf_model(base_model=MODEL, adapter_path=adapter, output_path=str(out / "merged"))
    weights.build_lora_adapter(base_model=MODEL, adapter_path=adapter, output_path=str(out / "peft"))
    model = AutoModelForCausalLM.from_pretrained(str(out / "merged"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([toks[:-1]])).logits[0]
    merged_lp = torch.log_softmax(logits, -1)[range(len(toks) - 1), toks[1:]].tolist()
    print(json.dumps({"path": path, "server_logprobs": server_lp, "merged_logprobs": merged_lp,
                      "adapter_files": sorted(os.listdir(adapter)), "peft_files": sorted(os.listdir(out / "peft")),
                      "listed_files": sorted(set(listed))}))


if __name__ == "__main__":
    main()
    finish()
