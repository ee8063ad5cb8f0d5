"""The cookbook's SL loop driven from a user script (``python -m tinker_cookbook.supervised.train`` is
broken in 0.6.1: its chz ``nested_entrypoint`` rejects an unannotated lambda).

``FromConversationFileBuilder`` on a chat JSONL with a held-out test split, so the
``SamplerNLLEvaluator`` runs (``save_weights_and_get_sampling_client`` + ``compute_logprobs``), and
periodic plus final checkpoints. Re-running with the same ``--log-path`` resumes.

usage: python custom_sl.py --model NAME --file JSONL --log-path DIR [--max-steps N] [--save-every N]
       [--eval-every N] [--batch-size B] [--learning-rate LR] [--lora-rank R]
"""

from __future__ import annotations

import argparse
import asyncio

from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from clean_exit import finish  # noqa: E402 - the script's own folder is on sys.path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--renderer", default="role_colon")
    p.add_argument("--file", required=True)
    p.add_argument("--log-path", required=True)
    p.add_argument("--base-url", default=None)
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--test-size", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--lora-rank", type=int, default=4)
    a = p.parse_args()
    builder = FromConversationFileBuilder(
        file_path=a.file,
        test_size=a.test_size,
        common_config=ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=a.model, renderer_name=a.renderer,
                                                     max_length=256, batch_size=a.batch_size),
    )
    config = train.Config(
        log_path=a.log_path,
        model_name=a.model,
        recipe_name="compat_custom_sl",
        renderer_name=a.renderer,
        dataset_builder=builder,
        learning_rate=a.learning_rate,
        lora_rank=a.lora_rank,
        base_url=a.base_url,
        save_every=a.save_every,
        eval_every=a.eval_every,
        max_steps=a.max_steps,
    )
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main()
    finish()
