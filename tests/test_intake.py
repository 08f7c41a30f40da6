"""The trainer's intake, driven for real: a real Intake (its reader, copies, gate and pool) on a
real local store, fed by real sealing writers. Every refusal takes one path: quarantine, the
sender's record, a ledger line and an event row."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from stoa.fleet.config import RunConfig
from stoa.fleet.intake import Intake
from stoa.fleet.trust.assign import assignment
from stoa.fleet.trust.ledger import Ledger
from stoa.transport.exchange import Batch, PollLimits, RolloutWriter, rollout_key
from stoa.transport.identity import enroll_worker, seal_batch
from stoa.transport.signing import generate_private_key, key_id
from stoa.transport.store import LocalStore
from stoa.types import Episode, Segment, encode_episodes

from helpers import TINY_FLEET

RUN = "intake"
ENV = TINY_FLEET["env"]


def _config(groups_per_step: int = 2, **trust) -> RunConfig:
    return RunConfig.from_dict({"name": RUN, "seed": 3, "env": ENV,
                                "rollout": {"group_size": 2, "groups_per_cohort": 2},
                                "trainer": {"groups_per_step": groups_per_step, "max_lag": 3},
                                "trust": {"replay": False, "audit": {"enabled": False}, "reward_range": [0.0, 1.0],
                                          **trust}})


class _Scorer:
    """Finite log-probs for any episode: the learner's role in ``settle`` (not under test)."""

    def logprobs(self, episodes, temperature=1.0, *, model_only=False):
        return [np.zeros(len(e.tokens()), np.float32) for e in episodes]


def _make_env():
    import stoa.envs

    return stoa.envs.make(ENV["id"], **ENV["kwargs"])


class _Run:
    """A run's store, key, ledger and event rows, and an Intake over them."""

    def __init__(self, tmp_path, groups_per_step: int = 2, **trust):
        self.store, self.key = LocalStore(tmp_path / "store"), generate_private_key()
        self.cfg = _config(groups_per_step, **trust)
        self.ledger_path, self.events, self.version = tmp_path / "ledger.jsonl", [], 0
        self.ledger = Ledger(self.ledger_path, lambda: {"rl_step": 0, "version": self.version})
        self.intake = self.make()

    def make(self) -> Intake:
        return Intake(self.cfg, self.store, self.key, vocab_size=700, metric_types={}, ledger=self.ledger,
                      float_scorer=_Scorer(), int8=None, make_env=_make_env,
                      event=lambda **row: self.events.append(row))

    def lines(self) -> list[dict]:
        return [json.loads(line) for line in self.ledger_path.read_text().splitlines()] if self.ledger_path.exists() else []

    def quarantined(self) -> dict[str, str]:
        """Original key -> reason, from the store's quarantine."""
        out = {}
        for k in self.store.list(f"{RUN}/quarantine/"):
            if k.endswith(".reason.json"):
                body = json.loads(self.store.get(k))
                out[body["key"]] = body["reason"]
        return out


def _work(run: _Run, writer: RolloutWriter, seq: int, version: int = 0, tag: int = 0, probation: bool = False,
          **over) -> list[Episode]:
    """The episodes a writer's key owes as its ``seq``-th batch: the work the intake assigns it
    (salted, as once the run publishes the key's salt), or with ``probation`` the work a key can
    compute without its salt (:func:`assignment`). Salted work is bound first to ``version``, as the
    trainer binds a ticket at that version (the first binding of a number stands)."""
    if probation:
        a = assignment(run.cfg.seed, writer.key_id, seq, run.intake.n_items, run.cfg.rollout.groups_per_cohort)
    else:
        run.intake.gate.binder.bind(writer.key_id, seq, version)
        a = run.intake.gate.bounds.assigned(Batch("", writer.worker_id, version, [], seq, writer.key_id))
    rng = np.random.default_rng(1000 * seq + tag)
    out = []
    for gid, item in zip(a.group_ids, a.items):
        for s in range(run.cfg.rollout.group_size):
            e = Episode(rng.integers(0, 700, 5), [Segment("model", rng.integers(0, 700, 4), -rng.random(4))],
                        reward=float(s), policy_version=version, worker_id=writer.worker_id, env_id=ENV["id"],
                        group_id=gid, sample_index=s, item_index=item)
            for k, v in over.items():
                setattr(e, k, v)
            out.append(e)
    return out


