"""``stoa status``: the fleet as the store sees it (heartbeats, versions, lag, throughput, trust, evals).

:func:`fleet_status` is the plain data (``stoa status --json`` prints it, strict JSON: a number
that is not finite becomes ``null``); :func:`render` lays it out for a terminal 80 columns wide.
Every string from the store (a worker's id, status, mode, host; ban reasons; evaluation metric
names) is shown only through :func:`clean`, as text, never as markup: no control characters, no
terminal escapes, no rich markup reach the operator's screen.

With the run's public key every document the trainer signs (head, trust report, evaluations,
finished marker) is verified and one that does not verify is not shown. Without it they are read
as they are and **marked unverified** (``"verified": false`` and ``"unverified"`` in the JSON, a
line in the layout): anyone with write access to the store could have written them. Heartbeats
are never signed: they are what workers say.
"""

from __future__ import annotations

import json
import math
import time
import unicodedata
from typing import Any

from stoa.errors import ExpectedFailure
from stoa.fleet.run import read_heartbeats
from stoa.transport import layout
from stoa.transport.exchange import is_finished
from stoa.transport.store import LocalStore, ObjectStore, StoreError

__all__ = ["RunNotFound", "UNVERIFIED", "clean", "eval_row", "fleet_status", "render", "runs_in", "show_status",
           "strict", "trust_lines"]

UNVERIFIED = ("unverified: read without the run's public key (--public-key); anyone with write access to the "
              "store could have written it")


