"""`on_detect="rewind"` in the plain loop, beside plain/__init__.py: what each entry of a checkpoint saved through
`handle.save_checkpoint` is (`LiveParts.layout_of`, at save time), and putting it back into the live objects, in
place (`LiveParts.restore`, at a rewind).

nanwatch knows the loop's objects from `watch()`: the model (and the wrapper it was given: DDP, torch.compile), the
optimizer (and any `handle.guard()`ed since), the LR schedulers (`scheduler=`) and the GradScaler (`scaler=`). At each
save, each top-level entry of the saved mapping is matched to one of them:

- the object itself (`{"model": model}`): by identity;
- its `state_dict()`: the model's by its keys (the wrapper's, `module.`-prefixed, or the inner model's); an optimizer's
  (`state` and `param_groups`) by its groups' shapes, then by identity of its per-parameter state; a scheduler's
  (`last_epoch` among its keys) and the scaler's by their keys, a scheduler's then by identity of its values.

An entry that is none of these (an epoch count, RNG states, an EMA copy) is left as it is at a rewind. Refused at save
time, with a one-line `ConfigError` and nothing written: a checkpoint without the model or without a guarded
optimizer's state (a rewind would put weights back without the optimizer state that goes with them), a scheduler's
or a scaler's state when `watch()` was given none (nanwatch cannot tell which live object it belongs to), an entry
that matches two of them. The layout travels with the checkpoint's record (JSON text), so a rank that did not save it
restores it into its own objects.
"""

from __future__ import annotations

import json
import pickle
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeAlias

import torch

from nanwatch.core.rewinds import RewindPoint
from nanwatch.errors import ConfigError

__all__ = ["LiveParts", "Part", "SchedulerArg", "schedulers_given"]

Role = Literal["model", "optimizer", "scheduler", "scaler"]

