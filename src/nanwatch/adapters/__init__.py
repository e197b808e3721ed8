"""Adapters: each maps one framework's counters and phases onto the core `Watcher`.

Only `plain` is imported eagerly; `lightning`, `accelerate` and `hf_trainer` import their framework when used.
"""
