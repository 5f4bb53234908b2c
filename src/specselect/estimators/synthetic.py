"""Synthetic greedy traces whose draft has a known calibration.

Estimators are judged by how well their scores rank draft tokens by the chance that the target
accepts them. On a trained pair the truth is unknown, so this module writes traces where it is
known: each output position ``t`` of a request has a true acceptance probability ``a[t]``, the
draft's token there is accepted with that probability, and the draft *reports* a probability
``q = f(a)`` whose relation to ``a`` is chosen (see :data:`CALIBRATIONS`):

* ``"calibrated"``: ``q = a`` — the draft's probability is the truth, so the paper's ranking is
  the best one can do from the draft alone;
* ``"under-confident"``: ``q = a^g`` with ``g = 1`` for half the requests and ``g = UNDER``
  for the other half — every token is accepted at least as often as the draft says, and on
  half the requests far more often (like the shipped pair, whose draft agrees with its target
  on 78% of prose tokens but 49% of code tokens at similar probabilities);
* ``"over-confident"``: ``q = a^(1/g)``, the same with the draft claiming more than the truth;
* ``"uninformative"``: ``q`` uniform on ``[0.05, 0.95]``, independent of ``a``.

Why the exponent varies by request: one power ``g`` for every token scales every cumulative
log-probability by ``g``, which leaves TETRIS's ranking unchanged, so a draft miscalibrated
that way ranks exactly as well as a calibrated one. (A miscalibration that is the same for
every token, such as ``a = 0.4 + 0.6 q``, moves the ranking little: the draft's probability
still ranks as well as the truth within about a point of tokens per step.) A per-request
exponent is what a learned estimate can fix and the draft's own ranking cannot.

Acceptance probabilities have request structure, as on real pairs: ``logit a[t] = mean +
offset_request + noise_t`` with ``offset ~ N(0, request_spread)`` and ``noise ~ N(0,
token_spread)``; ``request_spread = 0`` makes all requests alike, and with an uninformative
draft then nothing predicts acceptance.

The traces follow the replay conventions (:mod:`specselect.replay`): the target emits random
tokens (uniform over ``SYNTHETIC_VOCAB`` ids: text with no structure a context feature could
read), and the draft's continuation from position ``t`` proposes the target's token at offset
``j`` iff the draft "agrees" at ``t + j``, a Bernoulli(``a[t + j]``) draw shared by every window
that covers ``t + j``, so that the run lengths of overlapping windows are consistent.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specselect._checks import check_int

if TYPE_CHECKING:
    from specselect.replay.traces import Traces

__all__ = ["CALIBRATIONS", "reported_probability", "synthetic_traces"]

CALIBRATIONS = ("calibrated", "over-confident", "under-confident", "uninformative")
"""The draft calibrations :func:`synthetic_traces` can write."""

UNDER = 6.0  # the exponent of the miscalibrated half of the requests (module doc)
SYNTHETIC_VOCAB = 32000  # token ids of the synthetic text
SYNTHETIC_PROMPT = 4  # prompt tokens of each synthetic request


def _powers(acceptance: Tensor, generator: torch.Generator) -> Tensor:
    """``[N, 1]`` per-request exponent: 1 or :data:`UNDER`, each with probability 1/2
    (``acceptance`` is ``[N, T]``)."""
    miscalibrated = torch.rand(acceptance.shape[0], 1, generator=generator) < 0.5
    return torch.where(miscalibrated, UNDER, 1.0)


def reported_probability(
    acceptance: Tensor, calibration: str, generator: torch.Generator
) -> Tensor:
    """The probability the draft reports for tokens of true ``acceptance`` (``[N, T]``, one
    row per request), in ``[0.01, 1]``, under one of :data:`CALIBRATIONS` (module doc)."""
    _check_calibration(calibration)
    if calibration == "calibrated":
        q = acceptance
    elif calibration == "over-confident":
        q = acceptance ** (1 / _powers(acceptance, generator))
    elif calibration == "under-confident":
        q = acceptance ** _powers(acceptance, generator)
    else:  # uninformative
        q = 0.05 + 0.9 * torch.rand(acceptance.shape, generator=generator)
    return q.clamp(0.01, 1.0)


def _check_calibration(calibration: object) -> None:
    if calibration not in CALIBRATIONS:
        raise ValueError(
            f"calibration must be one of {', '.join(CALIBRATIONS)}, got {calibration!r}"
        )


def synthetic_traces(
    calibration: str,
    *,
    requests: int = 64,
    length: int = 64,
    width: int = 8,
    mean: float = 0.8,
    request_spread: float = 1.0,
    token_spread: float = 1.5,
    seed: int = 0,
) -> Traces:
    """Greedy traces of ``requests`` requests, ``length`` tokens each, ``width`` draft tokens
    per position, with a draft of the given ``calibration`` (see the module doc).

    Args:
        calibration: one of :data:`CALIBRATIONS`.
        requests: number of requests ``N``.
        length: tokens per request ``T``.
        width: draft tokens recorded per position (the traces' ``max_k``).
        mean: mean logit of the true acceptance probability.
        request_spread: standard deviation of each request's logit offset.
        token_spread: standard deviation of each token's logit noise.
        seed: seeds everything drawn.

    Returns:
        :class:`~specselect.replay.Traces` (``meta`` records the arguments).
    """
    from specselect.replay.traces import Traces

    _check_calibration(calibration)  # before drawing anything
    n = check_int("requests", requests, minimum=1)
    length = check_int("length", length, minimum=1)
    width = check_int("width", width, minimum=1)
    # Finite: a NaN (or an infinite spread times a zero draw) would write NaN log-probs.
    if not math.isfinite(mean):
        raise ValueError(f"mean must be a finite float, got {mean}")
    for name, value in (("request_spread", request_spread), ("token_spread", token_spread)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite float >= 0, got {value}")
    g = torch.Generator().manual_seed(seed)
    total = length + width
    offsets = request_spread * torch.randn(n, 1, generator=g)  # [N, 1]
    noise = token_spread * torch.randn(n, total, generator=g)  # [N, T + K]
    acceptance = torch.sigmoid(mean + offsets + noise)  # [N, T + K]
    agree = torch.rand(n, total, generator=g) < acceptance  # [N, T + K]
    q = reported_probability(acceptance, calibration, g)  # [N, T + K]
    # Random text, prompts included, drawn last (the numbers above do not depend on it): the
    # tokens carry the agreement and nothing else, so a feature of the context (prompt lookup)
    # finds no structure to learn from, where tokens 0 and 1 would spell out the outcomes (and
    # a prompt of one repeated token, a match at every request's first draft token).
    text = torch.randint(1, SYNTHETIC_VOCAB, (n, total), generator=g)  # [N, T + K]
    prompts = torch.randint(1, SYNTHETIC_VOCAB, (n, SYNTHETIC_PROMPT), generator=g)  # [N, P]
    drafted = torch.where(agree, text, text % (SYNTHETIC_VOCAB - 1) + 1)  # != text if not agree
    # Window t covers positions t .. t + K - 1.
    draft_tokens = drafted.unfold(1, width, 1)[:, :length].contiguous()  # [N, T, K]
    logprobs = q.log().unfold(1, width, 1)[:, :length].contiguous()  # [N, T, K]
    meta = {
        "synthetic": {
            "calibration": calibration,
            # Plain Python numbers: a NumPy scalar is no JSON value, which Traces refuse.
            "mean": float(mean),
            "request_spread": float(request_spread),
            "token_spread": float(token_spread),
            "seed": int(seed),
        }
    }
    return Traces(list(prompts), text[:, :length].contiguous(), draft_tokens, logprobs, meta)
