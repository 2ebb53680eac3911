"""Contiguous pipeline stages from per-layer weights, without torch: the split PyTorch's pipeline
schedules adapter (repro.adapters.torch_pipeline) makes, and the one the cost model predicts."""
from __future__ import annotations


def balance(weights: list[int], stages: int, starts: list[bool] | None = None) -> list[int]:
    """Layers per stage: contiguous stages, each with some weight and beginning where `starts` allows
    (anywhere when None), that minimise the heaviest stage's weight. ValueError when no split fits."""
    count = len(weights)
    starts = starts or [True] * count
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    # best[k][i]: (heaviest stage, cut) splitting the first i layers into k stages
    best = [[(float("inf"), 0)] * (count + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, stages + 1):
        for i in range(k, count + 1):
            best[k][i] = min(
                (max(best[k - 1][j][0], prefix[i] - prefix[j] or float("inf")) if starts[j] else float("inf"), j)
                for j in range(k - 1, i)
            )
    if best[stages][count][0] == float("inf"):
        raise ValueError(f"no split of {count} layers into {stages} stages gives every stage parameters")
    sizes, end = [], count
    for k in range(stages, 0, -1):
        start = best[k][end][1]
        sizes.append(end - start)
        end = start
    return sizes[::-1]
