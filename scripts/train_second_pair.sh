#!/usr/bin/env bash
# The second tiny pair that benchmarks/bench_replay_goals.py measures next to the shipped one.
# Same architectures and target recipe as the shipped pair, trained on other code (a ~12M-
# character sample of site-packages instead of the standard library), in two stages:
#
# 1. target + a draft distilled with KL, as for the shipped pair (~38 min on one shared CPU
#    thread), written to OUT_DIR-kl. That draft is a near copy of a flat target (greedy
#    agreement 0.82, but top probabilities far below it): badly under-confident;
# 2. the pair itself: the same target, and a draft trained with cross-entropy against the
#    target's greedy token (~10 min), whose confidence predicts greedy acceptance (peakier and
#    better calibrated), written to OUT_DIR.
#
# Weights stay outside the package:
#
#     scripts/train_second_pair.sh [OUT_DIR]     # default /work/pairs/second
#     python benchmarks/bench_replay_goals.py --pair OUT_DIR
set -euo pipefail
out="${1:-/work/pairs/second}"
here="$(cd "$(dirname "$0")" && pwd)"
common=(--corpus site-packages --corpus-chars 12000000 --seed 0 --threads 1)
python "$here/train_tiny_pair.py" "${common[@]}" --target-steps 1200 --draft-steps 900 \
    --out "$out-kl"
python "$here/train_tiny_pair.py" "${common[@]}" --target-from "$out-kl" --draft-loss argmax \
    --draft-steps 900 --out "$out"