def test_a_batch_of_assigned_work_reaches_a_step_and_is_settled(tmp_path):
    run = _Run(tmp_path)
    w = RolloutWriter(run.store, RUN, "w", private_key=generate_private_key())
    w.upload(_work(run, w, 0), 0)
    taken = run.intake.take(0)
    assert taken is not None and len(taken.groups) == 2 and all(g[0].group_id.startswith(w.key_id + "/")
                                                                 for g in taken.groups)
    run.intake.settle(taken)
    assert run.intake.gate.records[w.key_id].trained_episodes == 4 and run.quarantined() == {}
    assert run.intake.take(0) is None  # nothing new
    # A failed step whose batch the learner cannot score: that batch is refused, once, everywhere.
    w.upload(_work(run, w, 1), 0)
    taken = run.intake.take(0)

    class Broken(_Scorer):
        def logprobs(self, episodes, temperature=1.0, *, model_only=False):
            return [np.full(len(e.tokens()), np.nan, np.float32) for e in episodes]

    run.intake.float_scorer = Broken()
    run.intake.settle(taken, RuntimeError("boom"))
    (line,) = [e for e in run.lines() if "rejected" in e]
    assert "cannot take it" in line["reason"] and line["category"] == "invalid"
    assert [r["batch"] for r in run.events if r["event"] == "rejected"] == [line["rejected"]]


def test_every_refusal_kind_is_quarantined_ledgered_and_an_event_row(tmp_path):
    run = _Run(tmp_path, groups_per_step=64, ban_after=2)  # no step is taken: what is accepted stays pooled
    intake = run.intake
    intake.reader.poll_limits = PollLimits(max_decoded_bytes=1 << 20)  # a small budget, to reach "size"
    w = RolloutWriter(run.store, RUN, "w", private_key=generate_private_key())
    w.upload(_work(run, w, 0), 0)
    intake.take(0)
    assert intake.gate.members.established(w.key_id)  # w's key is bound to "w" by its accepted work
    expect: dict[str, str] = {}  # store key -> category

    def put(key: str, blob: bytes, category: str) -> None:
        run.store.put(key, blob)
        expect[key] = category

    def writer(name: str) -> RolloutWriter:
        return RolloutWriter(run.store, RUN, name, private_key=generate_private_key())

    # The reader's refusals: misnamed, signature, unsigned, refused, size, codec.
    put(f"{RUN}/rollouts/w/junk.bin", b"junk", "misnamed")
    genuine = w.upload(_work(run, w, 1), 0)
    put(rollout_key(RUN, "x", 0, 0), run.store.get(genuine), "signature")  # copied under another name
    put(rollout_key(RUN, "u", 0, 0), encode_episodes(_work(run, w, 0, tag=1)), "unsigned")
    put(rollout_key(RUN, "w", 7, 0), seal_batch(encode_episodes(_work(run, w, 7)), run=RUN, worker_id="w", seq=7,
                                                version=0, private_key=generate_private_key()), "refused")
    z = writer("z")
    bomb = [Episode(np.zeros(100_000, np.int32), [Segment("model", np.zeros(10, np.int32), np.zeros(10, np.float32))],
                    0.0, worker_id="z", env_id=ENV["id"], group_id="b", sample_index=i) for i in range(3)]
    expect[z.upload(bomb, 0)] = "size"
    y_key = generate_private_key()
    put(rollout_key(RUN, "y", 0, 0), seal_batch(b"not episodes", run=RUN, worker_id="y", seq=0, version=0,
                                                private_key=y_key), "invalid")
    # The intake's own: a copy, a version from the future, the run's bounds, assigned work.
    expect[w.upload(_work(run, w, 1), 0)] = "duplicate"  # the same episodes under a new number
    v1, v2, v3 = writer("v1"), writer("v2"), writer("v3")
    expect[v1.upload(_work(run, v1, 0, version=5), 5)] = "future"  # newer than the trainer's version: no strike
    expect[v2.upload(_work(run, v2, 0, temperature=0.5), 0)] = "invalid"  # not the run's temperature
    expect[v3.upload(_work(run, v3, 0)[1:], 0)] = "assignment"  # a group cut short
    intake.take(0)
    assert genuine in {b.key for b, _ in intake.pool.entries}  # the original of the copied object is accepted
    # A ban: the key's pooled batch is refused with it.
    b = writer("b")
    queued = b.upload(_work(run, b, 0), 0)
    intake.take(0)
    assert queued in {x.key for x, _ in intake.pool.entries}
    expect[queued] = "banned"
    expect[b.upload(_work(run, b, 1)[1:], 0)] = "assignment"
    expect[b.upload(_work(run, b, 2)[1:], 0)] = "assignment"  # a second strike: banned
    intake.take(0)
    assert all(r.stored is None for r in intake.reader.last_report.rejected)  # no bytes kept once quarantined

    quarantined = run.quarantined()
    lines = {e["rejected"]: e for e in run.lines() if "rejected" in e}
    rows = {r["batch"]: r for r in run.events if r["event"] == "rejected"}
    assert set(quarantined) == set(lines) == set(rows) == set(expect), set(expect) ^ set(quarantined)
    for key, category in expect.items():
        assert lines[key]["category"] == rows[key]["category"] == category, (key, lines[key], rows[key])
        assert lines[key]["reason"] == rows[key]["reason"] == quarantined[key][:500]
    assert set(expect.values()) == {"misnamed", "signature", "unsigned", "refused", "size", "invalid", "duplicate",
                                    "future", "assignment", "banned"}
    assert recs_of(intake, v1.key_id) == ({"future": 1}, 0)  # refused, never a strike
    assert "copied or renamed" in lines[rollout_key(RUN, "x", 0, 0)]["reason"]
    assert "impersonation" in lines[rollout_key(RUN, "w", 7, 0)]["reason"]
    bans = [r for r in run.events if r["event"] == "banned"]
    assert [r["key_id"] for r in bans] == [b.key_id] and any(e.get("banned") == b.key_id for e in run.lines())
    recs = intake.gate.records
    assert recs[b.key_id].strikes == 2 and recs[b.key_id].rejected == {"assignment": 2, "banned": 1}
    assert recs[w.key_id].rejected == {"duplicate": 1} and recs[w.key_id].strikes == 1
    assert recs[z.key_id].rejected == {"size": 1} and recs[z.key_id].strikes == 0
    y = key_id(y_key.public_key())
    assert recs[y].rejected == {"invalid": 1} and recs[y].strikes == 1
    assert intake.gate.records.anonymous["u"] == {"unsigned": 1} and intake.gate.records.anonymous["x"] == {"signature": 1}


