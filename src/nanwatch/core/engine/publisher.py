"""Publishing a detection: the report into the log and onto disk, before anything raises."""

from __future__ import annotations

import logging
from collections.abc import Callable

from nanwatch.core.config import WatchConfig
from nanwatch.core.engine.feature_set import FeatureSet
from nanwatch.core.formats.files import write_report
from nanwatch.core.log import warn
from nanwatch.core.report import Report
from nanwatch.core.scope import BatchSchedule

__all__ = ["Publisher"]


class Publisher:
    """Logs a report, writes it to `report_dir`, says which batches went unwatched, and tells the features.

    Nothing here may stop the detection from being raised: a failure is warned about, and the rest goes on.
    """

    def __init__(
        self,
        config: WatchConfig,
        logger: logging.Logger,
        schedule: BatchSchedule,
        features: FeatureSet,
        disable: Callable[[str], None],
    ) -> None:
        self._config = config
        self._logger = logger
        self._schedule = schedule
        self._features = features
        self._disable = disable

    def publish(self, report: Report) -> None:
        self._logger.error("\n" + self.text(report) + "\n")
        report_dir = self._config.report_dir
        if report_dir is not None:
            try:
                write_report(report_dir, report)
            except Exception as error:  # a full disk, or a bug in a format: the log has the report already
                warn(f"nanwatch could not write the report to {report_dir}: {error!r}")
        try:
            missed = self._schedule.missed_note(report.batch_number) if report.phase == "train" else None
        except Exception as error:
            missed = None
            self._disable(f"working out which batches went unwatched failed: {error!r}")
        if missed is not None:
            self._logger.warning(missed)
        self._features.dispatch("on_publish", report)

    def text(self, report: Report) -> str:
        """The report's text; if rendering it fails (a bug of ours), its header and why, so nothing is lost."""
        try:
            return report.to_text()
        except Exception as error:
            self._disable(f"rendering the report failed: {error!r}")
            return f"{report.header} (nanwatch could not render its frames: {error!r})"
