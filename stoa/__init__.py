"""Stoa: decentralized RL post-training of language models.

A fleet of consumer machines generates rollouts with int8 MLX inference; one GPU trainer runs the
gradient updates; the two meet only in an object store. ``import stoa`` is light: it never imports
mlx, torch or megatron (those live in ``stoa.backends.<name>``).
"""

__version__ = "0.1.0"

from stoa.types import Episode, EpisodeError, Segment, decode_episodes, encode_episodes

__all__ = ["Episode", "EpisodeError", "Segment", "decode_episodes", "encode_episodes", "__version__"]
