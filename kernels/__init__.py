"""Paged attention: Triton kernels and a torch implementation with the same signatures."""
