"""hf_ccl: continual learning for CLIP-style vision-language models, native to Hugging Face."""

__version__ = "0.1.0"
