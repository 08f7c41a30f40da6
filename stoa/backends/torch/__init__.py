"""The torch learner backend (``make_learner("torch", ...)``): transformers models, packing, AdamW."""

from stoa.backends.torch.learner import TorchLearner, make

__all__ = ["TorchLearner", "make"]
