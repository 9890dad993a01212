"""Property tests of the mask classifier: generated structures are recognised with the right details,
and every description rebuilds exactly the mask it came from."""

from __future__ import annotations


import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flash_catalog.capture import masks
from flash_catalog.capture.masks import (
    ALL_PASS, ARBITRARY, BLOCK_DIAGONAL, CAUSAL, KEY_PADDING, NONE, SLIDING_WINDOW,
    MaskCache, MaskInfo, classify_mask, describe_mask,
)

SETTINGS = settings(max_examples=40, deadline=None)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
BLOCKED = ("-inf", "min", "-1e4")


# -- builders -----------------------------------------------------------------------------------------

def groups_mask(sizes: list[int], rule: str = "none", covariate: list[bool] | None = None) -> torch.Tensor:
    """(S, S) bool block-diagonal mask of the given group sizes, with an in-group rule."""
    gid = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    m = gid[:, None] == gid[None, :]
    if rule == "causal":
        m &= torch.ones_like(m).tril()
    elif rule == "covariate_target":
        cov = torch.tensor(covariate)
        m &= ~(cov[:, None] & ~cov[None, :])  # covariate rows do not see target columns
    return m


def offsets_of(sizes: list[int]) -> tuple[int, ...]:
    return tuple(torch.tensor([0] + sizes).cumsum(0).tolist())


def additive(m: torch.Tensor, dtype: torch.dtype, blocked: str) -> torch.Tensor:
    value = {"-inf": float("-inf"), "min": torch.finfo(dtype).min, "-1e4": -1e4}[blocked]
    return torch.zeros(m.shape, dtype=dtype).masked_fill(~m, value)


def as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask == 0


def materialize(info: MaskInfo, b: int, sq: int, skv: int) -> torch.Tensor:
    """(b, sq, skv) bool mask a description stands for: the reference semantics of MaskInfo."""
    i, j = torch.arange(sq)[:, None], torch.arange(skv)[None, :]
    if info.kind == ALL_PASS:
        return torch.ones(b, sq, skv, dtype=torch.bool)
    if info.kind == KEY_PADDING:
        return torch.tensor(info.key_valid)[:, None, :].expand(b, sq, skv)
    if info.kind == CAUSAL:
        causal = (j <= i).expand(b, sq, skv)
        return causal if info.key_valid is None else causal & torch.tensor(info.key_valid)[:, None, :]
    if info.kind == SLIDING_WINDOW:
        left, right = info.window
        return ((j >= i - left) & (j <= i + right)).expand(b, sq, skv)
    assert info.kind == BLOCK_DIAGONAL and sq == skv
    out = []
    for n, offs in enumerate(info.offsets):
        sizes = torch.tensor(offs).diff()
        gid = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
        m = gid[:, None] == gid[None, :]
        if info.group_rule == "causal":
            m &= j <= i
        elif info.group_rule == "covariate_target":
            m &= ~(torch.tensor(info.covariate_rows[n])[:, None] & torch.tensor(info.target_cols[n])[None, :])
        out.append(m)
    return torch.stack(out).expand(b, sq, skv)


def check_roundtrip(mask: torch.Tensor, info: MaskInfo) -> None:
    """The description rebuilds the broadcast mask exactly (for every head) and flags empty rows right."""
    full = as_bool(mask)
    full = full.reshape((1,) * (4 - full.dim()) + full.shape)
    b, h, sq, skv = full.shape
    if info.kind != ARBITRARY:
        assert torch.equal(materialize(info, b, sq, skv)[:, None].expand(b, h, sq, skv), full)
    assert info.empty_rows == bool((~full.any(-1)).any())


def sizes_st(max_total: int = 64) -> st.SearchStrategy[list[int]]:
    """At least two groups, one bigger than 1 (all-singleton groups are the band of width 0)."""
    return (st.lists(st.integers(1, 16), min_size=2, max_size=8)
            .filter(lambda s: sum(s) <= max_total and max(s) >= 2))


form_st = st.one_of(st.just(None), st.tuples(st.sampled_from(FLOATS), st.sampled_from(BLOCKED)))


def in_form(m: torch.Tensor, form: tuple[torch.dtype, str] | None) -> torch.Tensor:
    return m if form is None else additive(m, *form)


# -- kinds ------------------------------------------------------------------------------------------

def test_none_and_all_pass() -> None:
    assert classify_mask(None) == NONE and describe_mask(None) == MaskInfo(NONE)
    assert describe_mask(torch.ones(5, 7, dtype=torch.bool)) == MaskInfo(ALL_PASS)
    assert describe_mask(torch.zeros(2, 3, 5, 5)) == MaskInfo(ALL_PASS)


