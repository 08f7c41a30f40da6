"""``stoa status``: the fleet as the store sees it (heartbeats, versions, lag, throughput, evals)."""

from __future__ import annotations

import json
import time
from typing import Any

from stoa.fleet.run import read_heartbeats
from stoa.transport.exchange import is_finished
from stoa.transport.store import KeyNotFound, ObjectStore

__all__ = ["fleet_status", "show_status", "trust_lines"]


def fleet_status(store: ObjectStore, run: str, public_key: Any = None) -> dict[str, Any]:
    """Plain data behind ``stoa status``. With ``public_key`` the head and evaluations are verified."""
    head, verified = None, False
    if public_key is not None:
        from stoa.transport.chain import WeightSubscriber

        head, verified = WeightSubscriber(store, run, public_key).head(), True
    else:
        try:  # display only: the pointer's signed body, read without checking the signature
            head = json.loads(json.loads(store.get(f"{run}/current.json"))["body"])["version"]
        except (KeyNotFound, ValueError, KeyError, TypeError):
            head = None
    beats, bad = read_heartbeats(store, run)
    now = time.time()
    workers = [{**b.__dict__, "age_s": now - b.time, "lag": None if head is None else head - b.version}
               for b in sorted(beats, key=lambda b: b.worker_id)]
    evals = []
    for key in store.list(f"{run}/eval/")[-5:]:
        try:
            blob = store.get(key)
            if public_key is not None:
                from stoa.transport.signing import open_document

                body = open_document(blob, "eval", public_key, key)
            else:
                body = json.loads(json.loads(blob)["body"])
            evals.append({"version": body["version"], **body["metrics"]})
        except Exception:
            continue
    from stoa.fleet.trust import read_trust_report
    from stoa.transport.signing import SignatureError

    try:
        trust = read_trust_report(store, run, public_key)
    except SignatureError:
        trust = None
    return {
        "run": run, "head": head, "verified": verified, "workers": workers, "bad_heartbeats": bad, "trust": trust,
        "rollouts_waiting": len(store.list(f"{run}/rollouts/")),
        "quarantined": len([k for k in store.list(f"{run}/quarantine/") if k.endswith(".reason.json")]),
        "finished": is_finished(store, run, public_key) if public_key is not None else store.exists(f"{run}/finished.json"),
        "evals": evals,
    }


def trust_lines(store: ObjectStore, run: str) -> list[tuple[str, str]]:
    """One line per worker key of the trainer's trust report (for the live view); empty without one."""
    from stoa.fleet.trust import read_trust_report

    tr = read_trust_report(store, run)
    if not tr:
        return []
    out = []
    for kid, w in sorted(tr.get("workers", {}).items(), key=lambda kv: kv[1]["worker_id"]):
        rej = ", ".join(f"{c} {n}" for c, n in sorted(w["rejected"].items()))
        state = f"[red]banned[/red]: {w['banned'][:50]}" if w["banned"] else "ok"
        out.append((f"trust {w['worker_id']}", f"{state}; accepted {w['accepted_batches']}, trained "
                                               f"{w['trained_episodes']} ep." + (f"; rejected {rej}" if rej else "")))
    return out


def show_status(store: ObjectStore, run: str, public_key: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    s = fleet_status(store, run, public_key)
    con = Console()
    state = "finished" if s["finished"] else "running" if s["head"] is not None else "not started"
    con.print(f"[bold]{run}[/bold]: {state}, head version {s['head']}"
              f"{'' if s['verified'] else ' (unverified: pass --public-key to check signatures)'}; "
              f"{s['rollouts_waiting']} rollout batches in the store, {s['quarantined']} quarantined")
    t = Table("worker", "status", "version", "lag", "last seen", "episodes/s", "tokens/s", "episodes", "mode", "host")
    for w in s["workers"]:
        t.add_row(w["worker_id"], w["status"], str(w["version"]), "-" if w["lag"] is None else str(w["lag"]),
                  f"{w['age_s']:.0f}s ago", f"{w['episodes_per_s']:.1f}", f"{w['tokens_per_s']:.0f}",
                  str(w["episodes"]), w["mode"], w["host"])
    con.print(t)
    for key in s["bad_heartbeats"]:
        con.print(f"[yellow]unreadable heartbeat {key}[/yellow]")
    if s["trust"]:
        tr = s["trust"]
        t = Table("worker", "key", "accepted", "trained ep.", "rejected (by reason)", "audit |log pi - log mu|",
                  "spot-checks", "banned", title=f"trust (mode {tr.get('mode')}, as of version {tr.get('version')})")
        for kid, w in sorted(tr["workers"].items(), key=lambda kv: kv[1]["worker_id"]):
            audit = " ".join(f"s{k[5:]}:{v:.3f}" for k, v in w.get("audit", {}).items() if k.startswith("abs_s"))
            t.add_row(w["worker_id"], kid, str(w["accepted_batches"]), str(w["trained_episodes"]),
                      ", ".join(f"{c} {n}" for c, n in sorted(w["rejected"].items())) or "-", audit or "-",
                      f"{w['spot_checks']} ({w['spot_check_failures']} failed)", (w["banned"][:60] or "-"))
        con.print(t)
        for wid, cats in sorted(tr.get("anonymous", {}).items()):
            con.print(f"[yellow]{wid}: refused unsigned or unverifiable batches: {cats}[/yellow]")
    if s["evals"]:
        # Whatever the task reports (eval/<metric> means), up to six columns beside pass@1.
        keys = [k for k in s["evals"][-1] if k.startswith("eval/") and k not in ("eval/pass@1", "eval/seconds",
                                                                                   "eval/questions")][:6]
        e = Table("version", "pass@1", *(k[len("eval/"):] for k in keys))
        for r in s["evals"]:
            e.add_row(str(r["version"]), f"{r['eval/pass@1']:.3f}",
                      *(f"{r[k]:.3f}" if isinstance(r.get(k), (int, float)) else "-" for k in keys))
        con.print(e)
