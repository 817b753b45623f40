"""Continual learning over streams of modality pairs (CMCL, Liu et al. 2025): frozen encoders, per-modality learner
heads, and methods that keep old alignments (DNS, GEM, A-GEM, EWC, DER++)."""