@SETTINGS
@given(sizes=sizes_st(), rule=st.sampled_from(["none", "causal"]), form=form_st)
def test_block_diagonal(sizes: list[int], rule: str, form) -> None:
    mask = in_form(groups_mask(sizes, rule), form)
    info = describe_mask(mask)
    assert info.kind == BLOCK_DIAGONAL
    assert info.offsets == (offsets_of(sizes),)
    assert info.group_rule == rule
    assert not info.empty_rows
    check_roundtrip(mask, info)


@SETTINGS
@given(data=st.data(), sizes=sizes_st(), form=form_st)
def test_block_diagonal_covariate_target(data: st.DataObject, sizes: list[int], form) -> None:
    s = sum(sizes)
    cov = data.draw(st.lists(st.booleans(), min_size=s, max_size=s))
    m = groups_mask(sizes, "covariate_target", cov)
    info = describe_mask(in_form(m, form))
    assert info.kind == BLOCK_DIAGONAL and info.offsets == (offsets_of(sizes),)
    # Canonical flags: covariate rows / target columns of the groups that hold both.
    gid = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    c = torch.tensor(cov)
    mixed = torch.tensor([bool(c[gid == g].any() and (~c[gid == g]).any()) for g in range(len(sizes))])[gid]
    if torch.equal(m, groups_mask(sizes)):
        assert info.group_rule == "none"
    elif torch.equal(m, groups_mask(sizes, "causal")):
        assert info.group_rule == "causal"  # e.g. (covariate, target) pairs: causal wins
    else:
        assert info.group_rule == "covariate_target"
        assert info.covariate_rows == (tuple((c & mixed).tolist()),)
        assert info.target_cols == (tuple((~c & mixed).tolist()),)
    check_roundtrip(m, info)


@SETTINGS
@given(data=st.data(), b=st.integers(2, 4), s=st.integers(4, 48))
def test_block_diagonal_per_batch_offsets(data: st.DataObject, b: int, s: int) -> None:
    rows, offsets = [], []
    for _ in range(b):
        cuts = sorted(data.draw(st.sets(st.integers(1, s - 1), min_size=1, max_size=s - 2)))
        offs = (0, *cuts, s)
        sizes = torch.tensor(offs).diff().tolist()
        assume(max(sizes) >= 2)
        rows.append(groups_mask(sizes))
        offsets.append(offs)
    assume(len(set(offsets)) > 1)
    mask = torch.stack(rows)[:, None]  # (B, 1, S, S)
    info = describe_mask(mask)
    assert info.kind == BLOCK_DIAGONAL and info.offsets == tuple(offsets) and info.group_rule == "none"
    check_roundtrip(mask, info)


@SETTINGS
@given(data=st.data(), b=st.integers(1, 4), s=st.integers(2, 64), form=form_st)
def test_key_padding_prefix(data: st.DataObject, b: int, s: int, form) -> None:
    lengths = data.draw(st.lists(st.integers(1, s), min_size=b, max_size=b))
    assume(min(lengths) < s)
    valid = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]  # (B, S)
    mask = in_form(valid[:, None, None, :], form)  # (B, 1, 1, S), the HF padding shape
    info = describe_mask(mask)
    assert info.kind == KEY_PADDING
    if len(set(lengths)) == 1:
        lengths = lengths[:1]  # one shared entry
    assert info.key_lengths == tuple(lengths)
    assert info.key_valid == tuple(tuple(r) for r in valid[: len(lengths)].tolist())
    assert not info.empty_rows
    # The same padding spelled out over the query rows and broadcast over heads.
    full = in_form(valid[:, None, None, :].expand(b, 1, 7, s).contiguous(), form)
    assert describe_mask(full) == info
    check_roundtrip(mask, info)


@SETTINGS
@given(data=st.data(), s=st.integers(2, 64))
def test_key_padding_not_prefix(data: st.DataObject, s: int) -> None:
    valid = torch.tensor(data.draw(st.lists(st.booleans(), min_size=s, max_size=s)))
    assume(not valid.all() and bool((valid[1:] & ~valid[:-1]).any()))  # some hole before a valid key
    mask = valid.expand(s, s)
    info = describe_mask(mask)
    assert info.kind == KEY_PADDING and info.key_lengths is None
    assert info.key_valid == (tuple(valid.tolist()),)
    check_roundtrip(mask, info)


