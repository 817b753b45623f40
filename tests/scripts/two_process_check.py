"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo, CPU) by tests/test_distributed.py.

1. The global-batch loss on 2 processes (each holding half the batch) equals the one-process loss on the whole batch,
   and so do the gradients after DDP-style averaging; also with each half split into 2 accumulated chunks through a
   DDP-wrapped model (`hf_ccl.accumulation`), a term on the parameters themselves included.
2. A 2-task continual run with ContinualTrainer is one DDP run: each rank's Trainer is distributed, the ranks batch
   disjoint rows, and both end with identical parameters. Several processes that would not be one run are refused
   (`training.use_cpu=false` on this CPU machine; a DataLoader that does not split the data).
3. So does every registered method (with `tests/method_matrix.py`'s METHOD_ARGS), and the papers' compositions
   ([modx, er], [ctp, er], [lwf, er]): the same model state and the same method state on both ranks, bit for bit.
4. 1 and 3 also on a tiny SigLIP: the sigmoid loss of each process's images against every process's texts, averaged
   over the processes, is the one-process loss of the whole batch (and the gradients agree); runs `SIGLIP_RUNS`.
Writes `rank<r>.json` into the folder given as the first argument. A second argument, a comma-separated list of
methods, limits the single-method runs of 3 to those (the compositions and accumulated runs always run).
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the method matrix
from method_matrix import method_args, state_digests, task_stream  # noqa: E402

from hf_ccl.callbacks import TaskCallback
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data.collate import load_image_processor, load_tokenizer
from hf_ccl.data.named import build_stream
from hf_ccl.distributed import world_size
from hf_ccl.families import default_image_processor
from hf_ccl.losses import positive_mask
from hf_ccl.methods import available_methods, build_methods
from hf_ccl.testing import tiny_clip, tiny_model

TEXTS = ["a photo of a cat", "a dog", "two birds", "a red car", "a photo of a cat", "a boat", "a tree", "the sea"]


def whole_batch(tokenizer, family: str = "clip") -> tuple:
    """A tiny model of `family` and the whole batch every process starts from: encoding (padded as the family
    expects), pixels, text and image hashes."""
    model = tiny_model(family, seed=0)
    model.align_special_tokens(tokenizer)
    encoding = tokenizer(TEXTS, padding=model.text_padding, max_length=16, truncation=True, return_tensors="pt")
    torch.manual_seed(123)
    pixels = torch.randn(len(TEXTS), 3, 32, 32)
    text_hash = torch.tensor([zlib.crc32(t.encode()) % 1000 for t in TEXTS])
    return model, encoding, pixels, text_hash, torch.arange(len(TEXTS))


def global_batch_check(tokenizer, rank: int, world: int, family: str = "clip") -> dict:
    """The family's loss of this process's half, over the global batch: its mean over the processes (CLIP: the same
    value on each; SigLIP: each process's local images against every text) equals the one-process loss of the
    whole batch, and so do the gradients after DDP's averaging."""
    model, encoding, pixels, text_hash, image_hash = whole_batch(tokenizer, family)
    # One process, whole batch: the loss computed directly, no gather involved.
    image_embeds = model.embed_images(pixels)
    text_embeds = model.embed_texts(encoding.input_ids, encoding.attention_mask)
    reference_loss = model.contrastive_loss(model.logits(image_embeds, text_embeds), positive_mask(text_hash, image_hash))
    reference_loss.backward()
    reference_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    # This process's half, gathered across processes.
    part = slice(rank * len(TEXTS) // world, (rank + 1) * len(TEXTS) // world)
    local = model(
        input_ids=encoding.input_ids[part], attention_mask=encoding.attention_mask[part], pixel_values=pixels[part],
        return_loss=True, text_hash=text_hash[part], image_hash=image_hash[part],
    )
    local.loss.backward()
    max_grad_diff = 0.0
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.clone()
        dist.all_reduce(grad)
        grad /= world  # what DDP does
        max_grad_diff = max(max_grad_diff, (grad - reference_grads[name]).abs().max().item())
    mean_loss = local.loss.detach().clone()
    dist.all_reduce(mean_loss)
    prefix = "" if family == "clip" else f"{family}_"
    return {f"{prefix}reference_loss": reference_loss.item(), f"{prefix}distributed_loss": mean_loss.item() / world,
            f"{prefix}max_grad_diff": max_grad_diff}


def accumulation_check(tokenizer, rank: int, world: int, family: str = "clip") -> dict:
    """This process's half of the batch in 2 chunks, through DDP, with a penalty on the text projection: the
    all-reduced gradients equal the one-process gradients of the whole batch's loss."""
    from torch.nn.parallel import DistributedDataParallel

    from hf_ccl.accumulation import accumulated_backward

    model, encoding, pixels, text_hash, image_hash = whole_batch(tokenizer, family)

    def penalty() -> torch.Tensor:
        return 1e-2 * model.projection("text").weight.pow(2).sum()

    image_embeds = model.embed_images(pixels)
    text_embeds = model.embed_texts(encoding.input_ids, encoding.attention_mask)
    logits = model.logits(image_embeds, text_embeds)
    reference_loss = model.contrastive_loss(logits, positive_mask(text_hash, image_hash)) + penalty()
    reference_loss.backward()
    reference_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    wrapped = DistributedDataParallel(model, find_unused_parameters=False)
    half = len(TEXTS) // world
    rows = range(rank * half, (rank + 1) * half)
    chunks = [
        {"input_ids": encoding.input_ids[part], "attention_mask": encoding.attention_mask[part],
         "pixel_values": pixels[part], "text_hash": text_hash[part], "image_hash": image_hash[part]}
        for part in (slice(rows[0], rows[0] + 1), slice(rows[0] + 1, rows[-1] + 1))
    ]

    def encode(chunk):
        outputs = wrapped(**chunk, features_only=True)
        return outputs.image_features, outputs.text_features

    def batch_loss(batch, image_features, text_features):
        outputs = model.contrastive_outputs(image_features, text_features, batch["text_hash"], batch["image_hash"],
                                            return_loss=True)
        return outputs.loss + penalty()

    loss = accumulated_backward(chunks, encode, batch_loss, list(model.parameters()), lambda s: s.backward(),
                                no_sync=wrapped.no_sync)
    max_grad_diff = max((p.grad - reference_grads[n]).abs().max().item() for n, p in model.named_parameters()
                        if n in reference_grads)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    prefix = "" if family == "clip" else f"{family}_"
    return {f"{prefix}accumulated_loss": mean_loss.item() / world,
            f"{prefix}accumulated_reference_loss": reference_loss.item(),
            f"{prefix}accumulated_max_grad_diff": max_grad_diff}


class RowsSeen(TaskCallback):
    """Records, per task, the image ids this process's Trainer batched and how its Trainer is parallelised."""

    def __init__(self) -> None:
        self.rows: dict[str, list[str]] = {}
        self.parallel: list[tuple[str, int]] = []

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        trainer, seen = kwargs["trainer"], self.rows.setdefault(kwargs["context"].task.name, [])
        self.parallel.append((trainer.args.parallel_mode.value, trainer.args.world_size))
        collate = trainer.data_collator

        def recording(rows):  # noqa: ANN001
            seen.extend(row["image_id"] for row in rows)
            return collate(rows)

        trainer.data_collator = recording


def continual_run(tokenizer, output_dir: Path) -> dict:
    stream = build_stream("digits", max_train_per_task=128, max_eval_per_task=40)
    stream.tasks = stream.tasks[:2]
    model = tiny_clip(seed=0)
    args = ContinualArguments(
        output_dir=str(output_dir / "run"),
        training={"max_steps": 4, "per_device_train_batch_size": 16, "learning_rate": 1e-3, "logging_steps": 1},
        progress=False,
    )
    seen = RowsSeen()
    learner = ContinualLearner(model, stream, build_methods(["finetune"]), load_image_processor(32), tokenizer, args,
                               task_callbacks=[seen])
    results = learner.fit()
    params = torch.cat([p.detach().flatten() for p in learner.model.parameters()])
    return {"param_sum": params.double().sum().item(), "param_abs_sum": params.double().abs().sum().item(),
            "rows": results.num_trained, "rows_seen": seen.rows, "parallel": seen.parallel,
            "samples_seen": [record.samples_seen for record in learner.compute],
            "task_rows": [len(task.train) for task in stream]}


def refusals(output_dir: Path) -> dict:
    """What the guard says to processes that would each train alone: `training.use_cpu=false` on this machine
    without a GPU, and a DataLoader that gives every process the same batches."""
    from torch.utils.data import DataLoader

    from hf_ccl.distributed import NotDistributedError, check_sharded_loader
    from hf_ccl.validation import ConfigError

    found = {}
    try:
        ContinualArguments(output_dir=str(output_dir / "refused"), training={"use_cpu": False})
    except ConfigError as error:
        found["use_cpu_false"] = str(error)
    data = list(range(8))
    try:
        check_sharded_loader(DataLoader(data, batch_size=2), data)
    except NotDistributedError as error:
        found["unsharded_loader"] = str(error)
    return found


COMPOSITIONS = (("modx", "er"), ("ctp", "er"), ("lwf", "er"), ("learner_heads", "dns"), ("learner_heads", "ewc"))
#: Runs on a tiny SigLIP (the sigmoid loss over the global batch): key `siglip:<methods>`.
SIGLIP_RUNS = (("finetune",), ("modx", "derpp"))
#: Runs repeated with 2 accumulated micro-batches per step (exact accumulation through DDP's no_sync).
ACCUMULATED = (("finetune",), ("ewc",), ("cllclip",), ("modx", "er"), ("ctp", "er"))


def rank_spread(tensors: list[torch.Tensor]) -> float:
    """max |this rank's value - the other ranks' values| over every element of `tensors` (a collective call)."""
    flat = torch.cat([t.detach().double().flatten() for t in tensors]) if tensors else torch.zeros(1)
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return (high - low).abs().max().item()


def method_matrix(tokenizer, output_dir: Path, only: set[str] | None = None) -> dict:
    """Every registered method (and the papers' compositions) for 2 tasks x 2 steps: per run, the sha256 of every
    model tensor and of every leaf of every method's state, and the largest difference of the model's tensors
    across ranks; the `ACCUMULATED` runs also with gradient_accumulation_steps=2 (keys `accumulate2:<methods>`)."""
    registered = set(available_methods())
    runs = [((name,), 1, "clip") for name in sorted(registered) if only is None or name in only]
    runs += [(combo, 1, "clip") for combo in COMPOSITIONS if set(combo) <= registered]
    runs += [(combo, 2, "clip") for combo in ACCUMULATED if set(combo) <= registered]
    runs += [(combo, 1, "siglip") for combo in SIGLIP_RUNS]
    report: dict[str, dict] = {"model_digests": {}, "method_digests": {}, "model_spread": {}}
    for names, accumulation, family in runs:
        key = "+".join(names) if accumulation == 1 else f"accumulate{accumulation}:" + "+".join(names)
        key = key if family == "clip" else f"{family}:{key}"
        args = ContinualArguments(  # a compute budget of 2 steps per task (Oracle needs one for its t x C)
            output_dir=str(output_dir / key.replace(":", "_")),
            training={"per_device_train_batch_size": 8, "learning_rate": 1e-3,
                      "gradient_accumulation_steps": accumulation},
            samples_per_task=2 * 8 * accumulation * world_size(),
            progress=False,
        )
        model = tiny_model(family, seed=0)
        learner = ContinualLearner(
            model, task_stream(names, train=64, evaluate=10), build_methods(list(names), method_args(names)),
            default_image_processor(model), tokenizer, args,
        )
        learner.fit()
        model_state = learner.model.state_dict()
        report["model_digests"][key] = state_digests(model_state)
        report["method_digests"][key] = {method.name: state_digests(method.state_dict()) for method in learner.methods}
        report["model_spread"][key] = rank_spread([t for t in model_state.values() if t.is_floating_point()])
    return report


def main() -> None:
    output_dir = Path(sys.argv[1])
    only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
    state = PartialState(cpu=True)
    rank, world = state.process_index, state.num_processes
    tokenizer = load_tokenizer()
    report = {
        "world_size": world,
        **global_batch_check(tokenizer, rank, world),
        **accumulation_check(tokenizer, rank, world),
        **global_batch_check(tokenizer, rank, world, "siglip"),
        **accumulation_check(tokenizer, rank, world, "siglip"),
        **continual_run(tokenizer, output_dir),
        "refused": refusals(output_dir),
        **method_matrix(tokenizer, output_dir, only),
    }
    (output_dir / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
