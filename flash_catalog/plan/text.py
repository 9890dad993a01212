"""A plan as text: the table `print(plan)` shows and the story of one site (`plan.explain`), every line at most
`WIDTH` columns, so a terminal or a log shows it uncut.

The table keeps to one line per site and shape: what the other columns say is left out of the notes, the notes are
numbered once each below the table (a model's many sites share few), and a cell too wide for its column is cut."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from ..decide.step import StepRecord
from . import receipts
from .records import Basis, ShapeRecord, SiteRecord

WIDTH = 120
LAYOUTS = {"bhsd": "(B,H,S,D)", "bshd": "(B,S,H,D)"}
"""The host's layout of q and k, as the shapes are written (diffusers' dispatch is (B,S,H,D), torch SDPA's is
(B,H,S,D))."""
CUT = "..."
HEADER = ("site", "shape", "outcome", "form", "speedup", "cosine", "note")
SHRINK = (("site", 20), ("shape", 32), ("shape", 16), ("form", 12))
"""Columns cut, in this order and down to these widths, while a row is wider than `WIDTH` (a site is cut from the
left, `_site_cut`, never so far that two sites read the same, unless nothing else is left to cut)."""
NOT_MEASURED = ("-: not measured (host: no form tried; refused: none qualified; declined, not run here: timed at "
                "another site)")


def wrap(line: str, width: int = WIDTH, indent: str = "    ") -> list[str]:
    """`line` as lines of at most `width` columns, the later ones indented (a word longer than a line is split)."""
    return textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False) or [""]


def table(sites: Sequence[SiteRecord], receipt_source: str | None = None) -> list[str]:
    """The table's lines: a header, one row per site and shape, then the numbered notes and the legends."""
    shapes = [(site, s) for site in sites for s in site.shapes]
    dtype, layout = _shared(shapes, "dtype"), _shared([(si, s) for si, s in shapes if si.kind == "attention"],
                                                        "layout")
    notes: dict[str, int] = {}
    rows = []
    for site, s in shapes:
        text = _note(s, receipt_source)
        number = notes.setdefault(text, len(notes) + 1) if text else None
        rows.append([site.name, _shape(s, dtype, layout is None), s.outcome, s.form or "-",
                     f"{s.speedup:.2f}x" if s.speedup is not None else "-",
                     f"{s.cosine:.6f}" if s.cosine is not None else "-", str(number or "")])
    header = list(HEADER)
    header[1] = " ".join(part for part in ("shape", LAYOUTS.get(layout or "", layout), dtype) if part)
    cells, cut = _fit([header, *rows])
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, _widths(cells))).rstrip() for r in cells]
    if notes:
        lines.append("notes:")
        lines += [line for text, n in notes.items() for line in wrap(f"{n:>3}  {text}", indent="     ")]
    if any("-" in r[3:6] for r in rows):
        lines += wrap(NOT_MEASURED)
    if cut:
        lines.append(f"cells ending in {CUT} are cut: plan.explain(site) tells one site's whole story")
    return lines


def explain(site: SiteRecord, step: StepRecord | None = None, routed: int = 0, fallbacks: int = 0) -> list[str]:
    """One site's story: per shape its outcome, form, speed (interval, ms), accuracy, where the decision came from,
    the full reason and every form tried; a feed-forward site's memory; what the step check and the calls did."""
    lines = wrap(f"site {site.name} ({site.kind}): {site.outcome}" + (f", {site.form}" if site.form else ""))
    for s in site.shapes:
        lines += [""] + wrap(f"shape {s.shape}: {s.outcome}" + (f", {s.form}" if s.form else ""))
        for label, text in _shape_facts(s):
            lines += wrap(f"  {label}: {text}", indent="      ")
        if s.trail:
            lines.append("  forms tried, in order:")
            lines += [line for t in s.trail for line in wrap(f"    {t}", indent="        ")]
    if site.memory:
        m = site.memory
        change = f", {m['delta_bytes'] / m['host_bytes']:+.1%}" if m.get("host_bytes") else ""
        lines += ["", f"memory on the device: host {size(m.get('host_bytes', 0))} -> form "
                      f"{size(m.get('form_bytes', 0))}{change} (the host's weights wait in CPU memory)"]
    if step is not None and site.name in step.dropped:
        lines += [""] + wrap(f"the step check dropped this site's binding: {step.describe()}")
    if routed or fallbacks:
        lines += ["", f"since attach: {routed} call(s) served by the form, {fallbacks} sent to the host by the guard"]
    return lines


