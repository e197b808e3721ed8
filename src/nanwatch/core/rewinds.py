"""What `on_detect="rewind"` works with, as plain records: the checkpoint a rewind may restore (`RewindPoint`), one
rewind done (`Rewind`), and the adapter's way of putting a checkpoint back in place (`Restorer`).

The engine (core/engine/rewinder.py) decides when to rewind and to which point, the same on every rank; only the
adapter knows which live object each part of a saved checkpoint belongs to, so it hands the engine a `Restorer`.
A point's `layout` is the adapter's own description of that (the plain loop's: which entry of the saved mapping is
the model, an optimizer, a scheduler, the scaler), text the engine passes along unread, so a rank that never saved
the checkpoint (rank 0 saves, rank 1 rewinds too) restores it into its own objects.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

__all__ = ["REWIND_LIST", "Restorer", "Rewind", "RewindPoint"]

# The rewind list's name in report_dir: one JSON object per rewind.
REWIND_LIST = "rewinds.jsonl"


@dataclass(frozen=True)
class RewindPoint:
    """A checkpoint the checkpoint guard verified finite and the framework then wrote: where a rewind goes back to.

    Attributes:
        path: where it was written (a file, or a folder for Accelerate's `save_state`).
        optimizer_step: its optimizer step, as the guard named it.
        layout: the adapter's description of which live object each part belongs to ("" where the framework's own
            format says it).
    """

    path: str
    optimizer_step: int | None
    layout: str = ""

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str | bytes) -> RewindPoint:
        data = json.loads(text.decode() if isinstance(text, bytes) else text)
        step = data["optimizer_step"]
        return cls(str(data["path"]), None if step is None else int(step), str(data.get("layout", "")))


@dataclass(frozen=True)
class Rewind:
    """One rewind, as `handle.rewinds` and `report_dir/rewinds.jsonl` list them.

    Attributes:
        batch_number: the micro-batch whose detection caused it (its update was never applied).
        rank: the rank that detected it.
        path: the checkpoint restored.
        optimizer_step: that checkpoint's optimizer step.
        restored: what was put back in place (`"model"`, `"optimizer"`, ...), in the order it was restored.
    """

    batch_number: int
    rank: int
    path: str
    optimizer_step: int | None
    restored: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "restored": list(self.restored)}


# Puts the checkpoint of a point back into the live objects, in place; returns the names of what it restored. Raises
# (any exception, its message saying what failed) when any part could not be restored.
Restorer = Callable[[RewindPoint], tuple[str, ...]]
