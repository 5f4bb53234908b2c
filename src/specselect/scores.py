"""What a selector may look at when draft tokens are *sampled*: causal scores.

With greedy verification any selection is lossless: the output is the target's argmax whatever
is verified. With speculative *sampling* it is not. Rejection sampling at draft position ``j``
is exact only if, given the tokens before ``j``, the token ``x_j`` it verifies is distributed as
the draft's ``q_j``. A rule that decides whether to verify ``x_j`` by looking at ``q_j(x_j)`` —
the draft probability of that very token, as TETRIS and confidence thresholds do — verifies the
likely tokens and replaces the unlikely ones by fresh target samples, which skews the output.
(With ``q = (.1, .2, .3, .4)``, ``p = (.4, .3, .2, .1)`` and "verify when q(x) >= .3", the
output frequencies are ``(.42, .19, .26, .13)`` instead of ``p``.)

The fix keeps every selector unchanged and changes what it is fed. The score of position ``j``
becomes ``sum_{t<j} log q_t(x_t) + log E_{x~q_j}[q_j(x)]``: the realised probabilities of the
tokens *before* ``j`` (already drawn; deciding on them is a stopping rule, which rejection
sampling tolerates) and, for ``x_j`` itself, the probability the draft *expects* to give its own
sample, ``sum_x q_j(x)^2``, which does not depend on which token was drawn. A running minimum
keeps the scores non-increasing, and :func:`causal_logprobs` returns their increments, which are
valid log-probabilities (<= 0) whose cumulative sum is that score. Whether position ``j`` is
among the best ``C`` then depends only on entries that rank above it, none of which depends on
``x_j``; so TETRIS, thresholds, and every other selector stay lossless on these inputs.

Deterministic drafts (greedy or top-k children) need none of this: a token that is a function of
its prefix may be judged by its own probability.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specselect._checks import check_logprobs, check_same_device


def expected_self_logprob(draft_probs: Tensor) -> Tensor:
    """``log sum_x q(x)^2`` per position: the draft's expected probability of its own sample.

    Args:
        draft_probs: ``[..., V]`` the (processed) distributions the draft tokens are sampled from.

    Returns:
        ``[...]`` float32 (or wider), in ``(-inf, 0]``.
    """
    q = draft_probs.to(torch.promote_types(draft_probs.dtype, torch.float32))
    return q.square().sum(dim=-1).clamp(max=1.0).log()


def causal_logprobs(
    token_logprobs: Tensor,  # [B, K]
    expected_logprobs: Tensor,  # [B, K]
    parents: Tensor | None = None,  # [B, K] int
) -> Tensor:  # [B, K]
    """Per-position (or per-node) log-scores for sampled drafts that keep any selection lossless.

    Args:
        token_logprobs: ``[B, K]`` log q of each sampled draft token (``-inf`` allowed).
        expected_logprobs: ``[B, K]`` :func:`expected_self_logprob` of the distribution each
            token was sampled from.
        parents: optional ``[B, K]`` draft-tree parents (:mod:`specselect.tree`); ``None`` for
            chains. Siblings drawn independently from the same distribution are tried one after
            another by multi-candidate verification, so the ``m``-th sibling is only reached
            after ``m - 1`` rejections: its expected term is discounted by
            ``(1 - E)^(m - 1)`` with ``E = exp(expected_logprobs)``.

    Raises:
        TypeError, ValueError: an input is not a log-probability tensor of the same ``[B, K]``
            shape (values are checked where :mod:`specselect._checks` allows reading them), or
            ``parents`` is not a forest (:func:`specselect.tree.check_parents`).

    Returns:
        ``[B, K]`` values <= 0 whose sum along each root-to-node path is the running minimum,
        along that path, of ``(sum of token_logprobs over strict ancestors) + expected term``.
        A node's value depends only on its ancestors' tokens, its parent's distribution and its
        rank among its siblings — never on its own token or a later sibling's. A ``-inf`` token
        log-prob makes every descendant ``-inf`` but not the node itself.
    """
    from specselect.tree import chain_parents, check_parents, path_reduce, sibling_rank

    token_logprobs = check_logprobs("token_logprobs", token_logprobs)
    expected_logprobs = check_logprobs("expected_logprobs", expected_logprobs)
    if expected_logprobs.shape != token_logprobs.shape:
        raise ValueError(
            "expected_logprobs must have the shape of token_logprobs "
            f"{tuple(token_logprobs.shape)} (one value per node), got "
            f"{tuple(expected_logprobs.shape)}"
        )
    check_same_device("expected_logprobs", expected_logprobs, "token_logprobs", token_logprobs)
    rows, width = token_logprobs.shape
    if parents is None:
        parents = chain_parents(rows, width, device=token_logprobs.device)
    parents = check_parents(parents, rows=rows, width=width)
    check_same_device("parents", parents, "token_logprobs", token_logprobs)

    tokens = token_logprobs.to(torch.promote_types(token_logprobs.dtype, torch.float32))
    expected = expected_logprobs.to(tokens.dtype)
    safe = parents.clamp(min=0)
    has_parent = parents >= 0
    through = path_reduce(tokens, parents, torch.add)  # [B, K] incl. the node itself
    before = torch.where(has_parent, through.gather(1, safe), 0.0)  # strict ancestors only
    earlier_siblings = (sibling_rank(parents) - 1).to(tokens.dtype)
    # 0 * log(0) would be NaN for a first child of a certain distribution: no discount there.
    discount = torch.where(
        earlier_siblings > 0, earlier_siblings * torch.log1p(-expected.exp()), 0.0
    )
    raw = before + expected + discount
    scores = path_reduce(raw, parents, torch.minimum)  # [B, K] non-increasing down paths
    previous = torch.where(has_parent, scores.gather(1, safe), 0.0)
    increments = scores - previous
    # -inf - -inf is NaN: once a path is -inf, every node below it stays -inf.
    return torch.where(previous == float("-inf"), float("-inf"), increments).clamp(max=0.0)
