"""What every adapter shares, in one import: `from nanwatch.adapters import _common`.

An adapter maps its framework's events onto the engine's contract (core/contract.py: `AdapterContract`, the only
members of the watcher an adapter may use) and nothing more. What they share lives in six modules, named here:

- `_checks`: the arguments (the model looked through its wrappers, a wrong argument told in one line, the config);
- `_hooks`: stopping cleanly, and the hooks beside the watcher's own (the root's, the optimizers', a wrapped method);
- `_handles`: what the user holds (`UserHandle`), one live handle per model (`take_over`), a loop's GradScaler read
  once per micro-batch (`ScaleAfterStep`);
- `_framework_state`: what a framework's own objects say (the GradScaler it keeps, the counters its state implies);
- `_summaries`: where a summary goes in each framework's own logging;
- `_checkpoints`: the checkpoint guard in each framework (what is about to be written, checked first).
"""

from __future__ import annotations

from nanwatch.adapters._checkpoints import (
    guard_accelerate_saves,
    guard_lightning_saves,
    save_checked,
    verify_trainer_save,
)
from nanwatch.adapters._checks import (
    ConfigLike,
    check_config,
    check_model,
    check_optimizer,
    check_skip,
    entry_module,
    optimizer_list,
    optional_base,
    real_optimizer,
    require,
    unwrap_model,
)
from nanwatch.adapters._framework_state import dataloader_epoch, follow_scaler, micro_batches_done, trainer_epoch
from nanwatch.adapters._handles import ScaleAfterStep, UserHandle, hold, let_go, take_over
from nanwatch.adapters._hooks import (
    PreHook,
    Runner,
    add_phase_hook,
    close_after,
    close_when_forward_raises,
    guard_optimizers,
    guard_steps,
    hook_root,
    stop_on_error,
    warn_if_steps_unguarded,
    watch_loss_of,
    watch_root,
)
from nanwatch.adapters._summaries import HeldForLog, Sink, to_loggers, to_trackers

__all__ = [
    "ConfigLike",
    "HeldForLog",
    "PreHook",
    "Runner",
    "ScaleAfterStep",
    "Sink",
    "UserHandle",
    "add_phase_hook",
    "check_config",
    "check_model",
    "check_optimizer",
    "check_skip",
    "close_after",
    "close_when_forward_raises",
    "dataloader_epoch",
    "entry_module",
    "follow_scaler",
    "guard_accelerate_saves",
    "guard_lightning_saves",
    "guard_optimizers",
    "guard_steps",
    "hold",
    "hook_root",
    "let_go",
    "micro_batches_done",
    "optimizer_list",
    "optional_base",
    "real_optimizer",
    "require",
    "save_checked",
    "stop_on_error",
    "take_over",
    "to_loggers",
    "to_trackers",
    "trainer_epoch",
    "unwrap_model",
    "verify_trainer_save",
    "warn_if_steps_unguarded",
    "watch_loss_of",
    "watch_root",
]
