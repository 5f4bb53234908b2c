"""TETRIS's goodput budget: how many draft tokens to verify, and how deep to draft.

TETRIS ranks every drafted token of the batch by its estimated probability of acceptance: the
``exp`` of its cumulative log-score, the chance that the target accepts the whole prefix (or
tree path) up to it. Verifying the ``C`` best tokens accepts ``E(C)``, the sum of their
probabilities, in expectation, and every active row emits one more token (the target's own).
A fixed budget (``C = k * active``) ignores what the step costs; the goodput budget chooses,
every step,

    ``C* = argmax_C (E(C) + a) / (T_draft(a, K) + T_verify(a, C + a))``

with ``a`` active rows, ``K`` draft passes, ``T_draft(a, K)`` the cost model's time for ``K``
sequential draft passes over ``a`` rows and ``T_verify(a, C + a)`` its time for one target
pass over the ``C`` selected tokens and one bonus token per row. It has two halves:

* **How many to verify** (:meth:`GoodputPlanner.select`, on the device, every step): one stable
  sort of the ``[B, K]`` costs (``-log`` of the scores) in the top-``C`` kernel's order (cost,
  then column, then row), a cumulative sum of the probabilities, and a table of the step times
  for every ``(a, C)``, so ``C*`` is one ``argmax``; the selection is the first ``C*`` entries
  of the same order. No host sync and static shapes: ``a`` stays a device value (the table has
  a row per possible ``a``), and the table depends only on host ints (rows, width) and the
  cost model, so it is built on the host once and cached on the device.
* **How deep to draft** (:meth:`GoodputPlanner.depth`, on the host, before the next step): the
  same objective, maximised over ``K`` in ``[0, max_depth]``, under a model of what each depth
  has yielded *under this budget*: per depth, the tokens accepted and verified per row that
  drafted it, fitted to the per-row outcomes the decoding loop already reads back
  (:meth:`~specselect.selection.Selector.observe`): no sync of its own. A drafted token the
  budget left out counts as not accepted. Modelling only the verified tokens would be biased:
  they are the best-scored ones, so their pass rate overstates what a deeper draft is worth
  when the budget verifies a few of its tokens (replaying the shipped pair with the default
  estimator on a CPU's costs, that bias drafted 1.5 to 1.7 passes deep on average where this
  model drafts about 1, and lost goodput to DSD where this model gains).
  ``K = 0`` is a plain decoding step: when the expected acceptance does not pay for even one
  draft pass (a drain down to requests the draft never agrees with, or a draft pass that costs
  as much as it saves), drafting nothing is the best step, as DSD's window of 0 is.
* **While the batch drains** (the loop says that no request waits for a slot, and how many
  tokens each row may still emit): the run lasts until its slowest row finishes, and tokens
  that finish the other rows sooner shorten nothing, so the depth minimises the modelled time
  to finish the batch instead: the step's time times the steps its slowest row still needs,
  each row's tokens per step modelled from the pooled depths scaled by what that row has
  accepted lately against what the pooled model expected of it. A static batch, as
  ``speculative_generate`` runs one without ``slots``, drains from the feedback of its first
  step on.

Why select the best-``C*`` prefix of the sorted order rather than run the top-``C`` kernel
with a device budget: the objective needs the scores in that order anyway (``E(C)`` is their
cumulative sum), and the kernel's budget is a static host int (``kthvalue``); taking the first
``C*`` entries of the order costs one comparison. The order is the kernel's (cost, then column,
then row), so the mask is exactly ``cheapest_mask(costs, C*)``: ``C*`` entries (never more than
are available) and closed under prefixes and ancestors, since an entry's prerequisites cost no
more and sit in lower columns, so they come strictly first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from specselect._checks import check_int, check_probability, check_real
from specselect.constants import arange_constant
from specselect.cost import PRICED_CONTEXT, CostModel, default_cost_model

__all__ = [
    "GOODPUT",
    "GoodputPlanner",
    "StepCosts",
    "StepTimes",
    "check_cost_model",
    "default_costs",
    "drafted_mask",
    "goodput_mask",
]

GOODPUT = "goodput"
"""The ``budget`` of a TETRIS selector that chooses ``C`` (and its draft depth) for goodput."""

INF = float("inf")
#: Defaults of :class:`GoodputPlanner`'s per-row model (the drain rule of its ``best_depth``).
ROW_DECAY = 0.5
ROW_DISPERSION = 0.35
# Per drafting step, the factor on the planner's evidence of how much the rows differ.
SPREAD_DECAY = 0.9
# The planner's decayed row counts per depth j (rows of GoodputPlanner._counts): rows whose
# depth j - 1 was accepted (_REACHED) and depth j too (_PASSED); rows whose depth j - 1 was
# verified (_OPENED) and depth j too (_VERIFIED).
_COUNTS = _REACHED, _PASSED, _OPENED, _VERIFIED = range(4)


@runtime_checkable
class StepCosts(Protocol):
    """What the goodput budget asks of a cost model: :class:`~specselect.cost.CostModel`'s two
    timing methods (called with their default context), in seconds."""

    def draft_time(self, batch: int, tokens: int) -> float:
        """``tokens`` sequential draft passes over ``batch`` rows."""
        ...

    def verify_time(self, batch: int, tokens: int) -> float:
        """One target pass over ``tokens`` tokens in total (bonus tokens included)."""
        ...


def default_costs() -> StepCosts:
    """The cost model a goodput budget plans with when given none: the library's default, the
    one replay prices steps with."""
    return default_cost_model()


def check_cost_model(value: object) -> StepCosts:
    """``value``, or a clear error unless it has the two timing methods of :class:`StepCosts`."""
    if not isinstance(value, StepCosts):
        raise TypeError(
            "cost_model must have draft_time(batch, tokens) and verify_time(batch, tokens) "
            f"methods (a specselect.cost.CostModel), got {type(value).__name__}"
        )
    return value


class StepTimes:
    """The cost model's times on the host, cached per number of active rows.

    The planner asks for the same times every step (and the device tables for all of them at
    once), so each ``(batch, tokens)`` is computed once. Every time is checked when first
    computed: finite, ``>= 0``, and a verification pass over a non-empty batch must take time
    (else a step could have infinite goodput).
    """

    def __init__(self, costs: StepCosts) -> None:
        self.costs = costs
        self._verify: dict[int, np.ndarray] = {}  # batch -> [T] verify_time(batch, t), t < T
        self._draft: dict[int, np.ndarray] = {}  # batch -> [P] draft_time(batch, p), p < P

    def verify(self, batch: int, tokens: int) -> np.ndarray:
        """``[tokens + 1]`` float64: ``verify_time(batch, t)`` for ``t = 0..tokens``; ``+inf``
        for ``t < batch``, which no step has (every row sends at least its bonus token)."""
        return self._grown(
            self._verify, batch, tokens, batch, INF, self._verify_time, self._verify_times
        )

    def draft(self, batch: int, passes: int) -> np.ndarray:
        """``[passes + 1]`` float64: ``draft_time(batch, p)`` for ``p = 0..passes`` (0 passes
        take no time)."""
        return self._grown(self._draft, batch, passes, 1, 0.0, self._draft_time)

    @staticmethod
    def _grown(
        cache: dict[int, np.ndarray],
        batch: int,
        last: int,
        first: int,
        below: float,
        time: Callable[[int, int], float],
        times: Callable[[int, np.ndarray], np.ndarray | None] | None = None,
    ) -> np.ndarray:
        """``cache[batch]`` extended to index ``last``: ``time(batch, n)`` from ``n = first``,
        ``below`` before it (the model is not asked about passes no step makes); ``times``,
        when it answers, gives every ``n`` of the extension at once."""
        have = cache.get(batch, np.zeros(0))
        if len(have) <= last:
            start = len(have)
            counts = range(max(start, first), last + 1)  # Python ints (what Dynamo traces)
            at_once = None
            if times is not None and len(counts):
                at_once = times(batch, np.arange(counts.start, counts.stop))
            if at_once is None:
                at_once = np.array([time(batch, n) for n in counts], dtype=np.float64)
            more = np.concatenate([np.full(max(0, first - start), below), at_once])
            have = cache[batch] = np.concatenate([have, more[: last + 1 - start]])
        return have[: last + 1]

    def _verify_times(self, batch: int, tokens: np.ndarray) -> np.ndarray | None:
        """``verify_time(batch, t)`` for every ``t`` of ``tokens`` in one numpy pass, for a
        :class:`~specselect.cost.CostModel` whose ``verify_time`` is its own (``None`` for
        any other model, which is asked token count by token count). A table at ``B = 256``
        and ``K = 5`` has 395,000 entries: asked one by one, its first step took a second.
        No check of the times: a CostModel's coefficients are finite and >= 0, and not all of
        its verification's fixed, per-row and per-token terms are 0, so every time here is
        finite and > 0 (and a check would be a data-dependent branch under torch.compile)."""
        if type(self.costs).verify_time is not CostModel.verify_time:
            return None
        assert isinstance(self.costs, CostModel)
        seconds = self.costs.verify.seconds_of_tokens(batch, tokens, PRICED_CONTEXT)
        return np.asarray(seconds, dtype=np.float64)

    def _verify_time(self, batch: int, tokens: int) -> float:
        seconds = _seconds("verify_time", batch, tokens, self.costs.verify_time(batch, tokens))
        if seconds <= 0:
            raise ValueError(
                f"cost_model.verify_time({batch}, {tokens}) = {seconds}: a target pass over "
                f"{batch} rows must take time, or a step could have infinite goodput"
            )
        return seconds

    def _draft_time(self, batch: int, passes: int) -> float:
        return _seconds("draft_time", batch, passes, self.costs.draft_time(batch, passes))


def _seconds(method: str, batch: int, tokens: int, value: object) -> float:
    """``value`` as seconds, or a clear error naming the cost model's call."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"cost_model.{method}({batch}, {tokens}) must return a float, got "
            f"{type(value).__name__}"
        )
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(
            f"cost_model.{method}({batch}, {tokens}) must be a finite time >= 0, got {value}"
        )
    return float(value)


