"""Adapters: each maps one framework's events onto the engine's contract (core/watcher.py), sharing `_common`.

`plain` (`nanwatch.watch`), `lightning`, `accelerate` and `hf_trainer`; each imports its framework only when used.
"""

__all__: list[str] = []