def recs_of(intake: Intake, kid: str) -> tuple[dict[str, int], int]:
    rec = intake.gate.records[kid]
    return rec.rejected, rec.strikes


def test_a_replayed_batch_is_refused_by_its_content_across_restarts(tmp_path):
    run = _Run(tmp_path, groups_per_step=3)
    w = RolloutWriter(run.store, RUN, "w", private_key=generate_private_key())
    first, second = _work(run, w, 0), _work(run, w, 1)
    w.upload(first, 0)
    assert run.intake.take(0) is None
    second_key = w.upload(second, 0)
    run.intake.settle(run.intake.take(0))  # all of `first`, one group of `second`: `second` is not done yet
    saved = json.loads(json.dumps(run.intake.state()))
    assert len(saved["hashes"]) == 1
    replay = w.upload(copy.deepcopy(first), 0)  # the very same episodes again, freshly sealed under a new number
    run.intake.take(0)
    assert [e["category"] for e in run.lines() if e.get("rejected") == replay] == ["duplicate"]
    again = run.make()
    again.restore(saved)
    assert again.take(0) is None
    assert [b.key for b, _ in again.pool.entries] == [second_key]  # redelivered, not taken for a duplicate
    copied = w.upload(copy.deepcopy(second), 0)
    assert again.take(0) is None
    assert [e["category"] for e in run.lines() if e.get("rejected") == copied] == ["duplicate"]


