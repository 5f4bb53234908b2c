"""Logit processing and sampling shared by the drafter, the target and verification.

Speculative sampling is lossless only if the draft distribution ``q`` and the target distribution
``p`` that verification compares are exactly the distributions the tokens are (or would be)
sampled from. Both models therefore go through the same :func:`warp_logits` (temperature, top-k,
top-p, min-p) and the same :func:`sample_from`. Everything is batched over any leading
dimensions, stays on the input's device, keeps static shapes and never reads a value back to
the host, so a decoding loop can call it between two forward passes or capture it in a CUDA
graph.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from specselect._checks import _values_checkable, check_int

NEG_INF = float("-inf")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of internal arithmetic: ``dtype`` promoted to at least float32.

    Half-precision softmaxes and cumulative sums lose enough mass to shift top-p cut-offs and
    acceptance ratios, so every computation here runs in float32 or wider.
    """
    return torch.promote_types(dtype, torch.float32)


def warp_logits(
    logits: Tensor,  # [..., V]
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> Tensor:  # [..., V]
    """Apply temperature, then top-k, then top-p, then min-p to logits (``generate``'s order).

    Args:
        logits: ``[..., V]`` floating logits (any leading shape: ``[B, V]``, ``[B, K, V]``, ...).
        temperature: divides the logits; must be a finite number > 0 (greedy decoding does not
            sample and uses :func:`specselect.verify.greedy_verify` instead).
        top_k: keep the tokens whose logit is at least the ``top_k``-th largest of their row.
            Ties at the boundary are all kept, so the result never depends on an arbitrary order
            among equal logits. ``None`` (or ``top_k >= V``) keeps everything.
        top_p: keep the smallest set of most likely tokens whose probability (after temperature
            and top-k) reaches ``top_p``; the most likely token is always kept. ``None`` or
            ``1.0`` keeps everything.
        min_p: keep the tokens whose probability (after the above) is at least ``min_p`` times
            their row's largest, as HF's ``MinPLogitsWarper``; the most likely token is always
            kept. ``None`` or ``0`` keeps everything.

    Returns:
        ``[..., V]`` logits in float32 or wider, with removed tokens at ``-inf``. Each row is
        processed independently, so draft ``[B, K, V]`` and target ``[B, K + 1, V]`` logits are
        warped identically, which is what keeps speculative sampling lossless.
    """
    logits = check_logits("logits", logits)
    temperature = check_temperature(temperature)
    top_k = None if top_k is None else check_int("top_k", top_k, minimum=1)
    top_p = None if top_p is None else check_top_p(top_p)
    min_p = None if min_p is None else check_min_p(min_p)
    warped = logits.to(compute_dtype(logits.dtype)) / temperature
    vocab = warped.shape[-1]
    if top_k is not None and top_k < vocab:
        warped = _apply_top_k(warped, top_k)
    if top_p is not None and top_p < 1.0:
        warped = _apply_top_p(warped, top_p)
    if min_p:
        warped = _apply_min_p(warped, min_p)
    return warped


def logits_to_probs(
    logits: Tensor,  # [..., V]
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> Tensor:  # [..., V]
    """Softmax of :func:`warp_logits`: the distribution a token is sampled from.

    Returns:
        ``[..., V]`` probabilities in float32 or wider; removed tokens get exactly 0.
    """
    return torch.softmax(warp_logits(logits, temperature, top_k, top_p, min_p), dim=-1)


def sample_from(
    probs: Tensor,  # [..., V]
    generator: torch.Generator | None = None,
) -> Tensor:  # [...]
    """Draw one token per row of ``probs``.

    Uses the exponential race: with ``E_v ~ Exp(1)`` independent, ``argmax_v probs[v] / E_v`` is
    distributed as ``probs / probs.sum()``. Unlike ``torch.multinomial`` it is a fixed sequence of
    elementwise ops and one ``argmax`` over any batch shape: no device-side validation, no
    synchronisation, static shapes.

    Args:
        probs: ``[..., V]`` non-negative weights. Rows need not be normalised (a residual
            ``max(p - q, 0)`` can be passed as is) but must have positive mass; a row of zeros
            returns token 0.
        generator: optional ``torch.Generator`` on the device of ``probs``, for reproducibility.

    Returns:
        ``[...]`` int64 token ids.
    """
    probs = check_probs("probs", probs, rank=None, maximum=None)
    check_generator(generator, probs.device)
    weights = probs.to(compute_dtype(probs.dtype))
    race = torch.empty_like(weights).exponential_(generator=generator)
    # Exp(1) can round to exactly 0; 0 / 0 would be NaN and win the argmax with a zero weight.
    race = race.clamp_min(torch.finfo(race.dtype).tiny)
    return (weights / race).argmax(dim=-1)


def _apply_top_k(logits: Tensor, top_k: int) -> Tensor:  # [..., V] -> [..., V]
    """Set logits below the ``top_k``-th largest of their row to ``-inf`` (ties kept)."""
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, NEG_INF)


def _apply_top_p(logits: Tensor, top_p: float) -> Tensor:  # [..., V] -> [..., V]
    """Keep the smallest most-likely set of each row whose probability reaches ``top_p``.

    A token is removed when the tokens ranked strictly before it already hold ``>= top_p`` of
    the mass; the first token has no predecessors and always stays. The sort is stable, so equal
    logits are ranked by index and the result is deterministic.
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove_sorted = mass_before >= top_p
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, NEG_INF)


def _apply_min_p(logits: Tensor, min_p: float) -> Tensor:  # [..., V] -> [..., V]
    """Remove the tokens less likely than ``min_p`` times their row's most likely one.

    Compared as probabilities, as HF's ``MinPLogitsWarper`` compares them (in log space the
    cut could round the other way at the boundary). The most likely token is at the threshold
    or above (``min_p <= 1``) and always stays, which HF ensures by keeping one token.
    """
    probs = torch.softmax(logits, dim=-1)  # [..., V]
    return logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), NEG_INF)


def check_min_p(value: object) -> float:
    """Return ``value`` as a float, or raise unless it lies in ``[0, 1]`` (0: keep every token)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"min_p must be a float in [0, 1], got {type(value).__name__}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {value}")
    return float(value)


