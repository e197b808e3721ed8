"""Adapters: each maps one framework's events onto the engine's contract (core/contract.py: `AdapterContract`).

Each adapter is a package: its `__init__.py` holds the adapter (the event mapping), and one module beside it holds
what only that adapter needs from its framework:

- `plain` (`nanwatch.watch`): `plain/_loop.py`, the arguments of `watch()`, one live handle per model, the loop's
  GradScaler read once per micro-batch;
- `lightning` (`OverflowCallback`): `lightning/_trainer.py`, the Trainer's checkpoint saves checked, its loggers fed;
- `accelerate` (`OverflowTracker`): `accelerate/_accelerator.py`, what is read from and wrapped on the Accelerator;
- `hf_trainer` (`OverflowTrainerCallback`): `hf_trainer/_trainer.py`, the Trainer's counters, and what its events
  lack (a summary held for its next log, a failing forward, the checkpoint about to be saved).

What two or more adapters share, each imports directly from the module that holds it (no module re-exports them):
`_checks` (the arguments: the model looked through its wrappers, a wrong argument told in one line, the framework
present, the config every adapter takes), `_hooks` (stopping cleanly; the root's hooks, the optimizer guard, the
warning for an unguarded optimizer), `_user_handle` (`UserHandle`: what `watch()`'s handle and Accelerate's tracker
offer alike), `_scaler` (the GradScaler a framework keeps, followed) and `_checkpoints` (the checkpoint guard's
shared pieces). No adapter imports another, nor another's module; each imports its framework only when used.
"""

__all__: list[str] = []
