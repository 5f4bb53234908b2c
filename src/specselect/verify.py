"""Verification of drafted chains: greedy matching and lossless speculative sampling.

A step drafts ``K`` tokens per request, a selector chooses how many of them (``lengths``) the
target verifies, and the target scores them in one forward pass. Column ``j`` of the target's
output (``[B, K + 1, V]``) is its prediction for draft position ``j`` given the pending token and
draft tokens ``0..j-1``; column ``lengths[i]`` predicts the token after a fully accepted prefix.

Each request emits its accepted draft tokens plus one target token (correction or bonus). The
functions here are pure, batched, keep static shapes and never sync with the host; randomness
comes from an optional ``torch.Generator``. The small building blocks (:func:`accepted_length`,
:func:`gather_columns`, :func:`residual_probs`, :func:`acceptance_probs`) are public because tree
verification reuses them along each root-to-leaf path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specselect._checks import (
    _values_checkable,
    check_counts,
    check_integer_tensor,
    check_same_device,
)
from specselect.sampling import (
    check_floating,
    check_generator,
    check_logits,
    check_probs,
    compute_dtype,
    sample_from,
)
from specselect.selection import leading_run, prefix_mask


def greedy_verify(
    draft_tokens: Tensor,  # [B, K] int64
    lengths: Tensor,  # [B] int64
    target_logits: Tensor,  # [B, K + 1, V]
) -> tuple[Tensor, Tensor]:  # ([B] int64, [B] int64)
    """Accept the leading selected draft tokens that equal the target's argmax.

    Args:
        draft_tokens: ``[B, K]`` integer draft tokens, every entry a valid id in ``[0, V)``.
        lengths: ``[B]`` integer number of selected (verified) tokens per row, ``0..K``. Draft
            tokens after the selected prefix are ignored even when they match.
        target_logits: ``[B, K + 1, V]`` target logits (or probabilities: only the argmax
            matters). Ties go to the lowest token id, as with ``torch.argmax``.

    Returns:
        ``num_accepted`` ``[B]`` int64 in ``0..lengths[i]``, and ``next_token`` ``[B]`` int64:
        the target's argmax at column ``num_accepted`` — the correction after the first mismatch,
        or the bonus token when the whole selected prefix was accepted.
    """
    draft_tokens, lengths, _ = _check_chain(draft_tokens, lengths, target_logits)
    target_logits = check_logits("target_logits", target_logits)
    width = draft_tokens.shape[1]
    target_tokens = target_logits.argmax(dim=-1)  # [B, K + 1]
    matches = draft_tokens == target_tokens[:, :width]  # [B, K]
    num_accepted = accepted_length(matches, lengths)
    next_token = target_tokens.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return num_accepted, next_token


def rejection_verify(
    draft_tokens: Tensor,  # [B, K] int64
    lengths: Tensor,  # [B] int64
    draft_probs: Tensor,  # [B, K, V]
    target_probs: Tensor,  # [B, K + 1, V]
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:  # ([B] int64, [B] int64)
    """Speculative sampling of a selected chain prefix: the emitted tokens follow ``p`` exactly.

    Draft position ``j < lengths[i]`` is accepted with probability ``min(1, p(x) / q(x))``. At
    the first rejection the next token is drawn from ``norm(max(p - q, 0))`` at that column; if
    all ``lengths[i]`` selected tokens are accepted, it is drawn from ``p`` at column
    ``lengths[i]``. The emitted tokens are distributed exactly as sampling from the target
    token by token, provided the choice of ``lengths`` never looks at the token it verifies:
    whether draft position ``j`` is verified may depend on the target-independent draft
    distributions and on draft tokens ``0..j-1`` (and on other rows), but not on token ``j``
    itself (e.g. its ``q(x_j)``) or anything drawn after it.

    Why the restriction: given tokens ``0..j-1``, token ``j`` must still be a fresh draw from
    ``q_j`` when it is verified, or the ``min(1, p/q)`` test is applied to a filtered ``q``.
    Counterexample: ``V = 2``, ``p = (.5, .5)``, ``q = (.9, .1)``, verify ``x_0`` only when
    ``q(x_0) > .2``; token 0 is then emitted with probability ``.9 * 5/9 + .1 * .5 = .55``,
    not ``.5``. A selection score that includes ``q(x_j)`` (plain TETRIS's cumulative draft
    probability, or a threshold on the drafted token's own probability) therefore biases
    sampling; greedy verification is unaffected (its output is the target's argmax whatever is
    verified).

    Args:
        draft_tokens: ``[B, K]`` integer draft tokens, each sampled from its ``draft_probs`` row;
            every entry must be a valid id in ``[0, V)``.
        lengths: ``[B]`` integer selected tokens per row, ``0..K``.
        draft_probs: ``[B, K, V]`` processed draft distribution each draft token was sampled from.
        target_probs: ``[B, K + 1, V]`` processed target distributions (same columns as in
            :func:`greedy_verify`), warped exactly like the draft's.
        generator: optional ``torch.Generator`` on the tensors' device. Draws ``[B, K]`` uniforms
            then ``[B, V]`` exponentials, whatever the values.

    Returns:
        ``num_accepted`` ``[B]`` int64 in ``0..lengths[i]`` and ``next_token`` ``[B]`` int64.
    """
    draft_tokens, lengths, vocab = _check_chain(draft_tokens, lengths, target_probs, "target_probs")
    target_probs = check_probs("target_probs", target_probs, rank=3)
    draft_probs = _check_draft_probs(
        draft_probs, (*draft_tokens.shape, vocab), target_probs, layout="[B, K, V]"
    )
    check_generator(generator, target_probs.device)
    batch, width = draft_tokens.shape
    dtype = compute_dtype(torch.promote_types(draft_probs.dtype, target_probs.dtype))

    accept = acceptance_probs(draft_tokens, draft_probs, target_probs[:, :width], dtype)
    uniforms = torch.rand(
        (batch, width), generator=generator, device=target_probs.device, dtype=dtype
    )
    num_accepted = accepted_length(uniforms < accept, lengths)

    p_next = gather_columns(target_probs, num_accepted).to(dtype)  # [B, V]
    if width == 0:
        return num_accepted, sample_from(p_next, generator)
    rejected = num_accepted < lengths  # [B]
    q_next = gather_columns(draft_probs, num_accepted.clamp(max=width - 1)).to(dtype)  # [B, V]
    # A row with nothing rejected subtracts nothing: its residual is p itself (the bonus).
    q_next = q_next * rejected.unsqueeze(1).to(dtype)
    return num_accepted, sample_from(residual_probs(p_next, q_next), generator)


def accepted_length(
    accept: Tensor,  # [B, K] bool
    lengths: Tensor,  # [B] int64
) -> Tensor:  # [B] int64
    """Length of the leading run of accepted positions within each row's selected prefix: up
    to the first rejection or the end of the prefix."""
    return leading_run(accept & prefix_mask(lengths, accept.shape[1]))


def gather_columns(
    values: Tensor,  # [B, C, V]
    columns: Tensor,  # [B] int64
) -> Tensor:  # [B, V]
    """Row ``i`` of the result is ``values[i, columns[i]]`` (one distribution per row)."""
    index = columns.view(-1, 1, 1).expand(-1, 1, values.shape[-1])
    return values.gather(1, index).squeeze(1)


def acceptance_probs(
    draft_tokens: Tensor,  # [B, K] int64
    draft_probs: Tensor,  # [B, K, V]
    target_probs: Tensor,  # [B, K, V]
    dtype: torch.dtype = torch.float32,
) -> Tensor:  # [B, K]
    """``min(1, p(x) / q(x))`` of each draft token ``x``, in ``dtype``.

    A token the draft gave probability 0 (it cannot have been sampled from ``q``) is accepted
    iff the target gives it positive probability, matching ``p / 0 = inf`` and ``0 / 0 -> 0``;
    ``torch.where`` discards the ``inf``/NaN quotients of those entries.
    """
    index = draft_tokens.unsqueeze(-1)  # [B, K, 1]
    q = draft_probs.gather(-1, index).squeeze(-1).to(dtype)  # [B, K]
    p = target_probs.gather(-1, index).squeeze(-1).to(dtype)  # [B, K]
    return torch.where(q > 0, p / q, (p > 0).to(dtype)).clamp(max=1.0)


def residual_probs(
    target_probs: Tensor,  # [..., V]
    draft_probs: Tensor,  # [..., V]
) -> Tensor:  # [..., V]
    """``norm(max(p - q, 0))``: the distribution to sample from after rejecting a draft of ``q``.

    When ``p == q`` the residual has no mass. A rejection then has probability 0, but it can still
    be reached numerically (or through a token with ``q(x) = p(x) = 0``); instead of dividing by
    zero the row falls back to ``p``, so the result is always a valid distribution. The
    computation runs in float32 or wider.
    """
    dtype = compute_dtype(torch.promote_types(target_probs.dtype, draft_probs.dtype))
    p = target_probs.to(dtype)
    residual = (p - draft_probs.to(dtype)).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)  # [..., 1]
    tiny = torch.finfo(dtype).tiny
    return torch.where(mass > tiny, residual / mass.clamp_min(tiny), p)


def _check_chain(
    draft_tokens: object,
    lengths: object,
    target: object,
    target_name: str = "target_logits",
) -> tuple[Tensor, Tensor, int]:
    """Check the arguments every chain verification shares; return int64 tokens/lengths and V.

    ``target`` must be ``[B, K + 1, V]`` with ``B, K`` from ``draft_tokens``; token ids must lie
    in ``[0, V)`` and ``lengths`` in ``[0, K]`` (values checked where reading them is free).
    """
    tokens, target_t = _check_tokens_and_target(
        "draft_tokens", draft_tokens, target_name, target, layout="[B, K + 1, V]"
    )
    batch, width = tokens.shape
    counts = check_counts("lengths", lengths, batch, tokens.device)
    if _values_checkable(counts) and counts.numel() and bool((counts > width).any()):
        raise ValueError(
            f"lengths must be <= K = {width} (the draft window), got max {int(counts.max())}"
        )
    return tokens, counts.to(torch.int64), target_t.shape[2]


def _check_tokens_and_target(
    tokens_name: str, tokens: object, target_name: str, target: object, *, layout: str
) -> tuple[Tensor, Tensor]:
    """Check draft tokens ``[B, M]`` against the target's output ``[B, M + 1, V]``.

    Shared by chain (``M = K``) and tree (``M = N``) verification, so both accept exactly the
    same inputs: integer token ids in ``[0, V)`` (the verifiers index with them, so a float would
    be truncated and an out-of-range id would read another row's memory or fail deep inside), a
    floating target on the tokens' device. Token values are checked only where
    :mod:`specselect._checks` allows reading them. Returns int64 tokens and the target.
    """
    ids = check_integer_tensor(tokens_name, tokens, rank=2, what="of token ids")
    batch, width = ids.shape
    target_t = check_floating(target_name, target, rank=3)
    if target_t.shape[:2] != (batch, width + 1):
        raise ValueError(
            f"{target_name} must have shape {layout} = [{batch}, {width + 1}, V] for "
            f"{tokens_name} of shape {tuple(ids.shape)}, got {tuple(target_t.shape)}"
        )
    check_same_device(target_name, target_t, tokens_name, ids)
    vocab = target_t.shape[2]
    if _values_checkable(ids) and ids.numel() and not bool(((ids >= 0) & (ids < vocab)).all()):
        raise ValueError(
            f"{tokens_name} must be token ids in [0, {vocab}) (V from {target_name}), got "
            f"values in [{int(ids.min())}, {int(ids.max())}]"
        )
    return ids.to(torch.int64), target_t


def _check_draft_probs(
    value: object, expected: tuple[int, ...], target_probs: Tensor, *, layout: str
) -> Tensor:
    """Check ``draft_probs``: probabilities of shape ``expected`` on ``target_probs``' device."""
    draft_probs = check_probs("draft_probs", value, rank=3)
    if tuple(draft_probs.shape) != expected:
        raise ValueError(
            f"draft_probs must have shape {layout} = {list(expected)}, got "
            f"{tuple(draft_probs.shape)}"
        )
    return check_same_device("draft_probs", draft_probs, "target_probs", target_probs)
