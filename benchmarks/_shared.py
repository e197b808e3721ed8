"""What more than one benchmark uses: the dispatch-bound step, counting module calls, and the means to share one model
among several tools.

Not a script: the benchmarks import it (`from _shared import ...`; a script's own folder is first on its path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

PAIRS, BATCH = 1000, 2
CALLS = 2 * PAIRS + 1  # every Linear and Tanh, and the Sequential around them


def dispatch_step() -> tuple[nn.Sequential, torch.Tensor, torch.optim.Optimizer]:
    """The dispatch-bound step (1,000 `Linear(4, 4)` + `Tanh` pairs, batch 2, plain SGD with `foreach=True`): the
    model, its batch and its optimizer. Compute is next to nothing, so a step costs what running Python around its
    kernels costs: where a watcher's cost per module call shows undiluted."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(PAIRS):
        layers += [nn.Linear(4, 4), nn.Tanh()]
    model = nn.Sequential(*layers)
    inputs = torch.randn(BATCH, 4)
    return model, inputs, torch.optim.SGD(model.parameters(), lr=1e-5, foreach=True)


def module_calls(model: nn.Module, forward: Callable[[], Any]) -> int:
    """How many module calls `forward()` (a forward of `model`) makes, counted by pre-hooks taken off after, under
    `torch.no_grad()`: what a step's added time or ops are divided by to give a figure per module call."""
    calls: list[int] = []
    handles = [module.register_forward_pre_hook(lambda *_: calls.append(1)) for module in model.modules()]
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return len(calls)


def shares_its_model(handle: Any) -> None:
    """`handle` (a `nanwatch.watch` handle) shares its model on purpose with other tools, each with its hooks on only
    around its own steps: the next `watch()` on the model must not close it as a handle left behind.

    The one private call of these benchmarks that a user never needs: nanwatch allows one watcher per model, and
    a benchmark that times several on one model has to tell it so.
    """
    from nanwatch.adapters.plain._loop import let_go

    let_go(handle)


class HookStash:
    """The hooks a tool put on a model, taken off and put back, so several tools can share one model.

    `capture(setup)` runs `setup()` (which registers the tool's hooks) and notes every hook that appeared in a hook
    dict of a module or parameter; `take_off()` removes exactly those, `put_back()` reinserts them under the same
    keys (so the tool's own handles can still remove them), in the same order. The optimizer's step hooks
    (`watch(..., optimizer=)`) count too. A tool that changes one of the model's classes is refused: it would change
    every variant's step, the unwatched one included.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._owners: list[object] = [*model.modules(), *model.parameters(), optimizer]
        self._hooks: list[tuple[dict[int, Any], int, Any]] = []
        self._classes = {type(module) for module in model.modules()}

    def _hook_dicts(self) -> Iterator[tuple[object, str, dict[int, Any]]]:
        for owner in self._owners:
            for name, value in vars(owner).items():
                if "hooks" in name and isinstance(value, dict):
                    yield owner, name, value

    def capture(self, setup: Callable[[], Any]) -> Any:
        before = {(id(owner), name): set(hooks) for owner, name, hooks in self._hook_dicts()}
        classes_before = {kind: dict(vars(kind)) for kind in self._classes}
        result = setup()
        for owner, name, hooks in self._hook_dicts():
            known = before.get((id(owner), name), set())
            self._hooks.extend((hooks, key, hook) for key, hook in hooks.items() if key not in known)
        changed = [kind.__name__ for kind, attributes in classes_before.items() if dict(vars(kind)) != attributes]
        if changed:
            raise RuntimeError(f"a watcher changed the model's classes ({', '.join(changed)}): the figures would lie")
        return result

    def take_off(self) -> None:
        for hooks, key, _hook in self._hooks:
            hooks.pop(key, None)

    def put_back(self) -> None:
        for hooks, key, hook in self._hooks:
            hooks[key] = hook
