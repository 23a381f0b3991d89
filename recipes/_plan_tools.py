"""Helpers of ``recipes/plan.py``: the mode constants and the version of its assignment file.

The metrics of an assignment (``expert_rank [L, E]`` plus ``token_rank [T, L]``) and the even token
spread of the planners without token scheduling are
:func:`moelayers.planning.semantic_eval.lar_report` and
:func:`~moelayers.planning.semantic_eval.even_token_rank`, re-exported here for the recipe.
"""

from __future__ import annotations

from moelayers.planning.semantic_eval import even_token_rank, lar_report

__all__ = ["ASSIGNMENT_FORMAT", "DP_MAX_RATIO", "MODES", "even_token_rank", "lar_report"]

DP_MAX_RATIO = 1.3  # no rank holds more than this × the mean tokens per rank in dp mode
MODES = ("tp", "dp")
#: the layout of plan.py's assignment.npz (its ``format_version``; files without it are of format 1),
#: which serve.py's ``layer.placement_path`` reads
ASSIGNMENT_FORMAT = 1
