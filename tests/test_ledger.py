"""The ledger describes exactly the training the current weights contain."""

import json

from stoa.fleet.trust.ledger import Ledger


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_cut_keeps_what_the_checkpoint_holds_and_a_fresh_start_keeps_nothing(tmp_path):
    step = {"rl_step": 0}
    ledger = Ledger(tmp_path / "ledger.jsonl", lambda: dict(step))
    ledger.write(trained=["k/g0"])
    ledger.write(checkpoint="v000001")
    step["rl_step"] = 1
    ledger.write(trained=["k/g1"])
    ledger.write(dropped={"stale": ["k/g2"]})

    ledger.cut("v000001")  # a resume: what came after the checkpoint was lost
    assert _lines(tmp_path / "ledger.jsonl") == [{"rl_step": 0, "trained": ["k/g0"]},
                                                 {"rl_step": 0, "checkpoint": "v000001"}]
    ledger.write(trained=["k/g1"])
    ledger.cut(None)  # a start over (no checkpoint survived): nothing of the earlier attempt stays
    assert (tmp_path / "ledger.jsonl").read_text() == ""
    ledger.write(trained=["k/g0"])
    assert [e["trained"] for e in _lines(tmp_path / "ledger.jsonl")] == [["k/g0"]]
