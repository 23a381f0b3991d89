"""Online scheduling: where requests go (attention-DP) and where tokens go (attention-TP).

- :mod:`moelayers.schedule.requests`: ``SemanticScheduler`` (Sem-MoE Algorithm 2) and
  ``RoundRobinScheduler``, both ``assign(token_ids) -> rank``.
- :mod:`moelayers.schedule.token_shuffle`: the attention-TP rebatch — the plan's fitted rank
  predictor over token ids and the previous layers' experts (``HistoryPredictor``, ``rebatch_history``,
  price-balanced into equal chunks), or Sem-MoE Algorithm 3 for plans without it — and the shuffled
  reduce-scatter / all-gather that carry it.
"""

from moelayers.schedule.requests import RequestScheduler, RoundRobinScheduler, SemanticScheduler
from moelayers.schedule.token_shuffle import (
    HistoryPredictor,
    LayerTables,
    Rebatch,
    balanced_ranks,
    inverse_permutation,
    predict_ranks,
    rebatch,
    rebatch_history,
    rebatch_tokens,
    shuffled_all_gather,
    shuffled_reduce_scatter,
)

__all__ = [
    "HistoryPredictor", "balanced_ranks", "rebatch_history", "LayerTables", "Rebatch", "RequestScheduler", "RoundRobinScheduler", "SemanticScheduler", "inverse_permutation",
    "predict_ranks", "rebatch", "rebatch_tokens", "shuffled_all_gather", "shuffled_reduce_scatter",
]
