"""From flags and local directories to a checked model pair, tokenized prompts and an engine
whose caches fit: what `generate`, `bench`, `serve` and the demo all start with.

It lies below those entry points so that none of them imports another to get started.
"""
