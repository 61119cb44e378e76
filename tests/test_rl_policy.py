"""The self-trained starting policy: a tokenizer, supervised training, a checkpoint that loads back."""

import pytest
import torch

from helpers import seed_for
from workbench.__main__ import main
from workbench.models import load_pretrained, load_tokenizer
from workbench.policies.selftrained import PolicyConfig, train_policy, train_tokenizer
from workbench.tasks import Arithmetic


def test_digit_level_tokenizer():
    tok = train_tokenizer(Arithmetic(seed=0, difficulty=2))
    ids = tok("12+34*5=170")["input_ids"]
    assert len(ids) == len("12+34*5=170"), "one token per character"
    assert tok.decode(ids) == "12+34*5=170" and tok.eos_token_id is not None


@pytest.mark.slow
def test_train_policy_learns_and_saves(tmp_path):
    cfg = PolicyConfig(max_steps=60, eval_every=30, eval_problems=16, target_accuracy=(0.99, 1.0))
    with pytest.warns(UserWarning, match="raise max_steps"):  # the range is out of reach: it trains to the end
        model, tok, table = train_policy(cfg, tmp_path / "policy")
    assert set(table.columns) == {"step", "metric", "value", "variant", "seed"}
    loss = table[table.metric == "loss"].value
    assert loss.iloc[-5:].mean() < 0.7 * loss.iloc[:5].mean()
    acc = table[table.metric == "accuracy"].value
    assert len(acc) == 2 and ((acc >= 0) & (acc <= 1)).all()
    again = load_pretrained(tmp_path / "policy", dtype=torch.bfloat16)
    assert again.config == model.config
    assert load_tokenizer(tmp_path / "policy")("7*8=")["input_ids"] == tok("7*8=")["input_ids"]
    ids = torch.tensor([tok("7*8=56")["input_ids"]])
    with torch.no_grad():
        assert (again(ids).float() - model(ids)).abs().max() < 0.1  # bf16 copy of the fp32 weights


def test_bad_policy_configs():
    with pytest.raises(ValueError, match="lr must be a positive number"):
        PolicyConfig(lr=0)
    with pytest.raises(ValueError, match="lr must be a positive number"):
        PolicyConfig(lr=float("nan"))
    with pytest.raises(ValueError, match="unknown policy size"):
        PolicyConfig(size="huge")
    with pytest.raises(ValueError, match="target_accuracy"):
        PolicyConfig(target_accuracy=(0.6, 0.1))
    with pytest.raises(SystemExit):
        main(["train-policy", "--lr", "-1"])


def test_micro_batched_supervised_step_is_the_batch_step():
    """Rows forwarded and backpropagated a few at a time give the whole batch's loss and gradient (fp32, up to the
    order of the sum): the warm start's memory cap does not change what it trains."""
    from workbench.kernels import mode
    from workbench.models import build
    from workbench.policies.selftrained import answer_batch, supervised_step

    seed = seed_for()
    g = torch.Generator().manual_seed(seed)
    pairs = [(torch.randint(3, 60, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist(),
              torch.randint(3, 60, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist())
             for _ in range(5)]
    batch = answer_batch(pairs, 0, "cpu")
    grads, losses = [], []
    for micro in (0, 2):
        model = build("tiny", dtype=torch.float32, seed=seed % 1000)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)   # lr 0: the step leaves the gradients to compare
        with mode("standard"):
            losses.append(supervised_step(model, opt, *batch, step=1, micro_rows=micro))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5), f"seed {seed}"
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("accuracies, stop, in_range, warned", [
    ((0.0, 0.8, 0.3, 0.3), 2, 0.0, "lower lr"),    # overshoot: stop there, more training would only raise it
    ((0.0, 0.3, 0.9, 0.9), 2, 1.0, None),          # the first measurement at the low end is in range
    ((0.0, 0.05, 0.05, 0.05), 4, 0.0, "raise max_steps"),   # the budget ends below the range
])
def test_training_stops_at_the_first_accuracy_at_the_targets_low_end(monkeypatch, recwarn, accuracies, stop,
                                                                     in_range, warned):
    """Scripted accuracies (the stop rule, not the learning): the run stops at the first measurement >= low,
    says whether it lies in the range, and warns in one line when it does not."""
    import workbench.policies.selftrained as policy

    scripted = iter(accuracies)
    monkeypatch.setattr(policy, "greedy_accuracy", lambda *a: next(scripted))
    cfg = PolicyConfig(max_steps=4, eval_every=1, batch_size=4, eval_problems=2, target_accuracy=(0.1, 0.6),
                       device="cpu")
    _, _, table = train_policy(cfg)
    acc = table[table.metric == "accuracy"]
    assert acc.step.tolist() == list(range(1, stop + 1)) and acc.value.tolist() == list(accuracies[:stop])
    assert table[table.metric == "in_range"].value.tolist() == [in_range]
    messages = [str(w.message) for w in recwarn if "target_accuracy" in str(w.message)]
    if warned:
        assert len(messages) == 1 and warned in messages[0] and "\n" not in messages[0], messages
    else:
        assert not messages, messages
