"""The features a watcher runs (core/features/), and how their events are dispatched: safely, in order."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from nanwatch.core.feature_api import EngineContext, Feature
from nanwatch.core.readouts import Readout
from nanwatch.errors import NanwatchError

__all__ = ["FeatureSet"]

_F = TypeVar("_F", bound=Feature)
_T = TypeVar("_T")


class FeatureSet:
    """The engine's plug-ins, in the order their events run.

    Args:
        features: from `features_for(config)`.
        disable: stops watching (the run goes on); called with the reason when a feature fails.
    """

    def __init__(self, features: list[Feature], disable: Callable[[str], None]) -> None:
        self._features = features
        self._disable = disable
        self._ctx: EngineContext | None = None  # the context the features are handed: `bind`

    def bind(self, ctx: EngineContext) -> None:
        """The context every event hands the features: made last, from the parts (core/engine/assembly.py), since
        it reads them all."""
        self._ctx = ctx

    @property
    def ctx(self) -> EngineContext:
        """The context bound (the engine binds it as it is made, before any event)."""
        assert self._ctx is not None, "the feature set is used before the engine bound its context"
        return self._ctx

    def __iter__(self) -> Iterator[Feature]:
        return iter(self._features)

    def dispatch(self, event: str, *args: Any) -> None:
        """Run one event on every feature. nanwatch's own errors (a detection, the loss scale's floor) propagate;
        anything else a feature raises is a bug of ours: it disables watching, and the run goes on."""
        for feature in self._features:
            self.safely(f"{feature.name}.{event}", getattr(feature, event), self.ctx, *args)

    def safely(self, what: str, call: Callable[..., Any], *args: Any) -> None:
        try:
            call(*args)
        except NanwatchError:
            raise
        except Exception as error:
            self._disable(f"{what} failed: {error!r}")

    def find(self, kind: type[_F]) -> _F | None:
        """The feature of this class, or None where the config leaves it out."""
        return next((feature for feature in self._features if isinstance(feature, kind)), None)

    def read(self, readout: Readout[Callable[[], _T]]) -> _T | None:
        """What the feature offering `readout` says now, or None where no feature offers it."""
        for feature in self._features:
            offered = feature.readouts().get(readout)
            if offered is not None:
                found: _T = offered()
                return found
        return None
