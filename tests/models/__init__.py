"""Whole-model tests: real model code, unmodified, compiled with the pass."""