def test_copies_of_a_group_under_one_key_are_not_trained_twice(tmp_path):
    """Attack: one key uploads two copies of an honest group (ids rewritten, each copy in a
    different batch). Both copies go to quarantine and the honest original is pooled."""
    run = _Run(tmp_path, groups_per_step=64, ban_after=0)  # nothing taken, nobody banned: only the copies matter
    honest = RolloutWriter(run.store, RUN, "honest", private_key=generate_private_key())
    mallory = RolloutWriter(run.store, RUN, "mallory", private_key=generate_private_key())
    group = _work(run, honest, 0)
    honest.upload(group, 0)

    def copied(eps, gid):
        out = []
        for e in eps:
            c = type(e)(**{**e.__dict__})
            c.worker_id, c.group_id = "mallory", gid
            out.append(c)
        return out

    mallory.upload(copied(group, "x1"), 0)
    mallory.upload(copied(group, "x2") + _work(run, mallory, 1), 0)
    run.intake.take(0)
    assert [b.worker_id for b, _ in run.intake.pool.entries] == ["honest"]
    dup = [e for e in run.events if e["event"] == "rejected" and e["category"] == "duplicate"]
    assert sorted(r["worker"] for r in dup) == ["mallory", "mallory"] and all(r["key_id"] for r in dup)
    # A third copy in a later poll is refused too.
    third = mallory.upload(copied(group, "x3"), 0)
    run.intake.take(0)
    assert [e["category"] for e in run.lines() if e.get("rejected") == third] == ["duplicate"]


def test_a_key_refused_by_an_enrolled_roster_is_never_decoded(tmp_path):
    run = _Run(tmp_path, mode="enrolled")
    me = generate_private_key()
    enroll_worker(run.store, RUN, run.key, me, "w")
    run.intake.gate.refresh(force=True)
    w = RolloutWriter(run.store, RUN, "w", private_key=me)
    stranger = RolloutWriter(run.store, RUN, "s", private_key=generate_private_key())
    w.upload(_work(run, w, 0), 0)
    refused = stranger.upload(_work(run, stranger, 0), 0)
    assert run.intake.take(0) is not None
    (line,) = [e for e in run.lines() if "rejected" in e]
    assert line["rejected"] == refused and line["category"] == "refused" and "not enrolled" in line["reason"]
    assert run.intake.gate.records[stranger.key_id].strikes == 0  # refused, not struck: its batch was never read


@pytest.mark.parametrize("field", ["reader", "hashes"])
def test_a_checkpoint_of_the_intake_restores_what_it_saved(tmp_path, field):
    run = _Run(tmp_path)
    w = RolloutWriter(run.store, RUN, "w", private_key=generate_private_key())
    w.upload(_work(run, w, 0), 0)
    run.intake.take(0)
    saved = json.loads(json.dumps(run.intake.state()))
    if field == "reader":  # an older checkpoint kept the payload hashes in the reader's state
        saved["reader"]["hashes"] = saved.pop("hashes")
    again = run.make()
    again.restore(saved)
    assert again.copies.hashes == run.intake.copies.hashes


def test_a_copy_of_another_keys_batch_is_not_the_copiers_assigned_work(tmp_path):
    """Copies across keys are caught without comparing keys: relabelled or not, another key's
    episodes are not the copier's assignment (a copy dressed as the copier's own items is the
    replay's and the sampling check's: test_trust)."""
    run = _Run(tmp_path, groups_per_step=64)
    honest, c1, c2 = (RolloutWriter(run.store, RUN, w, private_key=generate_private_key()) for w in ("h", "c1", "c2"))
    work = _work(run, honest, 0)
    honest.upload(work, 0)
    as_is = copy.deepcopy(work)
    for e in as_is:
        e.worker_id = "c1"
    relabelled = copy.deepcopy(work)  # under group ids of the copier's own (as the `copy` adversary does)
    for e in relabelled:
        e.worker_id, e.group_id = "c2", f"c2-copy-{e.group_id}"
    for c in (c1, c2):  # each copier's number is bound: the copy still is not its work
        run.intake.gate.binder.bind(c.key_id, 0, 0)
    keys = [c1.upload(as_is, 0), c2.upload(relabelled, 0)]
    run.intake.take(0)
    assert [b.worker_id for b, _ in run.intake.pool.entries] == ["h"]
    lines = {e["rejected"]: e for e in run.lines() if "rejected" in e}
    assert lines[keys[0]]["category"] == "assignment" and "not the assigned work" in lines[keys[0]]["reason"]
    assert lines[keys[1]]["category"] == "assignment" and "not one this batch was assigned" in lines[keys[1]]["reason"]


