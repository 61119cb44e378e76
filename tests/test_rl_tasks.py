"""Answer extraction, the lenient (math-verify) check, GSM8K and other question/answer files through
`datasets`, and the synthetic arithmetic task."""

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from workbench.tasks import GSM8K, PROMPT_TEMPLATE, Arithmetic, Problem, answers, make_task
from workbench.tasks.answers import extract_answer, lenient_correct, normalize_number

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
def test_gsm8k_from_the_local_copy(monkeypatch, tmp_path):
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
    monkeypatch.setenv("WORKBENCH_GSM8K", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="needs a source"):
        make_task("gsm8k")
    with pytest.raises(ValueError, match="unknown task"):
        make_task("chess")
    assert make_task("gsm8k", source=str(GSM8K_DIR)).problems(1)[0].answer


@pytest.mark.parametrize("text, answer, lenient", [
    ("\\boxed{\\frac{1}{2}}", "0.5", True),                   # LaTeX fraction vs a decimal reference
    ("The answer is $\\frac{1}{2}$.", "0.5", True),
    ("#### 1/2", "0.5", True),                                   # strict reads 1 here; math-verify reads 1/2
    ("It costs $1,234", "1234", True),                           # dollar sign and thousands separator
    ("The total is 1,234,567.", "1234567", True),
    ("\\boxed{\\$12}", "12", True),
    ("She has 12 dollars left.", "12", True),                    # a unit after the number
    ("\\boxed{12 \\text{ dollars}}", "12", True),
    ("3.0", "3", True),
    ("#### 18.00", "18", True),
    # A percentage is the number written: GSM8K answers "what percent" with the bare number (#### 50).
    ("The discount is 50%.", "50", True),
    ("\\boxed{50\\%}", "50", True),
    ("The discount is 50%.", "0.5", False),
    ("\\boxed{50\\%}", "0.5", False),
    ("so 6 * 7 = 42\n#### 42\n\nQuestion: Tom has 5 apples", "42", True),  # the '####' line, not the tail
    ("\\boxed{\\frac{1}{3}}", "0.5", False),
    ("no number here", "0", False),
    ("", "0", False),
])
def test_lenient_check(text, answer, lenient):
    problem = Problem("q", answer)
    task = GSM8K.__new__(GSM8K)  # scoring needs no data
    assert lenient_correct(text, answer) is lenient
    assert task.scores(text, problem)["lenient"] == float(lenient) == task.reward(text, problem)


def test_a_wrong_final_answer_after_the_right_number():
    problem = Problem("q", "72")
    task = GSM8K.__new__(GSM8K)
    for text in ("48 + 24 = 72 clips in all... no, 48 + 23 = 71.\n#### 71",
                 "She sold 72 clips? No: 71. The answer is 71.",
                 "#### 72 was a guess; the answer is #### 71",
                 "48/2 = 24, 48 + 24 = 72, but half of them broke, so \\boxed{\\frac{72}{2}}"):
        assert task.scores(text, problem) == {"strict": 0.0, "lenient": 0.0}, text
    assert task.scores("48 + 24 = 72\n#### 72", problem) == {"strict": 1.0, "lenient": 1.0}
    assert task.scores("48 + 24 = \\boxed{72}", problem) == {"strict": 0.0, "lenient": 1.0}


@pytest.mark.parametrize("text, lenient", [
    ("9^" * 50_000 + "9", 0.0),                                    # a power tower, cut to its tail
    ("x" * 100_000 + "\\boxed{9^{9^{9^{9}}}}", 0.0),                # sympy would not finish this one: the deadline
    ("{" * 50_000 + "}" * 50_000, 0.0),
    ("\\boxed{" * 30_000 + "72", 1.0),                              # its last number is the answer
    ("#### " + " " * 100_000 + "x", 0.0),                          # quadratic for the earlier regular expressions
    ("The answer is " + " " * 100_000 + "x", 0.0),
    ("1," * 50_000, 0.0),
])
def test_hostile_completions_end_fast(text, lenient):
    start = time.perf_counter()
    scores = GSM8K.__new__(GSM8K).scores(text, Problem("q", "72"))
    # The attack's bound, not a speed claim: a quadratic rule or an unbounded sympy call takes minutes on these
    # inputs, so a margin of seconds over the deadline cannot flake on a loaded machine and still catches them.
    assert time.perf_counter() - start < answers.MATH_VERIFY_TIMEOUT_S + 4
    assert scores == {"strict": 0.0, "lenient": lenient}
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0), "the timer is disarmed"
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None), "the handler is put back"


