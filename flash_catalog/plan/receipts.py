"""The receipt's sentences: every line a decision writes onto a shape's trail or reason, in one place.

Each names the form, what was measured or which rule broke, and the shape, so a reader of the plan can tell why."""

from __future__ import annotations

import re

from ..decide.gate import Accuracy, Timing
from ..catalog.specs import AccuracyFloor


def figures(timing: Timing, timed_at: str) -> str:
    """The speed measurement: ratio, the two times and the spread, from one statistic (gate.Timing)."""
    return timing.describe() + (f" ({timed_at})" if timed_at else "")


def refused(form: str, rule: str, shape: str) -> str:
    return f"{form}: {rule} at {shape}"


def error_text(exc: BaseException) -> str:
    """An error as receipts quote it: its type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


def failed(form: str, why: str, shape: str, stage: str = "run") -> str:
    """`why`: `error_text` of the error (naming the rank, under context parallelism)."""
    return f"{form}: failed to {stage} ({why}) at {shape}"


def below_floor(form: str, accuracy: Accuracy, floor: AccuracyFloor, shape: str) -> str:
    return (f"{form}: accuracy {accuracy.describe()} below floor cos>={floor.min_cosine} "
            f"err<={floor.max_rel_err} at {shape}")


def declined(form: str, timing: Timing, timed_at: str, need: float, shape: str, accuracy: Accuracy | None,
             alone: float | None = None) -> str:
    """A form not faster (or not surely faster: undecided) than `need`, with the measurement (its accuracy when it
    was run here; a form timed not faster at another site of this shape is not run again). `alone`: the speedup of
    the form's kernel without the routed call's guard, mask check and routing, where that was measured."""
    where = f", {timed_at}" if timed_at else ""
    checked = accuracy.describe() if accuracy is not None else "not run here"
    routed = f" as a routed call, kernel alone {alone:.2f}x" if alone is not None else ""
    return f"{form}: declined, {timing.reason(need)}{routed}{where} at {shape}, {checked}"


def bound(form: str, speed: str, need: float, accuracy: Accuracy, detail: str) -> str:
    return f"{form}: {speed}, faster than {need}x, {accuracy.describe()}" + (f"; {detail}" if detail else "")


def slower(form: str, speed: str, winner: str) -> str:
    return f"{form}: passed at {speed}, slower than {winner}"


def not_run_slower(form: str, speed: str, winner: str) -> str:
    """A form whose timing at this shape (from another site or a receipt) is below the winner's: not run here."""
    return f"{form}: not run here, {speed} is slower than {winner}"


def in_block(block: str, sites: int) -> str:
    """Where a timing of sites decided together came from: their block's trial (`decide/together.py`)."""
    return f"timed in block {block} with {sites} site{'s' if sites != 1 else ''}"


def pending_in_block(form: str, accuracy: Accuracy, block: str) -> str:
    """A projection site accurate at its input, whose speed its block judges once its forward returns."""
    return f"{form}: {accuracy.describe()}, its speed judged in block {block}"


def unjudged(form: str, block: str) -> str:
    """A pending projection whose block's forward never returned around it (its module was called from outside
    the block's forward): it stays on the host."""
    return f"{form}: not decided, block {block} did not return around this call, so the host serves it"


def host_only(problem: str) -> str:
    return f"host only: {problem}"


NO_FORMS = "no {family} forms selected"
NOT_CALLED = "not called during calibration"


_FIGURES = r"\S+x \([^()]* ms, spread [^()]*, \d+ rounds\)"  # Timing.describe()
_ORIGIN = r"(?:timed at|timed in block|reused from) [^()]*?"  # a timing measured at another site or in a block,
# or taken from a receipt
_BOUND = re.compile(rf"(?P<form>\S+): {_FIGURES}(?: \((?P<at>{_ORIGIN})\))?, faster than \S+x, cos=\S+ err=\S+"
                    rf"(?:; (?P<detail>.*))?", re.S)
_DECLINED = re.compile(rf"(?P<form>\S+): declined, (?P<verdict>[a-z ]+ \(need \S+x\)): {_FIGURES}"
                       rf"(?: as a routed call, kernel alone (?P<alone>\S+x))?(?:, (?P<at>{_ORIGIN}))? at \S+, "
                       rf"(?P<checked>.*)", re.S)
_DROPPED = re.compile(r"(?P<form>\S+): dropped by the step check \(.*\); alone it measured (?P<alone>.*)", re.S)
_AT_SHAPE = re.compile(r" at [a-z]=\([\d,]*\)(?=;|$)")


def note(reason: str) -> str:
    """What a shape's `reason` says beyond the table's other columns (form, outcome, speedup, cosine) and the step
    line: the detail a bound form chose, where its timing came from, a decline's verdict, a refusal's rules (without
    the shape, which the row shows)."""
    if m := _DROPPED.fullmatch(reason):
        alone = note(m["alone"])
        return "dropped by the step check" + (f"; alone: {alone}" if alone else "")
    if m := _BOUND.fullmatch(reason):
        return "; ".join(part for part in (m["at"], m["detail"]) if part)
    if m := _DECLINED.fullmatch(reason):
        parts = [m["verdict"], f"as a routed call (kernel alone {m['alone']})" if m["alone"] else "", m["at"] or "",
                 m["checked"] if m["checked"] == "not run here" else ""]
        return ", ".join(part for part in parts if part)
    return _AT_SHAPE.sub("", reason.removeprefix("host only: "))