def test_junk_planted_at_a_workers_next_numbers_is_not_counted_as_its_gaps(tmp_path):
    """Junk an attacker puts at a worker's next number voids that cohort (its work was assigned to
    the number); the intake counts the number as taken by others, not as withheld."""
    from stoa.transport.exchange import SequenceTaken

    run = _Run(tmp_path)
    w = RolloutWriter(run.store, RUN, "w", private_key=generate_private_key())
    wasted = 0
    for cohort in range(15):
        seq = w.next_seq  # the worker makes the work of this number...
        if cohort % 2:  # ...while an attacker puts junk under it
            run.store.put(rollout_key(RUN, "w", seq, 0), b"junk")
        try:
            w.upload(_work(run, w, seq, tag=cohort), 0, seq=seq)
        except SequenceTaken:
            wasted += 1
        run.intake.take(0)
    rec = run.intake.gate.records[w.key_id]
    assert wasted == 7 and rec.batches_seen == 8 and rec.max_seq == 14 and rec.rejected_batches == 0
    assert rec.withheld == 0 and run.intake.gate.records.withholding(run.cfg.trust.audit.worker_mads)[w.key_id] == (0.0, False)
    assert rec.taken_by_others == 7  # reported as what it is
    assert sorted(line["category"] for line in run.lines() if "rejected" in line) == ["unsigned"] * 7


def _junk(writer: RolloutWriter, version: int, token: int = 0) -> list[Episode]:
    """One episode of one token: nothing anyone would train on."""
    return [Episode(np.zeros(1, np.int32), [Segment("model", np.full(1, token, np.int32), np.zeros(1, np.float32))], 0.0,
                    policy_version=version, worker_id=writer.worker_id, env_id=ENV["id"], group_id="j",
                    sample_index=0)]


def test_stale_junk_at_withheld_numbers_counts_as_withheld(tmp_path):
    """Attack: withhold batches and fill each withheld number with a one-token junk batch claiming
    a stale version. The intake counted a number as delivered before it dropped the stale batch
    (no strike), so 13 withheld numbers of 15 were hidden; plain gaps (the control) are flagged."""
    run = _Run(tmp_path, groups_per_step=64)
    version = 5  # the trainer's; version 0 is past max_lag (3)
    writers = {name: RolloutWriter(run.store, RUN, name, private_key=generate_private_key())
               for name in ("h0", "h1", "h2", "launder", "gaps")}
    for seq in range(15):
        for name in ("h0", "h1", "h2"):
            writers[name].upload(_work(run, writers[name], seq, version), version)
        for name in ("launder", "gaps"):
            w = writers[name]
            w.next_seq = seq
            if seq in (0, 7, 14):  # the two it keeps, and the last
                w.upload(_work(run, w, seq, version), version, seq=seq)
            elif name == "launder":
                w.upload(_junk(w, 0, token=seq), 0, seq=seq)
        run.intake.take(version)
    flags = run.intake.gate.records.withholding(run.cfg.trust.audit.worker_mads)
    recs = run.intake.gate.records
    assert recs[writers["gaps"].key_id].withheld == 12 and flags[writers["gaps"].key_id][1]  # the control
    assert recs[writers["launder"].key_id].withheld == 12 and flags[writers["launder"].key_id][1]
    assert not any(flags[writers[h].key_id][1] or recs[writers[h].key_id].withheld for h in ("h0", "h1", "h2"))
    assert recs[writers["launder"].key_id].strikes == 0  # stale is still no fault of its own
    # The report says which gaps came late (the launderer's stale junk) and which never came.
    assert recs[writers["launder"].key_id].late_batches == 12 and recs[writers["gaps"].key_id].late_batches == 0


