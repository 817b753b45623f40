"""Classification tasks trained with CLIP's image-to-class-prompt cross-entropy (the ZSCL / MoE-Adapters fine-tuning
loss), and the classes a classification task is scored among (`class_scope`).

ZSCL (Zheng et al. 2023, official code `mtil/src/models/finetune.py`) and MoE-Adapters (Yu et al. 2024) fine-tune
CLIP on a classification task by encoding the prompt of every class of the task at every step and training

    L_CE = -1/B sum_b log softmax_c( exp(t) * cos(f_I(x_b), f_T(p_c)) )[y_b]                       (ZSCL Eq. 1)

on the batch's images. Here the class embedding f_T(p_c) is the normalised mean of the normalised embeddings of the
class's training-template prompts (with one template, as in ZSCL, the prompt's own embedding). On a sigmoid family
(SigLIP) the same candidates are scored with its pairwise sigmoid loss, the image's class as the positive.

Which classes a row is scored among (`class_scope`):
- `"task"` (task-aware, MTIL): the classes of the row's own task;
- `"seen"` (task-agnostic, the class-incremental protocol): the classes of every task seen so far.

A row's class is read from the caption the collator drew for it (the row's label put through one of its task's
training templates), so replayed rows of earlier tasks keep their own classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .data.canonical import DEFAULT_TRAIN_TEMPLATES
from .data.task import Task
from .data.templates import format_template
from .losses import sigmoid_contrastive_loss

CLASSIFICATION_LOSSES = ("contrastive", "cross_entropy")
CLASS_SCOPES = ("task", "seen")
#: The name of the cross-entropy term in the logged losses.
CROSS_ENTROPY_TERM = "class_cross_entropy"


def train_templates(task: Task) -> list[str]:
    """The templates a classification task's labels were put through for training."""
    return list(task.train_templates or DEFAULT_TRAIN_TEMPLATES)


def seen_class_names(seen: Sequence[Task], task: Task) -> list[str]:
    """The class names a task is scored among in the `"seen"` scope: those of every classification task in `seen`
    (in order, each name once), then `task`'s own that are not among them (a task not yet trained)."""
    names: dict[str, None] = {}
    for other in (*seen, task):
        if other.kind == "classification":
            names.update(dict.fromkeys(other.class_names or []))
    return list(names)


@dataclass
class ClassPrompts:
    """The class prompts a task's cross-entropy scores its rows among, tokenized once per task.

    Classes are numbered globally over `tasks` (task-major); `class_task[g]` is the position in `tasks` of class g's
    task, `prompt_class[p]` the class of prompt p. `lookup` maps every prompt text to its class: the collator turns
    the caption it drew for a row into the row's `class_labels`.
    """

    tasks: list[str]
    class_names: list[str]
    scope: str
    class_task: torch.Tensor
    prompt_class: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lookup: dict[str, int]

    @classmethod
    def build(cls, tasks: Sequence[Task], tokenizer: Any, *, scope: str = "task", max_length: int | None = None,
              padding: str = "longest") -> ClassPrompts:
        """The prompts of the classification tasks in `tasks` (the current task last). A prompt shared by two tasks
        (same template, same name) belongs to the later task's class."""
        if scope not in CLASS_SCOPES:
            raise ValueError(f"class_scope must be one of {list(CLASS_SCOPES)}, got {scope!r}")
        tasks = [task for task in tasks if task.kind == "classification"]
        if not tasks:
            raise ValueError("cross-entropy class prompts need at least one classification task")
        names, class_task, prompts, prompt_class, lookup = [], [], [], [], {}
        for position, task in enumerate(tasks):
            for name in task.class_names or []:
                index = len(names)
                names.append(name)
                class_task.append(position)
                for template in train_templates(task):
                    text = format_template(template, name)
                    prompts.append(text)
                    prompt_class.append(index)
                    lookup[text] = index
        tokens = tokenizer(prompts, padding=padding, truncation=True, max_length=max_length, return_tensors="pt")
        return cls([task.name for task in tasks], names, scope, torch.tensor(class_task), torch.tensor(prompt_class),
                   tokens["input_ids"], tokens["attention_mask"], lookup)

    def labels(self, texts: Sequence[str]) -> list[int]:
        """The class of each drawn caption; a caption that is no class prompt of these tasks is an error."""
        labels = []
        for text in texts:
            if text not in self.lookup:
                raise ValueError(
                    f"The caption {text!r} is no class prompt of the task(s) {self.tasks}: a row of another task "
                    "(replayed?) or a captioned row cannot be scored by the cross-entropy over these classes. Use "
                    "classification_loss: contrastive, or class_scope: seen so that earlier tasks' classes are "
                    "candidates."
                )
            labels.append(self.lookup[text])
        return labels

    def class_embeddings(self, model: Any) -> torch.Tensor:
        """[C, d] normalised class embeddings: the normalised mean of each class's normalised prompt embeddings,
        with gradients (encoded in one batch by the model's text tower)."""
        device = model.logit_scale.device
        input_ids, attention_mask, prompt_class, _ = self.on(device)
        prompts = model.embed_texts(input_ids, attention_mask)
        sums = torch.zeros(len(self.class_names), prompts.shape[-1], device=device, dtype=prompts.dtype)
        sums = sums.index_add(0, prompt_class, prompts)
        return F.normalize(sums, dim=-1)

    def candidate_mask(self, labels: torch.Tensor) -> torch.Tensor | None:
        """[B, C] True where class c is a candidate for row b: the classes of the row's own task in the `"task"`
        scope; None (every class) in the `"seen"` scope."""
        if self.scope == "seen":
            return None
        class_task = self.on(labels.device)[3]
        return class_task[labels].unsqueeze(1) == class_task.unsqueeze(0)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (the collator's `labels` to DataLoader workers) without the device copies."""
        state = dict(self.__dict__)
        state.pop("_on_device", None)
        return state

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(input_ids, attention_mask, prompt_class, class_task) on `device`, copied there once (not every step)."""
        cached = self.__dict__.get("_on_device")
        if cached is None or cached[0] != device:
            tensors = (self.input_ids, self.attention_mask, self.prompt_class, self.class_task)
            cached = self._on_device = (device, tuple(t.to(device) for t in tensors))
        return cached[1]


def class_prompt_loss(model: Any, image_embeds: torch.Tensor, class_embeds: torch.Tensor, labels: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """ZSCL Eq. 1 on normalised image and class embeddings: the mean over rows of the cross-entropy of the row's
    class among its candidates (`mask`, None: all). A sigmoid family scores every (row, candidate) pair with its
    sigmoid loss instead, the row's class positive, divided by the rows (Zhai et al. 2023, Eq. 1)."""
    logits = model.logits(image_embeds, class_embeds).float()
    if mask is not None:  # a non-candidate scores -inf: no softmax mass, and a sigmoid negative of zero loss
        logits = logits.masked_fill(~mask, -float("inf"))
    if model.loss_kind == "sigmoid":
        return sigmoid_contrastive_loss(logits, F.one_hot(labels, logits.shape[1]).bool())
    return F.cross_entropy(logits, labels)
