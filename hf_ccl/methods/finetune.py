"""Sequential fine-tuning: train on each task in turn with the contrastive loss alone (the lower bound)."""

from __future__ import annotations

from .base import ContinualMethod, MethodConfig
from .registry import register_method


@register_method
class Finetune(ContinualMethod[MethodConfig]):
    """Plain sequential fine-tuning: every hook is the base class's no-op."""

    fsdp_refusal = None  # trains sharded as unsharded (tests/test_fsdp.py)
    name = "finetune"
    test_families = ("siglip", "siglip2", "altclip", "chinese_clip", "metaclip_2")
    trains_pair_tasks = True  # on pair tasks: the learner heads' pair loss alone (CMCL's "vanilla")
