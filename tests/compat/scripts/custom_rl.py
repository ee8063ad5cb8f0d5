"""A user's own RL task on the cookbook's RL loop: a ``ProblemEnv`` subclass, an ``RLDataset`` and a
chz ``RLDatasetBuilder``, passed to ``tinker_cookbook.rl.train.main(Config(...))``.

The task: "What is A plus B minus B?" with A in {0, 1}; the answer must be written as
``\\boxed{A}``. The compat mirror's warm-started model answers ``\\boxed{0}``/``\\boxed{1}`` at
random and stops about half of the time, so groups get mixed rewards.

usage: python custom_rl.py --model NAME --log-path DIR [--mode sync|async|stream] [--max-steps N]
       [--save-every N] [--eval-every N] [--kl-penalty-coef C] [--post-kl] [--loss-fn NAME]
       [--groups-per-batch G] [--group-size K] [--max-tokens T] [--lora-rank R]
Re-running with the same ``--log-path`` resumes from its ``checkpoints.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Sequence
from functools import partial

import chz
from tinker_cookbook import renderers
from tinker_cookbook.rl import train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer
from clean_exit import finish  # noqa: E402 - the script's own folder is on sys.path


class BoxedBitEnv(ProblemEnv):
    def __init__(self, a: int, b: int, renderer: renderers.Renderer):
        super().__init__(renderer, convo_prefix=None, format_coef=0.1)
        self.a, self.b = a, b

    def get_question(self) -> str:
        return (f"What is {self.a} plus {self.b} minus {self.b}? "
                "Provide a numerical answer without units, written inside \\boxed{}.")

    def check_answer(self, sample_str: str) -> bool:
        return f"\\boxed{{{self.a}}}" in sample_str

    def check_format(self, sample_str: str) -> bool:
        return "\\boxed{" in sample_str

    def get_reference_answer(self) -> str:
        return str(self.a)


class BoxedBitDataset(RLDataset):
    def __init__(self, problems: list[tuple[int, int]], batch_size: int, group_size: int, renderer: renderers.Renderer):
        self.problems, self.batch_size, self.group_size, self.renderer = problems, batch_size, group_size, renderer

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        chunk = self.problems[index * self.batch_size:(index + 1) * self.batch_size]
        return [ProblemGroupBuilder(env_thunk=partial(BoxedBitEnv, a, b, self.renderer), num_envs=self.group_size,
                                    dataset_name="boxed_bit") for a, b in chunk]

    def __len__(self) -> int:
        return len(self.problems) // self.batch_size


@chz.chz
class BoxedBitDatasetBuilder(RLDatasetBuilder):
    model_name: str
    renderer_name: str
    batch_size: int
    group_size: int
    n_batches: int = 50
    n_test: int = 4
    seed: int = 0

    async def __call__(self) -> tuple[BoxedBitDataset, BoxedBitDataset]:
        renderer = renderers.get_renderer(self.renderer_name, get_tokenizer(self.model_name))
        rng = random.Random(self.seed)
        train_p = [(rng.randint(0, 1), rng.randint(0, 9)) for _ in range(self.n_batches * self.batch_size)]
        test_p = [(rng.randint(0, 1), rng.randint(0, 9)) for _ in range(self.n_test)]
        return (BoxedBitDataset(train_p, self.batch_size, self.group_size, renderer),
                BoxedBitDataset(test_p, self.n_test, 1, renderer))


def build_config(a: argparse.Namespace) -> train.Config:
    builder = BoxedBitDatasetBuilder(model_name=a.model, renderer_name=a.renderer, batch_size=a.groups_per_batch,
                                     group_size=a.group_size)
    extra: dict = {}
    if a.mode == "async":
        extra["async_config"] = train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=a.groups_per_batch)
    elif a.mode == "stream":
        extra["stream_minibatch_config"] = train.StreamMinibatchConfig(groups_per_batch=a.groups_per_batch,
                                                                        num_minibatches=2)
    if a.kl_penalty_coef:
        extra["kl_penalty_coef"] = a.kl_penalty_coef
        extra["kl_reference_config"] = train.KLReferenceConfig(base_model=a.model)
    if a.loss_fn:
        extra["loss_fn"] = a.loss_fn
    return train.Config(
        learning_rate=a.learning_rate,
        dataset_builder=builder,
        model_name=a.model,
        renderer_name=a.renderer,
        recipe_name="compat_custom_rl",
        max_tokens=a.max_tokens,
        log_path=a.log_path,
        base_url=a.base_url,
        lora_rank=a.lora_rank,
        eval_every=a.eval_every,
        save_every=a.save_every,
        compute_post_kl=a.post_kl,
        max_steps=a.max_steps,
        **extra,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--renderer", default="role_colon")
    p.add_argument("--log-path", required=True)
    p.add_argument("--base-url", default=None)  # default: TINKER_BASE_URL
    p.add_argument("--mode", choices=("sync", "async", "stream"), default="sync")
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--kl-penalty-coef", type=float, default=0.0)
    p.add_argument("--post-kl", action="store_true")
    p.add_argument("--loss-fn", default=None)
    p.add_argument("--groups-per-batch", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lora-rank", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    a = p.parse_args()
    asyncio.run(train.main(build_config(a)))


if __name__ == "__main__":
    main()
    finish()
