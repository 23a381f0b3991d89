"""Online scheduling (DESIGN.md §3): where requests go (attention-DP) and where tokens go (attention-TP).

- :mod:`moelayers.schedule.requests`: ``SemanticScheduler`` (Sem-MoE Algorithm 2) and
  ``RoundRobinScheduler``, both ``assign(token_ids) -> rank``.
- :mod:`moelayers.schedule.token_shuffle`: the attention-TP rebatch (Sem-MoE Algorithm 3) and the
  shuffled reduce-scatter / all-gather that carry it.
"""

from moelayers.schedule.requests import RequestScheduler, RoundRobinScheduler, SemanticScheduler
from moelayers.schedule.token_shuffle import (
    LayerTables,
    Rebatch,
    inverse_permutation,
    predict_ranks,
    rebatch,
    rebatch_tokens,
    shuffled_all_gather,
    shuffled_reduce_scatter,
)

__all__ = [
    "LayerTables", "Rebatch", "RequestScheduler", "RoundRobinScheduler", "SemanticScheduler", "inverse_permutation",
    "predict_ranks", "rebatch", "rebatch_tokens", "shuffled_all_gather", "shuffled_reduce_scatter",
]