def test_math_verify_failures_score_zero(monkeypatch):
    import math_verify

    def broken(*args, **kwargs):
        raise RuntimeError("a bug inside math-verify")

    def stuck(*args, **kwargs):
        while True:
            pass

    monkeypatch.setattr(math_verify, "parse", broken)
    assert lenient_correct("\\boxed{\\frac{2}{4}} (broken)", "0.5") is False
    assert lenient_correct("#### 0.5", "0.5") is True, "the regular-expression rule needs no math-verify"
    monkeypatch.setattr(math_verify, "parse", stuck)
    start = time.perf_counter()
    assert lenient_correct("\\boxed{\\frac{2}{4}} (stuck)", "0.5") is False
    assert time.perf_counter() - start < answers.MATH_VERIFY_TIMEOUT_S + 2  # the deadline ended it: stuck never returns


def test_lenient_check_outside_the_main_thread():
    """No SIGALRM there: math-verify runs without its timeouts, and spans that could run for ever are skipped."""
    out = {}

    def score():
        for text in ("\\boxed{\\frac{1}{2}} (thread)", "\\boxed{9^{9^{9^{9}}}} (thread)", "\\boxed{(10^{7})!}"):
            out[text] = lenient_correct(text, "0.5")

    worker = threading.Thread(target=score)
    worker.start()
    worker.join(30)  # a span evaluated instead of skipped runs for hours: a bound, not a timing
    assert not worker.is_alive(), "a span that could run for ever was evaluated"
    assert list(out.values()) == [True, False, False]