def goodput_mask(
    costs: Tensor,  # [B, W] >= +0 or +inf
    active: Tensor | None,  # [B] bool
    verify: Tensor,  # [B + 1, T] float64, T > B * (W + 1)
    draft: Tensor,  # [B + 1, W + 1] float64
    passes: Tensor | int,  # [] or int: the step's draft passes, <= W
) -> Tensor:  # [B, W] bool
    """The first ``C*`` entries of ``costs`` in (cost, column, row) order, ``C*`` maximising
    the modelled goodput; see the module docstring.

    Args:
        costs: ``-log`` of each entry's estimated probability of acceptance (``+inf``: never
            selected); costs must not decrease from an entry to one that depends on it.
        active: rows outside it take nothing and do not count in ``a``; ``None``: all rows.
        verify: ``verify[a, t]``, the target pass over ``t`` tokens for ``a`` rows (row 0:
            any positive value, so that an empty step has goodput 0 and no NaN).
        draft: ``draft[a, p]``, ``p`` draft passes for ``a`` rows.
        passes: the draft passes of this step (a device value for trees: their depth).

    Pure tensor code, no host sync. Among equal goodputs the smallest ``C`` wins: no token
    is verified that the model says does not pay.
    """
    rows, width = costs.shape
    device = costs.device
    if active is None:
        count = torch.full((), rows, dtype=torch.int64, device=device)  # [] a
    else:
        costs = costs.masked_fill(~active.unsqueeze(1), INF)
        count = active.sum()  # [] a, on the device
    # Column-major, so that a stable sort breaks equal costs by column, then by row.
    ordered, order = torch.sort(costs.t().reshape(-1), stable=True)  # [n], [n]
    n = ordered.shape[0]
    steps = arange_constant(n + 1, device)  # [n + 1] C = 0..n
    probs = ordered.to(torch.float64).neg().exp()  # [n], 0 where never selectable
    expected = torch.cat([probs.new_zeros(1), probs.cumsum(0)])  # [n + 1] E(C)
    # Both tables read at flat device indices (a 0-dim index would be read on the host).
    # verify[a, C + a] (the pass holds each row's own token too) sits at a * (T + 1) + C.
    drafting = draft.view(-1).index_select(0, (count * (width + 1) + passes).view(1))  # [1]
    verifying = verify.view(-1).index_select(0, count * (verify.shape[1] + 1) + steps)  # [n+1]
    seconds = drafting + verifying  # [n + 1] the step's time for every C
    goodput = (expected + count) / seconds  # [n + 1]
    available = (ordered < INF).sum()  # [] entries that may be selected
    best = goodput.masked_fill(steps > available, -INF).argmax()  # [] C*: the first maximum
    rank = torch.empty_like(order).scatter_(0, order, steps[:n])  # [n] position in the order
    return (rank < best).view(width, rows).t().contiguous()


