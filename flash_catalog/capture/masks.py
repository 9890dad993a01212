"""Mask classification: which structure a captured attention mask has.

A mask is a bool tensor (True = attend, the torch SDPA convention) or an additive float tensor
(0 = attend, <= BLOCKED_AT or -inf = blocked; any other value is a real bias, so "arbitrary"),
of any shape broadcastable to (B, H, Sq, Skv). Kinds, tested in this order:

- none: no mask.
- all_pass: nothing is blocked (safe to drop the mask).
- key_padding: within a batch row every query row sees the same key-validity vector (per batch row;
  the heads must agree). The valid keys need not be a prefix.
- causal: top-left aligned lower triangle, key j allowed for query i iff j <= i (SDPA's is_causal);
  with `key_valid` set, also only the valid keys of each batch row (a decoder with padding).
- sliding_window: top-left band, key j allowed for query i iff i - left <= j <= i + right
  (left, right >= 0; right == 0 is a causal window, left == right a symmetric one).
- block_diagonal: square, the sequence cut into contiguous groups (flash-attn cu_seqlens style offsets,
  per batch row) that only see themselves; inside a group either everything ("none"), the causal
  triangle ("causal") or everything except that flagged covariate rows do not see flagged target
  columns ("covariate_target", TiRex-2 style).
- arbitrary: anything else, including (batch, head) slices that differ where the kind does not allow it.

Every classification is a handful of vectorised passes over the (de-broadcast) mask.
Results are cached per mask tensor (identity and in-place version), so a reused mask is read once.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

NONE = "none"
ALL_PASS = "all_pass"
KEY_PADDING = "key_padding"
BLOCK_DIAGONAL = "block_diagonal"
CAUSAL = "causal"
SLIDING_WINDOW = "sliding_window"
ARBITRARY = "arbitrary"

# In-group rules of a block_diagonal mask.
RULE_NONE = "none"
RULE_CAUSAL = "causal"
RULE_COVARIATE_TARGET = "covariate_target"

BLOCKED_AT = -1e4
"""Additive values at or below this (rounded to the mask's dtype; -inf too) count as blocked; 0 attends;
anything else is a real bias. Swin-style -100 masks are therefore biases ("arbitrary")."""

Flags = tuple[tuple[bool, ...], ...]


@dataclass(frozen=True)
class MaskInfo:
    """What a mask is. Per-batch fields hold one entry per batch row, or one entry shared by all rows.

    kind: one of the kind strings above.
    empty_rows: some query row sees no key (host kernels disagree there: NaN, uniform average, zeros).
    key_valid: key_padding, or causal with padding: per batch row, which keys are valid.
    key_lengths: key_padding, when every key_valid is a prefix: the number of valid keys per batch row.
    window: sliding_window: (left, right); key j is allowed for query i iff i - left <= j <= i + right.
    offsets: block_diagonal: per batch row, group boundaries (0, end of group 0, ..., S).
    group_rule: block_diagonal: "none", "causal" or "covariate_target".
    covariate_rows, target_cols: covariate_target: per batch row and position, query rows flagged in
        covariate_rows do not see key columns flagged in target_cols of their own group, i.e.
        mask_mod(b, h, q, k) = same_group(q, k) and not (covariate_rows[b][q] and target_cols[b][k]).
    """

    kind: str
    empty_rows: bool = False
    key_valid: Flags | None = None
    key_lengths: tuple[int, ...] | None = None
    window: tuple[int, int] | None = None
    offsets: tuple[tuple[int, ...], ...] | None = None
    group_rule: str | None = None
    covariate_rows: Flags | None = None
    target_cols: Flags | None = None


_NONE_INFO = MaskInfo(NONE)


class MaskCache:
    """Per-tensor cache of descriptions; weak references keep a freed tensor's id from being reused."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[torch.Tensor], int, MaskInfo]] = {}

    def describe(self, mask: torch.Tensor | None) -> MaskInfo:
        """describe_mask(mask), read once per tensor and in-place version."""
        if mask is None:
            return _NONE_INFO
        key = id(mask)
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is mask and hit[1] == mask._version:
            return hit[2]
        info = describe_mask(mask)
        if len(self._entries) > 256:
            self._entries = {k: v for k, v in self._entries.items() if v[0]() is not None}
        self._entries[key] = (weakref.ref(mask), mask._version, info)
        return info

    def classify(self, mask: torch.Tensor | None) -> str:
        """The kind string of describe(mask)."""
        return self.describe(mask).kind

    def clear(self) -> None:
        self._entries.clear()


def classify_mask(mask: torch.Tensor | None) -> str:
    """The kind string of one mask."""
    return describe_mask(mask).kind


def describe_mask(mask: torch.Tensor | None) -> MaskInfo:
    """Classify one mask and record its structure."""
    if mask is None:
        return _NONE_INFO
    with torch.no_grad():
        m = _as_4d(mask)
        if m is None:
            return MaskInfo(ARBITRARY, empty_rows=_empty_rows_any(mask))
        if m.dtype != torch.bool:
            allowed = m == 0
            blocked = m <= blocked_at(m.dtype)
            if not bool((allowed | blocked).all()):
                return MaskInfo(ARBITRARY, empty_rows=bool(blocked.all(-1).any()))
            m = allowed
        return _describe_bool(m)


def _empty_rows_any(mask: torch.Tensor) -> bool:
    if mask.dim() == 0:
        return False
    if mask.dtype == torch.bool:
        return bool((~mask.any(-1)).any())
    if mask.is_floating_point():
        return bool((mask <= blocked_at(mask.dtype)).all(-1).any())
    return False


@functools.cache
def blocked_at(dtype: torch.dtype) -> float:
    """BLOCKED_AT rounded to `dtype` (read once per dtype: the run-time mask check asks at every call)."""
    return float(torch.tensor(BLOCKED_AT, dtype=dtype))


def _as_4d(mask: torch.Tensor) -> torch.Tensor | None:
    """A 4-D view with broadcast (stride 0) batch, head and query dims cut to size 1; None if unsupported."""
    if mask.dtype != torch.bool and not mask.is_floating_point():
        return None
    while mask.dim() > 4 and mask.shape[0] == 1:
        mask = mask[0]
    if mask.dim() > 4:
        return None
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    for d in range(3):
        if mask.shape[d] > 1 and mask.stride(d) == 0:
            mask = mask.narrow(d, 0, 1)
    return mask


def _flags(t: torch.Tensor) -> Flags:
    return tuple(tuple(row) for row in t.tolist())


def _describe_bool(a: torch.Tensor) -> MaskInfo:
    """a: (b, h, Sq, Skv) bool, True = attend."""
    if bool(a.all()):
        return MaskInfo(ALL_PASS)
    b, h, sq, skv = a.shape
    if bool((a == a[:, :, :1, :]).all()):
        return _key_padding(a[:, :, 0, :])
    if h > 1 and not bool((a == a[:, :1]).all()):
        return MaskInfo(ARBITRARY, empty_rows=bool((~a.any(-1)).any()))
    a3 = a[:, 0]
    if b > 1 and bool((a3 == a3[:1]).all()):
        a3 = a3[:1]

    # Per query row: number of allowed keys, first and last allowed key (skv and -1 when empty).
    u = a3.view(torch.uint8)
    count, first, last = _row_stats(u, -1)
    nonempty = count > 0
    empty = not bool(nonempty.all())
    if skv == 1:  # the key dim may be a broadcast: no structure beyond key_padding can be trusted
        return MaskInfo(ARBITRARY, empty_rows=empty)
    i = torch.arange(sq, device=a.device)

    if bool((count[nonempty] == (last - first + 1)[nonempty]).all()):  # every row one interval
        info = _causal_or_window(i, count, first, last, nonempty, skv, empty)
        if info is not None:
            return info
    if sq == skv:
        info = _block_diagonal(a3, u, i, count, first, last, empty) or _causal_padding(a3, empty)
        if info is not None:
            return info
    return MaskInfo(ARBITRARY, empty_rows=empty)


def _causal_padding(a3: torch.Tensor, empty: bool) -> MaskInfo | None:
    """Square a3 (b, S, S) equal to the causal triangle AND one key-validity vector per batch row (a decoder
    with padding): kind causal, with `key_valid`. The last row sees every valid key, so it is that vector."""
    valid = a3[:, -1, :]
    s = a3.shape[-1]
    tril = torch.ones(s, s, dtype=torch.bool, device=a3.device).tril()
    if not bool((a3 == (tril & valid[:, None, :])).all()):
        return None
    prefix = not bool((valid[:, 1:] & ~valid[:, :-1]).any())
    lengths = tuple(int(n) for n in valid.sum(-1).tolist()) if prefix else None
    return MaskInfo(CAUSAL, empty_rows=empty, key_valid=_flags(valid), key_lengths=lengths)


def _row_stats(u: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Along dim (-1 or -2) of a (b, n, n') 0/1 uint8 tensor: count of ones, first and last index of a one
    (n and -1 where there is none).

    Branch-free weighted maxima (argmax is data-dependent and several times slower on CPU), one batch
    slice at a time so the 16-bit temporaries stay small enough for the allocator to reuse.
    """
    n = u.shape[dim]
    wtype = torch.int16 if n < 2**15 else torch.int32
    up = torch.arange(1, n + 1, dtype=wtype, device=u.device)
    down = n + 1 - up
    if dim == -2:
        up, down = up[:, None], down[:, None]
    stats = [(x.sum(dim, dtype=wtype), (x * down).amax(dim), (x * up).amax(dim)) for x in u.unbind(0)]
    count, first, last = (torch.stack(t).long() for t in zip(*stats))
    return count, n - first, last - 1


def _key_padding(v: torch.Tensor) -> MaskInfo:
    """v: (b, h, Skv), the one key-validity vector of each slice."""
    if v.shape[1] > 1 and not bool((v == v[:, :1]).all()):
        return MaskInfo(ARBITRARY, empty_rows=not bool(v.any(-1).all()))
    v = v[:, 0]
    if v.shape[0] > 1 and bool((v == v[:1]).all()):
        v = v[:1]
    prefix = not bool((v[:, 1:] & ~v[:, :-1]).any())
    lengths = tuple(int(n) for n in v.sum(-1).tolist()) if prefix else None
    return MaskInfo(KEY_PADDING, empty_rows=not bool(v.any(-1).all()), key_valid=_flags(v), key_lengths=lengths)


def _causal_or_window(i: torch.Tensor, count: torch.Tensor, first: torch.Tensor, last: torch.Tensor,
                      nonempty: torch.Tensor, skv: int, empty: bool) -> MaskInfo | None:
    """Rows are single intervals: causal or a band, top-left aligned."""
    if bool(((first == 0) & (count == (i + 1).clamp(max=skv))).all()):
        return MaskInfo(CAUSAL)
    if not bool(nonempty.any()):
        return None
    rows = i.expand_as(count)
    left = int((rows - first)[nonempty].max())
    right = int((last - rows)[nonempty].max())
    if left < 0 or right < 0:
        return None
    lo = (i - left).clamp(min=0)
    hi = (i + right).clamp(max=skv - 1)
    want = (hi - lo + 1).clamp(min=0)
    if bool((count == want).all()) and bool(((first == lo) | (want == 0)).all()):
        return MaskInfo(SLIDING_WINDOW, empty_rows=empty, window=(left, right))
    return None


def _block_diagonal(a3: torch.Tensor, u: torch.Tensor, i: torch.Tensor, count: torch.Tensor,
                    first: torch.Tensor, last: torch.Tensor, empty: bool) -> MaskInfo | None:
    """Square a3 (b, S, S): contiguous groups that only see themselves, with an in-group rule."""
    s = a3.shape[-1]
    # A position's group span is the hull of its row and its column (exact when, for every position,
    # its row or its column is whole within the group, true for all three rules).
    ccount, cfirst, clast = _row_stats(u, -2)
    span_lo = torch.minimum(first, cfirst)
    span_hi = torch.maximum(last, clast)
    starts = span_lo == i
    ends = span_hi == i
    if not (bool(starts[:, 0].all()) and bool(ends[:, -1].all()) and bool((ends[:, :-1] == starts[:, 1:]).all())):
        return None
    gstart = torch.where(starts, i, 0).cummax(-1).values
    gend = torch.where(ends, i, s).flip(-1).cummin(-1).values.flip(-1)
    if not (bool((span_lo == gstart).all()) and bool((span_hi == gend).all())):
        return None
    # Now every row's allowed keys and every column's allowed queries lie inside their own group.
    size = gend - gstart + 1
    covariate_rows = target_cols = None
    if bool((count == size).all()):
        rule = RULE_NONE
    elif bool(((first == gstart) & (last == i) & (count == i - gstart + 1)).all()):
        rule = RULE_CAUSAL
    else:
        rows = count < size
        cols = ccount < size
        # Cheap necessary counts first: a flagged row misses exactly its group's flagged columns, and back.
        if not (bool((count == size - rows * _per_group(cols, gstart, gend)).all())
                and bool((ccount == size - cols * _per_group(rows, gstart, gend)).all())):
            return None
        for x, g, r, c in zip(a3, gstart, rows, cols):  # per batch slice: keeps the temporaries small
            if not bool((x == ((g[:, None] == g[None, :]) & ~(r[:, None] & c[None, :]))).all()):
                return None
        rule = RULE_COVARIATE_TARGET
        covariate_rows, target_cols = _flags(rows), _flags(cols)
    offsets = tuple(tuple(row.nonzero().flatten().tolist()) + (s,) for row in starts)
    if rule == RULE_NONE and all(len(o) == 2 for o in offsets):
        return MaskInfo(ALL_PASS)
    return MaskInfo(BLOCK_DIAGONAL, empty_rows=empty, offsets=offsets, group_rule=rule,
                    covariate_rows=covariate_rows, target_cols=target_cols)


def _per_group(flags: torch.Tensor, gstart: torch.Tensor, gend: torch.Tensor) -> torch.Tensor:
    """(b, S) flags -> for each position, how many positions of its group are flagged."""
    c = torch.nn.functional.pad(flags.long().cumsum(-1), (1, 0))
    return c.gather(-1, gend + 1) - c.gather(-1, gstart)