def test_another_timer_is_left_alone():
    """Where a real-time timer is already armed (an alarm, pytest-timeout), ours would replace it: none is armed."""
    old = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 60)
    try:
        assert lenient_correct("\\boxed{\\frac{3}{4}} (timer)", "0.75") is True
        assert lenient_correct("\\boxed{9^{9^{9^{9}}}} (timer)", "0.75") is False
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 60, "the other timer still runs"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _previous_loader(path: Path) -> list[Problem]:
    """The JSON-lines reader this task had before `datasets` (issue 19), as the reference."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Problem(PROMPT_TEMPLATE.format(question=r["question"]), extract_answer(r["answer"], "strict"))
            for r in rows]


@pytest.mark.skipif(not GSM8K_DIR.exists(), reason="the shared GSM8K copy is not beside this checkout")
def test_gsm8k_through_datasets_equals_the_previous_loader():
    for split, count in (("train", 7473), ("test", 1319)):
        before, now = _previous_loader(GSM8K_DIR / f"{split}.jsonl"), GSM8K(GSM8K_DIR, split).items
        assert len(now) == len(before) == count
        assert now[0] == before[0] and now[-1] == before[-1] and now == before


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_own_jsonl_and_parquet_with_named_fields(tmp_path):
    import pandas as pd

    rows = [{"problem": "What is 2 + 3?", "solution": "2 + 3 = 5\n#### 5", "id": 0},
            {"problem": "What is 1,000 + 234?", "solution": "#### 1,234", "id": 1}]
    jsonl = _write_jsonl(tmp_path / "mine.jsonl", rows)
    task = make_task("gsm8k", source=str(jsonl), question_field="problem", answer_field="solution")
    assert [p.answer for p in task.items] == ["5", "1234"]
    assert task.items[0].prompt == PROMPT_TEMPLATE.format(question="What is 2 + 3?")
    # A parquet folder with a train and a test split; the answer field holds just the number.
    folder = tmp_path / "pq"
    folder.mkdir()
    pd.DataFrame({"q": ["Half of 3?", "Twice 6?"], "final": [1.5, 12.0]}).to_parquet(folder / "train.parquet")
    pd.DataFrame({"q": ["Ten less than 3?"], "final": ["-7"]}).to_parquet(folder / "test.parquet")
    task = GSM8K(folder, seed=1, question_field="q", answer_field="final")
    assert [p.answer for p in task.items] == ["1.5", "12"] and "Half of 3?" in task.items[0].prompt
    assert [p.answer for p in task.eval_problems(5)] == ["-7"], "the test split keeps the field names"
    assert task.reward("\\boxed{\\frac{3}{2}}", task.items[0]) == 1.0
    single = GSM8K(folder / "train.parquet", question_field="q", answer_field="final")
    assert single.items == task.items


def test_a_missing_field_is_named_with_the_fields_present(tmp_path):
    path = _write_jsonl(tmp_path / "wrong.jsonl", [{"prompt": "q", "answer": "#### 1", "meta": 3}])
    with pytest.raises(ValueError) as err:
        make_task("gsm8k", source=str(path))
    message = str(err.value)
    assert str(path) in message and "'question'" in message and "prompt, answer, meta" in message
    with pytest.raises(ValueError, match=r"no field 'solution' \(answer_field\); its fields: prompt, answer, meta"):
        GSM8K(path, question_field="prompt", answer_field="solution")
    assert GSM8K(path, question_field="prompt").items[0].answer == "1"
    _write_jsonl(path, [{"question": "q", "answer": "#### 1"}, {"question": "q2"}])
    with pytest.raises(ValueError, match="row 1 has no 'answer'"):
        GSM8K(path)


def test_gsm8k_bad_sources(tmp_path):
    with pytest.raises(ValueError, match="no file"):
        GSM8K(tmp_path, "train")
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(ValueError, match="no '#### <number>'"):
        GSM8K(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{broken\n')
    with pytest.raises(ValueError, match=r"train.jsonl:2: not a JSON line"):
        GSM8K(tmp_path)
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(ValueError, match="has no problems"):
        GSM8K(tmp_path)
    (tmp_path / "train.parquet").write_text("not parquet")
    (tmp_path / "train.jsonl").unlink()
    with pytest.raises(ValueError, match="could not read it as parquet"):
        GSM8K(tmp_path)
    with pytest.raises(ValueError, match="no file"):
        GSM8K(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="loading it from the hub failed") as err:
        GSM8K("openai/gsm8k-does-not-exist")
    assert "\n" not in str(err.value), "one line"


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


@pytest.mark.parametrize("completion, reward", [
    ("", 0.0),
    (" paris", 2.0),                                  # lowercase, the answer: x2
    (" Paris", 2.0 * (1 - 0.9 / 6)),                  # one capital of 6 characters
    (" london", 0.5),                                 # no answer: x0.5
    ("ééééé paris", 2.0 * 0.1),                       # > 10% non-ASCII: x0.1
    ("PARIS", 2.0 * 0.1),                             # all uppercase: x(1 - 0.9)
])
def test_the_blog_reward_rule_for_rule(completion, reward):
    task = make_task("facts")
    assert task.reward(completion, task.problems(1)[0]) == pytest.approx(reward)


def test_the_blog_prompts_and_chat_arithmetic():
    facts = make_task("facts")
    assert [p.prompt for p in facts.problems(5, start=10)][0] == "The capital of France is"
    assert facts.scores("it is Jupiter", facts.problems(5)[4]) == {"answer": 1.0}
    chat = make_task("arithmetic-chat", seed=3, difficulty=1)
    bare = make_task("arithmetic", seed=3, difficulty=1)
    for c, b in zip(chat.problems(20), bare.problems(20)):
        assert c.answer == b.answer and c.prompt.startswith("What is ") and "####" in c.prompt
        assert c.prompt.split("?")[0][8:].replace(" ", "") == b.prompt[:-1], "the same problem, spaced"
    p = chat.problems(1)[0]
    assert chat.reward(f"so the answer is\n#### {p.answer}", p) == 1.0
    assert chat.scores(f"it is {p.answer}", p) == {"strict": 0.0, "lenient": 1.0}
