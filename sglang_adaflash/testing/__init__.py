"""Helpers for tests and smoke benchmarks: tiny random model pairs written as real directories."""

from .tiny_pair import PRESETS, TinyPair, TinyPairSpec, build_tiny_pair, write_tiny_workload

__all__ = ["PRESETS", "TinyPair", "TinyPairSpec", "build_tiny_pair", "write_tiny_workload"]
