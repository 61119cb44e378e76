"""Answer extraction, GSM8K from the local copy, and the synthetic arithmetic task."""

from pathlib import Path

import pytest

from workbench.rl.tasks import GSM8K, Arithmetic, extract_answer, make_task, normalize_number

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


@pytest.mark.parametrize("text, strict, lenient", [
    ("so 6 * 7 = 42\n#### 42", "42", "42"),
    ("The total is \\boxed{42}.", None, "42"),
    ("The answer is 42.", None, "42"),
    ("It costs $1,234.50 in all.\n#### $1,234.50", "1234.5", "1234.5"),
    ("The answer is -7", None, "-7"),
    ("#### 18.00", "18", "18"),
    ("first 3, then 5, so 8 apples", None, "8"),
    ("no number here", None, None),
])
def test_extraction(text, strict, lenient):
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "lenient") == lenient


def test_normalize_number():
    assert normalize_number("1,000") == "1000" and normalize_number("$3.50") == "3.5"
    assert normalize_number("-0.0") == "0" and normalize_number("abc") is None


@pytest.mark.skipif(not GSM8K_DIR.exists(), reason="the shared GSM8K copy is not beside this checkout")
def test_gsm8k_from_the_local_copy():
    task = GSM8K(GSM8K_DIR, "test")
    assert len(task) == 1319
    train = GSM8K(GSM8K_DIR / "train.jsonl")
    first = train.items[0]
    assert first.answer == "72" and "Natalia" in first.prompt
    assert task.reward("... #### 72", first) == 1.0 and task.reward("The answer is 71.", first) == 0.0
    assert task.reward("The answer is 72.", first, mode="strict") == 0.0
    assert task.scores("The answer is 72.", first) == {"strict": 0.0, "lenient": 1.0}
    stream = train.problems(len(train) + 3)
    assert stream[-3:] == stream[:3], "the training stream wraps around"
    assert stream[:50] != train.items[:50] and stream[:50] == GSM8K(GSM8K_DIR, seed=0).problems(50)
    assert GSM8K(GSM8K_DIR).eval_problems(2) == task.items[:2]
    with pytest.raises(ValueError, match="needs a folder holding test.jsonl"):
        train.eval_problems(2)
    with pytest.raises(ValueError, match="needs a source"):
        make_task("gsm8k")
    with pytest.raises(ValueError, match="unknown task"):
        make_task("chess")
    assert make_task("gsm8k", source=str(GSM8K_DIR)).problems(1)[0].answer


def test_gsm8k_bad_sources(tmp_path):
    with pytest.raises(ValueError, match="no file"):
        GSM8K(tmp_path, "train")
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(ValueError, match="no '#### <number>'"):
        GSM8K(tmp_path)
    (tmp_path / "train.jsonl").write_text("{broken\n")
    with pytest.raises(ValueError, match="not a JSON line"):
        GSM8K(tmp_path)
    with pytest.raises(ValueError, match="loading it from the hub failed"):
        GSM8K("openai/gsm8k-does-not-exist")


def test_arithmetic_task():
    task = Arithmetic(seed=3, difficulty=2)
    a, b = task.problems(50), Arithmetic(seed=3, difficulty=2).problems(50)
    assert a == b and len({p.prompt for p in a}) > 45
    for p in a:
        assert eval(p.prompt[:-1]) == int(p.answer)  # noqa: S307  (a test oracle on generated digits and + - *)
        assert task.reward(f" {p.answer}<|endoftext|>", p) == 1.0
        assert task.reward(str(int(p.answer) + 1), p) == 0.0
    assert Arithmetic(seed=4, difficulty=2).problems(5) != a[:5]
    with pytest.raises(ValueError, match="difficulty must be"):
        Arithmetic(difficulty=0)