@SETTINGS
@given(sq=st.integers(2, 64), skv=st.integers(2, 64), form=form_st)
def test_causal(sq: int, skv: int, form) -> None:
    m = torch.ones(sq, skv, dtype=torch.bool).tril()  # SDPA is_causal: top-left aligned
    mask = in_form(m, form)
    info = describe_mask(mask)
    assert info == MaskInfo(CAUSAL, empty_rows=False)
    check_roundtrip(mask, info)


@SETTINGS
@given(s=st.integers(3, 64), w=st.integers(0, 70), causal=st.booleans(), form=form_st)
def test_sliding_window(s: int, w: int, causal: bool, form) -> None:
    d = torch.arange(s)[:, None] - torch.arange(s)[None, :]
    m = ((d >= 0) & (d <= w)) if causal else (d.abs() <= w)
    mask = in_form(m, form)
    info = describe_mask(mask)
    if w >= s - 1:
        assert info.kind == (CAUSAL if causal else ALL_PASS)
    else:
        assert info.kind == SLIDING_WINDOW
        assert info.window == ((w, 0) if causal else (w, w))
    check_roundtrip(mask, info)


@SETTINGS
@given(sq=st.integers(1, 32), skv=st.integers(1, 32), data=st.data(), dtype=st.sampled_from(FLOATS))
def test_real_bias_is_arbitrary(sq: int, skv: int, data: st.DataObject, dtype: torch.dtype) -> None:
    seed = data.draw(st.integers(0, 2**31 - 1))
    bias = (torch.rand(sq, skv, generator=torch.Generator().manual_seed(seed)) * 8 - 4).to(dtype)
    assume(bool(((bias != 0) & (bias > -1e4)).any()))
    assert describe_mask(bias) == MaskInfo(ARBITRARY, empty_rows=False)
    # One real value in an otherwise structured additive mask is a bias too.
    causal = additive(torch.ones(sq, skv, dtype=torch.bool).tril(), dtype, "-inf")
    i, j = data.draw(st.integers(0, sq - 1)), data.draw(st.integers(0, skv - 1))
    causal[i, j] = -0.5
    assert classify_mask(causal) == ARBITRARY


