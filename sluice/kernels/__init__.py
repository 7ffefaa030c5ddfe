"""sluice.kernels: the C++ kernels (quantized GEMM, fused small ops, paged attention) and their Python faces.

Below ``models/`` and ``engine/``; imports torch, nothing of sluice above it.
"""
