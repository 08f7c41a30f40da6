"""Signed per-step transcripts of a pipeline's cohorts, and blame when a stage computed wrong.

**What a stage signs.** At the start of each cohort the driver sends every remote stage a
``cohort`` frame naming a fresh cohort id; the stage then starts its KV cache afresh, and from
there on it folds every frame it receives into a running hash (:func:`digest`, chained). Each
``forward`` it answers carries, in the answer's meta, a document signed with the stage's own key
(:func:`stoa.transport.signing.sign_document`, kind :data:`KIND`) whose body is::

    {"run", "pipeline", "stage": i, "cohort": id, "step": k,
     "inputs": hash of every frame received since step k-1 (chained, cache ops included),
     "output": hash of the answer (its op, meta without the signature, arrays)}

**What the driver keeps.** A :class:`Recorder` on each link recomputes both hashes from the
frames it sent and received and checks the signature against the key the stage announced (and
TLS pinned): a step that does not verify refuses the stage (:class:`TranscriptError`, a
``ConnectionError``: the cohort is void). The cohort's :class:`Transcript` holds, per stage, the
signed steps and (when the driver keeps frames) the frames themselves.

**Blame.** The inputs and a stage's share at the cohort's version determine its outputs: the
share is signed in the run's chain, and a stage's KV cache starts empty at ``cohort``.
:func:`replay` feeds the recorded frames, in order, to a fresh stage built on that share and
compares each answer with the signed one (:func:`differs`); :func:`blame` does this stage by
stage and names the first whose output differs. The driver is the hub, so every stage's inputs
are in the transcript and each stage is judged on its own inputs: an honest stage after a liar
is not blamed for the liar's activations. Anyone holding the transcript and the run's public
chain can redo it; the stage cannot deny a signed step.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stoa.transport.frames import Frame, FrameError
from stoa.transport.signing import SignatureError, key_id, load_public_key, open_document, sign_document

__all__ = ["ANSWERED", "KIND", "SIGNED", "Blame", "Recorder", "Step", "StepSigner", "Transcript", "TranscriptError",
           "blame", "differs", "digest", "new_cohort", "replay"]

KIND = "stage-step"
SIGNED = "signed"
"""The meta field of an answer that carries its signed step."""
ANSWERED = frozenset({"forward"})
"""Ops a stage answers inside a cohort (every other op of a cohort answers nothing)."""
TOLERANCE = 1e-3
"""A replayed float answer differs when an element is off by more than this times (1 + the
largest magnitude of the signed answer): far above the rounding of another CPU's kernels, far
below what changes a draw."""


class TranscriptError(FrameError):
    """A stage's signed step that does not verify or does not match the frames: the stage is refused."""

    def __init__(self, message: str, stage: int = -1) -> None:
        super().__init__(message)
        self.stage = stage
        """The stage that sent it (-1: not known)."""


def new_cohort() -> str:
    """A fresh cohort id: a signed step of one cohort cannot be passed off as another's."""
    return secrets.token_hex(12)


def digest(frame: Frame, prev: str = "") -> str:
    """sha256 (hex) of ``prev`` and ``frame``: its op, its meta (less :data:`SIGNED`) as sorted
    JSON, each array's dtype, shape and little-endian C-order bytes."""
    h = hashlib.sha256(prev.encode("ascii"))
    meta = {k: v for k, v in frame.meta.items() if k != SIGNED}
    head = json.dumps({"op": frame.op, "meta": meta,
                       "arrays": [[a.dtype.str, list(a.shape)] for a in frame.arrays]}, sort_keys=True,
                      separators=(",", ":"), allow_nan=False).encode()
    h.update(len(head).to_bytes(8, "little") + head)
    for a in frame.arrays:
        h.update(np.ascontiguousarray(a, a.dtype.newbyteorder("<")).data)
    return h.hexdigest()