def test_a_key_cannot_go_back_to_a_version_it_prefers_and_an_honest_stale_batch_is_taken(tmp_path):
    """Attack (version shopping): a worker holding several versions makes its assigned batch under
    each and uploads the one it prefers; every pick was accepted, most not the newest version's.
    Now a key's batch may not claim a version below one it already claimed, nor below the version
    published before its previous batch appeared in the store. An honest worker whose batch
    comes a few versions stale (it started before the trainer published) is still taken."""
    run = _Run(tmp_path, groups_per_step=64)
    intake = run.intake
    honest = RolloutWriter(run.store, RUN, "honest", private_key=generate_private_key())
    shopper = RolloutWriter(run.store, RUN, "shopper", private_key=generate_private_key())
    intake.take(0)
    honest.upload(_work(run, honest, 0, 0), 0)  # uploaded while the trainer is at version 0
    intake.take(0)
    intake.take(1)
    intake.take(2)  # versions 1 and 2 published meanwhile
    stale = honest.upload(_work(run, honest, 1, 0), 0)  # its next batch, begun before version 1 came out
    intake.take(3)
    kept = {b.key for b in intake.pool.batches()}
    assert stale in kept  # three versions behind, within max_lag: taken

    shopper.upload(_work(run, shopper, 0, 3), 3)
    intake.take(3)
    picks = {v: _work(run, shopper, 1, v, tag=v) for v in range(4)}  # its batch 1 under each version it holds
    preferred = shopper.upload(picks[1], 1)  # the one it likes best, not the newest
    intake.take(3)
    assert preferred not in {b.key for b in intake.pool.batches()}
    assert shopper.upload(_work(run, shopper, 2, 3), 3) and intake.take(3) is None
    # Two batches at once, the later one at the older version: read in one poll, or (under a poll's
    # caps) the older version first, the later batch is dropped once its predecessor is read.
    from stoa.transport.exchange import PollLimits

    intake.reader.poll_limits = PollLimits(max_batches=1)
    newer, older = shopper.upload(_work(run, shopper, 3, 3), 3), shopper.upload(_work(run, shopper, 4, 2), 2)
    intake.take(3)
    intake.take(3)
    shopper.upload(_work(run, shopper, 5, 3), 3)
    intake.take(3)
    kept = {b.key for b in intake.pool.batches()}
    assert newer in kept and older not in kept and preferred not in kept
    rec = intake.gate.records[shopper.key_id]
    assert rec.strikes == 0 and rec.withheld == 2  # dropped, not struck: counted as withheld numbers
    behind = [e for e in run.lines() if "behind" in e.get("dropped", {})]
    assert {e["batch"] for e in behind} == {preferred, older}

    # Read before its predecessor (its version is older) and pooled: dropped once the predecessor is read.
    run = _Run(tmp_path / "late", groups_per_step=64)
    late = RolloutWriter(run.store, RUN, "late", private_key=generate_private_key())
    run.intake.take(1)
    late.upload(_work(run, late, 0, 1), 1)
    for v in (1, 2, 3):
        run.intake.take(v)
    run.intake.reader.poll_limits = PollLimits(max_batches=1)
    first, second = late.upload(_work(run, late, 1, 3), 3), late.upload(_work(run, late, 2, 2), 2)
    run.intake.take(3)
    assert second in {b.key for b in run.intake.pool.batches()}  # its floor so far (version 1) lets it in
    run.intake.take(3)
    late.upload(_work(run, late, 3, 3), 3)
    run.intake.take(3)
    kept = {b.key for b in run.intake.pool.batches()}
    assert first in kept and second not in kept and run.intake.gate.records[late.key_id].withheld == 1
    assert [e["batch"] for e in run.lines() if "behind" in e.get("dropped", {})] == [second]


def test_a_keys_salt_costs_trust_probation_batches_accepted_probation_batches(tmp_path):
    """``trust.probation_batches`` is what each key a grinder tries costs: the salt, and so any
    trained work, comes only after that many of the key's probation batches are accepted."""
    from stoa.transport.identity import read_salt

    run = _Run(tmp_path, groups_per_step=64, probation_batches=3)
    w = RolloutWriter(run.store, RUN, "new", private_key=generate_private_key())
    for seq in range(3):
        assert read_salt(run.store, RUN, w.key_id, run.key.public_key()) is None
        w.upload(_work(run, w, seq, probation=True), 0)
        run.intake.take(0)
    rec = run.intake.gate.records[w.key_id]
    assert rec.probation_batches == 3 and rec.strikes == 0
    assert read_salt(run.store, RUN, w.key_id, run.key.public_key()) is not None


