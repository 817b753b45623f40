"""Continual methods on modality-pair streams: DNS, GEM, A-GEM, EWC, DER++ (and `vanilla`)."""

from . import derpp, dns, ewc, gem  # noqa: F401  (registers the methods)
from .base import PAIR_METHODS, PairMethod, PairTaskContext, build_pair_methods, register_pair_method

__all__ = ["PAIR_METHODS", "PairMethod", "PairTaskContext", "build_pair_methods", "register_pair_method"]
