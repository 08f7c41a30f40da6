"""The fleet runtime: trainer and worker processes, the local launcher, metrics."""