def test_ground_keys_choose_no_trained_items(tmp_path):
    """Attack (key grinding): keys cost nothing, and a key's work was a public function of the key,
    so a Sybil made keys until their first batch fell on items of its choosing (100 keys per usable
    one here) and uploaded only that batch from each. Now the work a key can compute before the run
    publishes its salt is probation work, checked and never trained; an honest newcomer's next
    batches, made with its published salt, are trained."""
    from stoa.transport.signing import key_id

    run = _Run(tmp_path, groups_per_step=2)
    n, groups = run.intake.n_items, run.cfg.rollout.groups_per_cohort
    chosen = set(range(0, n, 10))  # a tenth of the items
    usable, tried = [], 0
    while len(usable) < 4:
        key = generate_private_key()
        tried += 1
        if set(assignment(run.cfg.seed, key_id(key.public_key()), 0, n, groups).items) <= chosen:
            usable.append(key)
    sybils = [RolloutWriter(run.store, RUN, f"s{i}", private_key=k) for i, k in enumerate(usable)]
    for w in sybils:
        w.upload(_work(run, w, 0, probation=True), 0)  # the work it computed for its key: what it chose
    newcomer = RolloutWriter(run.store, RUN, "new", private_key=generate_private_key())
    newcomer.upload(_work(run, newcomer, 0, probation=True), 0)  # an honest newcomer: no salt yet
    trained = []
    for _ in range(4):
        taken = run.intake.take(0)
        if taken is not None:
            trained += [g[0].group_id for g in taken.groups]
            run.intake.settle(taken)
    sybil_keys = {w.key_id for w in sybils}
    assert not [g for g in trained if g.split("/")[0] in sybil_keys], (tried, trained)
    assert not [b for b in run.intake.pool.batches() if b.key_id in sybil_keys]
    assert all(run.intake.gate.records[k].probation_batches == 1 for k in sybil_keys)  # checked and credited
    assert run.intake.counters.probation_batches == 5
    from stoa.transport.identity import read_salt

    salt = read_salt(run.store, RUN, newcomer.key_id, run.key.public_key())  # published once it had accepted work
    assert salt is not None
    ids = assignment(run.cfg.seed, newcomer.key_id, 1, n, groups, salt).group_ids
    assert ids == run.intake.gate.bounds.assigned(Batch("", "new", 0, [], 1, newcomer.key_id)).group_ids
    newcomer.upload(_work(run, newcomer, 1), 0)
    taken = run.intake.take(0)
    assert taken is not None and {g[0].group_id.split("/")[0] for g in taken.groups} == {newcomer.key_id}
    forged = sybils[0]  # the public items under the salted ids: not the key's work (a strike)
    work = _work(run, forged, 1, probation=True)
    for e in work:
        e.group_id = e.group_id.replace("-p1-", "-s1-")
    refused = forged.upload(work, 0)
    run.intake.take(0)
    assert [e["category"] for e in run.lines() if e.get("rejected") == refused] == ["assignment"]


@pytest.mark.parametrize("order", ["same poll as its first batch", "poll before its first batch",
                                   "poll after its first batch"])
def test_numbers_planted_ahead_of_a_new_worker_are_never_its_gaps_in_any_order(tmp_path, order):
    """Junk at a worker's upcoming numbers counts as taken by others whenever the trainer reads it,
    also in the poll that makes the worker's record (before that poll, or after it)."""
    run = _Run(tmp_path)
    w = RolloutWriter(run.store, RUN, "w", private_key=generate_private_key())

    def plant():
        for j in range(1, 8):
            run.store.put(rollout_key(RUN, "w", j, 0), b"junk")

    if order.startswith("poll before"):
        plant()
        run.intake.take(0)
    w.upload(_work(run, w, 0, tag=0), 0, seq=0)
    if order.startswith("same"):
        plant()
    run.intake.take(0)
    if order.startswith("poll after"):
        plant()
        run.intake.take(0)
    for cohort in range(1, 8):
        seq = w.skip_taken()
        w.upload(_work(run, w, seq, tag=cohort), 0, seq=seq)
        run.intake.take(0)
    rec = run.intake.gate.records[w.key_id]
    assert rec.batches_seen == 8 and rec.max_seq == 14 and rec.taken_by_others == 7
    assert rec.withheld == 0 and run.intake.gate.records.withholding(run.cfg.trust.audit.worker_mads)[w.key_id] == (0.0, False)
    # The count survives the trainer's checkpoint.
    state = run.intake.gate.records.state()
    again = type(run.intake.gate.records)(0)
    again.restore(json.loads(json.dumps(state)))
    assert again.planted == run.intake.gate.records.planted


