"""Acceptance estimators: from draft log-probabilities to estimated acceptance probabilities.

TETRIS ranks draft tokens by cumulative draft probability, which is only a proxy for what it
needs: the probability that the target accepts each token given that its predecessors were
accepted. Small or briefly trained drafts are badly under-confident (on the shipped pair,
tokens drafted with probability 0.2 are accepted most of the time), and a ranking built on the
proxy can do worse than standard SD. An estimator learns the mapping online, from the
verification outcomes every step already produces, with no offline training.

Every estimator works on device tensors, costs O(B·K) per step, and never reads a value back to
the host. Per-request state lives in ``[B]`` tensors indexed by batch slot; :meth:`reset_rows`
clears the slots that were handed to new requests.

State is allocated on the first step (when the device and batch size are known) and from then on
only updated in place, never rebound: a decoding loop may capture ``select`` and ``update`` in a
CUDA graph, which replays its kernels on the buffers it recorded. Each batch size gets its own
per-request state (and its own capture), kept while the estimator lives. An estimator that keeps
to this says so with :attr:`AcceptanceEstimator.capturable`. The one exception is a move,
:meth:`AcceptanceEstimator.to`, which only a selector makes, when its inputs change device (it
then draws a new ``capture_token``, so that no graph recorded on the old tensors replays). Used
directly, an estimator refuses inputs on another device than its state's.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from specselect._checks import (
    _values_checkable,
    check_implies,
    check_ints,
    check_logprobs,
    check_mask,
    check_non_negative,
    check_tensor,
    outside_autograd,
)

EPS = 1e-4  # estimates are kept in [EPS, 1 - EPS]: log(0) would forbid a token forever


def default_positions(draft_logprobs: Tensor, positions: Tensor | None) -> Tensor:
    """``[B, K]`` 0-based position of each token: its column in a chain, ``depth - 1`` in a tree."""
    if positions is not None:
        return positions
    width = draft_logprobs.shape[1]
    return torch.arange(width, device=draft_logprobs.device).expand(draft_logprobs.shape)


class AcceptanceEstimator(abc.ABC):
    """Estimates ``log P(token j accepted | tokens < j accepted)`` for each draft token; for a
    draft-tree node, ``log P(node on the accepted path | its parent on it)``, what TETRIS's
    path product needs (see :func:`~specselect.estimators.outcomes.tree_outcomes`).

    ``positions`` (``[B, K]`` int64, optional) is each token's 0-based position along its
    chain: its column for chains (the default), ``depth - 1`` for draft-tree nodes.
    ``features`` (``[B, K, F]`` float, optional) are per-token features a loop computes from
    the context, :func:`specselect.lookup.lookup_features` in specselect's own loops; an
    estimator that reads them says so with :attr:`uses_features`, the others ignore them.

    An estimator implements :meth:`estimate` and, if it learns, :meth:`_learn`, which
    :meth:`learn` calls once the arguments are checked (``features`` included, ``None`` when
    there are none).
    """

    name: str = "estimator"

    @property
    def capturable(self) -> bool:
        """Whether :meth:`estimate` and :meth:`learn` may be captured in a CUDA graph: device
        code without host reads, state allocated on a shape's first call and only updated in
        place after it (see the module doc). ``False`` unless an estimator declares it."""
        return False

    @property
    def uses_features(self) -> bool:
        """Whether :meth:`estimate` reads per-token ``features``: a loop computes them only
        for an estimator that does. ``False`` unless an estimator declares it."""
        return False

    @abc.abstractmethod
    def estimate(
        self,
        draft_logprobs: Tensor,
        positions: Tensor | None = None,
        features: Tensor | None = None,
    ) -> Tensor:
        """``[B, K]`` draft log-probs → ``[B, K]`` estimated log acceptance probabilities.

        ``-inf`` inputs stay ``-inf`` (never selectable); everything else is finite and <= 0.
        """

    @outside_autograd
    def learn(
        self,
        draft_logprobs: Tensor,
        tested: Tensor,
        passed: Tensor,
        positions: Tensor | None = None,
        features: Tensor | None = None,
    ) -> None:
        """Update from ``[B, K]`` log-probs and ``[B, K]`` bool tested / passed masks
        (:func:`~specselect.estimators.outcomes.observed_outcomes` for chains,
        :func:`~specselect.estimators.outcomes.tree_outcomes` for trees).

        The arguments are checked here, for every estimator and before any state changes (a
        mask of the wrong shape used to fail inside a scatter, after the counts had decayed);
        :meth:`_learn` is what an estimator implements.
        """
        check_learn_arguments(draft_logprobs, tested, passed, positions, features)
        self._learn(draft_logprobs, tested, passed, positions, features)

    def _learn(  # noqa: B027
        self,
        draft_logprobs: Tensor,
        tested: Tensor,
        passed: Tensor,
        positions: Tensor | None,
        features: Tensor | None,
    ) -> None:
        """:meth:`learn` from checked arguments (learns nothing by default)."""

    def reset(self) -> None:  # noqa: B027
        """Forget everything learned (a new generation)."""

    def reset_rows(self, rows: Tensor) -> None:  # noqa: B027
        """Forget per-request state of ``rows`` (``[B]`` bool); shared state is kept."""

    def reset_requests(self) -> None:
        """Forget the per-request state of every row, at every batch size (every slot holds a
        new request). By default everything (:meth:`reset`), which is safe for any state; an
        estimator that learns across requests overrides it to keep that."""
        self.reset()

    def to(self, device: torch.device) -> None:  # noqa: B027
        """Move the state to ``device`` as copies, which keep what was learned (nothing to move
        by default). A selector calls it when its inputs move, before anything else."""


class DraftProbability(AcceptanceEstimator):
    """The paper's estimate: the draft probability itself. Learns nothing."""

    name = "draft"

    @property
    def capturable(self) -> bool:
        return True

    def estimate(
        self,
        draft_logprobs: Tensor,
        positions: Tensor | None = None,
        features: Tensor | None = None,
    ) -> Tensor:
        check_estimate_arguments(draft_logprobs, positions, features)
        return draft_logprobs


