"""Tests of the graph passes (``cce_inductor/fx_passes/``): the head chain, one file per matched form, fuzzing."""