def strict(obj: Any) -> Any:
    """``obj`` as strict JSON data: non-finite numbers become None, keys strings, tuples lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj if obj is None or isinstance(obj, (bool, int, str)) else str(obj)


def _version(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _eval_row(body: Any) -> dict[str, Any] | None:
    """An evaluation body as a row: its version (an int) and its numeric metrics only (one that is
    not finite as None)."""
    if not isinstance(body, dict) or _version(body.get("version")) is None or not isinstance(body.get("metrics"), dict):
        return None
    metrics = {str(k)[:64]: float(v) if math.isfinite(v) else None for k, v in body["metrics"].items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {"version": body["version"], **metrics}


def _learning(meta: Any) -> dict[str, Any] | None:
    """The learning figures a version's signed metadata carries (the trainer's last step), checked."""
    if not isinstance(meta, dict):
        return None
    frac, flat, reward = meta.get("signal_frac"), meta.get("flat_steps"), meta.get("reward")
    if (isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac <= 1
            or _version(flat) is None or isinstance(reward, bool) or not isinstance(reward, (int, float))):
        return None
    return {"signal_frac": float(frac), "flat_steps": flat, "reward": float(reward)}


def eval_row(store: ObjectStore, key: str, public_key: Any = None) -> dict[str, Any] | None:
    """The evaluation document at ``key`` as a row (its version and numeric metrics), verified under
    ``public_key`` when given; None when it is missing, does not verify, or does not parse."""
    try:
        blob = store.get(key, max_bytes=1 << 20)
        if public_key is not None:
            from stoa.transport.signing import open_document

            return _eval_row(open_document(blob, "eval", public_key, key))
        return _eval_row(json.loads(json.loads(blob)["body"]))
    except Exception:  # a forged, torn or foreign object: not a row
        return None


class RunNotFound(ExpectedFailure, LookupError):
    """The store holds no such run (the message names the runs it does hold, where it can list them)."""


def clean(text: Any, limit: int | None = None) -> str:
    """``text`` safe to print: control and format characters (ESC, BEL, CR, bidi overrides) shown as
    ``\\xNN`` / ``\\uNNNN``; cut to ``limit`` characters with an ellipsis when given."""
    out = []
    for ch in str(text):
        cat = unicodedata.category(ch)
        if cat[0] == "C":
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    s = "".join(out)
    return s if limit is None or len(s) <= limit else s[: limit - 1] + "…"


def runs_in(store: ObjectStore) -> list[str] | None:
    """Names of the runs in a local store (folders with a ``config.json``); None where listing every
    key would be needed (an S3 bucket)."""
    if not isinstance(store, LocalStore):
        return None
    return sorted(p.name for p in store.root.iterdir() if (p / "config.json").is_file())


def _check_run(store: ObjectStore, run: str) -> None:
    if store.exists(layout.config(run)) or store.list(layout.heartbeats(run)):
        return
    runs = runs_in(store)
    found = "" if runs is None else f"; runs there: {', '.join(runs)}" if runs else "; it holds no runs"
    raise RunNotFound(f"no run {run!r} in {store} (no {run}/config.json){found}")


def fleet_status(store: ObjectStore, run: str, public_key: Any = None) -> dict[str, Any]:
    """Plain data behind ``stoa status``. With ``public_key`` the head, evaluations and trust report
    are verified.

    Returns a JSON-ready dict: ``run``, ``state`` (``not started`` / ``running`` / ``finished``),
    ``head``, ``verified``, ``unverified`` (what was read without verifying it, with why),
    ``workers`` (each heartbeat with ``age_s``, ``lag`` and its ``trust`` record, matched by
    worker id, or None), ``bad_heartbeats``, ``trust`` (the trainer's whole report or None),
    ``rollouts_waiting``, ``quarantined``, ``finished``, ``evals`` (last five), ``learning`` (with the
    key: the head version's share of groups whose rewards differed, steps in a row with none, and
    mean reward, from its signed metadata; else None).

    Raises:
        RunNotFound: the store has no config and no heartbeats for ``run``.
    """
    _check_run(store, run)
    head, verified, learning = None, False, None
    if public_key is not None:
        from stoa.transport.chain import WeightSubscriber

        sub = WeightSubscriber(store, run, public_key)
        head, verified = sub.head(), True
        if head is not None:
            try:
                learning = _learning(sub.manifest(head).metadata.get("learning"))
            except Exception:  # a display extra: a manifest that cannot be read leaves it out
                learning = None
    else:
        try:  # display only: the pointer's signed body, read without checking the signature
            head = _version(json.loads(json.loads(store.get(layout.pointer(run), max_bytes=64 << 10))["body"])["version"])
        except (StoreError, ValueError, KeyError, TypeError):  # missing, oversized or malformed
            head = None
    from stoa.fleet.trust.records import read_trust_report
    from stoa.transport.signing import SignatureError

    try:
        report = read_trust_report(store, run, public_key)
    except SignatureError:
        report = None
    trust = strict(report.to_body()) if report is not None else None
    by_worker = {w.worker_id: {"key": kid, **trust["workers"][kid]} for kid, w in (report.workers.items() if report
                                                                                    else ())}
    beats, bad = read_heartbeats(store, run)
    now = time.time()
    workers = [{**b.__dict__, "age_s": round(now - b.time, 1), "lag": None if head is None else head - b.version,
                "trust": by_worker.get(b.worker_id)} for b in sorted(beats, key=lambda b: b.worker_id)]
    evals = []
    for key in store.list(layout.eval_prefix(run))[-5:]:
        try:
            blob = store.get(key, max_bytes=1 << 20)
            if public_key is not None:
                from stoa.transport.signing import open_document

                body = open_document(blob, "eval", public_key, key)
            else:
                body = json.loads(json.loads(blob)["body"])
        except Exception:
            continue
        row = _eval_row(body)
        if row is not None:
            evals.append(row)
    finished = (is_finished(store, run, public_key) if public_key is not None
                else store.exists(layout.finished(run)))
    unverified = [] if verified else [k for k, v in (("head", head), ("trust", trust), ("evals", evals),
                                                      ("finished", finished)) if v]
    return strict({
        "run": run, "state": "finished" if finished else "running" if head is not None else "not started",
        "head": head, "verified": verified, "unverified": unverified, "unverified_why": "" if verified else UNVERIFIED,
        "workers": workers, "bad_heartbeats": bad, "trust": trust,
        "rollouts_waiting": len(store.list(layout.rollouts(run))),
        "quarantined": len([k for k in store.list(layout.quarantine(run)) if k.endswith(".reason.json")]),
        "finished": finished, "evals": evals, "learning": learning,
    })


def _rejected(w: dict[str, Any]) -> str:
    rej = w.get("rejected") or {}
    return ", ".join(f"{clean(c)} {n}" for c, n in sorted(rej.items())) if isinstance(rej, dict) else clean(rej)


def trust_lines(store: ObjectStore, run: str, public_key: Any) -> list[tuple[str, str]]:
    """One line per worker key of the trainer's trust report, verified under the run's key (for the
    live view); empty without one, or when it does not verify."""
    from stoa.fleet.trust.records import read_trust_report
    from stoa.transport.signing import SignatureError

    try:
        tr = read_trust_report(store, run, public_key)
    except SignatureError:
        return []
    if tr is None:
        return []
    out = []
    for w in sorted(tr.workers.values(), key=lambda w: w.worker_id):
        rej = _rejected({"rejected": w.rejected})
        state = f"banned: {clean(w.banned)}" if w.banned else "ok"
        out.append((f"trust {clean(w.worker_id, 40)}", f"{state}; accepted {w.accepted_batches}, "
                    f"trained {w.trained_episodes} ep." + (f"; rejected {rej}" if rej else "")))
    return out


def render(s: dict[str, Any]) -> list[Any]:
    """Rich renderables of a :func:`fleet_status` dict, laid out for 80 columns: short headers,
    cells that fold instead of being cut, and ban reasons in full on lines of their own."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    def table(*headers: str, title: str | None = None) -> Table:  # headers and title as text, never markup
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=None if title is None else Text(title),
                  title_justify="left", expand=False)
        for h in headers:
            t.add_column(Text(h), overflow="fold")
        return t

    def num(x: Any, fmt: str = "") -> str:
        return "-" if not isinstance(x, (int, float)) or isinstance(x, bool) else format(x, fmt)

    out: list[Any] = [Text(f"{clean(s['run'])}: {clean(s['state'])}, head version {clean(s['head'])}")]
    out.append(Text(f"{clean(s['rollouts_waiting'])} rollout batches waiting, {clean(s['quarantined'])} quarantined"))
    if not s["verified"]:
        out.append(Text(f"{', '.join(map(clean, s.get('unverified') or ['the head']))}: {UNVERIFIED}", style="yellow"))
    if lr := s.get("learning"):
        if lr["flat_steps"]:
            out.append(Text(f"no learning signal for {lr['flat_steps']} steps in a row: in every group all episodes "
                            f"got the same reward (last mean {lr['reward']:.3f}), so the weights did not move",
                            style="red"))
        else:
            out.append(Text(f"learning signal: {lr['signal_frac']:.0%} of the last step's groups had rewards "
                            f"that differ (mean reward {lr['reward']:.3f})"))
    t = table("worker", "state", "ver", "lag", "seen", "ep/s", "tok/s", "episodes")
    for w in s["workers"]:
        t.add_row(Text(clean(w["worker_id"])), Text(clean(w["status"])), Text(num(w["version"])), Text(num(w["lag"])),
                  Text(f"{num(w['age_s'], '.0f')}s"), Text(num(w["episodes_per_s"], ".1f")),
                  Text(num(w["tokens_per_s"], ".0f")), Text(num(w["episodes"])))
    out.append(t)
    for w in s["workers"]:
        if w.get("trouble") and w["status"] != "stopped":
            out.append(Text(f"{clean(w['worker_id'])} is retrying: {clean(w['trouble'])}", style="yellow"))
    for key in s["bad_heartbeats"]:
        out.append(Text(f"unreadable heartbeat {clean(key)}", style="yellow"))
    tr = s.get("trust")
    if tr:
        mark = "" if s["verified"] else ", UNVERIFIED"
        t = table("worker", "key", "accepted", "trained", "rejected", "checks",
                  title=f"trust (mode {clean(tr.get('mode'))}, as of version {clean(tr.get('version'))}{mark})")
        banned = []
        for kid, w in sorted((tr.get("workers") or {}).items(), key=lambda kv: str(kv[1].get("worker_id"))):
            wid = clean(w.get("worker_id"))
            t.add_row(Text(wid), Text(clean(kid)[:8]), Text(num(w.get("accepted_batches"))),
                      Text(num(w.get("trained_episodes"))), Text(_rejected(w) or "-"),
                      Text(f"{num(w.get('spot_checks', 0))} ({num(w.get('spot_check_failures', 0))} failed)"))
            if w.get("banned"):
                banned.append(Text(f"banned {wid}: {clean(w['banned'])}", style="red"))
        out.append(t)
        out.extend(banned)
        for wid, cats in sorted((tr.get("anonymous") or {}).items()):
            out.append(Text(f"{clean(wid)}: refused unsigned or unverifiable batches: {clean(cats)}", style="yellow"))
    if s["evals"]:
        # Whatever the task reports (eval/<metric> means), up to four columns beside pass@1.
        keys = [k for k in s["evals"][-1] if k.startswith("eval/") and not k.endswith(".n")
                and k not in ("eval/pass@1", "eval/seconds", "eval/questions")][:4]
        e = table("version", "pass@1", *(clean(k[len("eval/"):], 24) for k in keys),
                  title=None if s["verified"] else "evaluations (UNVERIFIED)")
        for r in s["evals"]:
            e.add_row(Text(num(r.get("version"))), Text(num(r.get("eval/pass@1"), ".3f")),
                      *(Text(num(r.get(k), ".3f")) for k in keys))
        out.append(e)
    return out


def show_status(store: ObjectStore, run: str, public_key: Any = None, *, as_json: bool = False,
                watch: float | None = None, console: Any = None) -> None:
    """Print the status once, or every ``watch`` seconds until the run finishes (Ctrl-C stops).

    ``as_json``: one JSON object (with ``watch``: one per line, a stream a script can read).
    """
    from rich.console import Console, Group

    con = console or Console()
    while True:
        s = fleet_status(store, run, public_key)
        if as_json:  # strict JSON (never NaN), every control character escaped; out() applies no markup
            con.out(json.dumps(strict(s), sort_keys=True, allow_nan=False, indent=None if watch else 2),
                    highlight=False)
        else:
            if watch and con.is_terminal:
                con.clear()
            elif watch:
                con.out(time.strftime("-- %H:%M:%S --"), highlight=False)
            con.print(Group(*render(s)))
        if not watch or s["finished"]:
            return
        time.sleep(watch)
