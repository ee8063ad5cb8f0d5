"""The demo's task: character tokenizer, reward, training-datum layout, advantages (fast)."""

from __future__ import annotations

import random

import pytest

from tinsmith.demo import task
from tinsmith.demo.pretrain import noisy_answer, sft_batch
from tinsmith.demo.run import group_advantages, make_datum


def test_tokenizer_makes_one_token_per_character():
    tok = task.build_tokenizer()
    enc = tok.encode("347+85=432")
    assert enc.tokens == list("347+85=432")
    assert enc.ids == task.encode("347+85=432")
    assert tok.decode(enc.ids) == "347+85=432"
    assert tok.token_to_id(task.EOS) == task.EOS_ID
    assert tok.token_to_id(task.PAD) == task.PAD_ID
    assert tok.get_vocab_size() <= task.MODEL_VOCAB_SIZE


def test_saved_tokenizer_loads_with_transformers(tmp_path):
    import transformers

    transformers.PreTrainedTokenizerFast(tokenizer_object=task.build_tokenizer(), eos_token=task.EOS,
                                         pad_token=task.PAD).save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf("12+9=")["input_ids"] == task.encode("12+9=")
    assert hf.eos_token_id == task.EOS_ID
    assert hf.decode(task.encode("21") + [task.EOS_ID], skip_special_tokens=True) == "21"


def test_encode_rejects_other_characters_and_decode_stops_at_the_end_token():
    with pytest.raises(ValueError, match="'x'"):
        task.encode("1x2")
    assert task.decode(task.encode("12") + [task.EOS_ID] + task.encode("9")) == "12"


def test_problems_are_reproducible_and_within_the_digit_range():
    a, b = task.problems(200, seed=3), task.problems(200, seed=3)
    assert a == b
    assert a != task.problems(200, seed=4)
    for p in a:
        assert 0 <= p.a < 10**task.MAX_DIGITS and 0 <= p.b < 10**task.MAX_DIGITS
        assert p.prompt == f"{p.a}+{p.b}=" and int(p.answer) == p.a + p.b
        assert p.answer_ids()[-1] == task.EOS_ID
        assert len(p.answer_ids()) <= task.MAX_ANSWER_TOKENS
    lengths = {len(str(p.a)) for p in a}
    assert lengths == set(range(1, task.MAX_DIGITS + 1))


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("432$", 1.0),  # exact, with the end token
        ("432", 0.0),  # never ended
        ("431$", 0.5 * 2 / 3),  # units wrong, tens and hundreds right
        ("532$", 0.5 * 2 / 3),
        ("32$", 0.5 * 2 / 3),  # right-aligned: 2 and 3 match, length costs
        ("4320$", 0.0),  # shifted: nothing lines up
        ("1432$", 0.5 * 3 / 4),
        ("$", 0.0),
        ("4+2$", 0.0),
    ],
)
def test_reward_exact_match_with_partial_credit_per_digit(completion, expected):
    p = task.Problem(347, 85)
    ids = task.encode(completion.rstrip("$")) + ([task.EOS_ID] if completion.endswith("$") else [])
    assert task.reward(p, ids) == pytest.approx(expected)
    assert task.is_correct(p, ids) == (expected == 1.0)
    assert task.reward(p, ids) < 0.5 or expected == 1.0  # any wrong answer scores below half


def test_group_advantages_are_centred_and_scaled():
    adv = group_advantages([1.0, 0.0, 0.5, 0.5], scale=0.5)
    assert adv == pytest.approx([0.25, -0.25, 0.0, 0.0])
    assert group_advantages([0.3, 0.3, 0.3], scale=1.0) == [0.0, 0.0, 0.0]


def test_make_datum_puts_targets_logprobs_and_advantages_on_the_completion_only():
    prompt = task.encode("12+9=")
    completion = task.encode("21") + [task.EOS_ID]
    d = make_datum(prompt, completion, [-0.1, -0.2, -0.3], 0.7)
    tokens = prompt + completion
    assert d.model_input.to_ints() == tokens[:-1]
    assert d.loss_fn_inputs["target_tokens"].tolist() == tokens[1:]
    n = len(prompt) - 1
    assert d.loss_fn_inputs["logprobs"].tolist() == pytest.approx([0.0] * n + [-0.1, -0.2, -0.3])
    assert d.loss_fn_inputs["advantages"].tolist() == pytest.approx([0.0] * n + [0.7] * 3)


def test_sft_batch_labels_only_the_answer():
    probs = [task.Problem(5, 7), task.Problem(120, 3)]
    x, y = sft_batch(probs)
    for i, p in enumerate(probs):
        seq = p.prompt_ids() + p.answer_ids()
        assert x[i, : len(seq)].tolist() == seq
        assert (x[i, len(seq):] == task.PAD_ID).all()
        labelled = [(j, int(t)) for j, t in enumerate(y[i].tolist()) if t != -100]
        P = len(p.prompt)
        assert labelled == [(P - 1 + k, t) for k, t in enumerate(p.answer_ids())]


def test_noisy_answer_changes_exactly_one_digit():
    rng = random.Random(0)
    for p in task.problems(100, seed=1):
        noisy = noisy_answer(p, rng)
        assert noisy[-1] == task.EOS_ID
        text = task.decode(noisy)
        assert len(text) == len(p.answer) and text.isdigit()
        assert sum(a != b for a, b in zip(text, p.answer)) == 1


def test_cli_has_the_demo_command(capsys):
    from tinsmith.cli import main

    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--out", "--steps", "--port", "--model-dir"):
        assert flag in help_text


def test_the_starting_model_is_cached_inside_the_output_directory(tmp_path):
    from tinsmith.demo.run import DemoConfig, starting_model_dir

    assert starting_model_dir(DemoConfig(out_dir=str(tmp_path / "out"))) == tmp_path / "out" / "model"
    assert starting_model_dir(DemoConfig(out_dir=str(tmp_path / "out"), model_dir=str(tmp_path / "m"))) == tmp_path / "m"