# What a GradScaler's state_dict() holds (an enabled one's; a disabled one's is empty).
_SCALER_KEYS = frozenset({"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
_CALLER = "handle.save_checkpoint()"


@dataclass(frozen=True)
class Part:
    """One entry of a saved checkpoint that a rewind puts back.

    Attributes:
        key: the entry's key in the saved mapping.
        role: which of the loop's objects it belongs to.
        index: which optimizer or scheduler (in the order nanwatch was given them); 0 for the model and the scaler.
        whole: saved as the object itself (pickled whole), not as its state_dict.
        wrapped: the model's state as the module given to watch() has it (a DDP or compile wrapper's keys).
    """

    key: str
    role: Role
    index: int = 0
    whole: bool = False
    wrapped: bool = False


# `watch(scheduler=...)`: one LR scheduler, a list of them, or None.
SchedulerArg: TypeAlias = "torch.optim.lr_scheduler.LRScheduler | Sequence[torch.optim.lr_scheduler.LRScheduler] | None"


def schedulers_given(scheduler: object, caller: str) -> list[torch.optim.lr_scheduler.LRScheduler]:
    """`scheduler=` as a list (one, a list of them, or None); a one-line `TypeError` for anything else."""
    given: list[object] = (
        [] if scheduler is None else list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]
    )
    schedulers = []
    for item in given:
        if not isinstance(item, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError(
                f"{caller} needs scheduler= a torch.optim.lr_scheduler.LRScheduler (or a list of them), got "
                f"{type(item).__name__}"
            )
        schedulers.append(item)
    return schedulers


class LiveParts:
    """The loop's objects a rewind restores into, held weakly (a closed handle keeps none of them alive)."""

    def __init__(
        self,
        given: torch.nn.Module,
        watched: torch.nn.Module,
        *,
        optimizers: Iterable[torch.optim.Optimizer],
        schedulers: Iterable[torch.optim.lr_scheduler.LRScheduler],
        scaler: Any,
    ) -> None:
        self._given, self._watched = weakref.ref(given), weakref.ref(watched)
        self._optimizers = [weakref.ref(optimizer) for optimizer in optimizers]
        self._schedulers = [weakref.ref(scheduler) for scheduler in schedulers]
        self._scaler = None if scaler is None else weakref.ref(scaler)

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """`handle.guard(optimizer)`: its state belongs in every checkpoint a rewind restores too."""
        if all(ref() is not optimizer for ref in self._optimizers):
            self._optimizers.append(weakref.ref(optimizer))

    # ------------------------------------------------------------------------------------------------ at save

    def layout_of(self, state: Any) -> str:
        """Which live object each entry of `state` belongs to (JSON text for the checkpoint's record).

        Raises:
            ConfigError: a rewind could not restore `state` in full, or cannot tell what an entry belongs to.
        """
        if not isinstance(state, Mapping) or not all(isinstance(key, str) for key in state):
            raise ConfigError(
                f"nanwatch: on_detect='rewind' restores what {_CALLER} saved, entry by entry: pass a dict of named "
                f"parts, {{'model': model.state_dict(), 'optimizer': optimizer.state_dict()}}, got "
                f"{type(state).__name__}"
            )
        parts = [part for key, value in state.items() if (part := self._part(key, value)) is not None]
        self._check_complete(parts)
        return json.dumps([asdict(part) for part in parts])

    def _part(self, key: str, value: Any) -> Part | None:
        given, watched = self._given(), self._watched()
        if isinstance(value, torch.nn.Module):
            if value is given or value is watched:
                return Part(key, "model", whole=True, wrapped=value is given and given is not watched)
            return None  # another module (an EMA copy): left as it is
        if isinstance(value, torch.optim.Optimizer):
            found = [i for i, ref in enumerate(self._optimizers) if ref() is value]
            return Part(key, "optimizer", found[0], whole=True) if found else None
        if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
            found = [i for i, ref in enumerate(self._schedulers) if ref() is value]
            if not found:
                raise _not_given(key, "an LR scheduler", "scheduler=scheduler")
            return Part(key, "scheduler", found[0], whole=True)
        if isinstance(value, torch.amp.GradScaler):
            if self._scaler is None or self._scaler() is not value:
                raise _not_given(key, "a GradScaler", "scaler=scaler")
            return Part(key, "scaler", whole=True)
        if not isinstance(value, Mapping) or not value:
            return None
        keys = set(value)
        for wrapped, module in ((False, watched), (True, given)):
            if module is not None and keys == set(module.state_dict()):
                return Part(key, "model", wrapped=wrapped and given is not watched)
        if keys == {"state", "param_groups"}:
            return Part(key, "optimizer", self._optimizer_index(key, value))
        if "last_epoch" in keys:
            return Part(key, "scheduler", self._scheduler_index(key, value))
        if keys == _SCALER_KEYS:
            if self._scaler is None:
                raise _not_given(key, "a GradScaler's state", "scaler=scaler")
            return Part(key, "scaler")
        return None

    def _optimizer_index(self, key: str, saved: Mapping[str, Any]) -> int:
        live = [(i, ref()) for i, ref in enumerate(self._optimizers)]
        groups = [len(group.get("params", ())) for group in saved.get("param_groups", ())]
        shaped = [(i, o) for i, o in live if o is not None and [len(g["params"]) for g in o.param_groups] == groups]
        if len(shaped) > 1:  # the same shapes: told apart by the per-parameter state it holds (the optimizer's own)
            held = {id(value) for value in saved.get("state", {}).values()}
            shaped = [(i, o) for i, o in shaped if held & {id(value) for value in o.state.values()}]
        if len(shaped) != 1:
            which = "none" if not shaped else f"{len(shaped)}"
            raise ConfigError(
                f"nanwatch: on_detect='rewind': {_CALLER} entry {key!r} is an optimizer's state_dict that matches "
                f"{which} of the {len(live)} optimizers nanwatch guards (watch(optimizer=...), handle.guard(...)): "
                "a rewind could not tell which to restore it into"
            )
        return shaped[0][0]

    def _scheduler_index(self, key: str, saved: Mapping[str, Any]) -> int:
        live = [(i, ref()) for i, ref in enumerate(self._schedulers)]
        if not live:
            raise _not_given(key, "an LR scheduler's state", "scheduler=scheduler")
        shaped = [(i, s) for i, s in live if s is not None and set(s.state_dict()) == set(saved)]
        if len(shaped) > 1:  # the same kind: told apart by the lists its state_dict() shares with it
            shaped = [(i, s) for i, s in shaped if any(saved[k] is v for k, v in s.state_dict().items())]
        if len(shaped) != 1:
            raise ConfigError(
                f"nanwatch: on_detect='rewind': {_CALLER} entry {key!r} is an LR scheduler's state_dict that matches "
                f"{'none' if not shaped else len(shaped)} of the {len(live)} schedulers given to watch(scheduler=...): "
                "a rewind could not tell which to restore it into"
            )
        return shaped[0][0]

    def _check_complete(self, parts: list[Part]) -> None:
        seen: dict[tuple[Role, int], str] = {}
        for part in parts:
            earlier = seen.setdefault((part.role, part.index), part.key)
            if earlier != part.key:
                raise ConfigError(
                    f"nanwatch: on_detect='rewind': {_CALLER} entries {earlier!r} and {part.key!r} both hold the "
                    f"{part.role}'s state: a rewind could not tell which to restore"
                )
        if ("model", 0) not in seen:
            raise ConfigError(
                f"nanwatch: on_detect='rewind': {_CALLER} was given no state of the watched model (its state_dict() "
                "or the model itself): a rewind restores the model from it"
            )
        missing = [i for i, ref in enumerate(self._optimizers) if ref() is not None and ("optimizer", i) not in seen]
        if missing:
            raise ConfigError(
                f"nanwatch: on_detect='rewind': {_CALLER} was given no state of the optimizer nanwatch guards "
                "(optimizer.state_dict()): a rewind would put back weights without the optimizer state that goes "
                "with them"
            )

    # -------------------------------------------------------------------------------------------- at rewind

    def restore(self, point: RewindPoint) -> tuple[str, ...]:
        """Load `point`'s checkpoint and put each part back into its live object, in place; the entries restored.

        Raises:
            RuntimeError: the file cannot be read, lacks a part, a live object is gone, or a part does not load (then
                earlier parts may be restored already: the caller must not go on).
        """
        parts = [Part(**fields) for fields in json.loads(point.layout)]
        loaded = _load(point.path, objects=any(part.whole for part in parts))
        if not isinstance(loaded, Mapping):
            raise RuntimeError(f"{point.path!r} holds a {type(loaded).__name__}, not the dict that was saved")
        # Everything found before anything is touched: most failures leave the live objects as they were.
        planned = []
        for part in parts:
            if part.key not in loaded:
                raise RuntimeError(f"{point.path!r} holds no entry {part.key!r} (the {part.role}'s state)")
            saved = loaded[part.key]
            planned.append((part, self._live(part), saved.state_dict() if part.whole else saved))
        for part, live, state in planned:
            try:
                live.load_state_dict(state)
            except Exception as error:
                raise RuntimeError(f"entry {part.key!r} did not load into the {part.role}: {error}") from error
        return tuple(part.key for part in parts)

    def _live(self, part: Part) -> Any:
        found: object | None
        if part.role == "model":
            found = (self._given if part.wrapped else self._watched)()
        elif part.role == "optimizer":
            found = self._optimizers[part.index]() if part.index < len(self._optimizers) else None
        elif part.role == "scheduler":
            found = self._schedulers[part.index]() if part.index < len(self._schedulers) else None
        else:
            found = None if self._scaler is None else self._scaler()
        if found is None:
            raise RuntimeError(f"the {part.role} that entry {part.key!r} belongs to no longer exists")
        return found


def _not_given(key: str, what: str, keyword: str) -> ConfigError:
    return ConfigError(
        f"nanwatch: on_detect='rewind': {_CALLER} entry {key!r} is {what}, and watch() was given none to restore it "
        f"into: pass it, nanwatch.watch(model, optimizer=optimizer, {keyword}, on_detect='rewind')"
    )


def _load(path: str, *, objects: bool) -> Any:
    """The checkpoint as saved, its tensors on the CPU (each part's `load_state_dict` puts them where they belong).
    Tensors and plain containers load with `weights_only=True`; anything else (parts saved whole, the loop's own
    objects beside them) needs full unpickling, which is sound here only because this run wrote and verified the file.
    """
    if not objects:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            pass  # objects of the loop's own beside the parts
    return torch.load(path, map_location="cpu", weights_only=False)
