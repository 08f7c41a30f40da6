"""Test and benchmark tooling: a real S3 server on loopback and emulated home-internet links.

Importable without torch or mlx. Nothing here runs in production code paths.
"""
