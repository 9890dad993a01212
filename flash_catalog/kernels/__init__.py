"""Triton kernels (attention, quantisation, FFN) and their torch references."""
