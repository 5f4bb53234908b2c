"""Exact trace replay of greedy speculative decoding, and the oracle selector.

Under greedy verification the output of speculative decoding is the target's greedy sequence,
whatever the selector does: a selector only changes *how many steps* it takes to emit it. So one
recording per prompt is enough to replay any selector exactly, for free:

* the target's greedy output ``y[0:T]`` (``T = max_new_tokens``; EOS does **not** stop a request,
  every request runs to ``T`` tokens, so that all selectors emit the same tokens);
* for every output position ``t``, the draft's ``max_k``-token greedy continuation of
  ``prompt + y[:t]`` with the log-probability of each drafted token, and the *run length*
  ``run[t]``: how many leading drafted tokens equal ``y[t:]``.

A request at position ``t`` that the selector gives ``L`` tokens accepts ``min(L, run[t])`` of
them (the target accepts a drafted token iff it equals its own greedy token, and the first
``run[t]`` drafted tokens are exactly the target's next tokens), emits one more target token and
advances by ``min(L, run[t]) + 1``. :func:`replay` streams requests through a fixed number of
batch slots, refilling a finished request's slot from the queue, because the composition of the
batch is what a batch-level selector such as TETRIS exploits.

End of a request (the convention the decoding loop follows too): a request that may still emit
``remaining`` tokens offers no draft token at positions ``j >= remaining - 1`` (their log-probs
are ``-inf``), since every step emits accepted + 1 tokens. Runs therefore only need to be exact
inside the output, and are recorded against ``y[0:T]``.

This package is an offline tool: the replay loop reads values back to the host freely, but each
step is vectorised over the batch slots. :class:`OracleSelector` is replay-only: it is handed the
true run lengths, which no real decoding loop knows.

Where things live (everything is importable from ``specselect.replay`` itself):

* :mod:`specselect.replay.traces` — :class:`Traces`, :func:`match_runs`, the trace file format
  (:func:`save_traces`, :func:`load_traces`) and recording (:func:`record_traces`,
  :func:`greedy_continue`, :func:`left_pad`), and :func:`traces_summary`;
* :mod:`specselect.replay.oracle` — :class:`OracleSelector`;
* :mod:`specselect.replay.engine` — the replay loop (:func:`iter_replay`, :func:`replay`,
  :class:`ReplayStep`, :class:`ReplayResult`, :func:`end_of_row_logprobs`, reliability bins);
* :mod:`specselect.replay.grid` — selector grids and comparisons (:class:`SelectorConfig`,
  :func:`selector_grid`, :func:`compare_replay`);
* :mod:`specselect.replay.results` — :class:`ResultRow`, one configuration's result in a
  comparison (replayed or live), the row type of :mod:`specselect.report`;
* :mod:`specselect.replay.live` — live comparisons that run ``speculative_generate`` and
  measure wall-clock goodput (:func:`compare_live`, :func:`live_totals`,
  :func:`oracle_row`);
* :mod:`specselect.replay.provenance` — checks before reusing a trace file: the grid fits it
  (:func:`check_trace_shape`), and it was recorded from these models
  (:func:`check_trace_models`, :func:`model_differences`, :func:`describe_model`) and prompts
  (:func:`check_trace_prompts`); they raise :class:`TraceMismatchError`. :func:`reuse_traces`
  applies them all: the policy for reusing recorded traces. :func:`cost_model_differences`
  says whether a cost model was measured on the traces' models.
"""

from __future__ import annotations

from specselect.replay.engine import (
    RELIABILITY_BINS,
    ReplayResult,
    ReplayStep,
    end_of_row_logprobs,
    iter_replay,
    replay,
)
from specselect.replay.grid import (
    DEFAULT_THRESHOLD,
    NO_ESTIMATOR,
    SelectorConfig,
    compare_replay,
    selector_grid,
)
from specselect.replay.live import compare_live, live_totals, oracle_row
from specselect.replay.oracle import OracleSelector
from specselect.replay.provenance import (
    TraceMismatchError,
    check_trace_models,
    check_trace_prompts,
    check_trace_shape,
    cost_model_differences,
    model_differences,
    reuse_traces,
)
from specselect.replay.results import MEASURED, MODELLED, ResultRow
from specselect.replay.traces import (
    TRACE_FORMAT,
    TRACE_VERSION,
    Traces,
    describe_model,
    greedy_continue,
    left_pad,
    load_traces,
    match_runs,
    record_traces,
    save_traces,
    traces_summary,
)

__all__ = [
    "DEFAULT_THRESHOLD",
    "MEASURED",
    "MODELLED",
    "NO_ESTIMATOR",
    "RELIABILITY_BINS",
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "OracleSelector",
    "ReplayResult",
    "ReplayStep",
    "ResultRow",
    "SelectorConfig",
    "TraceMismatchError",
    "Traces",
    "check_trace_models",
    "check_trace_prompts",
    "check_trace_shape",
    "compare_live",
    "compare_replay",
    "cost_model_differences",
    "describe_model",
    "end_of_row_logprobs",
    "greedy_continue",
    "iter_replay",
    "left_pad",
    "live_totals",
    "load_traces",
    "match_runs",
    "model_differences",
    "oracle_row",
    "record_traces",
    "replay",
    "reuse_traces",
    "save_traces",
    "selector_grid",
    "traces_summary",
]