class StepSigner:
    """A stage's side: signs each answer of a cohort with the stage's key (see the module docstring)."""

    def __init__(self, private_key: Any, run: str, pipeline: str, index: int) -> None:
        self.key, self.run, self.pipeline, self.index = private_key, run, pipeline, index
        self.cohort = ""
        self.step = 0
        self.inputs = ""

    def begin(self, cohort: Any) -> None:
        if not (isinstance(cohort, str) and 8 <= len(cohort) <= 64 and cohort.isalnum()):
            raise FrameError(f"a cohort id is 8-64 letters and digits, not {str(cohort)[:80]!r}")
        self.cohort, self.step, self.inputs = cohort, 0, ""

    def received(self, frame: Frame) -> None:
        if self.cohort:
            self.inputs = digest(frame, self.inputs)

    def sign(self, answer: Frame) -> Frame:
        """``answer`` with its signed step (unchanged outside a cohort)."""
        if not self.cohort:
            return answer
        body = {"run": self.run, "pipeline": self.pipeline, "stage": self.index, "cohort": self.cohort,
                "step": self.step, "inputs": self.inputs, "output": digest(answer)}
        self.step, self.inputs = self.step + 1, ""
        return Frame(answer.op, {**answer.meta, SIGNED: sign_document(KIND, body, self.key).decode()}, answer.arrays)


@dataclass
class Step:
    """One answered frame of one stage: what was sent to it since the previous answer, its answer
    (without the signature) and the signed document. When frames are not kept, ``sent`` is empty
    and the answer has no arrays: the signed hashes stand for them."""

    sent: list[Frame]
    answer: Frame
    signed: bytes


@dataclass
class Transcript:
    """One cohort of a pipeline: for each remote stage (by index), its signed steps in order."""

    cohort: str
    version: int | None = None
    keys: dict[int, str] = field(default_factory=dict)
    """Each stage's public key (hex), as announced and pinned."""
    steps: dict[int, list[Step]] = field(default_factory=dict)
    frames: bool = True
    """Whether the frames were kept (a transcript of hashes and signatures only cannot be replayed)."""

    def nbytes(self) -> int:
        """Array bytes held (the memory the transcript costs)."""
        return sum(a.nbytes for st in self.steps.values() for s in st for f in [*s.sent, s.answer] for a in f.arrays)


class Recorder:
    """The driver's side of one link: checks and records every signed step (module docstring).

    Args:
        run, pipeline, index: what the stage must sign for.
        public_key: the stage's key (the one its announcement carries and TLS pinned).
    """

    def __init__(self, run: str, pipeline: str, index: int, public_key: Any) -> None:
        self.run, self.pipeline, self.index = run, pipeline, index
        self.pub = load_public_key(public_key)
        self.hex = self.pub.public_bytes_raw().hex()
        self.transcript: Transcript | None = None
        self._queue: list[Frame] = []
        self._inputs = ""

    def begin(self, transcript: Transcript) -> None:
        self.transcript, self._queue, self._inputs = transcript, [], ""
        transcript.keys[self.index] = self.hex
        transcript.steps[self.index] = []

    def sent(self, frame: Frame) -> None:
        if self.transcript is not None:
            self._queue.append(frame)

    def answered(self, answer: Frame) -> Frame:
        """``answer`` less its signature, once the signature verifies and the step it signs is the
        one the frames make. Raises :class:`TranscriptError` otherwise."""
        t = self.transcript
        if t is None:
            return answer
        k = next((j for j, f in enumerate(self._queue) if f.op in ANSWERED), None)
        if k is None:
            raise TranscriptError(f"stage {self.index} answered a frame that asks for no answer", self.index)
        sent, self._queue = self._queue[:k + 1], self._queue[k + 1:]
        inputs = self._inputs
        for f in sent:
            inputs = digest(f, inputs)
        raw = answer.meta.get(SIGNED)
        plain = Frame(answer.op, {k2: v for k2, v in answer.meta.items() if k2 != SIGNED}, answer.arrays)
        steps = t.steps[self.index]
        want = {"run": self.run, "pipeline": self.pipeline, "stage": self.index, "cohort": t.cohort,
                "step": len(steps), "inputs": inputs, "output": digest(plain)}
        if not isinstance(raw, str):
            raise TranscriptError(f"stage {self.index} answered step {len(steps)} of cohort {t.cohort} unsigned",
                                  self.index)
        try:
            body = open_document(raw.encode(), KIND, self.pub, f"stage {self.index}'s step {len(steps)}")
        except SignatureError as e:
            raise TranscriptError(str(e), self.index) from None
        if body != want:
            bad = sorted(k2 for k2 in set(body) | set(want) if body.get(k2) != want.get(k2))
            raise TranscriptError(f"stage {self.index}'s signed step {len(steps)} is not the one its frames make "
                                  f"(fields {', '.join(bad)[:200]})", self.index)
        kept = Step(sent, plain, raw.encode()) if t.frames else Step([], Frame(plain.op, plain.meta), raw.encode())
        steps.append(kept)
        return plain


