"""Fused GPU kernels for inference (Triton)."""