@SETTINGS
@given(data=st.data(), s=st.integers(2, 48), kind=st.sampled_from(["causal", "groups", "random"]))
def test_empty_rows(data: st.DataObject, s: int, kind: str) -> None:
    if kind == "causal":
        m = torch.ones(s, s, dtype=torch.bool).tril()
    elif kind == "groups":
        m = groups_mask([s // 2, s - s // 2])
    else:
        m = torch.tensor(data.draw(st.lists(st.booleans(), min_size=s * s, max_size=s * s))).view(s, s)
    rows = data.draw(st.sets(st.integers(0, s - 1), min_size=1, max_size=s))
    m[sorted(rows)] = False
    for mask in (m, additive(m, torch.float32, "-inf")):
        info = describe_mask(mask)
        assert info.empty_rows
        check_roundtrip(mask, info)


def test_empty_rows_in_structured_kinds() -> None:
    pad = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    pad[1] = False  # a batch row with no valid key
    assert describe_mask(pad) == MaskInfo(KEY_PADDING, empty_rows=True, key_valid=((True,) * 6, (False,) * 6),
                                          key_lengths=(6, 0))
    band = torch.ones(8, 4, dtype=torch.bool).tril()  # Sq > Skv causal: no empty row
    assert describe_mask(band).kind == CAUSAL and not describe_mask(band).empty_rows
    d = torch.arange(8)[:, None] - torch.arange(4)[None, :]
    window = (d >= 0) & (d <= 1)  # rows 5.. see nothing
    info = describe_mask(window)
    assert info.kind == SLIDING_WINDOW and info.window == (1, 0) and info.empty_rows
    check_roundtrip(window, info)


@SETTINGS
@given(data=st.data(), sizes=sizes_st(48), base=st.sampled_from(["groups", "causal_groups", "causal", "band"]),
       flips=st.integers(0, 3))
def test_any_description_is_exact(data: st.DataObject, sizes: list[int], base: str, flips: int) -> None:
    """Soundness: perturbed structures are classified as whatever they are, never as what they are not."""
    s = sum(sizes)
    d = torch.arange(s)[:, None] - torch.arange(s)[None, :]
    m = {"groups": groups_mask(sizes), "causal_groups": groups_mask(sizes, "causal"),
         "causal": d >= 0, "band": d.abs() <= sizes[0]}[base].clone()
    for _ in range(flips):
        i, j = data.draw(st.integers(0, s - 1)), data.draw(st.integers(0, s - 1))
        m[i, j] = ~m[i, j]
    check_roundtrip(m, describe_mask(m))


# -- shapes -----------------------------------------------------------------------------------------

@SETTINGS
@given(sizes=sizes_st(), b=st.integers(1, 3), h=st.integers(1, 4), rule=st.sampled_from(["none", "causal"]))
def test_broadcast_shapes(sizes: list[int], b: int, h: int, rule: str) -> None:
    m = groups_mask(sizes, rule)
    want = describe_mask(m)
    assert want.kind == BLOCK_DIAGONAL
    for mask in (m[None], m[None, None], m.expand(b, h, *m.shape), m.repeat(b, h, 1, 1)):
        assert describe_mask(mask) == want
        check_roundtrip(mask, want)


def test_heads_or_batches_that_differ_are_arbitrary() -> None:
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    other = torch.ones(6, 6, dtype=torch.bool)
    other[:, 4:] = False
    assert classify_mask(torch.stack([causal, other])[None]) == ARBITRARY  # heads differ
    assert classify_mask(torch.stack([causal, other])[:, None]) == ARBITRARY  # batches differ in kind
    pad = torch.ones(1, 2, 1, 6, dtype=torch.bool)
    pad[0, 1, 0, 5] = False
    assert classify_mask(pad) == ARBITRARY  # key padding that differs per head
    g = groups_mask([3, 3])
    assert classify_mask(torch.stack([g, groups_mask([3, 3], "causal")])[:, None]) == ARBITRARY


def test_other_dtypes_and_ranks() -> None:
    assert classify_mask(torch.ones(4, 4, dtype=torch.int64)) == ARBITRARY
    assert classify_mask(torch.ones(6, dtype=torch.bool)) == ALL_PASS
    assert describe_mask(torch.tensor([True, True, False])).key_lengths == (2,)
    assert classify_mask(torch.ones(1, 1, 1, 4, 4, dtype=torch.bool).tril()) == CAUSAL
    assert classify_mask(torch.ones(2, 1, 1, 4, 4, dtype=torch.bool).tril()) == ARBITRARY


# -- cache and cost ---------------------------------------------------------------------------------

def test_cache_reuses_and_notices_in_place_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = masks.describe_mask
    monkeypatch.setattr(masks, "describe_mask", lambda m: calls.append(1) or real(m))
    cache = MaskCache()
    mask = torch.ones(8, 8, dtype=torch.bool)
    first = cache.describe(mask)
    assert first.kind == ALL_PASS and cache.classify(mask) == ALL_PASS
    assert cache.describe(mask) is first and len(calls) == 1
    mask.tril_()  # in place: _version bumps
    assert cache.classify(mask) == CAUSAL and len(calls) == 2
    assert cache.classify(mask) == CAUSAL and len(calls) == 2
    other = torch.ones(8, 8, dtype=torch.bool).tril()
    assert cache.classify(other) == CAUSAL and len(calls) == 3  # equal content, other tensor
    cache.clear()
    assert cache.classify(mask) == CAUSAL and len(calls) == 4
    assert cache.classify(None) == NONE and cache.describe(None).kind == NONE


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _large(kind: str, s: int) -> torch.Tensor:
    i = torch.arange(s)
    gid = i // 128
    return {
        "causal": i[None, :] <= i[:, None],
        "groups": gid[:, None] == gid[None, :],
        "covariate": (gid[:, None] == gid[None, :]) & ~((i % 128 >= 100)[:, None] & (i % 128 < 100)[None, :]),
        "additive": additive(i[None, :] <= i[:, None], torch.float32, "-inf"),
    }[kind]


@pytest.mark.parametrize("kind", ["causal", "groups", "covariate", "additive"])
def test_large_mask_is_classified_by_a_fixed_number_of_vectorised_passes(kind: str) -> None:
    """Classification costs a handful of whole-tensor ops, however long the sequence (no Python loop over rows or
    groups): the count of torch ops is the same at 2176 and at 4352 positions. (A count, not a wall-clock time:
    timed unit tests flake on loaded machines.)"""
    counts = []
    describe_mask(_large(kind, 256))  # once before counting: per-dtype constants are read on a first call only
    for s in (2176, 4352):
        m = _large(kind, s)
        with _CountOps() as counter:
            info = describe_mask(m)
        assert info.kind in (CAUSAL, BLOCK_DIAGONAL)
        counts.append(counter.ops)
    assert counts[0] == counts[1] and counts[0] < 200, counts


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 40), st.lists(st.integers(0, 40), min_size=1, max_size=3), st.booleans())
def test_causal_with_padding(s, pads, left):
    """A decoder's mask: the causal triangle AND each batch row's valid keys."""
    valid = torch.ones(len(pads), s, dtype=torch.bool)
    for b, p in enumerate(pads):
        p = min(p, s - 1)
        if left:
            valid[b, :p] = False
        else:
            valid[b, s - p:] = False if p else True
    if bool(valid.all()):
        valid[0, -1] = False
    mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    assume(not bool((mask == mask[:, :, :1]).all()))  # every row alike: that is key padding, checked elsewhere
    info = describe_mask(mask)
    assert info.kind == "causal"
    rows = info.key_valid if len(info.key_valid) == len(pads) else info.key_valid * len(pads)
    assert torch.equal(torch.tensor(rows), valid)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["bool_groups", "bool_broadcast", "additive_pure", "additive_bias", "all_pass",
                                  "all_pass_blocked", "nan", "strided"])
