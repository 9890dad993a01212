"""Triton attention kernels (SageAttention2-style INT8 QK / FP8 PV) with their quantisation kernels and torch references."""
