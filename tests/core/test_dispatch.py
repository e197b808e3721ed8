"""core/dispatch.py: the shortcut past torch's hook dispatch calls what torch calls, in its order, or steps aside.

Each scenario runs twice on fresh modules: hooks registered with torch alone, and the same hooks added through
`HookSet.add_forward` (which puts the shortcut on the class). What the hooks saw, in what order, and what the call
returned must be the same; a counter on torch's own `_call_impl` tells which way each call went.
"""

from __future__ import annotations

import copy
import gc
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from nanwatch.core.dispatch import shortcut_on
from nanwatch.core.hooks import HookSet


class Affine(nn.Module):
    """A module class of this file's own, so a shortcut left on it could only be this file's doing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([2.0, 3.0]))

    def forward(self, x: torch.Tensor, *, shift: float = 0.0) -> torch.Tensor:
        return x * self.weight + shift


class OwnCallImpl(Affine):
    """A class with a `_call_impl` of its own: the shortcut must leave it alone."""

    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        return super()._call_impl(*args, **kwargs) + 100


class OwnCall(Affine):
    """A class with a `__call__` of its own (as `torch.fx.GraphModule` has): left alone too."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs) + 1000


Events = list[tuple[Any, ...]]


def _hooks(events: Events) -> dict[str, Callable[..., Any]]:
    def plain(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        events.append(("plain", module, args, output.tolist()))

    def keywords(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        events.append(("keywords", module, args, dict(kwargs), output.tolist()))

    def replaces(module: nn.Module, args: tuple[Any, ...], output: Any) -> torch.Tensor:
        events.append(("replaces", output.tolist()))
        return output * 10

    def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
        events.append(("pre", args[0].tolist()))

    def always(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        events.append(("always", output is None))

    return {"plain": plain, "keywords": keywords, "replaces": replaces, "pre": pre, "always": always}


def _add(module: nn.Module, hooks: HookSet | None, hook: Callable[..., Any], *, with_kwargs: bool = False) -> None:
    if hooks is None:
        module.register_forward_hook(hook, with_kwargs=with_kwargs)
    else:
        hooks.add_forward(module, hook, with_kwargs=with_kwargs)


@pytest.fixture
def torch_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[nn.Module]]:
    """The modules whose calls ran torch's own `_call_impl` (where the shortcut is on: went on to it)."""
    went: list[nn.Module] = []
    original = nn.Module._call_impl

    def counted(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        went.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "_call_impl", counted)
    return went


def _scenario(name: str, hooks: HookSet | None) -> tuple[Events, Any]:
    torch.manual_seed(0)
    events: Events = []
    made = _hooks(events)
    module = Affine()
    x = torch.tensor([1.0, -1.0], requires_grad=True)  # a full backward hook wants an input that needs a gradient
    if name == "one hook with keywords":
        _add(module, hooks, made["keywords"], with_kwargs=True)
    elif name == "hooks in order, one replacing the output":
        _add(module, hooks, made["plain"])
        _add(module, hooks, made["replaces"])
        _add(module, hooks, made["keywords"], with_kwargs=True)
    elif name == "a forward pre-hook too":
        _add(module, hooks, made["plain"])
        module.register_forward_pre_hook(made["pre"])
    elif name == "an always_call hook too":
        _add(module, hooks, made["plain"])
        module.register_forward_hook(made["always"], always_call=True)
    elif name == "a full backward hook too":
        _add(module, hooks, made["plain"])
        module.register_full_backward_hook(lambda *_: events.append(("backward",)))
    elif name == "a global forward hook too":
        _add(module, hooks, made["plain"])
        handle = nn.modules.module.register_module_forward_hook(made["replaces"])
        try:
            output = module(x, shift=0.5)
        finally:
            handle.remove()
        return events, output.tolist()
    output = module(x, shift=0.5)
    if name == "a full backward hook too":
        output.sum().backward()
    return events, output.tolist()


def _same(torch_run: tuple[Events, Any], our_run: tuple[Events, Any]) -> None:
    """The two runs saw the same: modules compared by their place, tensors by value."""

    def plain(events: Events) -> list[tuple[Any, ...]]:
        return [
            tuple(
                "module"
                if isinstance(item, nn.Module)
                else [t.tolist() for t in item]
                if isinstance(item, tuple)
                else item
                for item in event
            )
            for event in events
        ]

    assert plain(our_run[0]) == plain(torch_run[0])
    assert our_run[1] == torch_run[1]


@pytest.mark.parametrize(
    ("scenario", "shortcut_taken"),
    [
        ("one hook with keywords", True),
        ("hooks in order, one replacing the output", True),
        ("a forward pre-hook too", False),
        ("an always_call hook too", False),
        ("a full backward hook too", False),
        ("a global forward hook too", False),
    ],
)
def test_the_shortcut_calls_what_torch_calls_or_leaves_it_to_torch(
    scenario: str, shortcut_taken: bool, torch_calls: list[nn.Module]
) -> None:
    torch_run = _scenario(scenario, None)
    assert torch_calls, "torch's own `_call_impl` ran, and the counter saw it"
    torch_calls.clear()
    hooks = HookSet()
    our_run = _scenario(scenario, hooks)
    hooks.remove_all()
    assert torch_run[0], "the scenario ran no hook: it would compare nothing"
    _same(torch_run, our_run)
    assert (len(torch_calls) == 0) is shortcut_taken


def test_a_module_of_the_class_without_hooks_calls_its_forward_and_one_with_a_pre_hook_goes_to_torch(
    torch_calls: list[nn.Module],
) -> None:
    hooks = HookSet()
    hooks.add_forward(Affine(), _nothing)  # puts the shortcut on the class
    unhooked, pre_hooked = Affine(), Affine()
    seen: list[str] = []
    pre_hooked.register_forward_pre_hook(lambda *_: seen.append("pre"))
    assert unhooked(torch.ones(2), shift=1.0).tolist() == [3.0, 4.0]
    assert torch_calls == []  # straight to its forward, as torch's fast path goes
    assert pre_hooked(torch.ones(2)).tolist() == [2.0, 3.0]
    assert torch_calls == [pre_hooked]
    assert seen == ["pre"]
    hooks.remove_all()


def test_exceptions_go_up_unchanged_from_the_forward_and_from_a_hook(torch_calls: list[nn.Module]) -> None:
    module, hooks = Affine(), HookSet()

    def failing(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        raise KeyError("the hook's own")

    hooks.add_forward(module, failing)
    with pytest.raises(KeyError, match="the hook's own"):
        module(torch.ones(2))
    with pytest.raises(RuntimeError, match="size of tensor"):
        module(torch.ones(3))
    hooks.remove_all()
    assert torch_calls == []


def test_the_class_carries_the_shortcut_while_a_hooked_module_of_it_does() -> None:
    first, second = HookSet(), HookSet()
    a, b = Affine(), Affine()
    first.add_forward(a, lambda *_: None)
    second.add_forward(b, lambda *_: None)
    assert shortcut_on(a)
    assert "__call__" in vars(Affine)
    first.remove_all()
    assert shortcut_on(b)  # the second set still holds a module of the class
    second.remove_all()
    assert not shortcut_on(a)
    assert "__call__" not in vars(Affine)
    assert Affine.__call__ is nn.Module.__call__


def test_a_shortcut_someone_took_off_the_class_is_put_back_by_the_next_hook() -> None:
    first, second = HookSet(), HookSet()
    first.add_forward(Affine(), _nothing)
    del Affine.__call__  # a tool that shares the model took it off (benchmarks/overhead.py's HookStash does)
    module = Affine()
    second.add_forward(module, _nothing)
    assert shortcut_on(module)
    first.remove_all()
    assert shortcut_on(module)  # the second set still holds it
    second.remove_all()
    assert not shortcut_on(module)


def test_a_hook_set_dropped_without_removal_lets_the_class_go_when_collected() -> None:
    module = Affine()
    hooks = HookSet()
    hooks.add_forward(module, lambda *_: None)
    assert shortcut_on(module)
    del hooks
    gc.collect()
    assert not shortcut_on(module)


def test_classes_with_their_own_call_or_call_impl_and_plain_modules_keep_torchs() -> None:
    hooks = HookSet()
    own_impl, own_call, plain = OwnCallImpl(), OwnCall(), nn.Module()
    plain.forward = lambda x: x  # type: ignore[method-assign]
    seen: list[str] = []
    hooks.add_forward(own_impl, lambda *_: seen.append("own _call_impl"))
    hooks.add_forward(own_call, lambda *_: seen.append("own __call__"))
    hooks.add_forward(plain, lambda *_: seen.append("plain"))
    assert not shortcut_on(own_impl)
    assert not shortcut_on(own_call)
    assert not shortcut_on(plain)
    assert own_impl(torch.ones(2)).tolist() == [102.0, 103.0]  # its own `_call_impl` still runs
    assert own_call(torch.ones(2)).tolist() == [1002.0, 1003.0]  # and its own `__call__`
    plain(torch.ones(2))
    assert seen == ["own _call_impl", "own __call__", "plain"]
    hooks.remove_all()


def test_a_tracer_that_patches_module_call_is_obeyed() -> None:
    # torch.fx (and export's tracers) patch `nn.Module.__call__` to see each module call: leaf modules become
    # `call_module` nodes. A class-level shortcut would hide the calls from the patch; it steps aside instead.
    torch.manual_seed(0)
    model, hooks = nn.Sequential(nn.Linear(2, 2), nn.Tanh()), HookSet()
    seen: list[nn.Module] = []
    for module in model:
        hooks.add_forward(module, _remember_module(seen))
    assert shortcut_on(model[0])
    graph = torch.fx.symbolic_trace(model).graph
    assert [node.target for node in graph.nodes if node.op == "call_module"] == ["0", "1"]
    assert seen == []  # fx's leaf modules are not run while tracing
    model(torch.ones(1, 2))  # and after tracing, the shortcut again
    assert seen == [model[0], model[1]]
    hooks.remove_all()


def test_a_torch_with_a_kind_of_hook_the_shortcut_does_not_know_keeps_its_own_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nn.modules.module, "_global_forward_rehearsal_hooks", {}, raising=False)
    module, hooks = Affine(), HookSet()
    seen: list[nn.Module] = []
    hooks.add_forward(module, _remember_module(seen))
    assert not shortcut_on(module)
    module(torch.ones(2))
    assert seen == [module]
    hooks.remove_all()


def test_copies_and_replicas_call_their_own_forward_and_keep_their_class() -> None:
    module, hooks = Affine(), HookSet()
    seen: list[nn.Module] = []
    hooks.add_forward(module, _remember_module(seen))
    copied = copy.deepcopy(module)
    with torch.no_grad():
        copied.weight.fill_(5.0)
    assert copied(torch.ones(2)).tolist() == [5.0, 5.0]
    assert seen == [copied]
    replica = module._replicate_for_data_parallel()  # what nn.DataParallel does on each device
    replica.weight = torch.tensor([7.0, 7.0])
    assert replica(torch.ones(2)).tolist() == [7.0, 7.0]
    assert seen[-1] is replica
    hooks.remove_all()


def test_a_hooked_module_pickles_as_its_own_class() -> None:
    module, hooks = Affine(), HookSet()
    hooks.add_forward(module, _nothing)
    loaded = pickle.loads(pickle.dumps(module))
    assert type(loaded) is Affine
    assert loaded(torch.ones(2)).tolist() == [2.0, 3.0]
    hooks.remove_all()


def _nothing(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    return None


def _remember_module(seen: list[nn.Module]) -> Callable[..., None]:
    return lambda module, args, output: seen.append(module)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_a_traced_call_goes_through_torch(torch_calls: list[nn.Module]) -> None:
    module, hooks = Affine(), HookSet()
    seen: list[nn.Module] = []
    hooks.add_forward(module, _remember_module(seen))
    traced = torch.jit.trace(module, torch.ones(2))
    assert module in torch_calls  # torch's own path, which calls `_slow_forward` under the tracer
    assert seen
    assert seen[0] is module
    assert traced(torch.ones(2)).tolist() == [2.0, 3.0]
    hooks.remove_all()
