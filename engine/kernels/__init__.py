"""Triton kernels of the engine, each with a PyTorch reference."""
