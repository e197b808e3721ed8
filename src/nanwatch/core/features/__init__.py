"""The engine's plug-ins, one module each; `features_for(config)` is the only list of them."""

from __future__ import annotations

from nanwatch.core.config import WatchConfig
from nanwatch.core.feature_api import Feature
from nanwatch.core.features.capture import ReplayCapture
from nanwatch.core.features.cause import CauseFeature
from nanwatch.core.features.checkpoints import CheckpointGuard
from nanwatch.core.features.culprit import CulpritFeature
from nanwatch.core.features.gradients import GradientRecorder
from nanwatch.core.features.guard import GradientGuard
from nanwatch.core.features.headroom import HeadroomMonitor
from nanwatch.core.features.loss_scale import LossScaleFeature
from nanwatch.core.features.sentinel import SentinelFeature
from nanwatch.core.features.spikes import SpikeMonitor
from nanwatch.core.features.summary import SummaryFeature
from nanwatch.core.features.trace import TraceFeature

__all__ = ["features_for"]


def features_for(config: WatchConfig) -> list[Feature]:
    """The features a run with `config` needs, in the order their events run.

    Order matters twice: hooks attach in this order, after the engine's own (so a feature's forward hook on a module
    runs once that module's frame is recorded), and reports pass through `annotate` and `judge` in this order.
    """
    features: list[Feature] = []
    if config.trace_batch_nums:
        features.append(TraceFeature())
    if config.watch_gradients:
        features.append(GradientRecorder())
    features.append(GradientGuard())  # before each optimizer step, on by default
    features.append(CulpritFeature())
    if HeadroomMonitor.wanted(config):
        features.append(HeadroomMonitor(config))
    features.append(LossScaleFeature(config.min_loss_scale))  # inert until an adapter hands over a GradScaler
    if config.spike_window is not None:  # after the guard, whose gradient maximum it reads
        features.append(SpikeMonitor(config.spike_window, config.spike_factor, config.spike_zscore))
    if config.mode == "sentinel":
        features.append(SentinelFeature())  # after the loss scale: it replays what is to be raised
    # After the culprit, the loss scale's judgement (an overflow the scaler handles is not tested) and the replay.
    features.append(CauseFeature(config))
    if config.capture_on_detect:
        features.append(ReplayCapture())
    features.append(SummaryFeature(config.summary_every_n_batches))
    features.append(CheckpointGuard(config.checkpoint_guard))  # acts only when an adapter hands it a checkpoint
    return features
