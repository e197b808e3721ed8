"""How the parts of one engine are made and wired to each other (core/watcher.py holds them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from nanwatch.core.distributed.board import DetectionBoard
from nanwatch.core.distributed.rewind_notice import RewindNotice
from nanwatch.core.distributed.stepvote import StepVote
from nanwatch.core.engine.arbiter import Arbiter
from nanwatch.core.engine.checker import Checker
from nanwatch.core.engine.counters import Counters
from nanwatch.core.engine.feature_context import EngineView, Facade, Fixed
from nanwatch.core.engine.feature_set import FeatureSet
from nanwatch.core.engine.publisher import Publisher
from nanwatch.core.engine.recording.recorder import Recorder
from nanwatch.core.engine.rewinder import Rewinder
from nanwatch.core.feature_api import Feature
from nanwatch.core.readouts import LOSS_SCALE_HISTORY
from nanwatch.core.scope import BatchSchedule
from nanwatch.core.stats.cache import StatsCache
from nanwatch.core.stats.measure import extra_kernels

__all__ = ["Parts", "assemble"]


class Parts(NamedTuple):
    schedule: BatchSchedule
    cache: StatsCache
    counters: Counters
    features: FeatureSet
    recorder: Recorder
    checker: Checker
    publisher: Publisher
    arbiter: Arbiter
    rewinder: Rewinder | None  # with on_detect="rewind"


def assemble(facade: Facade, fixed: Fixed, features: list[Feature], *, on_raise: Callable[[], None]) -> Parts:
    """The parts of `facade`'s engine, each given what it needs of the others; the features get their context.

    Args:
        features: from `features_for(config)` (the facade's choice: the engine knows no concrete feature).
        on_raise: called as a detection is raised (the micro-batch ends there).
    """
    config, rank, world_size, logger = fixed.config, fixed.rank, fixed.world_size, fixed.logger
    disable = facade.disable
    schedule = BatchSchedule(config)
    cache = StatsCache(extra_kernels(config))
    counters = Counters(logger)
    plugins = FeatureSet(features, disable)
    recorder = Recorder(
        counters,
        cache,
        show_recomputes=config.watch_gradients,
        trace=lambda frame, module, args, output: plugins.dispatch("on_frame", frame, module, args, output),
        disable=disable,
    )
    checker = Checker(config, counters, recorder, cache, plugins, rank=rank, world_size=world_size, disable=disable)
    publisher = Publisher(config, logger, schedule, plugins, disable)
    board = DetectionBoard.for_model(facade.model, facade.entry, rank, world_size, config.rank_wait_s)
    votes = None
    if board is not None and config.on_detect in ("skip", "rewind"):  # every rank votes before each optimizer step
        votes = StepVote(board._store, board._prefix, board.world_size, config.rank_wait_s)
    rewinder = None
    if config.on_detect == "rewind":
        rewinder = Rewinder(
            logger,
            max_rewinds=config.max_rewinds,
            rank=rank,
            world_size=world_size,
            report_dir=config.report_dir,
            notice=None if board is None else RewindNotice(board._store, board._prefix),
        )

    def scaler_skipped_since(batch_number: int) -> bool:
        history = plugins.read(LOSS_SCALE_HISTORY)
        return history is not None and history.skipped_since(batch_number)

    arbiter = Arbiter(
        board,
        publisher,
        counters,
        logger,
        rank=rank,
        world_size=world_size,
        on_raise=on_raise,
        on_detect=config.on_detect,
        max_consecutive_skips=config.max_consecutive_skips,
        report_dir=config.report_dir,
        votes=votes,
        scaler_skipped_since=scaler_skipped_since,
        rewinder=rewinder,
    )
    plugins.bind(EngineView(facade, fixed, counters, recorder, checker, publisher, plugins, cache, schedule))
    return Parts(schedule, cache, counters, plugins, recorder, checker, publisher, arbiter, rewinder)
