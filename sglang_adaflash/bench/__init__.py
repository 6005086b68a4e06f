"""Benchmarks of the reference engine against Hugging Face generate(): `adaflash bench`."""
