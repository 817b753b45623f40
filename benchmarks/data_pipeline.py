"""Data pipeline: images per second per CPU core at 224 px, with and without the preprocessing cache.

Three paths, measured one after another in one process on one core (`torch.set_num_threads(1)`), each repeated:

(a) `CLIPCollator` on canonical rows (read from the dataset as the DataLoader does): decode + resize + crop +
    normalise every image, choose and tokenize a caption;
(b) the same collator on rows of the image cache (`hf_ccl.data.image_cache`): read uint8 pixels, normalise
    through the processor's lookup table, choose and tokenize a caption;
(c) building the cache: decode + resize + crop once and write uint8 pixels with `datasets` (`num_proc=1`, per
    core; and with `--build-procs` processes when more than one core is usable).

against the rate one GPU consumes. That figure is an estimate, not a measurement (no GPU here): CLIP ViT-B/32 at
224 px costs 14.78 GFLOPs per image-text pair forward (OpenCLIP, docs/model_profile.csv), about 3x that to train;
at 40% of an A100's 312 TFLOP/s bf16 peak that is about 2,800 pairs/s (`--target` takes a measured figure).

Images: the first `--images` Flickr8k train images of the bundled data (64 px JPEGs, upscaled to 224), and the
same images re-encoded at 500x375 (JPEG quality 90; Flickr8k's originals are about that size), which is closer to
what real data costs to decode.

    python benchmarks/data_pipeline.py [--images 256] [--repeats 5] [--batch 64]

Writes benchmarks/results/data_pipeline.md.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from datasets import Dataset
from PIL import Image

from hf_ccl.data import CLIPCollator, load_image_processor, load_tokenizer, to_canonical
from hf_ccl.data.builders import CANONICAL_FEATURES, load_split
from hf_ccl.data.image_cache import cached_pixels_dataset
from hf_ccl.data.workers import usable_cores
from hf_ccl.paths import data_root

TARGET_SOURCE = ("estimate: CLIP ViT-B/32 at 224 px, 14.78 GFLOPs per pair forward (OpenCLIP docs/model_profile.csv) "
                 "x 3 for training, at 40% of one A100's 312 TFLOP/s bf16 peak")
PHOTO_SIZE = (500, 375)


def photo_sized(dataset: Dataset) -> Dataset:
    """The same rows with every image re-encoded at `PHOTO_SIZE` as JPEG quality 90."""
    def reencode(row: dict) -> dict:
        image = Image.open(io.BytesIO(row["image"]["bytes"])).convert("RGB").resize(PHOTO_SIZE, Image.BICUBIC)
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=90)
        return {"image": {"bytes": buffer.getvalue(), "path": None}}

    return Dataset.from_list([{**dataset[i], **reencode(dataset[i])} for i in range(len(dataset))],
                             features=CANONICAL_FEATURES)


def collate_all(dataset: Dataset, collator: CLIPCollator, batch: int) -> None:
    """Every batch of `dataset` through `collator`, rows read as the DataLoader's fetcher reads them."""
    for start in range(0, len(dataset), batch):
        collator(dataset.__getitems__(list(range(start, min(start + batch, len(dataset))))))


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def build_once(dataset: Dataset, processor: object, procs: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="hf_ccl-bench-cache-"))
    try:
        cached_pixels_dataset(dataset, processor, cache_dir=folder, num_proc=procs)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--build-repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--build-procs", type=int, default=usable_cores())
    parser.add_argument("--target", type=float, default=2800.0, help="images/s one GPU trains on")
    parser.add_argument("--output", default="benchmarks/results/data_pipeline.md")
    args = parser.parse_args()
    for name in ("images", "repeats", "build_repeats", "batch", "size", "build_procs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    torch.set_num_threads(1)
    load_start, cores = os.getloadavg()[0], usable_cores()
    raw = load_split(data_root() / "flickr8k", "train")
    bundled = to_canonical(raw, source="flickr8k", split="train", text_column="en", indices=range(args.images))
    bundled = Dataset.from_list([bundled[i] for i in range(len(bundled))], features=CANONICAL_FEATURES)
    sources = {"bundled 64 px JPEG": bundled, f"{PHOTO_SIZE[0]}x{PHOTO_SIZE[1]} JPEG": photo_sized(bundled)}
    processor, tokenizer = load_image_processor(args.size), load_tokenizer()

    rows: list[tuple[str, str, list[float], int, str]] = []  # (path, source, seconds per run, cores, note)
    for source, dataset in sources.items():
        n = len(dataset)
        collator = CLIPCollator(processor, tokenizer, seed=0)
        collate_all(dataset.select(range(min(n, args.batch))), collator, args.batch)  # warm-up
        rows.append(("(a) collator: decode + processor", source,
                     timed(lambda d=dataset, c=collator: collate_all(d, c, args.batch), args.repeats), 1, ""))
        rows.append(("(c) build the cache, num_proc=1", source,
                     timed(lambda d=dataset: build_once(d, processor, 1), args.build_repeats), 1,
                     "decode + resize + crop + write uint8"))
        if args.build_procs > 1:
            rows.append((f"(c) build the cache, num_proc={args.build_procs}", source,
                         timed(lambda d=dataset: build_once(d, processor, args.build_procs), args.build_repeats),
                         args.build_procs, "per core = total / num_proc"))
        folder = Path(tempfile.mkdtemp(prefix="hf_ccl-bench-cache-"))
        try:
            cached = cached_pixels_dataset(dataset, processor, cache_dir=folder, num_proc=1)
            collate_all(cached.select(range(min(n, args.batch))), collator, args.batch)  # warm-up
            rows.append(("(b) collator on the cache", source,
                         timed(lambda d=cached, c=collator: collate_all(d, c, args.batch), args.repeats), 1,
                         "read uint8 + lookup-table normalise"))
            del cached
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    load_end = os.getloadavg()[0]

    shared = load_start > 0.5 or load_end > 0.5
    lines = [
        f"# Data pipeline at {args.size} px: images per second per CPU core",
        "",
        f"Command: `python benchmarks/data_pipeline.py --images {args.images} --repeats {args.repeats} "
        f"--build-repeats {args.build_repeats} --batch {args.batch} --size {args.size} "
        f"--build-procs {args.build_procs}`  ",
        f"Machine: {platform.machine()}, {cores} usable cores, torch {torch.__version__}, one thread per path "
        f"(`torch.set_num_threads(1)`); load average (1 min) {load_start:.2f} at the start, {load_end:.2f} at the end"
        + (" — **taken on a machine shared with other jobs: rates can be several times low**" if shared else "")
        + ".  ",
        f"Data: the first {args.images} Flickr8k train images of the bundled data, as bundled (64 px JPEG) and "
        f"re-encoded at {PHOTO_SIZE[0]}x{PHOTO_SIZE[1]} (JPEG q90, about Flickr8k's original size); CLIP processor "
        f"(`CLIPImageProcessorPil`, bicubic) at {args.size} px; batch {args.batch}; one caption tokenized per image "
        "(real CLIP BPE) in (a) and (b). Each path timed over all images, repeated; rate = images / time.  ",
        f"Target: **{args.target:,.0f} images/s per GPU** ({TARGET_SOURCE}); an H100 needs about 2-3x that.",
        "",
        "| path | images | images/s per core (median) | images/s per core (best) | cores per GPU at the target "
        "(median rate) | runs | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for path, source, seconds, used, note in rows:
        per_core = [len(bundled) / t / used for t in seconds]
        median, best = statistics.median(per_core), max(per_core)
        lines.append(f"| {path} | {source} | {median:,.0f} | {best:,.0f} | {args.target / median:,.1f} | "
                     f"{len(seconds)} | {note} |")
    lines += [
        "",
        "(a) is what every epoch costs without the cache; with the cache every epoch costs (b), and (c) is paid once "
        "per dataset and processor setting (a later run reuses it). The default DataLoader workers on a GPU "
        "(`hf_ccl.data.workers`: the process's cores less one, at most 8) multiply the per-core rate by the "
        "worker count.",
    ]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
