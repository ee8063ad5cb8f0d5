"""The offline "CWD mirror": hub ids the recipes hard-code, as local folders of tiny stand-ins.

``transformers`` and ``datasets.load_dataset`` both treat a hub id that exists as a directory
relative to the working directory as local. Recipes run from a folder holding

* ``Qwen/Qwen3.5-9B-Base/``, ``Qwen/Qwen3.5-4B/``, ``Qwen/Qwen3.6-35B-A3B/`` (the "student"): a
  tiny Qwen3 whose byte-level BPE tokenizer also has the Qwen chat specials (``<think>``,
  ``<tool_call>`` ...) and the Llama 3 header tokens, so ``role_colon``, ``qwen3*``/``qwen3_5*``
  and ``llama3`` renderers all build; its weights are warm-started (``scripts/warm_start.py``)
  so RL groups get mixed rewards;
* ``Qwen/Qwen3.5-9B/`` (the "teacher" of on-policy distillation): the same tokenizer and shape
  with plain random weights, so the student/teacher KL is not zero;
* ``Qwen/Qwen3.5-397B-A17B/`` (the vision-language classifier's default): a tiny image-text
  Qwen3.5-MoE (a vision tower, an image processor) with the same chat specials;
* small JSONL datasets with the columns each recipe reads: ``HuggingFaceH4/no_robots``,
  ``openai/gsm8k`` (config ``main``), ``Anthropic/hh-rlhf``, ``zwhe99/DeepMath-103K``,
  ``allenai/tulu-3-sft-mixture`` and ``Salesforce/wikitext`` (config ``wikitext-103-raw-v1``),
  and ``dpdl-benchmark/caltech101`` as an image folder (``train``/``test``, a folder per class);

run unmodified and offline. The server serves the same folders under the same names
(``--model-alias Qwen/Qwen3.5-9B-Base=<mirror>/Qwen/Qwen3.5-9B-Base`` ...).

The mirror is built once under ``.compat/mirror-<key>`` (the key hashes this file and the models'
key), its two models once under ``.compat/models-<key>`` (the tiny-model factory, the warm-start
script, the shape and the pinned versions), and each test session works in a fresh directory of
symlinks to the mirror, so nothing a recipe writes into its CWD reaches the cache.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
from pathlib import Path

from tests.compat.venvs import COMPAT_DIR, main_pins, _lock
from tinsmith.devtools import tiny_model
from tinsmith.devtools.tiny_model import LLAMA3_SPECIAL_TOKENS, QWEN_CHAT_SPECIAL_TOKENS, TinyShape, make_tiny_model

HERE = Path(__file__).resolve().parent
WARM_START = HERE / "scripts" / "warm_start.py"

# Context for multi-turn recipes (guess_number prompts grow to ~600 tokens); hidden 64 >= the
# LoRA ranks the suite asks for (4 .. 32).
SHAPE = TinyShape(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
SPECIALS = QWEN_CHAT_SPECIAL_TOKENS + LLAMA3_SPECIAL_TOKENS
# The image-text model: head_dim 32 gives its quarter-width rotary one frequency per multimodal axis.
VLM_SHAPE = TinyShape(**{**SHAPE.__dict__, "head_dim": 32})

STUDENT = "Qwen/Qwen3.5-9B-Base"
# Served by the student's weights: the recipes' default ids (rl_numerics_check and the rubric
# grader default to Qwen3.6-35B-A3B).
STUDENT_ALIASES = ("Qwen/Qwen3.5-9B-Base", "Qwen/Qwen3.5-4B", "Qwen/Qwen3.6-35B-A3B")
TEACHER = "Qwen/Qwen3.5-9B"
VLM = "Qwen/Qwen3.5-397B-A17B"
MODEL_IDS = (*STUDENT_ALIASES, TEACHER, VLM)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

_WORDS = ("the a and to of in on with from up down small large fast slow red blue green one two three "
          "hello world answer number what is why how when story about letter word good bad").split()


def _key(*parts: object, files: tuple[Path, ...] = ()) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    h.update(json.dumps([repr(p) for p in parts], sort_keys=True).encode())
    return h.hexdigest()[:12]


def models_key() -> str:
    """The tiny models depend on the factory, the warm start, the shape and the pinned versions."""
    return _key(SHAPE, VLM_SHAPE, SPECIALS, sorted(main_pins().items()), files=(Path(tiny_model.__file__), WARM_START))


def mirror_key() -> str:
    return _key(models_key(), files=(Path(__file__),))


# ------------------------------------------------------------------------------------------ datasets
def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."


def _write_dataset(root: Path, repo_id: str, splits: dict[str, list[dict]], config: str | None = None) -> None:
    """JSONL files plus a README whose YAML ``configs`` header names the splits (and config)."""
    d = root / repo_id
    sub = config or "data"
    (d / sub).mkdir(parents=True, exist_ok=True)
    lines = ["---", "configs:", f"- config_name: {config or 'default'}", "  data_files:"]
    for split, rows in splits.items():
        (d / sub / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        lines += [f"  - split: {split}", f"    path: {sub}/{split}.jsonl"]
    lines += ["---", f"Offline stand-in for {repo_id} (tinsmith compat suite).", ""]
    (d / "README.md").write_text("\n".join(lines))


def write_datasets(root: Path, seed: int = 0) -> None:
    rng = random.Random(seed)

    def chat(n_turns: int = 1) -> list[dict]:
        msgs = []
        for _ in range(n_turns):
            msgs += [{"role": "user", "content": _sentence(rng, 3, 8)},
                     {"role": "assistant", "content": _sentence(rng, 4, 14)}]
        return msgs

    # sl_loop / chat_sl dataset=no_robots: "messages"
    _write_dataset(root, "HuggingFaceH4/no_robots", {
        split: [{"prompt": m[0]["content"], "prompt_id": f"{split}-{i}", "messages": m, "category": "Chat"}
                for i, m in enumerate(chat(rng.randint(1, 2)) for _ in range(n))]
        for split, n in (("train", 256), ("test", 160))})  # sl_basic evaluates whole batches of 128
    # rl_loop (question/answer, "#### N"): answers 0/1, the digits the warm-started model boxes.
    gsm = {}
    for split, n in (("train", 256), ("test", 32)):
        rows = []
        for _ in range(n):
            a, b = rng.randint(0, 1), rng.randint(0, 1)
            rows.append({"question": f"What is {a} plus {b} minus {b}?",
                         "answer": f"{a} plus {b} is <<{a}+{b}={a + b}>>{a + b}, minus {b} is {a}.\n#### {a}"})
        gsm[split] = rows
    _write_dataset(root, "openai/gsm8k", gsm, config="main")
    # preference.dpo dataset=hhh: "chosen"/"rejected" transcripts sharing all but the last turn
    hh = {}
    for split, n in (("train", 128), ("test", 32)):
        rows = []
        for _ in range(n):
            q = _sentence(rng, 3, 8)
            rows.append({"chosen": f"\n\nHuman: {q}\n\nAssistant: {_sentence(rng, 3, 10)}",
                         "rejected": f"\n\nHuman: {q}\n\nAssistant: {_sentence(rng, 3, 10)}"})
        hh[split] = rows
    _write_dataset(root, "Anthropic/hh-rlhf", hh)
    # distillation dataset=deepmath: "question" (train split only, like the real one)
    _write_dataset(root, "zwhe99/DeepMath-103K", {"train": [
        {"question": f"What is {a} + {b}?", "final_answer": str(a + b), "difficulty": 1.0,
         "topic": "Mathematics -> Algebra", "r1_solution_1": "", "r1_solution_2": "", "r1_solution_3": ""}
        for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(128))]})
    # distillation / chat_sl dataset=tulu3: "messages"
    _write_dataset(root, "allenai/tulu-3-sft-mixture", {"train": [
        {"id": f"tulu-{i}", "messages": chat(1), "source": "compat"} for i in range(128)]})
    # rl_numerics_check: wikitext "text" lines
    _write_dataset(root, "Salesforce/wikitext", {
        split: [{"text": (" " + _sentence(rng, 8, 30) + "\n") if i % 3 else ""} for i in range(n)]
        for split, n in (("train", 512), ("validation", 32), ("test", 32))}, config="wikitext-103-raw-v1")
    _write_image_folder(root / "dpdl-benchmark/caltech101", rng)


# vlm_classifier dataset=caltech101: class names as the real one spells them (the recipe cleans
# "_", "." and "-" out of them), each class its own colour.
IMAGE_CLASSES = {"Motorbikes": (200, 30, 30), "red_panda": (30, 160, 40), "yin.yang": (40, 40, 220)}


def _write_image_folder(d: Path, rng: random.Random) -> None:
    """``train/<class>/*.png`` and ``test/<class>/*.png``: what ``datasets``' image folder loader
    reads as an ``image`` column and a ``label`` class column."""
    from PIL import Image

    for split, n in (("train", 4), ("test", 2)):
        for name, colour in IMAGE_CLASSES.items():
            (d / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                size = (rng.randint(40, 120), rng.randint(40, 120))
                shade = tuple(min(255, c + rng.randint(0, 30)) for c in colour)
                Image.new("RGB", size, shade).save(d / split / name / f"{i}.png")


# ------------------------------------------------------------------------------------------ models
def write_models(root: Path, cookbook_python: Path) -> None:
    """``root/student`` (warm-started) and ``root/teacher`` (random), sharing one tokenizer, and
    ``root/vlm`` (random, image-text, with the same chat specials)."""
    student = root / "student"
    make_tiny_model(student, "qwen3", SHAPE, seed=1, extra_special_tokens=SPECIALS)
    tok = json.loads((student / "tokenizer.json").read_text())
    top = max([*tok["model"]["vocab"].values(), *(t["id"] for t in tok["added_tokens"])])
    vocab = json.loads((student / "config.json").read_text())["vocab_size"]
    assert top < vocab, f"tokenizer ids up to {top} but the model's vocabulary is {vocab}"
    shutil.copytree(student, root / "teacher")  # the raw random weights, before the warm start
    make_tiny_model(root / "vlm", "qwen3_5_moe_vl", VLM_SHAPE, seed=3, extra_special_tokens=SPECIALS)
    proc = subprocess.run([str(cookbook_python), str(WARM_START), str(student)], capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"warm start failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    (root / "warm_start.json").write_text(proc.stdout.strip().splitlines()[-1] + "\n")


def _build_once(root: Path, build) -> Path:
    """Build ``root`` with ``build(tmp)`` unless a complete one exists (locked against concurrent runs)."""
    ok = root / ".compat-ok"
    if ok.exists():
        return root
    with _lock(root.with_name(f".{root.name}.lock")):
        if ok.exists():
            return root
        shutil.rmtree(root, ignore_errors=True)
        tmp = root.with_name(root.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        build(tmp)
        tmp.rename(root)
        ok.write_text("ok\n")
    return root


def ensure_mirror(cookbook_python: Path) -> Path:
    """The cached mirror for the current sources and versions (built on first use).

    The warm-started models are cached on their own (``.compat/models-<key>``), so changing only
    the datasets does not train them again.
    """
    models = _build_once(COMPAT_DIR / f"models-{models_key()}", lambda d: write_models(d, cookbook_python))

    def build(d: Path) -> None:
        write_datasets(d)
        for alias in STUDENT_ALIASES:
            shutil.copytree(models / "student", d / alias)
        shutil.copytree(models / "teacher", d / TEACHER)
        shutil.copytree(models / "vlm", d / VLM)

    return _build_once(COMPAT_DIR / f"mirror-{mirror_key()}", build)


def link_workdir(mirror: Path, workdir: Path) -> Path:
    """A fresh CWD whose top-level folders (``Qwen``, ``openai`` ...) are symlinks into ``mirror``."""
    workdir.mkdir(parents=True, exist_ok=True)
    for entry in mirror.iterdir():
        if entry.is_dir():
            (workdir / entry.name).symlink_to(entry, target_is_directory=True)
    return workdir


def server_args(mirror: Path) -> tuple[Path, list[str]]:
    """``--base-model`` and the ``--model-alias`` flags that serve every mirrored model id."""
    base = mirror / STUDENT
    args: list[str] = []
    for alias in STUDENT_ALIASES:
        args += ["--model-alias", f"{alias}={base}"]
    args += ["--model-alias", f"{TEACHER}={mirror / TEACHER}", "--model-alias", f"{VLM}={mirror / VLM}"]
    return base, args
