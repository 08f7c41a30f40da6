"""Backends: heavy frameworks live only in their own subpackage (mlx, torch, megatron)."""
