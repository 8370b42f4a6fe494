"""Flax helpers for :func:`jax_fp8.fp8_dot_general` (flax is imported only when a function here is called)."""
from .linen import Fp8Model, Fp8Report, Layer, fp8_autocast, fp8_dot_general_for, fp8_model, use_fp8_dot_general

__all__ = ["use_fp8_dot_general", "fp8_dot_general_for", "fp8_model", "fp8_autocast", "Fp8Model", "Fp8Report",
           "Layer"]