def test_a_number_is_made_under_its_bound_version_only_and_its_work_is_unknown_before_it_is_bound(tmp_path):
    """Attack (version rerolls): a worker holding several versions made its assigned batch under
    each and uploaded the one it liked best; the items did not depend on the version, and any
    claim at or above its floor was taken. Attack (key grinding): once a key's salt was out, all
    its future work was known. Now a worker tickets a number when it is due, the trainer binds it
    to its version and a fresh beacon, and only that version and the beacon's work are taken. An
    honest worker that ticketed ahead and was outpaced by the trainer is still taken."""
    from stoa.fleet.trust.binding import read_bindings, write_ticket
    from stoa.transport.identity import enroll_worker, read_salt

    run = _Run(tmp_path, groups_per_step=64)
    intake, n, groups = run.intake, run.intake.n_items, run.cfg.rollout.groups_per_cohort
    keys = {name: generate_private_key() for name in ("honest", "shopper")}
    for name, k in keys.items():
        enroll_worker(run.store, RUN, run.key, k.public_key(), name)
    honest, shopper = (RolloutWriter(run.store, RUN, name, private_key=k) for name, k in keys.items())

    def work(writer, seq, version, *, predicted=False):
        """The worker's side: its salt and the binding of ``seq`` it reads from the store (with
        ``predicted``: what it could compute from its salt alone, as a grinder does)."""
        salt = read_salt(run.store, RUN, writer.key_id, run.key.public_key())
        bound = read_bindings(run.store, RUN, run.key.public_key())[0].get(writer.key_id, {}).get(seq)
        a = assignment(run.cfg.seed, writer.key_id, seq, n, groups, salt, None if predicted else bound.beacon)
        return [Episode([1, 2], [Segment("model", [3, 4], [-0.5, -0.5])], reward=float(s), policy_version=version,
                        worker_id=writer.worker_id, env_id=ENV["id"], group_id=g, sample_index=s, item_index=i)
                for g, i in zip(a.group_ids, a.items) for s in range(run.cfg.rollout.group_size)]

    for w in (honest, shopper):  # one accepted batch each: past a fresh key's one binding at a time
        w.upload(_work(run, w, 0), 0)
    for v in range(4):
        intake.take(v)
    for seq in (1, 2):
        write_ticket(run.store, RUN, seq, keys["honest"])
    for seq in (1, 2):
        write_ticket(run.store, RUN, seq, keys["shopper"])
    intake.take(3)  # binds every ticket to version 3
    assert intake.gate.binder.bound[shopper.key_id] == {0: 0, 1: 3, 2: 3} == intake.gate.binder.bound[honest.key_id]
    assert read_salt(run.store, RUN, shopper.key_id, run.key.public_key()) is not None
    rerolled = shopper.upload(work(shopper, 1, 1), 1)  # made under version 1, which it held: within max_lag
    predicted = shopper.upload(work(shopper, 2, 3, predicted=True), 3)  # the salt-only work, at the bound version
    unbound = shopper.upload(_work_unbound(run, shopper, 3), 3)  # a number it never ticketed
    fair = honest.upload(work(honest, 1, 3), 3)
    for v in (4, 5):
        intake.take(v)  # the trainer moves on before the honest worker's next batch comes
    ahead = honest.upload(work(honest, 2, 3), 3)  # ticketed ahead, bound to 3: below the old floor (5)
    intake.take(5)
    pooled = {b.key for b in intake.pool.batches()}
    assert fair in pooled and ahead in pooled
    lines = {e["rejected"]: e for e in run.lines() if "rejected" in e}
    assert {k: lines[k]["category"] for k in (rerolled, predicted, unbound)} == dict.fromkeys(
        (rerolled, predicted, unbound), "assignment")
    assert "bound to version 3" in lines[rerolled]["reason"]
    assert "assigned item" in lines[predicted]["reason"]
    assert "never bound" in lines[unbound]["reason"]
    assert intake.gate.records[honest.key_id].strikes == 0 and intake.gate.records[honest.key_id].withheld == 0


def _work_unbound(run: _Run, writer: RolloutWriter, seq: int) -> list[Episode]:
    """Salted-looking work for a number nobody ticketed (the group ids of the salted form)."""
    from stoa.transport.identity import assignment_salt

    a = assignment(run.cfg.seed, writer.key_id, seq, run.intake.n_items, run.cfg.rollout.groups_per_cohort,
                   assignment_salt(run.key, RUN, writer.key_id))
    return [Episode([1, 2], [Segment("model", [3, 4], [-0.5, -0.5])], reward=float(s), policy_version=3,
                    worker_id=writer.worker_id, env_id=ENV["id"], group_id=g, sample_index=s, item_index=i)
            for g, i in zip(a.group_ids, a.items) for s in range(run.cfg.rollout.group_size)]
