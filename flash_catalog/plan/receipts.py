"""The receipt's sentences: every line a decision writes onto a shape's trail or reason, in one place.

Each names the form, what was measured or which rule broke, and the shape, so a reader of the plan can tell why."""

from __future__ import annotations

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


def host_only(problem: str) -> str:
    return f"host only: {problem}"


NO_FORMS = "no {family} forms selected"
NOT_CALLED = "not called during calibration"
