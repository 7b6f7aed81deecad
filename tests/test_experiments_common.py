"""experiments/common.py: overrides reach the config parser as the intended values; the results schema."""

import json

import tomllib

from experiments import common
from titanloop.train.config import parse_overrides


def test_override_args_parse_back_to_the_same_values():
    values = {
        "training.steps": 7,
        "optimizer.lr": 0.003,
        "model.readout": "raw",
        "checkpoint.enable": True,
        "optimizer.betas": [0.9, 0.95],
        "data.task_options": {"max_ops": 4, "name": "a b"},
    }
    parsed = parse_overrides(common.override_args(values))
    flat = {f"{s}.{k}": v for s, d in parsed.items() for k, v in d.items()}
    assert flat == values
    assert tomllib.loads("v = " + common.toml_literal(1e-5))["v"] == 1e-5


def test_write_results_schema(tmp_path):
    rows = [{"variant": "a", "acc": 0.5}, {"variant": "b", "acc": 0.75}]
    res = common.write_results(
        tmp_path,
        name="x",
        title="X",
        paper="up",
        columns=["variant", "acc"],
        rows=rows,
        verdict="b > a",
        reproduced=True,
        command="python -m experiments.x",
        smoke=True,
    )
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk == res and on_disk["reproduced"] is None  # a smoke run never claims a result
    assert on_disk["schema"] == common.RESULTS_SCHEMA and on_disk["rows"] == rows
    md = (tmp_path / "results.md").read_text()
    assert "| b | 0.75 |" in md and "not judged" in md
    assert common.mean_std([1.0, 3.0]) == (2.0, 2**0.5)
