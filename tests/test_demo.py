import pytest

from workbench.__main__ import main
from workbench.teach.demo import BatchVarianceConfig, batch_variance, summarize


def test_batch_variance_table():
    cfg = BatchVarianceConfig(k=64, n=48, batch_sizes=(1, 5, 33), dtypes=("float32",))
    table = batch_variance(cfg)
    assert list(table["M"]) == [1, 5, 33]
    assert table["invariant_bitwise_equal"].all() and (table["invariant_max_ulps"] == 0).all()
    assert "invariant  float32: row 0 identical at every M" in summarize(table)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="dtypes may be"):
        BatchVarianceConfig(dtypes=("float16",))
    with pytest.raises(SystemExit):
        main(["demo", "--k", "0"])


def test_cli_runs(capsys):
    assert main(["demo", "--k", "32", "--n", "32", "--batch-sizes", "1", "3", "--dtypes", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "invariant bfloat16: row 0 identical at every M" in out
