"""Tests of the Triton kernels (``kernels/``, imported as ``cce_inductor.kernels``)."""