def check_step(signed: bytes, public_key: Any) -> dict[str, Any]:
    """The body of one signed step, verified under ``public_key`` (for anyone re-checking a
    transcript). Raises :class:`TranscriptError`."""
    try:
        return open_document(signed, KIND, public_key, "a signed stage step")
    except SignatureError as e:
        raise TranscriptError(str(e)) from None


def differs(got: Frame | None, signed: Frame) -> str | None:
    """Why the replayed answer ``got`` is not the signed answer, or None (same op and arrays;
    floats within :data:`TOLERANCE`, integers equal)."""
    if got is None or got.op != signed.op or len(got.arrays) != len(signed.arrays):
        return f"the replay answered {None if got is None else got.op!r}, the stage {signed.op!r}"
    for j, (a, b) in enumerate(zip(got.arrays, signed.arrays)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"array {j}: replay {a.dtype}{list(a.shape)}, stage {b.dtype}{list(b.shape)}"
        if a.dtype.kind == "f":
            if not np.isfinite(b).all():
                return f"array {j}: the stage sent non-finite values"
            gap = float(np.max(np.abs(a - b))) if a.size else 0.0
            if gap > TOLERANCE * (1.0 + (float(np.max(np.abs(b))) if b.size else 0.0)):
                return f"array {j}: off by up to {gap:.3g}"
        elif not np.array_equal(a, b):
            return f"array {j}: {int(np.sum(a != b))} of {a.size} values differ"
    return None


def replay(handle: Callable[[Frame], Frame | None], steps: Iterable[Step]) -> tuple[int, str] | None:
    """Feed each step's sent frames to ``handle`` (a fresh stage's
    :meth:`~stoa.backends.torch.remote.StageService.handle`) in order; the first step whose
    answer differs from the signed one and why, or None when every answer is the stage's."""
    for k, step in enumerate(steps):
        if not step.sent:
            raise ValueError("this transcript kept no frames: it cannot be replayed")
        out = None
        for f in step.sent:
            try:
                out = handle(f)
            except FrameError as e:  # the stage accepted a frame an honest stage refuses
                return k, f"an honest stage refuses its input: {e}"
        why = differs(out, step.answer)
        if why:
            return k, why
    return None


@dataclass(frozen=True)
class Blame:
    """The first stage of a transcript whose outputs are not what its layers make of its inputs."""

    stage: int
    key_id: str
    step: int
    why: str
    cohort: str


def blame(t: Transcript, service: Callable[[int], Callable[[Frame], Frame | None]],
          stages: Iterable[int] | None = None) -> Blame | None:
    """Replay ``stages`` of ``t`` (default: all, in order) and name the first that differs.
    ``service(i)`` is a fresh stage ``i`` on its share at ``t.version`` (its ``handle``)."""
    for i in sorted(t.steps) if stages is None else stages:
        got = replay(service(i), t.steps[i])
        if got is not None:
            return Blame(i, key_id(load_public_key(t.keys[i])), got[0], got[1], t.cohort)
    return None


def keys_of(t: Transcript) -> Mapping[int, str]:
    """Stage index -> key id, for a log line."""
    return {i: key_id(load_public_key(k)) for i, k in t.keys.items()}
