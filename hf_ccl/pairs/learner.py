"""`PairStreamLearner`: learner heads trained on a stream of modality pairs (CMCL, spec cmcl.md §2.5), one
`PairTrainer` per task, with the task-by-task results matrix, checkpoints and resume.

Per task k (Alg. 1): methods' `on_task_start` (DNS builds its projectors) → train the pair's two heads (all other
heads frozen, spec §2.1) → methods' `on_task_end` (covariances, memories, Fisher) → evaluate every task (Recall@K,
and the drift of each earlier task's train alignment matrix from right after it was learned, Def. 1) → checkpoint
`output_dir/task-<k>/`: the heads, every method's state, the results so far, the per-task timings, and, when a CLIP
is given, that CLIP with the image and text heads folded into its projections (`fold_into_clip`), so the folder
loads with plain `CLIPModel.from_pretrained`. With `hub_model_id` each folder is pushed (main + branch task-<k>).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.func import functional_call
from transformers import CLIPModel, TrainingArguments

from ..distributed import barrier, is_main_process
from ..evaluation.matrix import INITIAL_LABEL, ResultsMatrix
from ..hub import HubPusher, PushReport
from ..methods.state import load_method_states, save_method_states
from .encoders import ModalityEncoder
from .evaluate import alignment_matrix, evaluate_pair, relative_drift
from .features import FeaturePairs, TaskFeatures, encode_task
from .heads import SIMILARITIES, LearnerHeads, fold_into_clip
from .methods.base import PairMethod, PairTaskContext, build_pair_methods
from .objective import PairObjective
from .task import PairStream
from .trainer import PairTrainer

logger = logging.getLogger(__name__)

HEADS_FILE = "learner_heads.safetensors"
SNAPSHOTS_FILE = "heads_after_each_task.safetensors"
STATE_FILE = "pair_stream.json"
METHOD_STATE_DIR = "hf_ccl"
HEADLINE = "R@1"


@dataclass
class PairStreamArguments:
    """Options of a modality-pair run (defaults: the paper's, spec §3)."""

    output_dir: str = field(
        metadata={"help": "Run folder; task k's checkpoint goes to <output_dir>/task-<k>/."}
    )
    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW learning rate (paper 1e-4)."})
    weight_decay: float = field(default=1e-3, metadata={"help": "Decoupled weight decay (paper 1e-3)."})
    batch_size: int = field(default=64, metadata={"help": "Pairs per batch and process (paper 64)."})
    epochs: float = field(default=5.0, metadata={"help": "Epochs per task (paper 5)."})
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Gradient-norm clipping (HF default, as the code)."}
    )
    optim: str = field(
        default="adamw_torch", metadata={"help": "Trainer optimizer; 'sgd' to check the theory."}
    )
    temperature: float | None = field(
        default=None,
        metadata={"help": "τ of Eq. 2; None: 1/exp(logit_scale) of the given CLIP, else 1 (A10)."},
    )
    similarity: str = field(
        default="dot", metadata={"help": "'dot' (paper, raw inner products) or 'cosine'."}
    )
    symmetric: bool = field(
        default=False, metadata={"help": "Both loss directions (paper: anchor = modality a)."}
    )
    head_bias: bool = field(
        default=False, metadata={"help": "Heads with a bias (official code); not foldable."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the heads' training (task k uses seed + k)."})
    evaluate_initial: bool = field(
        default=True, metadata={"help": "Evaluate the identity heads (the prior) first."}
    )
    resume: bool = field(
        default=True, metadata={"help": "Continue from the newest complete task-<k>/ folder."}
    )
    fold_image_modality: str | None = field(
        default="image",
        metadata={"help": "Head folded into CLIP's visual_projection when saving (None: no CLIP)."},
    )
    fold_text_modality: str | None = field(
        default="en", metadata={"help": "Head folded into CLIP's text_projection when saving."}
    )
    logging_steps: int = field(default=10, metadata={"help": "Trainer logging interval."})
    hub_model_id: str | None = field(default=None, metadata={"help": "Hub repository to push every task to."})
    hub_private_repo: bool = field(default=False, metadata={"help": "Create the Hub repository private."})

    def __post_init__(self) -> None:
        if self.similarity not in SIMILARITIES:
            raise ValueError(f"similarity must be one of {list(SIMILARITIES)}, got {self.similarity!r}")
        if self.batch_size < 2:
            raise ValueError(
                f"batch_size must be >= 2 (a contrastive batch needs negatives), got {self.batch_size}"
            )
        if self.epochs <= 0 or self.learning_rate <= 0:
            raise ValueError("epochs and learning_rate must be > 0")
        if self.temperature is not None and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


class PairStreamLearner:
    """Train learner heads over a `PairStream` with the given methods. See the module docstring."""

    def __init__(
        self,
        stream: PairStream,
        encoders: Mapping[str, ModalityEncoder],
        args: PairStreamArguments,
        methods: Sequence[PairMethod] | Sequence[str] | str = "vanilla",
        method_args: Mapping[str, Mapping[str, Any]] | None = None,
        clip: CLIPModel | None = None,
        features: Sequence[TaskFeatures] | None = None,
    ):
        """`features`: each task's cached encoder features (`encode_task`), to share one encoding between runs;
        None: `run()` encodes every task."""
        stream.check_encoders(list(encoders))
        dims = {m: int(encoders[m].dim) for m in stream.modalities}
        if len(set(dims.values())) != 1:
            raise ValueError(f"every modality's encoder must give the same feature size, got {dims}")
        if isinstance(methods, str) or (methods and isinstance(methods[0], str)):
            methods = build_pair_methods(methods, method_args)
        self.methods: list[PairMethod] = list(methods)
        self.stream, self.encoders, self.args, self.clip = stream, dict(encoders), args, clip
        self.dim = next(iter(dims.values()))
        if clip is not None and args.fold_image_modality is not None:
            missing = [m for m in (args.fold_image_modality, args.fold_text_modality) if m not in dims]
            if missing:
                raise ValueError(
                    f"fold modality(ies) {missing} are not in the stream's modalities {list(dims)}"
                )
            if args.head_bias:
                raise ValueError(
                    "head_bias=True heads cannot be folded into a CLIP; set fold_image_modality=None"
                )
        temperature = args.temperature
        if temperature is None:
            temperature = float(1.0 / clip.logit_scale.exp()) if clip is not None else 1.0
        self.objective = PairObjective(temperature, args.similarity, args.symmetric)
        self.output_dir = Path(args.output_dir)
        self.heads = LearnerHeads(self.dim, stream.modalities, bias=args.head_bias)
        self.matrix = ResultsMatrix(stream.task_names, HEADLINE)
        self.features: list[TaskFeatures] = list(features or [])
        if features is not None:
            if len(self.features) != len(stream):
                raise ValueError(f"features for {len(self.features)} tasks, the stream has {len(stream)}")
            for task, cached in zip(stream, self.features, strict=True):
                rows = (len(task.train), len(task.train), len(task.test), len(task.test))
                got = (len(cached.train_a), len(cached.train_b), len(cached.test_a), len(cached.test_b))
                if got != rows or cached.train_a.shape[1] != self.dim:
                    raise ValueError(
                        f"task {task.name!r}: cached features {got} x {cached.train_a.shape[1]} do not "
                        f"match its splits {rows} x {self.dim}"
                    )
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.timings: list[dict[str, float]] = []
        self.pusher = (
            HubPusher(args.hub_model_id, private=args.hub_private_repo) if args.hub_model_id else None
        )
        self.push_report: PushReport | None = None

    # ----- the run ------------------------------------------------------------------------------------------------
    def run(self) -> ResultsMatrix:
        """Train every task not yet in a checkpoint; returns the results matrix."""
        if not self.features:
            self.features = [encode_task(task, self.encoders) for task in self.stream]
        start = self._resume() if self.args.resume else 0
        if start == 0 and self.args.evaluate_initial:
            self.matrix.add_row(INITIAL_LABEL, self.evaluate())
        try:
            for index in range(start, len(self.stream)):
                self._run_task(index)
        finally:
            if self.pusher is not None:
                self.push_report = self.pusher.finish()
                logger.info("%s", self.push_report.summary())
        return self.matrix

    def context(self, index: int) -> PairTaskContext:
        features = self.features[index]
        return PairTaskContext(
            task_index=index,
            task=self.stream[index],
            stream=self.stream,
            heads=self.heads,
            train_a=features.train_a,
            train_b=features.train_b,
            objective=self.objective,
            seed=self.args.seed + index,
        )

    def _run_task(self, index: int) -> None:
        task, context = self.stream[index], self.context(index)
        started = time.perf_counter()
        for method in self.methods:
            method.on_task_start(context)
        method_seconds = time.perf_counter() - started
        self.heads.train_only(task.modalities)
        trainer = PairTrainer(
            model=self.heads,
            args=self.training_arguments(index),
            train_dataset=FeaturePairs(context.train_a, context.train_b),
            methods=self.methods,
            context=context,
        )
        seconds = float(trainer.train().metrics["train_runtime"])
        steps = max(trainer.state.global_step, 1)
        self.heads.requires_grad_(False)
        started = time.perf_counter()
        for method in self.methods:
            method.on_task_end(context)
        method_seconds += time.perf_counter() - started
        self.timings.append(
            {
                "task": index,
                "train_seconds": seconds,
                "steps": steps,
                "seconds_per_step": seconds / steps,
                "method_task_seconds": method_seconds,
            }
        )
        self.snapshots[index] = {
            name: p.detach().cpu().clone() for name, p in self.heads.state_dict().items()
        }
        self.matrix.add_row(task.name, self.evaluate(trained_through=index))
        logger.info("task %d (%s) done in %.1fs: %s", index, task.name, seconds, self.matrix.headline()[-1])
        self._save(index)

    def training_arguments(self, index: int) -> TrainingArguments:
        args, rows = self.args, len(self.stream[index].train)
        if rows < args.batch_size:
            raise ValueError(
                f"task {self.stream[index].name!r} has {rows} training pairs, fewer than batch_size={args.batch_size}"
            )
        return TrainingArguments(
            output_dir=str(self.output_dir / "trainer" / f"task-{index}"),
            per_device_train_batch_size=args.batch_size,
            num_train_epochs=args.epochs,
            learning_rate=args.learning_rate,
            weight_decay=args.weight_decay,
            max_grad_norm=args.max_grad_norm,
            optim=args.optim,
            lr_scheduler_type="linear",
            warmup_steps=0,
            seed=args.seed + index,
            dataloader_drop_last=True,
            remove_unused_columns=False,
            save_strategy="no",
            report_to=[],
            logging_steps=args.logging_steps,
            disable_tqdm=True,
        )

    # ----- evaluation ---------------------------------------------------------------------------------------------
    def evaluate(self, trained_through: int | None = None) -> dict[str, dict[str, float]]:
        """Recall@K of every task's test pairs; after task t also `drift`, ‖A_{i;t} − A_{i;i}‖_F / ‖A_{i;i}‖_F on the
        train pairs of each earlier task i (Def. 1: zero for perfect stability)."""
        results = {}
        for index, (task, features) in enumerate(zip(self.stream, self.features, strict=True)):
            metrics = evaluate_pair(
                self.heads, task.modality_a, task.modality_b, features.test_a, features.test_b, self.objective
            )
            if trained_through is not None and index < trained_through and index in self.snapshots:
                metrics["drift"] = self.alignment_drift(index)
            results[task.name] = metrics
        return results

    def alignment_drift(self, index: int) -> float:
        task, features = self.stream[index], self.features[index]
        inputs = (task.modality_a, features.train_a, task.modality_b, features.train_b)
        now = alignment_matrix(
            self.heads, task.modality_a, task.modality_b, features.train_a, features.train_b
        )
        with torch.no_grad():  # the heads as they were right after task `index`
            z_a, z_b = functional_call(self.heads, self.snapshots[index], inputs)
        return relative_drift(now, z_a.double() @ z_b.double().T)

    # ----- checkpoints --------------------------------------------------------------------------------------------
    def _save(self, index: int) -> None:
        if is_main_process():
            folder = self.output_dir / f"task-{index}"
            partial = folder.with_name(folder.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            (partial / METHOD_STATE_DIR).mkdir(parents=True)
            heads_state = {name: p.detach().cpu().contiguous() for name, p in self.heads.state_dict().items()}
            save_file(heads_state, str(partial / HEADS_FILE))
            snapshots = {
                f"{task}/{name}": t.contiguous()
                for task, state in self.snapshots.items()
                for name, t in state.items()
            }
            save_file(snapshots, str(partial / SNAPSHOTS_FILE))
            save_method_states(self.methods, partial / METHOD_STATE_DIR)
            self.matrix.save(partial)
            if self.clip is not None and self.args.fold_image_modality is not None:
                folded = fold_into_clip(
                    self.clip, self.heads, self.args.fold_image_modality, self.args.fold_text_modality
                )
                folded.save_pretrained(partial)
            state = {
                "task_index": index,
                "tasks": self.stream.task_names,
                "pairs": [list(task.modalities) for task in self.stream],
                "methods": [method.name for method in self.methods],
                "dim": self.dim,
                "temperature": self.objective.temperature,
                "timings": self.timings,
                "args": asdict(self.args),
            }
            (partial / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
            (partial / "README.md").write_text(self.model_card(index), encoding="utf-8")
            shutil.rmtree(folder, ignore_errors=True)
            partial.rename(folder)
            if self.pusher is not None:
                self.pusher.push(folder, index)
        barrier()

    def model_card(self, index: int) -> str:
        """A short model card: what the checkpoint is, the stream so far, the methods and the results matrix."""
        args, folded = self.args, self.clip is not None and self.args.fold_image_modality is not None
        pairs = ", ".join(
            f"{task.name} ({task.modality_a}–{task.modality_b})" for task in self.stream.tasks[: index + 1]
        )
        usage = (
            "```python\nfrom transformers import CLIPModel\n"
            f'model = CLIPModel.from_pretrained("{args.hub_model_id or "<this folder>"}", revision="task-{index}")\n```\n'
            f"The image head `{args.fold_image_modality}` and the text head `{args.fold_text_modality}` are folded into "
            "`visual_projection` and `text_projection`; every head is in `learner_heads.safetensors`.\n"
            if folded
            else "Learner heads only: `learner_heads.safetensors` (no CLIP was given to fold them into).\n"
        )
        front = (
            "---\nlibrary_name: transformers\ntags:\n- clip\n- continual-learning\n- hf_ccl\n- cmcl\n---\n"
        )
        return (
            f"{front}\n# Modality-pair continual learning, after task {index}\n\n"
            f"Trained with hf_ccl's modality-pair streams (CMCL, Liu et al. 2025): frozen encoders, per-modality "
            f"learner heads, methods {[m.name for m in self.methods] or ['vanilla']}.\n\nTasks so far: {pairs}.\n\n"
            f"{usage}\n{self.matrix.to_markdown()}"
        )

    def _resume(self) -> int:
        """Load the newest complete task checkpoint; returns the index of the next task to train."""
        done = sorted(
            (int(p.name.split("-", 1)[1]), p)
            for p in self.output_dir.glob("task-*")
            if p.name.split("-", 1)[1].isdigit() and (p / STATE_FILE).is_file()
        )
        if not done:
            return 0
        index, folder = done[-1]
        state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
        if state["tasks"][: index + 1] != self.stream.task_names[: index + 1]:
            raise ValueError(
                f"{folder} was written for tasks {state['tasks']}, not this stream's {self.stream.task_names}; "
                "use another output_dir or resume=False"
            )
        if state["methods"] != [method.name for method in self.methods]:
            raise ValueError(
                f"{folder} was written by methods {state['methods']}, not {[m.name for m in self.methods]}"
            )
        self.heads.load_state_dict(load_file(str(folder / HEADS_FILE)))
        load_method_states(self.methods, folder / METHOD_STATE_DIR)
        saved = ResultsMatrix.load(
            folder
        )  # its columns may be a prefix of this stream's (a stream grown since)
        for row in ([saved.initial] if saved.initial is not None else []) + saved.rows:
            self.matrix.add_row(row.label, row.metrics)
        self.timings = list(state.get("timings", []))
        self.snapshots = {}
        for key, tensor in load_file(str(folder / SNAPSHOTS_FILE)).items():
            task, name = key.split("/", 1)
            self.snapshots.setdefault(int(task), {})[name] = tensor
        logger.info("Resuming after task %d from %s", index, folder)
        return index + 1
