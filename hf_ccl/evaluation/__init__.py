"""Evaluation: Recall@K, zero-shot accuracy, the task-by-task results matrix and continual-learning metrics."""

from .cache import EmbeddingCache
from .checks import NonFiniteEmbeddingError, NotEvaluatedWarning
from .continual_metrics import (
    average_incremental,
    backward_transfer,
    final_average,
    forgetting,
    forward_transfer,
    summarize,
    tic_backward,
    tic_forward,
    tic_in_domain,
    tic_relative_backward,
    tic_relative_forward,
)
from .encode import encode_images, encode_texts
from .evaluator import evaluate_stream, evaluate_task
from .matrix import ResultsMatrix, ResultsRow
from .plots import plot_matrix_heatmap
from .retrieval import (
    RankCounts,
    captions_to_text_to_image,
    hit_rate,
    image_to_text_rank_counts,
    recall_at_k,
    recall_from_rank_counts,
    similarity_scores,
    single_positive_rank_counts,
    text_to_image_rank_counts,
    unique_texts,
)
from .scoring import EvaluationScorer, evaluation_scorer
from .zeroshot import accuracy_from_scores, zero_shot_accuracy, zero_shot_classifier

__all__ = [
    "EmbeddingCache",
    "EvaluationScorer",
    "NonFiniteEmbeddingError",
    "NotEvaluatedWarning",
    "RankCounts",
    "ResultsMatrix",
    "ResultsRow",
    "accuracy_from_scores",
    "average_incremental",
    "backward_transfer",
    "captions_to_text_to_image",
    "encode_images",
    "encode_texts",
    "evaluation_scorer",
    "evaluate_stream",
    "evaluate_task",
    "final_average",
    "forgetting",
    "forward_transfer",
    "hit_rate",
    "image_to_text_rank_counts",
    "plot_matrix_heatmap",
    "recall_at_k",
    "recall_from_rank_counts",
    "similarity_scores",
    "single_positive_rank_counts",
    "summarize",
    "text_to_image_rank_counts",
    "tic_backward",
    "tic_forward",
    "tic_in_domain",
    "tic_relative_backward",
    "tic_relative_forward",
    "unique_texts",
    "zero_shot_accuracy",
    "zero_shot_classifier",
]
