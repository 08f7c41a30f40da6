"""The trainer's view of its fleet (stoa.fleet.trainer.fleetwatch): a worker asleep past the
heartbeat window, one heard again, one whose store or cache disk fails, each once as an event; a
worker gone for good is forgotten, and its heartbeat deleted from the store."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stoa.fleet.run import Heartbeat, delete_heartbeat, read_heartbeats, write_heartbeat
from stoa.fleet.sections import ConfigError
from stoa.fleet.trainer.fleetwatch import FORGET_S, FleetWatch
from stoa.fleet.trainer.section import TrainerConfig
from stoa.transport.store import LocalStore


def beat(wid: str, t: float, **kw) -> Heartbeat:
    return replace(Heartbeat(wid, 3, "generating", 0, 0, 0.0, 0.0, "int8", "h", t), **kw)


def test_a_sleeping_worker_is_silent_once_then_back_and_trouble_is_reported_once():
    w = FleetWatch()
    m, ev = w.see([beat("a", 100.0, store_retries=2), beat("b", 100.0, store_retries=5)], 101.0)
    assert m == {"fleet/workers_alive": 2, "fleet/workers_silent": 0, "fleet/workers_in_trouble": 0,
                 "fleet/store_retries": 7} and ev == []
    m, ev = w.see([beat("a", 140.0), beat("b", 100.0)], 141.0)  # b asleep for 41 s
    assert m["fleet/workers_silent"] == 1 and [e["event"] for e in ev] == ["worker_silent"]
    assert w.see([beat("a", 150.0), beat("b", 100.0)], 151.0)[1] == []  # said once
    disk = "cache: OSError: [Errno 28] No space left on device"
    m, ev = w.see([beat("a", 160.0, trouble=disk), beat("b", 170.0)], 171.0)
    assert [(e["event"], e["worker"]) for e in ev] == [("worker_trouble", "a"), ("worker_back", "b")]
    assert ev[1]["silent_s"] == 70.0 and m["fleet/workers_in_trouble"] == 1
    assert w.see([beat("a", 175.0, trouble=disk), beat("b", 175.0)], 176.0)[1] == []
    ev = w.see([beat("a", 180.0), beat("b", 180.0, status="stopped")], 181.0)[1]
    assert [(e["event"], e["was"]) for e in ev] == [("worker_recovered", disk)]


def test_heartbeats_of_older_workers_still_parse():
    old = b'{"batches": 1, "episodes": 2, "episodes_per_s": 0.5, "host": "h", "mode": "int8", "status": "waiting",' \
          b' "time": 1.0, "tokens_per_s": 3.0, "version": 4, "worker_id": "w"}'
    hb = Heartbeat.parse(old)
    assert hb.store_retries == 0 and hb.trouble == "" and hb.sync_bytes == 0
    assert Heartbeat.parse(beat("w", 1.0, store_retries=3, trouble="x").to_json()).store_retries == 3


def test_the_silence_window_is_the_trainers_setting():

    w = FleetWatch(TrainerConfig(silent_after_s=5.0).silent_after_s)
    assert w.see([beat("a", 100.0)], 104.0)[0]["fleet/workers_silent"] == 0
    m, ev = w.see([beat("a", 100.0)], 105.5)
    assert m["fleet/workers_silent"] == 1 and [e["event"] for e in ev] == ["worker_silent"]
    assert FleetWatch().silent_s == 30.0
    with pytest.raises(ConfigError, match="silent_after_s"):
        TrainerConfig(silent_after_s=0)


def test_a_worker_gone_for_good_is_forgotten_and_its_heartbeat_deleted(tmp_path):
    # A fleet churning through identities (killed workers never say "stopped") must not leave one
    # heartbeat per identity ever: the trainer would read them all every step, and past 4096 the
    # newest workers would go unread.
    store, w = LocalStore(tmp_path), FleetWatch()
    for wid, t in (("left-long-ago", 0.0), ("asleep", 1000.0), ("live", 1000.0 + FORGET_S)):
        write_heartbeat(store, "r", beat(wid, t))
    now = 1000.0 + FORGET_S + 1.0
    beats, _ = read_heartbeats(store, "r")
    assert [e["worker"] for e in w.see(beats, now)[1]] == ["asleep", "left-long-ago"]  # silent
    gone = w.forget(beats, now)
    assert gone == ["asleep", "left-long-ago"] and w._silent == {}
    assert all(delete_heartbeat(store, "r", wid) for wid in gone)
    assert [b.worker_id for b in read_heartbeats(store, "r")[0]] == ["live"]
    assert w.forget(read_heartbeats(store, "r")[0], now) == []
    # the sleeper wakes: a worker seen anew, no "back" event for a worker the trainer forgot
    write_heartbeat(store, "r", beat("asleep", now + 1.0))
    assert w.see(read_heartbeats(store, "r")[0], now + 2.0)[1] == []
    assert not delete_heartbeat(store, "r", "../config")  # a stranger's id never names a key
