"""Scope: which modules get a hook (decided once, at attach) and which training batches are recorded.

Modules are chosen by glob patterns on their qualified names (`include_modules`, then `exclude_modules`); a module
left out carries no hook, so it costs nothing at all. Batches are chosen by `watch_every_n_batches` and the window
`watch_first_batch`..`watch_last_batch`; the watcher turns recording on and off at batch boundaries, so an unwatched
batch is counted but records nothing. The schedule depends only on the config and the batch number, so every rank
of a distributed run takes the same decisions without talking to the others.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Literal

from nanwatch.core.config import ConfigError, WatchConfig

if TYPE_CHECKING:
    import torch  # for the hints only: the tools that read reports select modules without torch

__all__ = ["BatchSchedule", "rank_in", "select_modules", "select_names", "ROOT_NAME"]

# How the messages and the summary name the root module, whose qualified name is "".
ROOT_NAME = "(root)"


def _shown(name: str) -> str:
    return repr(name) if name else f"'' {ROOT_NAME}"


def select_modules(
    named_modules: Iterable[tuple[str, torch.nn.Module]], include: list[str], exclude: list[str]
) -> list[tuple[str, torch.nn.Module]]:
    """The `(name, module)` pairs that match an `include` pattern (any, when empty) and no `exclude` pattern.

    Patterns are fnmatch globs matched case-sensitively against the whole qualified name: `*` matches any run of
    characters, dots included, so `"encoder.*"` matches `encoder.0` and `encoder.0.attn` but not `encoder` itself.

    Raises:
        ConfigError: a pattern matches none of the modules (the message names it and suggests near names), or the
            patterns together leave no module to watch.
    """
    pairs = list(named_modules)
    if not include and not exclude:
        return pairs
    names = [name for name, _ in pairs]
    chosen = set(select_names(names, include, exclude, among=f"the model's {len(names)} modules"))
    return [(name, module) for name, module in pairs if name in chosen]


def select_names(names: Sequence[str], include: Sequence[str], exclude: Sequence[str], *, among: str) -> list[str]:
    """The names (in order, once each) that match an `include` pattern (any, when empty) and no `exclude` pattern.

    The one rule for every place that takes `include_modules`/`exclude_modules`: watching a model, and the
    `nanwatch show`/`diff`/`plot` commands reading a report or trace.

    Args:
        names: qualified module names (the root is "").
        include: glob patterns; empty selects every name.
        exclude: glob patterns applied after `include`.
        among: how messages name the set, e.g. "the model's 55 modules" or "the 5 modules in trace.jsonl".

    Raises:
        ConfigError: a pattern matches none of `names` (the message names it and suggests near names), or the
            patterns together leave none.
    """
    known = list(dict.fromkeys(names))
    for field, patterns in (("include_modules", include), ("exclude_modules", exclude)):
        for pattern in patterns:
            if not any(fnmatchcase(name, pattern) for name in known):
                raise ConfigError(_no_match(field, pattern, known, among))
    chosen = [
        name
        for name in known
        if (not include or any(fnmatchcase(name, p) for p in include))
        and not any(fnmatchcase(name, p) for p in exclude)
    ]
    if not chosen:
        raise ConfigError(
            f"include_modules={list(include)} and exclude_modules={list(exclude)} leave none of {among} "
            f"({_examples(known)})"
        )
    return chosen


def _examples(names: list[str]) -> str:
    return ", ".join(_shown(n) for n in names[:6]) + (", ..." if len(names) > 6 else "")


def _no_match(field: str, pattern: str, names: list[str], among: str) -> str:
    near = difflib.get_close_matches(pattern, [n for n in names if n], n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
    return (
        f"{field}: the pattern {pattern!r} matches none of {among}{hint} "
        f"(module names look like: {_examples(names)}; `*` matches any characters, dots included)"
    )


def rank_in(rank: int, ranks: Literal["zero", "all"] | list[int]) -> bool:
    """Whether `rank` is one of `ranks`, as `trace_ranks` names them."""
    return ranks == "all" or (rank == 0 if ranks == "zero" else rank in ranks)


class BatchSchedule:
    """Which 0-indexed training batches are recorded: a window, every Nth batch of it, and every traced batch."""

    def __init__(self, config: WatchConfig) -> None:
        self.every = config.watch_every_n_batches
        self.first = config.watch_first_batch
        self.last = config.watch_last_batch
        self.traced = frozenset(config.trace_batch_nums)
        self.trace_ranks = config.trace_ranks
        self.watch_eval = config.watch_eval
        # The common case: every batch is recorded, nothing to compute.
        self.watches_all = self.every == 1 and self.first == 0 and self.last is None

    def watched(self, batch_number: int) -> bool:
        """True when training batch `batch_number` is recorded. Traced batches always are (on every rank)."""
        if self.watches_all or batch_number in self.traced:
            return True
        if batch_number < self.first or (self.last is not None and batch_number > self.last):
            return False
        return (batch_number - self.first) % self.every == 0

    def records(self, phase: str, batch_number: int) -> bool:
        """Whether micro-batch `batch_number` of `phase` is recorded (evaluation: only with `watch_eval`)."""
        return self.watched(batch_number) if phase == "train" else self.watch_eval

    def traces(self, phase: str, batch_number: int, rank: int) -> bool:
        """Whether this rank traces micro-batch `batch_number` of `phase` (`trace_batch_nums`, `trace_ranks`)."""
        return phase == "train" and batch_number in self.traced and rank_in(rank, self.trace_ranks)

    def previous_watched(self, batch_number: int) -> int | None:
        """The last watched batch before `batch_number`, or None when there is none."""
        candidates = [b for b in self.traced if b < batch_number]
        if self.first < batch_number:
            end = batch_number - 1 if self.last is None else min(batch_number - 1, self.last)
            if end >= self.first:
                candidates.append(end - (end - self.first) % self.every)
        return max(candidates) if candidates else None

    def unwatched_before(self, batch_number: int) -> tuple[int, int] | None:
        """The run of unwatched batches just before `batch_number`, as (first, last), or None when there is none."""
        if batch_number <= 0:
            return None
        previous = self.previous_watched(batch_number)
        first = 0 if previous is None else previous + 1
        return (first, batch_number - 1) if first <= batch_number - 1 else None

    def missed_note(self, batch_number: int) -> str | None:
        """What a report about training batch `batch_number` cannot say: whether an unwatched batch went first.

        The batch itself may be unwatched too: the optimizer guard reports non-finite gradients at every step.
        None when the batches up to it were watched (or it is batch 0 and watched).
        """
        watched = self.watched(batch_number)
        gap = self.unwatched_before(batch_number if watched else batch_number + 1)
        if gap is None:
            return None
        first, last = gap
        batches = f"batch_number={first}" if first == last else f"batch_numbers {first}..{last}"
        which = "before this one" if watched else "up to this one"
        return (
            f"nanwatch: {batches} {which} were not watched (watch_every_n_batches={self.every}, "
            f"watch_first_batch={self.first}, watch_last_batch={self.last}); the inf/nan may have appeared there "
            f"first, for example if the weights or the inputs in this report are already non-finite. To see where, "
            f"rerun with watch_first_batch={first} and watch_every_n_batches=1."
        )
