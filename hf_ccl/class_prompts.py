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
- `"seen"` (task-agnostic, the class-incremental protocol): the classes of every task seen so far;
- `"all"` (X-TAIL, Xu et al. 2024, RAIL): evaluation scores among the classes of every task of the stream, trained
  or not (`scope_class_names`); the loss scores as in `"seen"` (a learner has no rows of domains to come).

A class is identified across tasks by its prompt texts (`class_prompt_texts`): its name put through its task's
training templates, the very texts whose embeddings make its class embedding. Two tasks that train the same prompt
text (`mtil-bundled` with `pacs_domain: photo`: "a photo of a dog." in CIFAR-10 and in PACS) train one class: in the
`"seen"` scope it is one column of the logits, its prompts the union of theirs, so a row's loss can reach 0 (two
columns with one embedding would hold it above ln 2). The same name under different training templates ("a photo of
a dog." / "a sketch of a dog.") is two classes, because the loss embeds two different texts. The evaluator puts every
candidate name through the evaluated task's own templates (`seen_class_names`), so there a prompt text is given by
the name alone: the loss's and the evaluator's classes are the same wherever tasks that share a name share its
training prompts.

A row's class is read from the caption the collator drew for it and the row's `label` (the class's index in its own
task), so replayed rows of earlier tasks keep their own classes: in the `"task"` scope a prompt trained by two tasks
is a column in each task's block, and the label picks the row's own task. Where even the label cannot (two tasks
train the same prompt at the same index among different classes), `ClassPrompts.build` refuses them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .arguments import CLASS_SCOPES, CLASSIFICATION_LOSSES  # noqa: F401 (re-exported)
from .data.canonical import DEFAULT_TRAIN_TEMPLATES
from .data.task import Task
from .data.templates import format_template
from .losses import sigmoid_contrastive_loss

#: The name of the cross-entropy term in the logged losses.
CROSS_ENTROPY_TERM = "class_cross_entropy"


def train_templates(task: Task) -> list[str]:
    """The templates a classification task's labels were put through for training."""
    return list(task.train_templates or DEFAULT_TRAIN_TEMPLATES)


def class_prompt_texts(task: Task, name: str) -> tuple[str, ...]:
    """What identifies a class across tasks: its name put through its task's training templates (each text once)."""
    return tuple(dict.fromkeys(format_template(template, name) for template in train_templates(task)))


def seen_class_names(seen: Sequence[Task], task: Task) -> list[str]:
    """The class names a task is scored among in the `"seen"` scope: those of every classification task in `seen`
    (in order, each name once), then `task`'s own that are not among them (a task not yet trained). The evaluator
    puts each through the evaluated task's own templates, so a name is one prompt text there (module docstring)."""
    names: dict[str, None] = {}
    for other in (*seen, task):
        if other.kind_spec.has_classes:
            names.update(dict.fromkeys(other.class_names or []))
    return list(names)


def scope_class_names(tasks: Sequence[Task], trained: int, task: Task, scope: str) -> list[str] | None:
    """The class names `task` is also scored among after training the first `trained` of the stream's `tasks`: None
    in the `"task"` scope (and for a task without classes); `"seen"`: `seen_class_names` of the trained tasks;
    `"all"` (X-TAIL, RAIL Sec. 3): those of every task of the stream, trained or not, each name once."""
    if scope == "task" or not task.kind_spec.has_classes:
        return None
    return seen_class_names(tasks if scope == "all" else tasks[:trained], task)


#: A lookup entry whose prompt belongs to classes scored differently (`ClassPrompts.labels` cannot pick one).
_AMBIGUOUS = -1


@dataclass
class ClassPrompts:
    """The class prompts a task's cross-entropy scores its rows among, tokenized once per task.

    One class is one column of the logits. In the `"task"` scope the columns are the classes of each task in turn
    (task-major); in the `"seen"` scope the distinct classes of all `tasks`, a prompt text trained by several tasks
    being one class (module docstring). `class_task[g]` is the position in `tasks` of class g's (first) task,
    `prompt_class[p]` the class of prompt p. `lookup` maps (prompt text, the row's label) to the row's class and
    `by_text` the prompt alone where that suffices: the collator turns the caption it drew for a row into the
    row's `class_labels`.
    """

    tasks: list[str]
    class_names: list[str]
    scope: str
    class_task: torch.Tensor
    prompt_class: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lookup: dict[tuple[str, int], int]
    by_text: dict[str, int]

    @classmethod
    def build(cls, tasks: Sequence[Task], tokenizer: Any, *, scope: str = "task", max_length: int | None = None,
              padding: str = "longest") -> ClassPrompts:
        """The prompts of the classification tasks in `tasks` (the current task last). Refused: two classes of one
        task with a common prompt, and in the `"task"` scope a prompt that two tasks train at the same label index
        among different classes (a row's own task could not be told)."""
        if scope not in CLASS_SCOPES:
            raise ValueError(f"class_scope must be one of {list(CLASS_SCOPES)}, got {scope!r}")
        scope = "seen" if scope == "all" else scope  # the loss of the X-TAIL scope: every class trained so far
        tasks = [task for task in tasks if task.kind_spec.has_classes]
        if not tasks:
            raise ValueError("cross-entropy class prompts need at least one classification task")
        entries = _class_entries(tasks)  # (task position, label index, name, prompt texts), task-major
        columns = (_merged_by_prompt([texts for *_, texts in entries]) if scope == "seen"
                   else list(range(len(entries))))
        merged = {(position, column) for (position, *_), column in zip(entries, columns, strict=True)}
        if len(merged) < len(entries):  # only through other tasks' prompts: one task's own are checked above
            raise ValueError(f"class_scope 'seen': two classes of one task of {[task.name for task in tasks]} are one "
                             "class through prompts that other tasks share with both; give them templates that tell "
                             "them apart")
        names: list[str] = []
        class_task: list[int] = []
        texts_of: list[dict[str, None]] = []  # a class's prompt texts, in first-seen order
        for (position, _, name, texts), column in zip(entries, columns, strict=True):
            if column == len(names):
                names.append(name)
                class_task.append(position)
                texts_of.append({})
            texts_of[column].update(dict.fromkeys(texts))
        prompts = [text for texts in texts_of for text in texts]
        prompt_class = [column for column, texts in enumerate(texts_of) for _ in texts]
        lookup, by_text = _lookups(entries, columns, _signatures(entries, columns, scope))
        clashes = sorted(key for key, column in lookup.items() if column == _AMBIGUOUS)
        if clashes:
            text, index = clashes[0]
            owners = [tasks[position].name for position, label, _, texts in entries if label == index and text in texts]
            raise ValueError(
                f"class_scope 'task': tasks {owners} all train the prompt {text!r} as class {index} but among "
                "different classes, so a replayed row's own task cannot be told from its caption and label. Use "
                "class_scope: seen, or classification_loss: contrastive."
            )
        tokens = tokenizer(prompts, padding=padding, truncation=True, max_length=max_length, return_tensors="pt")
        return cls([task.name for task in tasks], names, scope, torch.tensor(class_task), torch.tensor(prompt_class),
                   tokens["input_ids"], tokens["attention_mask"], lookup, by_text)

    def labels(self, texts: Sequence[str], row_labels: Sequence[int | None] | None = None) -> list[int]:
        """The class of each drawn caption, given the row's `label` (its class index in its own task; None: the
        caption alone, enough unless a prompt of several tasks is scored differently). A caption that is no class
        prompt of these tasks is an error."""
        table: Mapping[Any, int]  # prompt text -> class, or (prompt text, label) -> class
        keys: list[Any]
        if row_labels is None:
            table, keys = self.by_text, list(texts)
        else:
            table = self.lookup
            keys = [(text, -1 if label is None else int(label)) for text, label in zip(texts, row_labels, strict=True)]
        classes = []
        for text, key in zip(texts, keys, strict=True):
            column = table.get(key)
            if column is None:
                raise ValueError(
                    f"The caption {text!r}{'' if row_labels is None else f' (label {key[1]})'} is no class prompt "
                    f"of the task(s) {self.tasks}: a row of "
                    "another task (replayed?) or a captioned row cannot be scored by the cross-entropy over these "
                    "classes. Use classification_loss: contrastive, or class_scope: seen so that earlier tasks' "
                    "classes are candidates."
                )
            if column == _AMBIGUOUS:
                raise ValueError(f"The caption {text!r} is a class prompt of several of the tasks {self.tasks}, "
                                 "scored among different classes: give each row's label")
            classes.append(column)
        return classes

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


def _class_entries(tasks: Sequence[Task]) -> list[tuple[int, int, str, tuple[str, ...]]]:
    """(task position, label index, name, prompt texts) of every class of `tasks`; two classes of one task with a
    common prompt are refused."""
    entries = []
    for position, task in enumerate(tasks):
        names = list(task.class_names or [])
        owner: dict[str, int] = {}
        for index, name in enumerate(names):
            texts = class_prompt_texts(task, name)
            for text in texts:
                if owner.setdefault(text, index) != index:
                    raise ValueError(f"Task {task.name!r}: classes {owner[text]} ({names[owner[text]]!r}) and {index} "
                                     f"({name!r}) share the training prompt {text!r}: one prompt, one class")
            entries.append((position, index, name, texts))
    return entries


def _merged_by_prompt(prompts: Sequence[Sequence[str]]) -> list[int]:
    """The class of each entry when entries with a common prompt text are one class (transitively), numbered in
    order of first appearance."""
    parent = list(range(len(prompts)))

    def root(entry: int) -> int:
        while parent[entry] != entry:
            parent[entry] = entry = parent[parent[entry]]
        return entry

    first: dict[str, int] = {}
    for entry, texts in enumerate(prompts):
        for text in texts:
            a, b = root(entry), root(first.setdefault(text, entry))
            parent[max(a, b)] = min(a, b)  # a root is its class's first entry
    numbers: dict[int, int] = {}
    return [numbers.setdefault(root(entry), len(numbers)) for entry in range(len(prompts))]


def _signatures(entries: Sequence[tuple[int, int, str, tuple[str, ...]]], columns: Sequence[int],
                scope: str) -> dict[int, Any]:
    """Per column, what a row's loss depends on: its class (`"seen"`: every row scored among every class), or its
    class's prompts and the prompts of its task's classes (`"task"`). Two columns of one signature score a row alike."""
    if scope == "seen":
        return {column: column for column in columns}
    blocks: dict[int, set[frozenset[str]]] = {}
    for position, _, _, texts in entries:
        blocks.setdefault(position, set()).add(frozenset(texts))
    return {column: (frozenset(texts), frozenset(blocks[position]))
            for (position, _, _, texts), column in zip(entries, columns, strict=True)}


def _lookups(entries: Sequence[tuple[int, int, str, tuple[str, ...]]], columns: Sequence[int],
             signatures: dict[int, Any]) -> tuple[dict[tuple[str, int], int], dict[str, int]]:
    """(prompt text, label index) -> column and prompt text -> column; `_AMBIGUOUS` where the entries that train it
    are columns of different signatures."""
    lookup: dict[tuple[str, int], int] = {}
    by_text: dict[str, int] = {}
    for (_, index, _, texts), column in zip(entries, columns, strict=True):
        for text in texts:
            tables: tuple[tuple[dict[Any, int], Any], ...] = ((lookup, (text, index)), (by_text, text))
            for table, key in tables:
                held = table.setdefault(key, column)
                if held != _AMBIGUOUS and signatures[held] != signatures[column]:
                    table[key] = _AMBIGUOUS
    return lookup, by_text


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
