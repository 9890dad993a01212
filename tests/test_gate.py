"""The paired timer: settled blocks, so one side's lingering state is not charged to the other."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from flash_catalog.gate import SETTLE_S, paired_speedup, repeats, settle_calls

CPU = torch.device("cpu")


def test_settle_calls_fill_the_settle_time():
    assert settle_calls(0.0, 0.015) == 0
    assert settle_calls(0.1, 0.015) == 7  # ceil(0.1 / 0.015)
    assert settle_calls(0.1, 0.5) == 1  # a call longer than the settle time still runs once
    assert settle_calls(0.1, 0.0) == 10_000  # capped
    assert SETTLE_S["cpu"] == 0.0 and SETTLE_S["cuda"] > 0


def test_negative_settle_time_is_refused():
    with pytest.raises(ValueError, match="settle_s=-1"):
        paired_speedup(lambda: None, lambda: None, CPU, settle_s=-1)


def _runs(calls: list[str]) -> list[int]:
    return [len(list(group)) for _, group in itertools.groupby(calls)]


def test_each_timed_block_follows_an_untimed_run_of_the_same_side():
    calls: list[str] = []

    def host():
        calls.append("host")
        time.sleep(1e-3)

    def form():
        calls.append("form")
        time.sleep(1e-3)

    paired_speedup(host, form, CPU, rounds=4, warmup=1, min_round_s=0.0, settle_s=0.01)
    timed = calls[4:]  # after the warm-up pair and the two one-call estimates
    # rounds alternate order (host, form), (form, host), ...; each run of one side is at least one settled
    # block: settle (>= 1 call of ~1 ms for 10 ms, more unless sleeps overshoot a lot) + 1 timed call
    assert [side for side, _ in itertools.groupby(timed)] == ["host", "form", "host", "form", "host"]
    assert all(n >= 3 for n in _runs(timed)), _runs(timed)


def test_without_settling_the_sides_alternate_call_by_call():
    calls: list[str] = []
    paired_speedup(lambda: calls.append("host"), lambda: calls.append("form"), CPU, rounds=4, warmup=1,
                   min_round_s=0.0, settle_s=0.0)
    assert calls[4:] == ["host", "form", "form", "host", "host", "form", "form", "host"]


def test_settling_times_the_form_in_its_own_steady_state():
    """A form that is slow only on the first call after the host (like a clock still lowered by the host's
    power draw) is measured slow by call-by-call alternation and at its steady speed once settled."""
    last = {"side": None}

    def host():
        last["side"] = "host"
        time.sleep(4e-3)

    def form():
        penalty = last["side"] == "host"
        last["side"] = "form"
        time.sleep(12e-3 if penalty else 1e-3)

    alternating = paired_speedup(host, form, CPU, rounds=3, warmup=1, min_round_s=0.0, settle_s=0.0)
    settled = paired_speedup(host, form, CPU, rounds=3, warmup=1, min_round_s=0.0, settle_s=0.02)
    assert alternating.speedup < 0.6, alternating
    assert settled.speedup > 2.0, settled


def test_each_side_repeats_only_as_often_as_its_own_duration_needs():
    assert repeats(2e-3, 1e-4) == 20 and repeats(2e-3, 0.5) == 1 and repeats(2e-3, 0.0) == 1000
    calls = {"host": 0, "form": 0}

    def host():
        calls["host"] += 1

    def form():
        calls["form"] += 1
        time.sleep(5e-3)  # slower than min_round_s: one call per sample, however fast the host is

    paired_speedup(host, form, CPU, rounds=3, warmup=1, min_round_s=2e-3, settle_s=0.0)
    assert calls["form"] == 1 + 1 + 3  # warm-up, the one-call estimate, one per round
    assert calls["host"] > 3 + 2  # the fast host is repeated within each sample
