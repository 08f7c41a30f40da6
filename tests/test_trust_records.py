"""Per-key records (stoa.fleet.trust.records, through the gate): strikes and bans, the trust
report, checkpoints, group namespaces and the share cap, withholding."""

from __future__ import annotations

import json

from stoa.fleet.intake.copies import group_prints
from stoa.fleet.trust.gate import TrustGate, max_groups, scoped
from stoa.fleet.trust.records import read_trust_report
from stoa.fleet.trust.review import Verdict
from stoa.fleet.trust.section import TrustConfig
from stoa.transport.signing import generate_private_key

from trust_helpers import ListLedger, RUN, batch_of, episodes


def test_strikes_ban_a_key_and_the_ban_survives_a_checkpoint(tmp_path):
    from stoa.transport.store import LocalStore

    ledger: list[dict] = []
    gate = TrustGate(TrustConfig(ban_after=2), LocalStore(tmp_path), RUN, generate_private_key(),
                     ledger=ListLedger(ledger))
    honest = [episodes("h", group=f"h{i}", seed=i) for i in range(3)]
    assert gate.review([batch_of("hk", "h", honest[0]), batch_of("hk", "h", honest[1], 1)], 0) == [None, None]
    copy_reason = "duplicate: repeats a group this key uploaded in an earlier batch"
    gate.refused(None, "ck", "c", "duplicate", copy_reason, episodes=2)  # what the intake does with a copy
    assert not gate.members.is_banned("ck") and gate.records["ck"].strikes == 1
    gate.refused(None, "ck", "c", "duplicate", copy_reason, episodes=2)
    assert gate.members.is_banned("ck") and gate.new_bans() == [("ck", "c", gate.records["ck"].banned)]
    assert ledger[-1]["banned"] == "ck" and gate.new_bans() == []
    assert gate.review([batch_of("ck", "c", honest[2], 2)], 0) == [Verdict("refused", "key ck is banned")]
    assert gate.records["hk"].accepted_batches == 2 and gate.records["hk"].rejected_batches == 0
    gate.write_report(3, force=True)
    report = read_trust_report(gate.store, RUN, gate.key.public_key())
    assert report.workers["ck"].banned and report.workers["ck"].rejected == {"duplicate": 2}
    assert report.workers["ck"].rejected_episodes == 4 and report.version == 3
    state = json.loads(json.dumps(gate.state()))
    fresh = TrustGate(TrustConfig(), gate.store, RUN, gate.key)
    fresh.restore(state)
    assert fresh.members.is_banned("ck") and fresh.records["hk"].accepted_batches == 2


def test_identical_samples_are_no_copy_and_groups_live_in_their_senders_namespace():
    same = episodes("a", n=1) * 3
    assert group_prints(same) == []  # a near-deterministic group may repeat itself
    assert group_prints(episodes("a")) == group_prints(episodes("b", group="other"))
    assert scoped("k1", "g") != scoped("k2", "g") and scoped("", "g") == "g"
    cfg = TrustConfig(max_worker_share=0.5)
    assert max_groups(cfg, 8) == 4 and max_groups(cfg, 1) == 1


def test_groups_whose_draws_are_rederived_get_no_print():
    """An honest batch of the addition example was refused as a duplicate of itself: the same item
    drawn twice in one batch, and a converged policy answered it alike in both groups (7 samples of
    one answer, 1 of another). Where every token is re-derived from the batch's assigned seed, a
    repeated group is either the draws (honest) or refused by that check, so no print is taken."""
    from dataclasses import replace

    from stoa.fleet.intake.copies import Copies

    mixed = episodes("w", group="g3", seed=7)  # two different samples: a mixed group
    twice = mixed + [replace(e, group_id="g4") for e in mixed]
    b = batch_of("k", "w", twice, 5)
    b = replace(b, sha256="ab" * 32)
    fresh, dups = Copies(16).sift([b])
    assert not fresh and "repeats a group" in dups[0][1]  # without the draws check: a copy
    fresh, dups = Copies(16).sift([b], redraws=True)
    assert fresh == [b] and not dups
    gate = TrustGate(TrustConfig(), None, RUN, generate_private_key())
    assert not gate.admission().redraws  # no int8 re-score: the prints stand


def test_gaps_in_a_keys_sequence_numbers_are_counted_and_a_withholder_flagged():
    gate = TrustGate(TrustConfig(), None, RUN, generate_private_key())
    for kid in ("h1", "h2", "h3"):
        for seq in range(20):
            gate.records.saw(kid, kid, seq)
    for seq in range(0, 20, 3):  # uploads one number in three
        gate.records.saw("sel", "sel", seq)
    held = gate.records.withholding(gate.cfg.audit.worker_mads)
    assert gate.records["sel"].withheld == 12 and held["sel"][1]
    assert all(gate.records[k].withheld == 0 and not held[k][1] for k in ("h1", "h2", "h3"))
    assert gate.metrics()["trust/withheld_batches"] == 12 and gate.metrics()["trust/withholding_flagged"] == 1

    # Banned keys say nothing about the fleet's range: two copiers whose numbers were nearly all
    # gaps (they upload only when they find a batch to copy) once hid the withholder.
    for kid in ("c1", "c2", "c3"):
        for seq in (0, 19):
            gate.records.saw(kid, kid, seq)
        gate.ban(kid, "strikes")
    held = gate.records.withholding(gate.cfg.audit.worker_mads)
    assert held["sel"][1] and not any(held[k][1] for k in ("h1", "h2", "h3"))


