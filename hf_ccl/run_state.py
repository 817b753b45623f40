"""What a continual run carries from task to task and across a resume, apart from the loop that runs it.

`ContinualLearner` holds one `RunState` (`learner.run_state`; `learner.results`, `learner.global_step`,
`learner.tokenizer`, ... are its fields); a task checkpoint is this state plus the model and its processor, written
and read by the functions of `hf_ccl.checkpointing`, which take it (and nothing of the learner) as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from .callbacks import TaskCallback
from .evaluation.matrix import ResultsMatrix
from .methods.base import ContinualMethod


@dataclass
class RunState:
    """The state of a continual run besides the model's weights: what a task checkpoint saves and a resume
    restores."""

    #: The results matrix so far (one row per evaluation).
    results: ResultsMatrix
    #: The tokenizer the model trains and evaluates with (a method may grow it: `TaskContext.replace_tokenizer`).
    tokenizer: PreTrainedTokenizerBase
    #: The methods; each one's `state_dict()` is saved (`method_state.json` / `.safetensors`).
    methods: list[ContinualMethod]
    #: What a resume must match (`hf_ccl.resume_settings.run_settings`), stored in every checkpoint.
    settings: dict[str, Any]
    #: The task callbacks; those with state (`TaskCallback.state_dict`) are saved (`callback_state.json`).
    callbacks: list[TaskCallback] = field(default_factory=list)
    #: Dotted setting keys (fnmatch patterns) a resume may change (`resume_allow_changes`).
    allow_changes: list[str] = field(default_factory=list)
    #: The changes allowed at the resumes so far, each `{"after_task", "key", "saved", "now"}` (shown in the card).
    resume_changes: list[dict[str, Any]] = field(default_factory=list)
    #: Optimizer steps over the stream so far: the step `training.report_to` logs at.
    global_step: int = 0
    #: What every checkpoint records for its readers (the model card) besides: `base_model`, `seed`, `training`,
    #: `first_task_epochs`, `card_license`.
    description: dict[str, Any] = field(default_factory=dict)
