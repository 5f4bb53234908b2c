"""Prompt-lookup agreement: does a draft token continue an n-gram the way the context did?

Text repeats itself (code most of all: names, call patterns, whole lines), and where it does,
the target tends to continue a repeated n-gram as it continued it before. Prompt-lookup
decoding drafts from that alone. Here it is a *feature* of each draft token, for a learned
acceptance estimator (:class:`~specselect.estimators.RequestHistory`): take the token's own
context (the committed tokens, then the draft tokens before it on its chain or tree path),
find the longest suffix of at most :data:`MAX_NGRAM` tokens that occurs earlier in the
committed tokens, and ask whether the token that followed its most recent occurrence is the
draft token. On the shipped pair, draft tokens that agree are accepted far more often than
their draft probability says, and ones that contradict a long match far less.

Everything is static-shaped device code: the committed tokens are a right-aligned window of
the last ``W`` tokens (:data:`LOOKUP_WINDOW` in the decoding loop and in replay), and every
token is compared with every window position at once (``[B, N, MAX_NGRAM, W]`` booleans), with
no host read, so a loop can compute the features inside a captured draft stage.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specselect._checks import (
    _values_checkable,
    check_integer_tensor,
    check_ints,
    check_non_negative,
    check_same_device,
    values_trusted,
)
from specselect.constants import arange_constant, cached_constant

MAX_NGRAM = 4  # the longest suffix looked up
LOOKUP_WINDOW = 256  # committed tokens searched, the most recent ones
LOOKUP_FEATURES = 4  # see lookup_features


def chain_paths(width: int, device: torch.device) -> Tensor:  # -> [width, width] int64
    """The draft path of each chain position, as :func:`lookup_features` takes it: position
    ``j``'s path is positions ``0..j`` (``-1`` beyond), as a draft tree's
    :attr:`~specselect.tree.TreeBuffers.paths` would give for a chain."""
    index = torch.arange(width, device=device)
    return torch.where(index.unsqueeze(0) <= index.unsqueeze(1), index.unsqueeze(0), -1)


def lookup_matches(
    window: Tensor,  # [B, W] int64 committed tokens, right-aligned
    filled: Tensor,  # [B] int64 how many of the window's last entries are tokens
    tokens: Tensor,  # [B, N] int64 draft tokens (chain positions or tree nodes)
    paths: Tensor,  # [B, N, D] or [N, D] int64 each token's path, itself last, -1 padded
) -> tuple[Tensor, Tensor]:  # length [B, N] int64, agrees [B, N] bool
    """For each draft token: the length of the longest suffix of its context (at most
    :data:`MAX_NGRAM`; 0 if none) found earlier in the window, and whether the window's token
    after the most recent occurrence of that suffix is the draft token.

    A token's context is the committed tokens followed by its path's tokens before itself
    (``paths[b, n, d]`` is the index in ``tokens`` of the path's token at depth ``d + 1``; a
    token at depth ``t`` has entries ``0..t-1``, the last one itself, then ``-1``). Occurrences
    are searched in the committed tokens only, the follower included.
    """
    if not values_trusted():  # (a loop's own tensors, every step: checked by construction)
        _check_lookup(window, filled, tokens, paths)
    rows, width = window.shape
    nodes = tokens.shape[1]
    paths = paths.expand(rows, nodes, paths.shape[-1])  # [B, N, D]
    depth = (paths >= 0).sum(dim=2)  # [B, N], >= 1
    path_tokens = tokens.gather(1, paths.clamp(min=0).reshape(rows, nodes * paths.shape[2]))
    path_tokens = path_tokens.view(paths.shape)  # [B, N, D]
    suffix = _suffixes(window, filled, path_tokens, depth)  # [B, N, M], -2 where none
    # shifted[b, i, q] = window[b, q - i - 1]: the token i + 1 before follower position q.
    start = width - filled  # [B] first filled column
    columns = arange_constant(width, window.device)  # [W]
    source = cached_constant(("lookup_sources", width, window.device), _sources)  # [M, W]
    readable = source.unsqueeze(0) >= start.view(rows, 1, 1)  # [B, M, W]
    shifted = window.gather(1, source.clamp(min=0).view(1, -1).expand(rows, -1))
    shifted = torch.where(readable, shifted.view(rows, MAX_NGRAM, width), -1)  # [B, M, W]
    equal = shifted.unsqueeze(1) == suffix.unsqueeze(3)  # [B, N, M, W]
    # At each follower position q, the length of the longest suffix that occurs there: the
    # count of leading distances that match (boolean ands, no cumulative product).
    run = equal[:, :, 0]  # [B, N, W]
    matched = run.to(torch.int32)
    for i in range(1, MAX_NGRAM):
        run = run & equal[:, :, i]
        matched += run
    # The longest match wins, then the most recent: one max over length * W + q.
    best = (matched * width + columns).amax(dim=2)  # [B, N]
    length, follower = best // width, best % width
    followed_by = window.gather(1, follower)  # [B, N]
    return length, (length > 0) & (followed_by == tokens)


def lookup_features(
    window: Tensor, filled: Tensor, tokens: Tensor, paths: Tensor
) -> Tensor:  # -> [B, N, LOOKUP_FEATURES] float32
    """``[agrees, contradicts, agrees · length / M, length / M]`` per draft token (see
    :func:`lookup_matches` for the arguments; ``M`` = :data:`MAX_NGRAM`): a match that agrees,
    one that names another token, and how long the match is, with and without agreement (a
    long match that agrees is stronger evidence than a one-token one)."""
    length, agrees = lookup_matches(window, filled, tokens, paths)
    scaled = length.to(torch.float32) / MAX_NGRAM
    agree = agrees.to(torch.float32)
    contradicts = (length > 0).to(torch.float32) - agree
    return torch.stack([agree, contradicts, agree * scaled, scaled], dim=2)


def _check_window(window: Tensor, filled: Tensor) -> None:
    """``window`` ``[B, W]`` int64 and ``filled`` ``[B]`` int64 on its device, in ``[0, W]``."""
    if not isinstance(window, Tensor) or window.dim() != 2 or window.dtype != torch.int64:
        got = f"{window.dtype} {tuple(window.shape)}" if isinstance(window, Tensor) else window
        raise TypeError(f"window must be a [B, W] int64 tensor of token ids, got {got}")
    rows, width = window.shape
    check_non_negative("filled", check_ints("filled", filled, (rows,), window.device))
    _check_at_most("filled", filled, width, "the window's width")


def _check_at_most(name: str, t: Tensor, bound: int, what: str) -> None:
    """A value check (skipped where values are not cheaply readable, as in the loop)."""
    if _values_checkable(t) and t.numel() and int(t.max()) > bound:
        raise ValueError(f"{name} must be <= {what} ({bound}), got max {int(t.max())}")


def _check_rows(name: str, value: object, window: Tensor) -> Tensor:
    """``value`` as a ``[B, T]`` integer tensor with the window's rows, on its device."""
    t = check_integer_tensor(name, value, rank=2)
    return check_ints(name, t, (window.shape[0], t.shape[1]), window.device)