def size(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1: `1.5 MiB`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _shape_facts(s: ShapeRecord) -> list[tuple[str, str]]:
    layout = (s.key or {}).get("layout")
    facts = [("calls", f"{s.calls} in the calibration" + (f"; q, k in the host's layout {LAYOUTS.get(layout, layout)}"
                                                          if layout else ""))]
    if s.speedup is not None:
        interval = f", interval {s.spread[0]:.3f}-{s.spread[1]:.3f}x" if s.spread else ""
        rounds = f" over {s.rounds} rounds" if s.rounds else ""
        ms = f"; host {s.host_ms:.3f} ms -> form {s.form_ms:.3f} ms" if s.host_ms is not None and s.form_ms else ""
        facts.append(("speed", f"{s.speedup:.3f}x{interval}{rounds}{ms}"))
    if s.cosine is not None:
        facts.append(("accuracy", f"cos={s.cosine:.6f} err={s.max_rel_err or 0.0:.2e}"))
    basis = {Basis.DECIDED: "decided by this attach", Basis.REUSED: "reused from a receipt",
             Basis.REDECIDED: "re-decided here: the receipt given could not serve"}[s.basis]
    facts.append(("basis", basis + (f" ({s.basis_reason})" if s.basis_reason else "")))
    if s.reason:
        facts.append(("reason", s.reason))
    return facts


def _shared(shapes: Sequence[tuple[SiteRecord, ShapeRecord]], field: str) -> str | None:
    """The key's `field` (a dtype, a layout) when every shape has it and it is the same for all, else None."""
    values = {(s.key or {}).get(field) for _, s in shapes}
    return values.pop() if len(values) == 1 and None not in values else None


def _shape(s: ShapeRecord, dtype: str | None, label_layout: bool) -> str:
    """The shape cell: without the dtype the header names (where the shape's text holds it: a receipt's key and
    text may disagree); with the layout where the header cannot name one."""
    words = s.shape.split(" ")
    if dtype in words:
        words.remove(dtype)
    layout = (s.key or {}).get("layout") if label_layout else None
    return " ".join(([LAYOUTS.get(layout, layout)] if layout else []) + words)


def _note(s: ShapeRecord, receipt_source: str | None) -> str:
    """The row's note: its reason less what the row shows; the receipt named by its file, as the footer names it."""
    text = receipts.note(s.reason)
    if s.basis is Basis.REDECIDED and s.basis_reason:
        text = f"re-decided: {s.basis_reason}" + (f"; {text}" if text else "")
    return text.replace(receipt_source, Path(receipt_source).name) if receipt_source else text


def _widths(rows: Sequence[Sequence[str]]) -> list[int]:
    return [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]


def _site_cut(names: Sequence[str]) -> Callable[[str, int], str]:
    """How site names are cut to a width: from the left, an ellipsis in place of what is cut; where the names do
    not all start alike (a pipeline's `transformer.` and `transformer_2.`), the first part is kept before it."""
    keep_head = len({n.split(".", 1)[0] for n in names}) > 1

    def cut(name: str, width: int) -> str:
        if len(name) <= width:
            return name
        head = name.split(".", 1)[0] if keep_head else ""
        head = head if len(head) <= width // 2 else ""
        return head + CUT + name[len(name) - (width - len(head) - len(CUT)):]
    return cut


def _fit(rows: list[list[str]]) -> tuple[list[list[str]], bool]:
    """The rows with the `SHRINK` columns cut until a row fits `WIDTH` (site names never so far that two read the
    same); whether any cell was cut."""
    names = [r[0] for r in rows[1:]]
    cut_site = _site_cut(names)
    widths = dict(zip(HEADER, _widths(rows)))
    for column, least in SHRINK:
        over = sum(widths.values()) + 2 * (len(widths) - 1) - WIDTH
        if over <= 0:
            break
        if column == "site":
            while least < widths["site"] and len({cut_site(n, least) for n in names}) < len(set(names)):
                least += 1
        widths[column] = max(least, widths[column] - over)
    over = sum(widths.values()) + 2 * (len(widths) - 1) - WIDTH
    widths["site"] -= max(0, min(over, widths["site"] - len(CUT) - 1))
    index = {name: i for i, name in enumerate(HEADER)}
    out = [list(r) for r in rows]
    for r in out[1:]:
        for column, _ in SHRINK:
            i, width = index[column], widths[column]
            if column == "site":
                r[i] = cut_site(r[i], width)
            elif len(r[i]) > width:
                r[i] = r[i][:width - len(CUT)] + CUT
    return out, out != rows