def test_mask_match_kernel_agrees_with_the_torch_check(case):
    """The one-pass Triton check (CUDA's path) gives the torch path's verdict, for matching and broken masks."""
    from flash_catalog.kernels.mask_match import mask_matches
    from flash_catalog.capture.mask_check import MaskCheck
    from flash_catalog.capture.masks import blocked_at, describe_mask

    gid = torch.arange(48) // 8
    groups = gid[:, None] == gid[None, :]
    if case == "bool_groups":
        seen, other = groups, groups.clone()
        other[3, 20] = True
    elif case == "bool_broadcast":
        seen = groups.expand(2, 3, 48, 48)
        other = seen.clone()
        other[1, 2, 5, 40] = True
    elif case in ("additive_pure", "additive_bias", "nan"):
        seen = torch.zeros(48, 48).masked_fill(~groups, float("-inf"))
        other = seen.clone()
        other[0, 40] = {"additive_pure": -1e9, "additive_bias": -0.5, "nan": float("nan")}[case]  # a blocked key
    elif case in ("all_pass", "all_pass_blocked"):
        seen = torch.zeros(2, 1, 1, 48, dtype=torch.bfloat16)
        other = seen.clone()
        if case == "all_pass_blocked":
            other[1, 0, 0, 7] = -1e4
    else:
        seen = groups.t().contiguous().t()  # column-major storage
        other = seen.clone()
        other[10, 2] = True
    check = MaskCheck.of(seen, describe_mask(seen))
    for mask in (seen, other):
        blocked = blocked_at(mask.dtype) if mask.dtype != torch.bool else 0.0
        assert bool(mask_matches(mask, check.expected, blocked)) == bool(check.passes(mask)), (case, mask is seen)
    assert bool(check.passes(seen))
    assert bool(check.passes(other)) == (case in ("additive_pure", "all_pass"))  # still blocked / unchanged


def test_a_verified_mask_is_read_again_whenever_it_may_have_changed(mask_reads):
    """`MaskCheck.verdict` skips the read only for a mask it verified that is provably unchanged: the same tensor
    object (or a view of the same base, same geometry) at the same version and data pointer. A write, an in-place
    change of geometry, `.data` or `set_` swapping its memory all make it read the mask again."""
    from flash_catalog.capture.mask_check import MaskCheck
    from flash_catalog.capture.masks import describe_mask

    reads = mask_reads
    gid = torch.arange(32) // 8
    mask = (gid[:, None] == gid[None, :]).unsqueeze(0)
    check = MaskCheck.of(mask, describe_mask(mask))
    other = mask.clone()
    other[0, 3, 20] = True

    def verdict(m):
        before = reads[0]
        ok = check.verdict(m)
        return ok, reads[0] - before

    assert verdict(mask) == (True, 1)
    assert verdict(mask) == (True, 0)  # the same object, unwritten
    assert verdict(mask.view(1, 32, 32)) == (True, 0)  # another view of the same base, same geometry
    mask.data = other.clone()  # new memory behind the same object: no version bump, another data pointer
    assert verdict(mask) == (False, 1)
    mask.data = (gid[:, None] == gid[None, :]).unsqueeze(0)
    assert verdict(mask) == (True, 1)
    mask.set_(other.clone())  # in place, same shape, another structure
    assert verdict(mask) == (False, 1)
    mask.set_((gid[:, None] == gid[None, :]).unsqueeze(0))
    assert verdict(mask) == (True, 1)
    mask.transpose_(1, 2)  # in-place geometry change (symmetric here: still passes, but read again)
    assert verdict(mask) == (True, 1)
    mask[0, 3, 20] = True
    assert verdict(mask) == (False, 1)
    assert verdict(mask) == (False, 1)  # a failed check is never remembered