def _check_push(window: Tensor, filled: Tensor, tokens: Tensor, counts: Tensor) -> None:
    """The arguments of :func:`push_tokens`."""
    _check_window(window, filled)
    check_non_negative("tokens", _check_rows("tokens", tokens, window))
    check_non_negative("counts", check_ints("counts", counts, (window.shape[0],), window.device))
    _check_at_most("counts", counts, tokens.shape[1], "the tokens per row, tokens.shape[1]")


def _check_lookup(window: Tensor, filled: Tensor, tokens: Tensor, paths: Tensor) -> None:
    """The arguments of :func:`lookup_matches`: shapes, dtypes and devices (free to check),
    and where values are readable, token ids >= 0 (a negative one would match the window's
    marker for an unreadable column) and paths of node indices in ``[-1, N)``."""
    _check_window(window, filled)
    rows, nodes = check_non_negative("tokens", _check_rows("tokens", tokens, window)).shape
    if not isinstance(paths, Tensor) or paths.dim() not in (2, 3):
        raise TypeError("paths must be a [B, N, D] or [N, D] integer tensor")
    check_integer_tensor("paths", paths, rank=paths.dim())
    if paths.shape[-2] != nodes or (paths.dim() == 3 and paths.shape[0] != rows):
        raise ValueError(
            f"paths must be [B, N, D] or [N, D] with B = {rows} and N = {nodes} (one path per "
            f"token), got {tuple(paths.shape)}"
        )
    check_same_device("paths", paths, "window", window)
    if _values_checkable(paths) and paths.numel():
        low, high = int(paths.min()), int(paths.max())
        if low < -1 or high >= nodes:
            raise ValueError(
                f"paths must hold node indices in [-1, {nodes}) (-1: none), got values from "
                f"{low} to {high}"
            )