class Cached:
    """One value computed from some tensors, kept for a later call on the *same* tensors.

    A selector's ``update`` hands an estimator the very tensors its ``select`` estimated, so
    work done in ``estimate`` (features, table cells) need not be redone in ``learn``. The key
    is the tensors' identity, and :meth:`take` forgets the value: a loop that refills one input
    buffer in place must never get a stale value for new data.
    """

    def __init__(self) -> None:
        self._key: tuple[Tensor | None, ...] = ()
        self._value: Any = None

    def keep(self, key: tuple[Tensor | None, ...], value: Any) -> None:
        self._key, self._value = key, value

    def take(self, key: tuple[Tensor | None, ...]) -> Any:
        """The kept value if it was kept for these very tensors, else ``None``; then forget."""
        same = len(key) == len(self._key) and all(
            a is b for a, b in zip(key, self._key, strict=True)
        )
        value = self._value if same else None
        self.clear()
        return value

    def clear(self) -> None:
        self._key, self._value = (), None


def read_state(
    live: Tensor | None, device: torch.device, build: Callable[[torch.device], Tensor]
) -> Tensor:
    """State for a reading on ``device``: the live tensor when it is there (what a captured
    selection must read), a copy when it lives on another device, ``build(device)`` (new
    values, bound to nothing) before the first step. Never a binding: a diagnostic read on
    another device (the CPU by default) must not discard what was learned, nor leave a captured
    graph updating a tensor nobody holds, nor, read before the first step, tie the state to its
    device (the first step on a GPU would then be refused)."""
    return build(device) if live is None else live.to(device)


def check_state_device(owner: object, state: Tensor, device: torch.device) -> None:
    """Inputs must be on the state's device: only :meth:`AcceptanceEstimator.to` moves state
    (a selector calls it), since a move rebinds tensors that a captured graph may hold."""
    if state.device != device:
        raise ValueError(
            f"{type(owner).__name__} keeps its state on {state.device}, got inputs on {device}: "
            "move it first with .to(device) (a selector does so itself when its inputs move)"
        )


def check_learn_arguments(
    draft_logprobs: object, tested: object, passed: object, positions: object, features: object
) -> None:
    """Check :meth:`AcceptanceEstimator.learn`'s arguments: what
    :func:`check_estimate_arguments` checks, ``[B, K]`` bool masks on the log-probs' device,
    and that every token that passed was tested, where the values can be read without a sync
    (see :mod:`specselect._checks`): a pass that was not tested would count as both an
    acceptance and a rejection."""
    logprobs = check_estimate_arguments(draft_logprobs, positions, features)
    shape, device = tuple(logprobs.shape), logprobs.device
    tested_mask = check_mask("tested", tested, shape, device)
    passed_mask = check_mask("passed", passed, shape, device)
    check_implies("passed", passed_mask, "tested", tested_mask)


def check_estimate_arguments(draft_logprobs: object, positions: object, features: object) -> Tensor:
    """Check what an estimator reads, before it reads it: ``[B, K]`` log-probabilities (no
    NaN, +inf or positive values, where readable without a sync), optional ``[B, K]`` integer
    positions ``>= 0`` and ``[B, K, F]`` floating features on their device. Returns the
    log-probs (an estimator that reads features checks their values).

    One NaN that reached an estimator's shared state would turn every later estimate into NaN,
    for every request; a negative position would index its tables from the end."""
    logprobs = check_logprobs("draft_logprobs", draft_logprobs)
    shape, device = tuple(logprobs.shape), logprobs.device
    if positions is not None:
        checked = check_ints("positions", positions, shape, device)
        check_non_negative("positions", checked)
    if features is not None:
        check_features(features, logprobs)
    return logprobs


def check_features(features: object, draft_logprobs: Tensor) -> Tensor:
    """``features`` as a ``[B, K, F]`` floating tensor on ``draft_logprobs``'s device, ``B, K``
    its shape, or a clear error."""
    checked = check_tensor("features", features, rank=3)
    if not checked.is_floating_point():
        raise TypeError(f"features must be a floating-point tensor, got {checked.dtype}")
    rows, width = draft_logprobs.shape
    if tuple(checked.shape[:2]) != (rows, width):
        raise ValueError(
            f"features must be a [B, K, F] tensor with [B, K] = {[rows, width]} "
            f"(draft_logprobs' shape), got shape {list(checked.shape)}"
        )
    if checked.device != draft_logprobs.device:
        raise ValueError(
            f"features must be on draft_logprobs' device ({draft_logprobs.device}), "
            f"got {checked.device}"
        )
    if _values_checkable(checked) and not bool(torch.isfinite(checked).all()):
        raise ValueError("features must be finite (NaN or inf would poison what is learned)")
    return checked


def logit(p: Tensor) -> Tensor:
    """``log(p / (1 - p))`` with ``p`` clamped to ``[EPS, 1 - EPS]`` (finite everywhere)."""
    p = p.clamp(EPS, 1 - EPS)
    return p.log() - (-p).log1p()


def clamp_log(p: Tensor, finite: Tensor) -> Tensor:
    """``log p`` with ``p`` clamped to ``[EPS, 1 - EPS]``; ``-inf`` where not ``finite``."""
    return torch.where(finite, p.clamp(EPS, 1 - EPS).log(), float("-inf"))
