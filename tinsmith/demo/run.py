"""The demo that learns: start ``tinsmith serve``, then run an RL loop through the ``tinker`` SDK.

Each step: freeze the current LoRA weights for sampling (``save_weights_and_get_sampling_client``),
sample a group of completions per addition prompt at temperature 1, score them (exact match,
with partial credit per digit), centre the rewards within each group to get advantages, and
train on the sampled tokens with the ``importance_sampling`` loss followed by ``optim_step``.
A progress line per step shows reward, loss and throughput; ``metrics.jsonl`` and
``reward_curve.png`` are written to the output directory as the run goes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tinsmith.demo import task
from tinsmith.demo.pretrain import PretrainConfig, ensure_model
from tinsmith.progress import bar, progress_log, progress_wanted

API_KEY = "tml-demo"


@dataclass
class DemoConfig:
    out_dir: str = "./data/demo"
    model_dir: str | None = None  # default: OUT_DIR/model (pre-trained once, then reused)
    steps: int = 80
    prompts_per_step: int = 32
    group_size: int = 16
    learning_rate: float = 2e-3
    lora_rank: int = 16
    temperature: float = 1.0
    seed: int = 0
    port: int | None = None
    server_start_timeout_s: float = 120.0


# --------------------------------------------------------------------------------- server
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DemoServer:
    """``tinsmith serve`` as a child process, logging to ``server.log`` in the output directory."""

    def __init__(self, model_dir: Path, out_dir: Path, port: int):
        self.model_dir, self.out_dir, self.port = model_dir, out_dir, port
        self.data_dir = out_dir / "server-data"
        self.log_path = out_dir / "server.log"
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> None:
        import httpx

        shutil.rmtree(self.data_dir, ignore_errors=True)  # a fresh database for every demo run
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "tinsmith.cli", "serve", "--base-model", str(self.model_dir),
               "--host", "127.0.0.1", "--port", str(self.port), "--data-dir", str(self.data_dir),
               "--max-lora-adapters", "2", "--log-level", "warning"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tinsmith serve exited with code {self.proc.returncode}; "
                                   f"last lines of {self.log_path}:\n{self.log_tail()}")
            try:
                r = httpx.get(self.base_url + "/api/v1/healthz", timeout=2.0)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"tinsmith serve not healthy after {timeout_s:.0f}s; see {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        if self._log is not None:
            self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        if self._log is not None:
            self._log.close()
            self._log = None


def starting_model_dir(cfg: DemoConfig) -> Path:
    """Where the pre-trained starting model is cached: ``--model-dir``, else inside ``--out``, so a
    demo writes nothing outside the directory it was given."""
    return Path(cfg.model_dir).resolve() if cfg.model_dir else Path(cfg.out_dir).resolve() / "model"


# --------------------------------------------------------------------------------- RL step parts
def make_datum(prompt_ids: list[int], completion: list[int], logprobs: list[float], advantage: float):
    """One training sequence: the prompt plus the sampled completion, advantages on the completion."""
    from tinker import types

    tokens = prompt_ids + completion
    n_prompt = len(prompt_ids) - 1  # target positions that predict prompt tokens: no loss there
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * n_prompt + [float(x) for x in logprobs],
            "advantages": [0.0] * n_prompt + [advantage] * len(completion),
        },
    )


def group_advantages(rewards: list[float], scale: float) -> list[float]:
    """Rewards minus the group mean, times ``scale`` (all zero when the group agrees)."""
    mean = sum(rewards) / len(rewards)
    return [(r - mean) * scale for r in rewards]


def plot_curve(records: list[dict], path: Path, start_greedy: float | None = None) -> None:
    """Reward and exact-match rate per step; a dashed line marks the starting model's greedy accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, [r["reward_mean"] for r in records], marker="o", ms=3, lw=1.5, label="mean reward")
    ax.plot(steps, [r["exact_match"] for r in records], marker="s", ms=3, lw=1.0, alpha=0.8,
            label="exact-match rate")
    if start_greedy is not None:
        ax.axhline(start_greedy, color="gray", ls="--", lw=1.0,
                   label=f"starting model, greedy exact match ({100 * start_greedy:.0f}%)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward / rate (sampled at temperature 1)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title("tinsmith demo: GRPO-style RL on multi-digit addition (LoRA)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------- main loop
def run_demo(cfg: DemoConfig, log=print) -> dict:
    """Run the whole demo; returns a summary (also written to ``summary.json``)."""
    import tinker
    from tinker import types

    t_start = time.perf_counter()
    out = Path(cfg.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir, model_meta = ensure_model(starting_model_dir(cfg), PretrainConfig(), log)
    start_acc = model_meta["stats"]["held_out_exact_match"]
    log(f"starting model: held-out exact match {100 * start_acc['greedy']:.1f}% greedy, "
        f"{100 * start_acc['sampled']:.1f}% when sampled at temperature 1")

    server = DemoServer(model_dir, out, cfg.port or free_port())
    log(f"starting tinsmith serve on {server.base_url} (log: {server.log_path})")
    server.start(cfg.server_start_timeout_s)
    metrics_path, png_path = out / "metrics.jsonl", out / "reward_curve.png"
    metrics_path.write_text("")
    records: list[dict] = []
    rng = random.Random(cfg.seed)
    try:
        sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        tc = sc.create_lora_training_client(base_model=str(model_dir), rank=cfg.lora_rank, seed=cfg.seed).result()
        params = dict(max_tokens=task.MAX_ANSWER_TOKENS, temperature=cfg.temperature, stop=[task.EOS_ID])
        adam = types.AdamParams(learning_rate=cfg.learning_rate, beta1=0.9, beta2=0.99)
        n_seqs = cfg.prompts_per_step * cfg.group_size
        log(f"RL: {cfg.steps} steps x {cfg.prompts_per_step} prompts x {cfg.group_size} samples, "
            f"LoRA rank {cfg.lora_rank}, lr {cfg.learning_rate:g}, setup {time.perf_counter() - t_start:.0f}s")
        steps_bar = bar(progress_wanted(), total=cfg.steps, desc="RL steps", unit="step", leave=False)
        for step in range(1, cfg.steps + 1):
            t0 = time.perf_counter()
            sampler = tc.save_weights_and_get_sampling_client().result()
            probs = [task.random_problem(rng) for _ in range(cfg.prompts_per_step)]
            t_s = time.perf_counter()
            futures = [sampler.sample(types.ModelInput.from_ints(p.prompt_ids()), cfg.group_size,
                                      types.SamplingParams(seed=rng.getrandbits(31), **params)) for p in probs]
            results = [f.result() for f in futures]
            sample_s = time.perf_counter() - t_s

            data, rewards, exact, sampled_tokens = [], [], [], 0
            for p, res in zip(probs, results):
                rs = [task.reward(p, list(s.tokens)) for s in res.sequences]
                rewards += rs
                exact += [task.is_correct(p, list(s.tokens)) for s in res.sequences]
                sampled_tokens += sum(len(s.tokens) for s in res.sequences)
                for s, a in zip(res.sequences, group_advantages(rs, 1.0 / n_seqs)):
                    if a != 0.0:
                        data.append(make_datum(p.prompt_ids(), list(s.tokens), list(s.logprobs), a))

            t_t = time.perf_counter()
            loss, train_tokens = 0.0, sum(len(d.model_input.to_ints()) for d in data)
            if data:
                fb = tc.forward_backward(data, "importance_sampling")
                opt = tc.optim_step(adam)
                loss = float(fb.result().metrics.get("loss:sum", 0.0))
                opt.result()
            train_s = time.perf_counter() - t_t
            rec = {
                "step": step,
                "reward_mean": sum(rewards) / len(rewards),
                "exact_match": sum(exact) / len(exact),
                "loss": loss,
                "sampled_tokens": sampled_tokens,
                "sample_tokens_per_s": sampled_tokens / sample_s if sample_s > 0 else 0.0,
                "trained_sequences": len(data),
                "train_tokens": train_tokens,
                "train_tokens_per_s": train_tokens / train_s if data and train_s > 0 else 0.0,
                "step_s": time.perf_counter() - t0,
                "elapsed_s": time.perf_counter() - t_start,
            }
            records.append(rec)
            with metrics_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            log(f"step {step:3d}/{cfg.steps}  reward {rec['reward_mean']:.3f}  exact {100 * rec['exact_match']:5.1f}%  "
                f"loss {loss:+.4f}  sample {rec['sample_tokens_per_s']:6.0f} tok/s  "
                f"train {rec['train_tokens_per_s']:6.0f} tok/s  {rec['step_s']:4.1f}s  [{rec['elapsed_s']:5.0f}s]")
            plot_curve(records, png_path, start_acc["greedy"])
            steps_bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", refresh=False)
            steps_bar.update()
        steps_bar.close()
        try:
            sc.close("success").result(timeout=10)
        except Exception:  # noqa: BLE001 - closing the session is a courtesy; the server stops next
            pass
    finally:
        server.stop()

    k = max(1, min(5, len(records) // 4))
    first = sum(r["reward_mean"] for r in records[:k]) / k
    last = sum(r["reward_mean"] for r in records[-k:]) / k
    summary = {
        "config": asdict(cfg),
        "starting_model": model_meta["stats"],
        "steps": len(records),
        "window": k,
        "reward_first": first,
        "reward_last": last,
        "exact_first": sum(r["exact_match"] for r in records[:k]) / k,
        "exact_last": sum(r["exact_match"] for r in records[-k:]) / k,
        "wall_s": time.perf_counter() - t_start,
        "reward_curve": str(png_path),
        "metrics": str(metrics_path),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    log(f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}  "
        f"(exact match {100 * summary['exact_first']:.1f}% -> {100 * summary['exact_last']:.1f}%)")
    log(f"done in {summary['wall_s']:.0f}s; reward curve: {png_path}")
    return summary


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="tinsmith demo", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


def add_arguments(p) -> None:
    d = DemoConfig()
    p.add_argument("--out", default=d.out_dir, help=f"output directory (default {d.out_dir})")
    p.add_argument("--model-dir", default=d.model_dir,
                   help="where the pre-trained starting model is cached (default: OUT/model)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"RL steps (default {d.steps})")
    p.add_argument("--port", type=int, default=None, help="server port (default: a free one)")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of prompts and sampling (default {d.seed})")


def run_from_args(a) -> int:
    if a.steps < 1:
        print("tinsmith demo: --steps must be at least 1", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401 - checked now, not after minutes of training
    except ImportError:
        print("tinsmith demo: the demo draws its reward curve with matplotlib: pip install 'tinsmith[demo]'",
              file=sys.stderr)
        return 2
    cfg = DemoConfig(out_dir=a.out, model_dir=a.model_dir, steps=a.steps, port=a.port, seed=a.seed)
    try:
        run_demo(cfg, log=progress_log)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:  # the server did not start; the message carries its log's tail
        print(f"tinsmith demo: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
