"""Decisions agreed across the ranks of a context-parallel model.

Under diffusers' context parallelism every rank runs the same model on its share of the sequence, and attach runs on
every rank. Each rank measures accuracy and speed on its own inputs; before anything depends on them, the figures are
combined over the ranks (the worst cosine, the worst relative error, per round the geometric mean of the speed
ratios, a form's variant timings by the slowest rank), so every rank reaches the same verdict from the same numbers:
identical plans by construction. A single process uses `LOCAL`, which combines nothing.

Collectives run in the order decisions are taken, which is the same on every rank (the same model, the same
calibration call); each carries the name of its step, so ranks that reach different steps (a form that ran
differently on them) stop together with `RanksOutOfStep` instead of mixing each other's values or waiting alone;
`check` compares the finished decisions and fails the attach on every rank if they differ.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..plan import receipts
from ..plan.records import ParallelRecord, SiteRecord
from .gate import Accuracy, Timing, pseudo_median, signed_rank_interval



class RanksOutOfStep(BaseException):
    """The ranks reached different agreement steps at one collective. Every rank raises it at that collective, from
    the same gathered values. It derives from BaseException so that no form's or gate's `except Exception` takes it
    for a failure of its own and carries on alone into another collective, where the other ranks would never come;
    `attach` restores the host and raises AttachError on every rank."""


@dataclass(frozen=True, eq=False)
class Agreement:
    """The process group decisions are agreed over (None: one process, nothing to combine)."""

    group: Any = None
    record: ParallelRecord | None = None

    @classmethod
    def of(cls, model: nn.Module) -> Agreement:
        """The agreement a model needs: over its whole context-parallel mesh (diffusers' flattened ring x Ulysses
        mesh: every rank, not one ring or Ulysses group, since a decision binds all of them) when diffusers' context
        parallelism is enabled on it or on a module in it (a pipeline's denoisers: `enable_parallelism` before
        `attach`), else `LOCAL`."""
        configs = (getattr(getattr(m, "_parallel_config", None), "context_parallel_config", None)
                   for m in model.modules())
        config = next((c for c in configs if getattr(c, "_flattened_mesh", None) is not None), None)
        if config is None:
            return LOCAL
        group = config._flattened_mesh.get_group()
        ranks = tuple(sorted(torch.distributed.get_process_group_ranks(group)))
        return cls(group, ParallelRecord(len(ranks), config.ring_degree, config.ulysses_degree, ranks))

    @property
    def parallel(self) -> bool:
        return self.group is not None

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks of the group, in the order a gather returns their values."""
        return self.record.decided_by if self.record is not None else (0,)

    def _gather(self, step: str, value: Any) -> list[Any]:
        """Every rank's value at this collective, in rank order; `step` names what is being agreed, and ranks that
        are at different steps raise RanksOutOfStep together."""
        if self.group is None:
            return [value]
        out: list[Any] = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(out, (step, value), group=self.group)
        steps = [s for s, _ in out]
        if any(s != step for s in steps):
            at = ", ".join(f"rank {rank} at {s!r}" for rank, s in zip(self.ranks, steps))
            raise RanksOutOfStep(f"the context-parallel ranks fell out of step while agreeing ({at}): a form ran "
                                 f"differently on the ranks")
        return [v for _, v in out]

    def failure(self, error: BaseException | None) -> str | None:
        """Why a step failed, in the same words on every rank: this rank's error, or the first failing rank's (named);
        None where it failed on no rank. Every rank calls it, failed or not, so that none waits alone in a later
        collective."""
        text = None if error is None else receipts.error_text(error)
        if self.group is None:
            return text
        every = self._gather("a failure", text)
        return next((f"{why} on rank {rank}" for rank, why in zip(self.ranks, every) if why is not None), None)

    def accuracy(self, accuracy: Accuracy) -> Accuracy:
        """The worst accuracy over the ranks."""
        if self.group is None:
            return accuracy
        every: list[Accuracy] = self._gather("accuracy", accuracy)
        return Accuracy(min(a.cosine for a in every), max(a.max_rel_err for a in every))

    def timing(self, timing: Timing) -> Timing:
        """One timing from every rank's: per round the geometric mean of the ratios (over the rounds every rank
        took), its Hodges-Lehmann centre and interval, the mean host time."""
        if self.group is None:
            return timing
        every: list[Timing] = self._gather("a timing", timing)
        rounds = min(t.rounds for t in every)
        logs = [statistics.fmean(math.log(t.ratios[i]) for t in every) for i in range(rounds)]
        low, high = signed_rank_interval(logs)
        speedup = math.exp(pseudo_median(logs))
        host_ms = statistics.fmean(t.host_ms for t in every)
        return Timing(tuple(math.exp(x) for x in logs), speedup, host_ms, host_ms / speedup, math.exp(low),
                      math.exp(high), every[0].threads, every[0].load_1m)

    def slowest(self, seconds: float) -> float:
        """A form's timing of one of its own variants, as the slowest rank measured it (inf: failed there), so
        that every rank picks the same variant."""
        return seconds if self.group is None else max(self._gather("a variant's seconds", seconds))

    def check(self, records: Sequence[SiteRecord]) -> None:
        """Raise on every rank unless every rank decided the same (its sites' outcomes, forms and figures), naming
        the first site where they differ. One process: nothing to compare, nothing serialised."""
        if self.group is None:
            return
        digests = [hashlib.sha256(json.dumps(r.to_dict(), sort_keys=True, default=str).encode()).hexdigest()
                   for r in records]
        every = self._gather("the plan", digests)
        if all(d == every[0] for d in every):
            return
        differ = [rank for rank, d in zip(self.ranks, every) if d != every[0]]
        first = next((i for i in range(max(map(len, every)))
                      if len({tuple(d[i:i + 1]) for d in every}) > 1), 0)
        site = records[first].name if first < len(records) else "(a site only some ranks have)"
        raise RuntimeError(f"ranks decided differently (ranks {differ} differ from rank {self.ranks[0]}, first at "
                           f"{site}); the plans were not bound")


LOCAL = Agreement()