def _columns(width: int, device: torch.device) -> Tensor:  # -> [W] int64
    return torch.arange(width, device=device)


def _distances(device: torch.device) -> Tensor:  # -> [M] int64
    return torch.arange(1, MAX_NGRAM + 1, device=device)


def _sources(width: int, device: torch.device) -> Tensor:  # -> [M, W] int64
    """``[i, q]``: the window column ``i + 1`` before follower column ``q`` (negative: none)."""
    return _columns(width, device).unsqueeze(0) - _distances(device).unsqueeze(1)


def _suffixes(
    window: Tensor, filled: Tensor, path_tokens: Tensor, depth: Tensor
) -> Tensor:  # -> [B, N, M] int64
    """``[b, n, i]``: the token ``i + 1`` before token ``n`` in its context (its path's earlier
    tokens, then the window's last ones), ``-2`` where the context is shorter (``-2`` never
    equals a token nor the ``-1`` of an unreadable window entry)."""
    rows, width = window.shape
    distance = cached_constant(("lookup_distances", window.device), _distances)  # [M]
    # Depth along the path of the token i + 1 before: <= 0 means in the window.
    at = depth.unsqueeze(2) - distance  # [B, N, M]
    on_path = path_tokens.gather(2, (at - 1).clamp(min=0))  # [B, N, M]
    column = width + at - 1  # window column when at <= 0
    in_window = window.gather(1, column.clamp(0, width - 1).reshape(rows, at.shape[1] * MAX_NGRAM))
    in_window = in_window.view(at.shape)  # [B, N, M]
    readable = column >= (width - filled).view(rows, 1, 1)
    return torch.where(at > 0, on_path, torch.where(readable, in_window, -2))


def push_tokens(
    window: Tensor,  # [B, W] int64
    filled: Tensor,  # [B] int64
    tokens: Tensor,  # [B, T] int64
    counts: Tensor,  # [B] int64, the first counts[b] of tokens[b] are appended
) -> None:
    """Append each row's first ``counts`` tokens to its window, in place: the oldest drop out
    on the left. Static shapes: one gather over ``[B, W + T]``.

    Raises:
        TypeError, ValueError: tensors of other ranks, shapes, dtypes or devices than those
            above; ``counts`` outside ``[0, T]`` (a value check, where values are readable:
            more than ``T`` repeated the last token and overstated ``filled``). Nothing is
            checked inside :func:`~specselect._checks.trusted_values` (a loop's own tensors).
    """
    if not values_trusted():  # (a loop's own tensors, every step: checked by construction)
        _check_push(window, filled, tokens, counts)
    width, appended = window.shape[1], tokens.shape[1]
    joined = torch.cat([window, tokens], dim=1)  # [B, W + T]
    source = torch.arange(width, device=window.device).unsqueeze(0) + counts.unsqueeze(1)
    window.copy_(joined.gather(1, source.clamp(max=width + appended - 1)))
    filled.add_(counts).clamp_(max=width)
