"""A plan as one self-contained HTML page (`flash-catalog plan receipt.json --html out.html`): a row per site and
shape with a speedup bar and an accuracy bar beside their figures, the step check, the environment and the options.
The style is inline and there are no scripts, fonts or images to fetch: the page reads the same offline."""

from __future__ import annotations

import html
import json
import math
from typing import Any

from ..decide.step import StepOutcome
from . import receipts
from .text import LAYOUTS
from .plan import Plan

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { padding: 2px 8px; text-align: left; vertical-align: top; border-bottom: 1px solid #ddd; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, td.shape { font-family: ui-monospace, monospace; font-size: 12px; }
.bar { position: relative; width: 160px; height: 12px; background: #eee; }
.bar span { position: absolute; top: 0; bottom: 0; left: 0; }
.bar i { position: absolute; top: -2px; bottom: -2px; width: 1px; background: #000; }
.accuracy span { background: #57a; }
.bound span { background: #3a7; } .declined span { background: #d93; } .refused span, .host span { background: #999; }
tr.bound td.outcome { color: #262; } tr.declined td.outcome { color: #a60; } tr.refused td.outcome { color: #a22; }
"""
BAR_MAX = 4.0
"""The speedup at a bar's right end (log scale from 1/BAR_MAX at the left, 1x in the middle, the black line)."""
NINES_MAX = 6
"""An accuracy bar is full at this many nines of cosine (0.999999) or closer to 1."""
LEGEND = (f"Speedup bars: log scale, 1x at the black line, {BAR_MAX:g}x at the right end. Accuracy bars: the "
          f"cosine's nines against the host's output, 0.99 a third, 0.{'9' * NINES_MAX} the whole bar.")


def render(plan: Plan) -> str:
    """The page: the summary lines `print(plan)` ends with, the step check, the sites, environment, options."""
    counts = ", ".join(f"{n} {o}" for o, n in plan.counts().items() if n) or "none"
    title = f"flash_catalog plan: {len(plan.sites)} sites ({counts})"
    body = [f"<h1>{_e(title)}</h1>"]
    if plan.source:
        body.append(f"<p>receipt <code>{_e(plan.source)}</code></p>")
    summary = plan.summary(with_step=False)  # the step check has a section of its own
    body.append("<ul id=\"summary\">" + "".join(f"<li>{_e(line)}</li>" for line in summary) + "</ul>")
    body += _step(plan) + _sites(plan)
    body += ["<h2>Environment</h2>", _pairs(plan.environment), "<h2>Options</h2>",
             _pairs({**plan.options.to_dict(), "adapter": plan.adapter})]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{STYLE}</style></head>\n<body>\n" + "\n".join(body)
            + "\n</body></html>\n")


def _step(plan: Plan) -> list[str]:
    """The whole example call, host vs attached: the figure, and a bar where it was measured."""
    step = plan.step
    if step is None:
        return ["<h2>Step check</h2>", "<p id=\"step\">not recorded (a receipt written before the step check)</p>"]
    bar = (_bar(step.speedup, "bound" if step.outcome in (StepOutcome.FASTER, StepOutcome.TRIMMED) else "declined")
           if step.speedup is not None else "")
    dropped = (f"<p>dropped, smallest gain first: {_e(', '.join(step.dropped))}</p>" if step.dropped else "")
    return ["<h2>Step check</h2>", f"<p id=\"step\">{_e(step.describe())}</p>", bar, dropped]


def _sites(plan: Plan) -> list[str]:
    rows = ["<h2>Sites</h2>", "<table id=\"sites\"><thead><tr><th>site</th><th>shape</th><th>outcome</th>"
            "<th>form</th><th>speedup</th><th></th><th>cosine</th><th></th><th>max rel err</th><th>note</th></tr>"
            "</thead><tbody>"]
    for site in plan.sites:
        for s in site.shapes:
            speedup = f"{s.speedup:.3f}x" if s.speedup is not None else ""
            interval = f" ({s.spread[0]:.3f}-{s.spread[1]:.3f}x)" if s.spread else ""
            layout = (s.key or {}).get("layout")
            layout = f" <small>q, k as {_e(LAYOUTS.get(layout, layout))}</small>" if layout else ""
            rows.append(
                f"<tr class=\"shape {s.outcome}\" title=\"{_e(s.reason)}\"><td>{_e(site.name)}</td>"
                f"<td class=\"shape\">{_e(s.shape)}{layout}</td><td class=\"outcome\">{s.outcome}</td>"
                f"<td>{_e(s.form or '')}</td><td class=\"num\">{speedup}{interval}</td>"
                f"<td>{_bar(s.speedup, s.outcome) if s.speedup is not None else ''}</td>"
                f"<td class=\"num\">{f'{s.cosine:.6f}' if s.cosine is not None else ''}</td>"
                f"<td>{_accuracy_bar(s.cosine) if s.cosine is not None else ''}</td>"
                f"<td class=\"num\">{f'{s.max_rel_err:.2e}' if s.max_rel_err is not None else ''}</td>"
                f"<td>{_e(receipts.note(s.reason))}</td></tr>")
    rows += ["</tbody></table>", f"<p id=\"legend\">{_e(LEGEND)}</p>"]
    return rows


def _bar(speedup: float, outcome: str) -> str:
    """A speedup as a bar on a log scale: 1x (the black line) in the middle, `BAR_MAX` at the right end."""
    share = 0.5 + math.log(max(speedup, 1e-9)) / (2 * math.log(BAR_MAX))
    return (f"<div class=\"bar {outcome}\" title=\"{speedup:.3f}x\"><span style=\"width: "
            f"{100 * min(max(share, 0.0), 1.0):.1f}%\"></span><i style=\"left: 50%\"></i></div>")


def _accuracy_bar(cosine: float) -> str:
    """A cosine as a bar of its nines, -log10(1 - cos): 0.99 fills a third of it, `NINES_MAX` nines the whole."""
    nines = -math.log10(max(1.0 - cosine, 10.0 ** -NINES_MAX))
    return (f"<div class=\"bar accuracy\" title=\"cos={cosine:.6f}\"><span style=\"width: "
            f"{100 * min(max(nines / NINES_MAX, 0.0), 1.0):.1f}%\"></span></div>")


def _pairs(values: dict[str, Any]) -> str:
    rows = "".join(f"<tr><th>{_e(k)}</th><td><code>{_e(_value(v))}</code></td></tr>" for k, v in values.items())
    return f"<table>{rows}</table>"


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _e(text: str) -> str:
    return html.escape(text, quote=True)