def check_temperature(value: object) -> float:
    """Return ``value`` as a float, or raise unless it is a finite real number > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"temperature must be a float > 0, got {type(value).__name__}")
    if not (math.isfinite(float(value)) and float(value) > 0.0):
        raise ValueError(f"temperature must be a finite float > 0, got {value}")
    return float(value)


def check_top_p(value: object) -> float:
    """Return ``value`` as a float, or raise unless it lies in ``(0, 1]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"top_p must be a float in (0, 1], got {type(value).__name__}")
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {value}")
    return float(value)


def check_generator(generator: object, device: torch.device) -> None:
    """Raise unless ``generator`` is ``None`` or a ``torch.Generator`` for ``device``'s type."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator)}")
    if device.type != "meta" and generator.device.type != device.type:
        raise ValueError(
            f"generator is on {generator.device} but the tensors are on {device}; "
            "create it with torch.Generator(device=...)"
        )


def check_logits(name: str, value: object) -> Tensor:
    """Check ``[..., V]`` logits: floating, ``V >= 1``, every row finite-max (no NaN, no +inf).

    A row of only ``-inf`` has no distribution; it is rejected too. The value check is one
    ``amax`` and runs only where :mod:`specselect._checks` allows reading values.
    """
    t = check_floating(name, value, rank=None)
    if _values_checkable(t) and t.numel():
        row_max = t.amax(dim=-1)  # NaN and +inf propagate; all -inf rows give -inf
        if not bool(torch.isfinite(row_max).all()):
            if bool(torch.isnan(t).any()):
                raise ValueError(f"{name} contains NaN")
            if bool(torch.isposinf(t).any()):
                raise ValueError(f"{name} contains +inf")
            raise ValueError(f"{name} has a row of only -inf logits (no token can be sampled)")
    return t


def check_probs(
    name: str, value: object, *, rank: int | None, maximum: float | None = 1.0
) -> Tensor:
    """Check a ``[..., V]`` tensor of probabilities (or weights when ``maximum`` is None).

    Args:
        name: argument name used in error messages.
        value: the candidate tensor.
        rank: required rank, or ``None`` for any rank >= 1.
        maximum: largest allowed value (1 for probabilities, ``None`` for unnormalised weights).

    Values (no NaN, ``>= 0``, ``<= maximum``) are checked only where :mod:`specselect._checks`
    allows reading them; row sums are not checked, so rounding of half-precision softmaxes and
    unused (e.g. zero-filled) positions are accepted.
    """
    t = check_floating(name, value, rank=rank)
    if _values_checkable(t) and t.numel():
        upper = math.inf if maximum is None else maximum
        if not bool(((t >= 0) & (t <= upper)).all()):
            if bool(torch.isnan(t).any()):
                raise ValueError(f"{name} contains NaN")
            bound = "non-negative" if maximum is None else f"in [0, {maximum:g}]"
            raise ValueError(
                f"{name} must be {bound}, got values in [{float(t.min()):g}, {float(t.max()):g}]"
            )
    return t


def check_floating(name: str, value: object, *, rank: int | None) -> Tensor:
    """Raise unless ``value`` is a floating tensor of the given rank (any rank >= 1 if None)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if rank is None and value.dim() < 1:
        raise ValueError(f"{name} must have a last (vocabulary) dimension, got a 0-dim tensor")
    if rank is not None and value.dim() != rank:
        raise ValueError(
            f"{name} must have rank {rank}, got shape {tuple(value.shape)} (rank {value.dim()})"
        )
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if value.shape[-1] < 1:
        raise ValueError(f"{name} must have a non-empty last (vocabulary) dimension")
    return value