class GoodputPlanner:
    """The goodput budget of one TETRIS selector: ``C*`` on the device, ``K`` on the host.

    Args:
        max_depth: the deepest draft (``k + extra``); :meth:`depth` chooses in
            ``[0, max_depth]``.
        cost_model: the step times (see :class:`StepCosts`).
        prior: acceptance probability of a depth before any evidence.
        strength: pseudo-observations of the prior (for depth 1) or of the depth above (for
            the deeper ones) in each depth's estimate.
        decay: per-step factor on the observed counts, so that the model follows the batch.
        probe_every: after this many steps in a row that verified nothing, probe (see below).
        row_decay: per drafting step, the factor on each row's own counts (accepted tokens,
            and what the pooled model expected of it; its square on the expected tokens that
            scale the noise), which the drain rule of :meth:`best_depth` reads.
        row_dispersion: the variance of a row's accepted tokens per step over their mean, as
            the drain rule assumes it when it tells a row's streak from chance (see
            :meth:`row_ratio`).

    The model behind :meth:`depth`, pooled over the rows and the recent steps (Kaplan-Meier
    estimates with decayed counts), over the steps that drafted depth ``j``: the probability
    that depth ``j`` is accepted given depth ``j - 1`` was (a drafted token the budget left
    out counting as not accepted), and that it is verified given depth ``j - 1`` was. So ``K``
    passes are modelled by what the budget made of them, not by what verifying everything
    drafted would give: ``a * sum_{j<=K} S(j)`` accepted tokens and about
    ``width * a * sum_{j<=K} V(j)`` verified, with ``S`` and ``V`` the two survivals and
    ``width`` the verified nodes per verified depth (1 for chains). Pooled, because a fixed
    draft depth serves every row, whatever the rows' differences. Per depth, because
    acceptance is not geometric: a token that follows accepted ones is accepted more often
    (replaying the shipped pair, about 0.45 at depth 1 and 0.8 after). A depth that has not
    been drafted lately shrinks to the one above it, so a depth the planner stopped drafting is
    valued like the deepest drafted.

    ``K = 0`` (a plain step) tests nothing, and a step whose budget verifies none of what was
    drafted (scores that undervalue the draft) only counts the first depth as failed, which
    takes the depth down to 0 where a draft pass costs: so the planner *probes*: once
    ``probe_every`` steps in a row verified nothing, every step drafts at least one token until
    one verifies something, unless no acceptance rate could make drafting pay (certain
    acceptance at every depth still loses to a plain step), and :meth:`select` verifies
    everything drafted, whatever the estimates say: a probe that tests nothing teaches nothing.
    Without probes, a prior under which drafting does not pay would never be put to the test.
    Between probes the counts keep decaying, so where the prior says drafting pays, it also
    brings drafting back by itself.
    """

    def __init__(
        self,
        max_depth: int,
        cost_model: StepCosts,
        *,
        prior: float = 0.7,
        strength: float = 2.0,
        decay: float = 0.8,
        probe_every: int = 4,
        row_decay: float = ROW_DECAY,
        row_dispersion: float = ROW_DISPERSION,
    ) -> None:
        self.max_depth = check_int("max_depth", max_depth, minimum=1)
        self.cost_model = check_cost_model(cost_model)
        self.prior = check_probability("prior", prior)
        if not (math.isfinite(strength) and strength > 0):
            raise ValueError(f"strength must be a finite float > 0, got {strength}")
        self.strength = float(strength)
        self.decay = check_probability("decay", decay)
        self.probe_every = check_int("probe_every", probe_every, minimum=1)
        self.row_decay = check_probability("row_decay", row_decay)
        self.row_dispersion = check_real("row_dispersion", row_dispersion, low=0.0, open_low=True)
        self.times = StepTimes(cost_model)
        # [] bool on the selections' device: the probe flag as a captured selection reads it
        # (depth() fills it in place, outside any capture). Made by the first select().
        self._probe_flag: Tensor | None = None
        # (rows, width, device) -> the device tables of goodput_mask: they depend on no state
        self._tables: dict[tuple[int, int, torch.device], tuple[Tensor, Tensor]] = {}
        self.reset()

    def reset(self) -> None:
        """Forget the observed outcomes (a new generation)."""
        depths = self.max_depth
        # Decayed row counts per depth j = 1..max_depth, over the steps that drafted depth j:
        self._counts = np.zeros((len(_COUNTS), depths))  # [4, D], rows of _COUNTS
        # Decayed verified nodes and deepest depths: a tree verifies several nodes per depth.
        self._nodes = self._deepest = 0.0
        # The draft depth of the step being observed, as planned (a tree shallower than that
        # fails its missing depths, which values them at nothing, as they are).
        self._drafted = depths
        self._idle = 0  # steps in a row that verified nothing
        self._probing = False  # whether the last depth() was a probe
        # Per batch row (grown on demand): decayed accepted tokens, the accepted tokens the
        # pooled model expected of the row at the depths it drafted, and those expected
        # tokens decayed by the square of row_decay (what the noise of the ratio scales with).
        self._row_counts = np.zeros((3, 0))  # [3, rows]
        # Decayed over drafting steps (see _observe_spread): the rows' squared distances from
        # their common ratio less their noise, summed, and the number of terms.
        self._spread = self._spread_terms = 0.0
        # While the batch drains: ([R] batch rows, [R] tokens each may still emit) of the
        # unfinished rows the last observe() reported; None while requests wait or unsaid.
        self._draining: tuple[np.ndarray, np.ndarray] | None = None
        if self._probe_flag is not None:
            self._probe_flag.fill_(False)

    # ------------------------------------------------------------------ host: the draft depth
    def observe(
        self,
        verified: Sequence[int],
        accepted: Sequence[int],
        deepest: Sequence[int],
        *,
        active: Sequence[bool] | None = None,
        remaining: Sequence[int] | None = None,
        waiting: bool | None = None,
    ) -> None:
        """One step's outcomes, per active row (checked host ints; see ``Selector.observe``,
        which also says what ``active``, ``remaining`` and ``waiting`` are).

        A row that accepted ``x`` draft tokens and verified down to depth ``d`` (``deepest``;
        a chain's verified count) in a step that drafted ``K`` deep reached depths
        ``1..min(x + 1, K)`` and passed ``1..x``; it had depths ``1..min(d + 1, K)`` open to
        verification and verified ``1..d``. A reached depth the budget did not verify counts
        as not passed: what a draft pass is worth is what the budget makes of it, and the
        pass rate of the verified tokens alone (the best-scored ones) would overvalue the
        depths the budget mostly leaves out. For a draft tree these are the tree's depths:
        depth ``x + 1`` failed whether the accepted path had a selected child or not.
        """
        v = np.asarray(verified, dtype=np.int64).reshape(-1)
        x = np.asarray(accepted, dtype=np.int64).reshape(-1)
        d = np.asarray(deepest, dtype=np.int64).reshape(-1)
        drafted = max(self._drafted, int(d.max(initial=0)))
        if min(v.min(initial=0), x.min(initial=0), d.min(initial=0)) < 0:
            raise ValueError(
                "verified, accepted and deepest must be counts >= 0, got "
                f"{v.tolist()}, {x.tolist()} and {d.tolist()}"
            )
        depths = np.stack([np.minimum(x + 1, drafted), x, np.minimum(d + 1, drafted), d])
        self._draining = None
        if remaining is not None:  # the rows' own model serves the drain rule only
            if active is None:  # entries shift as rows finish: no row would keep its counts
                raise ValueError("remaining needs active=: which batch row each entry is")
            rows = np.flatnonzero(np.asarray(active, dtype=bool))  # [R]
            left = np.asarray(remaining, dtype=np.int64).reshape(-1)  # [R]
            self._observe_rows(rows, x, left, drafted)
            unfinished = left > 0  # [R]
            if waiting is not None and not waiting and unfinished.any():
                self._draining = (rows[unfinished], left[unfinished])
        self._counts *= self.decay
        self._counts += _reaching(depths, self.max_depth)  # rows in the order of _COUNTS
        self._nodes = self.decay * self._nodes + float(v.sum())
        self._deepest = self.decay * self._deepest + float(d.sum())
        self._idle = 0 if v.any() else self._idle + 1

    def acceptance(self) -> np.ndarray:
        """``[max_depth]`` float64: estimated P(depth ``j`` accepted | depth ``j - 1`` was),
        a depth that the budget left unverified counting as not accepted."""
        return _chained(self._counts[_PASSED], self._counts[_REACHED], self.prior, self.strength)

    def verification(self) -> np.ndarray:
        """``[max_depth]`` float64: estimated P(depth ``j`` verified | depth ``j - 1`` was);
        before any evidence, 1 (the budget verifies what is drafted)."""
        return _chained(self._counts[_VERIFIED], self._counts[_OPENED], 1.0, self.strength)

    def width(self) -> float:
        """Verified nodes per verified depth: 1 for chains, a tree's mean width."""
        return self._nodes / self._deepest if self._deepest > 0 else 1.0

    def depth(self, active: int) -> int:
        """The draft depth for ``active`` rows: :meth:`best_depth`; on a probe (once
        ``probe_every`` steps in a row verified nothing, if certain acceptance would make
        drafting pay), at least 1, and :meth:`select` verifies all of it until the next
        :meth:`depth`."""
        best = self.best_depth(active)
        self._probing = self._idle >= self.probe_every
        if self._probing and not best:  # unless no acceptance could make drafting pay
            certain = np.ones(self.max_depth)
            self._probing = self.best_depth(active, certain, certain, 1.0) > 0
        self._drafted = max(best, 1) if self._probing else best
        if self._probe_flag is not None:
            self._probe_flag.fill_(self._probing)  # a fill kernel: no copy, no sync
        return self._drafted

    def best_depth(
        self,
        active: int,
        acceptance: np.ndarray | None = None,
        verification: np.ndarray | None = None,
        width: float | None = None,
    ) -> int:
        """The draft depth ``K`` in ``[0, max_depth]`` with the best modelled goodput for
        ``active`` rows (the smallest on ties); 0 with no active row. While the batch drains
        (the last :meth:`observe` was told that no request waits, and which rows have tokens
        left), the depth with the shortest modelled time to finish the batch instead.

        Host arithmetic on the cached times and the model (or the given ``[max_depth]``
        rates and width, which always plan for goodput): no device value. ``K`` passes accept
        ``a * sum_{j<=K} S(j)`` tokens and verify ``width * a * sum_{j<=K} V(j)`` (a
        fractional count, timed between its two neighbours linearly), with ``S`` and ``V``
        the survivals of :meth:`acceptance` and :meth:`verification`: the outcomes of the
        budget as it has been choosing, not of a budget that verifies everything drafted.
        ``K = 0`` (no draft pass) is a plain decoding step.

        Draining, the run ends when its slowest row does: ``K`` is chosen for the step's time
        times ``max_i r_i / (1 + min(K, rho_i * sum_{j<=K} S(j)))``, the steps row ``i``
        still needs for its ``r_i`` tokens, where ``rho_i`` is what the row accepted lately
        over what the pooled model expected of it (:meth:`row_ratio`). A row the draft
        rarely agrees with gains little from a deeper draft, so when it is the slowest, the
        cheaper step wins: replaying the shipped pair's static batches of 8 on an H100's
        graph-mode costs, the budget drafts 1.2 to 1.3 deep where it drafted 1.9 to 2.4 for
        goodput, and finishes sooner.
        """
        active = check_int("active", active)
        if active == 0:
            return 0
        given = acceptance is not None or verification is not None or width is not None
        accept = (
            self.acceptance()
            if acceptance is None
            else _rates("acceptance", acceptance, self.max_depth)
        )
        verify = (
            self.verification()
            if verification is None
            else _rates("verification", verification, self.max_depth)
        )
        width = self.width() if width is None else check_real("width", width, low=0.0)
        # Python floats, not numpy: a handful of depths, between a step's read-back and the
        # next launch, where numpy's per-call overhead would cost more than the arithmetic.
        gains = _running_sums(accept)  # [D + 1] tokens accepted per row
        tested = [width * active * s + active for s in _running_sums(verify)]  # bonus included
        verify_times = self.times.verify(active, math.floor(tested[-1]) + 1).tolist()
        draft_times = self.times.draft(active, self.max_depth).tolist()  # [D + 1]
        seconds = []  # [D + 1] the step's time at each depth
        for tokens, draft in zip(tested, draft_times, strict=True):
            low = math.floor(tokens)
            share = tokens - low  # in [0, 1)
            seconds.append(draft + (1 - share) * verify_times[low] + share * verify_times[low + 1])
        if self._draining and not given:
            return self._finishing_depth(gains, seconds)
        goodputs = [
            (active * gain + active) / time for gain, time in zip(gains, seconds, strict=True)
        ]
        return goodputs.index(max(goodputs))  # the first maximum: the smallest K

    def _finishing_depth(self, gains: list[float], seconds: list[float]) -> int:
        """The depth whose step time times the steps the slowest draining row still needs is
        the least (the smallest on ties); see :meth:`best_depth`. One numpy pass over
        ``[D + 1, R]``: between a step's read-back and the next launch, for every row."""
        assert self._draining is not None
        rows, left = self._draining  # [R], [R]
        depths = np.arange(len(gains)).reshape(-1, 1)  # [D + 1, 1]
        per_step = 1 + np.minimum(depths, np.reshape(gains, (-1, 1)) * self._ratios(rows))
        finish = np.asarray(seconds) * (left / per_step).max(axis=1)  # [D + 1]
        return int(finish.argmin())  # the first minimum: the smallest K

    def row_ratio(self, row: int) -> float:
        """What batch row ``row`` accepted lately over what the pooled model expected of it:
        the ``rho`` of the drain rule of :meth:`best_depth`; 1 for a row not seen since it
        last finished.

        Its raw ratio (counts decayed by :attr:`row_decay` per drafting step) is pulled
        towards 1 as an empirical-Bayes estimate: ``rho = 1 + w * (raw - 1)`` with
        ``w = tau2 / (tau2 + noise)``. ``noise`` is the variance that chance alone gives the
        raw ratio (:attr:`row_dispersion` times the expected tokens decayed by the square of
        :attr:`row_decay`, over the square of those decayed by it). ``tau2`` is how far the
        rows' ratios lie apart beyond their noise: each drafting step, over the unfinished
        rows with counts (two at least), the squared distance of each ratio from the rows'
        common ratio (``sum(accepted) / sum(expected)``), scaled by ``G / (G - 1)`` and less
        its noise, summed and decayed by ``SPREAD_DECAY`` (0.9) per such step, over the
        decayed number of terms, floored at 0.

        Where rows differ (one the draft never agrees with), a row's streak counts almost in
        full; where they are alike, a bad streak is taken for chance and the pooled model
        stands, so one unlucky row does not turn the batch to plain steps, which would teach
        nothing about it. Each row adds one term, so in a large batch of rows alike one
        straggler moves ``tau2`` little: in the tests' drain of 12 steps (a draft pass a
        fifth of a target pass) of rows that accept everything beside one that accepts
        nothing, that row's ratio ends at 0.23 among 4 rows (3 of those steps drafted), 0.36
        among 16 and 0.92 among 32; the figures depend on the costs and the depths drafted.
        It is told apart in small batches and in the tail of a drain, less in a full large
        batch. The default dispersion,
        0.35, is what a one-token draft accepted 65% of the time gives (variance over mean
        ``1 - p``); deeper drafts give about 1 or more, so a row's streak counts for more
        than independent steps would say: its last steps predict its next ones better. It
        was chosen on exact replay of two pairs and checked on a third.
        """
        row = check_int("row", row)
        if row >= self._row_counts.shape[1]:  # never observed: no counts, the pooled model's
            return 1.0
        return float(self._ratios(np.array([row]))[0])

    def _ratios(self, rows: np.ndarray) -> np.ndarray:  # [R] observed batch rows -> [R]
        """:meth:`row_ratio` of each of ``rows``, rows the counts cover (every row an
        :meth:`observe` with ``remaining`` reported)."""
        raw, noise = self._raw_ratios(rows)  # [R], [R]
        terms = self._spread_terms
        spread = max(self._spread / terms, 0.0) if terms else 0.0  # tau2
        weight = np.divide(spread, spread + noise, out=np.zeros_like(noise), where=noise > 0)
        return 1.0 + weight * (raw - 1.0)

    def _raw_ratios(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``[R]`` decayed accepted over expected tokens of ``rows`` (1 without counts), and
        ``[R]`` the variance chance gives it (0 without counts)."""
        accepted, expected, squared = self._row_counts[:, rows]  # [R] each
        seen = expected > 0
        raw = np.divide(accepted, expected, out=np.ones_like(expected), where=seen)
        scale = np.divide(squared, expected**2, out=np.zeros_like(expected), where=seen)
        return raw, self.row_dispersion * scale

    def _observe_rows(
        self, rows: np.ndarray, accepted: np.ndarray, remaining: np.ndarray, drafted: int
    ) -> None:
        """Each reported row's decayed counts (accepted tokens, what the pooled model before
        this step's outcomes expected of it at the step's depth), then the rows' spread. A
        plain step (nothing drafted) is no evidence and changes no count. A row this step
        finished (nothing remaining) starts afresh: its slot's next request is another."""
        counts = self._row_counts  # [3, rows]
        if len(rows) and counts.shape[1] <= rows.max():
            grow = int(rows.max()) + 1 - counts.shape[1]
            counts = self._row_counts = np.pad(counts, ((0, 0), (0, grow)))
        if drafted:
            expected = _running_sums(self.acceptance())[min(drafted, self.max_depth)]
            decay = self.row_decay
            counts[:, rows] *= [[decay], [decay], [decay**2]]  # accepted, expected, its noise's
            counts[0, rows] += accepted
            counts[1:, rows] += expected
        counts[:, rows[remaining == 0]] = 0.0
        if drafted:
            self._observe_spread(rows[counts[1, rows] > 0])

    def _observe_spread(self, rows: np.ndarray) -> None:  # [G] unfinished rows with counts
        """How far the rows' ratios lie apart beyond their noise, this step: the squared
        distance of each from the rows' common ratio (scaled by ``G / (G - 1)``, about
        unbiased: the common ratio weighs rows by their expected tokens), less its noise,
        added to the decayed sums. Measured from the common ratio, not from 1: while the
        pooled model lags (every row beating it), the rows do not differ. One row says
        nothing about how rows differ: a step with fewer than two neither adds nor decays."""
        if len(rows) < 2:
            return
        accepted, expected, _ = self._row_counts[:, rows]  # [G] each
        raw, noise = self._raw_ratios(rows)  # [G], [G]
        common = accepted.sum() / expected.sum()
        excess = (raw - common) ** 2 * len(rows) / (len(rows) - 1) - noise  # [G]
        self._spread = SPREAD_DECAY * self._spread + float(excess.sum())
        self._spread_terms = SPREAD_DECAY * self._spread_terms + len(rows)

    # ------------------------------------------------------------------ device: the budget
    def select(self, costs: Tensor, active: Tensor | None, passes: Tensor | int) -> Tensor:
        """``[B, W]`` bool: :func:`goodput_mask` with this planner's cached device tables; on a
        probe step (see the class), every available entry of the active rows.

        After its first call per shape and device (which builds the device tables and the
        probe flag) it changes no host state, and it reads the probe flag from the device copy
        that :meth:`depth` fills in place, so a captured call replays exactly: what it depends
        on is the shapes, the tables and that flag. Both masks are computed, and one is picked
        on the device. A chain the loop drafted shallower than planned (no row could emit the
        rest) counts as drafted as planned: a row that accepted all of it failed the next
        depth, in the last steps of a row only.
        """
        rows, width = costs.shape
        if rows * width == 0:
            return torch.zeros(costs.shape, dtype=torch.bool, device=costs.device)
        verify, draft = self._device_tables(rows, width, costs.device)
        best = goodput_mask(costs, active, verify, draft, passes)  # [B, W]
        return torch.where(self._device_flag(costs.device), drafted_mask(costs, active), best)

    def _device_flag(self, device: torch.device) -> Tensor:
        """The probe flag on ``device`` (``[]`` bool), made on first use there."""
        flag = self._probe_flag
        if flag is None or flag.device != device:
            flag = self._probe_flag = torch.full((), self._probing, device=device)
        return flag

    def _device_tables(self, rows: int, width: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """``([B + 1, B * (W + 1) + 1] verify, [B + 1, W + 1] draft)`` seconds on ``device``."""
        key = (rows, width, device)
        tables = self._tables.get(key)
        if tables is None:
            tokens = rows * (width + 1)
            verify = np.ones((rows + 1, tokens + 1))  # row 0: no active row, goodput 0
            draft = np.zeros((rows + 1, width + 1))
            for a in range(1, rows + 1):
                verify[a] = self.times.verify(a, tokens)
                draft[a] = self.times.draft(a, width)
            tables = self._tables[key] = (_upload(verify, device), _upload(draft, device))
        return tables


def drafted_mask(costs: Tensor, active: Tensor | None) -> Tensor:  # [B, W] -> [B, W] bool
    """Every entry that may be selected (finite cost) in the active rows: what a probe, and
    TETRIS's guard fallback under the goodput budget, verify. Closed under prefixes and
    ancestors, since an entry after an unavailable one costs ``+inf`` too."""
    available = costs < INF  # [B, W]
    return available if active is None else available & active.unsqueeze(1)


def _chained(passed: np.ndarray, tried: np.ndarray, prior: float, strength: float) -> np.ndarray:
    """``[D]``: per depth, ``passed / tried`` shrunk to the depth above (to ``prior`` for the
    first) with ``strength`` pseudo-observations: a Kaplan-Meier estimate whose untried depths
    take the rate of the deepest tried one."""
    rates = np.empty(len(passed))
    previous = prior
    for j in range(len(passed)):
        previous = rates[j] = (passed[j] + strength * previous) / (tried[j] + strength)
    return rates


def _rates(name: str, rates: object, depths: int) -> np.ndarray:
    """Given per-depth ``rates`` as ``[depths]`` float64 probabilities, or an error naming
    ``name``."""
    values = np.asarray(rates, dtype=np.float64)
    if values.shape != (depths,) or not ((values >= 0) & (values <= 1)).all():
        raise ValueError(
            f"{name} must hold {depths} probabilities in [0, 1], one per depth, got "
            f"{values.tolist()}"
        )
    return values


def _running_sums(rates: np.ndarray) -> list[float]:
    """``[D + 1]``: 0, then the running sums of the survivals ``prod_{i<=j} rates[i]``."""
    sums, survival, total = [0.0], 1.0, 0.0
    for rate in rates.tolist():
        survival *= rate
        total += survival
        sums.append(total)
    return sums


def _reaching(depths: np.ndarray, max_depth: int) -> np.ndarray:
    """``[S, max_depth]``: per series of ``depths`` (``[S, rows]`` int64, each ``>= 0``), how
    many are ``>= j``, for ``j = 1..max_depth``. One ``bincount`` for every series (each gets
    its own ``max_depth + 1`` bins): the planner runs between a step's read-back and the next
    step's launch, where a GPU waits for it."""
    series, bins = depths.shape[0], max_depth + 1
    offsets = np.arange(0, series * bins, bins).reshape(-1, 1)  # [S, 1]
    binned = np.minimum(depths, max_depth) + offsets  # [S, rows]
    counts = np.bincount(binned.reshape(-1), minlength=series * bins).reshape(series, bins)
    return counts[:, ::-1].cumsum(axis=1)[:, ::-1][:, 1:].astype(np.float64)


def _upload(values: np.ndarray, device: torch.device) -> Tensor:
    """A host table on ``device``. To a GPU through pinned memory, asynchronously: a copy from
    pageable memory would wait for the device's queue (a sync), and a table is first needed
    in the middle of a run whenever the draft depth changes."""
    host = torch.from_numpy(values)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