def test_the_public_report_publishes_nothing_that_decides_whether_a_batch_is_checked(tmp_path):
    """The store's trust.json (which every worker reads) published the audit floor and each key's
    mean |log pi - log mu| per staleness bucket, and reasons quoting the fleet's median and limit:
    a forger sized its forgeries below the thresholds they give (18 forged batches accepted, none
    spot-checked). Now it says how much was audited, not what was measured; the operator's copy,
    in the trainer's own folder, has it all."""
    from stoa.fleet.trust.audit import TokenStats
    from stoa.transport.store import LocalStore

    store, key = LocalStore(tmp_path / "store"), generate_private_key()
    gate = TrustGate(TrustConfig(), store, RUN, key, roster_copy=tmp_path / "run" / "roster")
    gate.checks.audit.floor = 0.0123
    for kid in ("h1", "h2", "h3"):
        gate.records.touch(kid, kid)
        gate.checks.audit.observe(kid, 0, TokenStats(tokens=500, abs_sum=500 * 0.0456, implausible=1))
    suspicion = ("log-prob audit: running mean |log pi - log mu| 0.300 at staleness 0 leaves the fleet's honest range "
                 "(median 0.046, limit 0.120); spot-check: episode 2: 3 of 10 model tokens off the int8 re-score")
    gate.refused(None, "h3", "h3", "audit", suspicion)
    gate.write_report(4, force=True)
    public = json.loads(json.loads(store.get(f"{RUN}/trust.json"))["body"])
    text = json.dumps(public)
    assert public["floor"] is None and "0.0123" not in text and "0.0456" not in text and "0.046" not in text
    assert all(set(w["audit"]) == {"tokens_s0"} and w["audit"]["tokens_s0"] == 500
               for k, w in public["workers"].items() if k.startswith("h"))
    assert "median" not in text and "limit" not in text and "3 of 10 model tokens" in public["workers"]["h3"]["last_reason"]
    assert read_trust_report(store, RUN, key.public_key()).floor is None
    own = json.loads((tmp_path / "run" / "roster" / "trust.json").read_text())  # the operator's copy
    assert own["operator"] and own["floor"] == 0.0123 and own["workers"]["h1"]["audit"]["abs_s0"] == 0.0456


def test_the_trust_report_round_trips_byte_for_byte():
    """``TrustReport.parse(body).to_body()`` is ``body`` (same keys, same order, same values), for
    a report built from live records; the record's own ``floors`` are never reported."""
    from stoa.fleet.trust.records import Records, TrustReport, build_report

    class Audit:
        def summary(self, kid):
            return {"tokens_s0": 12.0, "abs_s0": 0.25}

    records = Records(ban_after=2)
    records.accept("k1", "w1", episodes=4)
    records.saw("k1", "w1", 0)
    records.saw("k1", "w1", 3)
    records.reject("k2", "w2", "duplicate", "duplicate: repeats a group", episodes=2)
    records["k1"].floors.append([3, 7])
    for operator in (False, True):
        report = build_report(RUN, 5, "audit", 0.5, records, {"k1": (0.5, True)}, Audit(), banned_keys=1,
                              operator=operator)
        body = json.loads(json.dumps(report.to_body()))
        assert list(body["workers"]["k1"]) == [
            "worker_id", "accepted_batches", "accepted_episodes", "trained_episodes", "rejected_batches",
            "rejected_episodes", "rejected", "unverifiable_episodes", "strikes", "spot_checks",
            "spot_check_failures", "probation_batches", "last_reason", "banned", "last_seen", "last_accepted",
            "batches_seen", "max_seq", "taken_by_others", "late_batches", "standing_lost", "probation_owed",
            "withheld", "withheld_rate",
            "withholding_flagged", "audit"]
        assert body["workers"]["k1"]["withheld"] == 2 and body["workers"]["k1"]["withholding_flagged"]
        assert json.dumps(TrustReport.parse(body).to_body()) == json.dumps(body)
        assert TrustReport.parse(body) == report


def test_a_refusal_met_again_counts_once():
    """An object whose quarantine failed is read again at the next poll and refused again: its
    sender is struck once for it, and a planted object counts once against nobody."""
    from stoa.transport.exchange import Rejection

    gate = TrustGate(TrustConfig(ban_after=3), None, RUN, generate_private_key())
    bad = batch_of("ck", "c", episodes("c"), 4)
    for _ in range(3):  # the same object, three polls in a row
        gate.refused(bad, "ck", "c", "invalid", "reward out of range", episodes=2)
    assert gate.records["ck"].strikes == 1 and gate.records["ck"].rejected_batches == 1
    assert not gate.members.is_banned("ck")
    gate.refused(batch_of("ck", "c", episodes("c"), 5), "ck", "c", "invalid", "reward out of range", episodes=2)
    assert gate.records["ck"].strikes == 2  # another object: another strike
    gate.records.touch("hk", "h")
    planted = Rejection(f"{RUN}/rollouts/h/s000000000009-v000000000000.episodes", "h", "ck", "invalid", "junk")
    for _ in range(2):
        gate.refused(planted, "ck", "h", "invalid", "junk")
    assert gate.records["hk"].taken_by_others == 1 and gate.records["ck"].strikes == 3
