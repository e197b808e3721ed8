"""`WatchConfig`: the one configuration shared by every entry point and adapter.

The model and its rules live here; how a file is read (`reading`) and how a mistake is worded (`messages`) sit beside
it, since the CLI uses both without building a config.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from nanwatch.core.config.messages import describe, echo
from nanwatch.core.config.reading import MAX_VALUES, read_config_file, too_many_values
from nanwatch.errors import ConfigError

__all__ = ["WatchConfig", "ConfigError", "resolve_config", "read_config_file", "echo", "MAX_FRAMES"]

# The most frames a report may show: nanwatch keeps that many at all times, whatever the loop does.
MAX_FRAMES = 10_000


class WatchConfig(BaseModel):
    """What to watch and what to do when inf/nan appears.

    Every entry point (`nanwatch.watch`, the Lightning, Accelerate and HF Trainer adapters, the CLI) takes this
    same model, a dict of its fields, or the path of a YAML/JSON file holding them.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
    # Set by `for_rerun` only: this config watches sentinel mode's replay of a micro-batch (not a field: no user sets
    # it, and it is neither validated nor written out).
    _for_a_replay: bool = PrivateAttr(default=False)

    mode: Literal["full", "sentinel"] = Field(
        "full",
        description='"full": every module is watched on every batch (the report is exact as it happens). '
        '"sentinel": no per-module hooks; the model\'s output, the gradient w.r.t. it, the loss and the gradients '
        "about to be applied are checked (one pass over the output and the gradients), and when one is inf/nan the "
        "failing micro-batch is run again with full watching to write the same report (a replay).",
    )
    max_frames_to_save: int = Field(
        21,
        ge=1,
        le=MAX_FRAMES,
        description=f"How many frames the report shows, ending at the first inf/nan. 1 to {MAX_FRAMES}: a longer "
        "story is a trace (trace_batch_nums).",
    )
    trace_batch_nums: list[int] = Field(
        default_factory=list,
        description="0-indexed batch numbers whose every frame is traced as it happens: written to report_dir's "
        "trace files (the log gets one line per traced batch), or logged when there is no report_dir.",
    )
    abort_after_batch_num: int | None = Field(
        None, ge=0, description="Stop the run once this 0-indexed batch has finished."
    )
    report_dir: Path | None = Field(
        None, description="Where the detecting process writes the text and JSON report before raising."
    )
    watch_eval: bool = Field(
        False, description="Also watch validation/evaluation forwards (counted apart, as eval_batch_number)."
    )
    trace_ranks: Literal["zero", "all"] | list[int] = Field(
        "zero", description='Which ranks log trace output: "zero", "all", or a list of ranks.'
    )
    capture_on_detect: bool = Field(
        False,
        description="On inf/nan, the detecting process also saves what replaying the failing forward needs (its "
        "inputs, RNG states, and the weights and buffers as it began) to report_dir/replay-rank{R}-batch{N}.pt, "
        "for `nanwatch replay`. Costs a copy of the weights at every training forward; needs report_dir.",
    )
    watch_gradients: bool = Field(
        False,
        description="Also record backward frames: the gradient w.r.t. each module's output and inputs, and each "
        "parameter's accumulated gradient (labelled `grad output`, `grad input[0]`, `grad weight`), so a nan that "
        "first appears in backward is reported at the module where it appeared. In-place ops stay allowed.",
    )
    min_loss_scale: float | None = Field(
        1.0,
        description="Under a GradScaler: stop (LossScaleBelowFloor) when the loss scale falls below this. Each "
        "skipped step halves the scale; below 1 the loss is scaled down, which no fp16 run needs, so gradients that "
        "keep overflowing there are inf/nan whatever the scale. > 0; null: no floor.",
    )
    include_modules: list[str] = Field(
        default_factory=list,
        description="Glob patterns (fnmatch, case-sensitive, `*` crosses dots) on qualified module names; only "
        'modules matching one get a hook. Empty: every module. The root module is named "". Decided at attach; a '
        "pattern that matches no module is an error.",
    )
    exclude_modules: list[str] = Field(
        default_factory=list,
        description="Glob patterns of modules that get no hook, applied after include_modules. A pattern that "
        "matches no module is an error.",
    )
    watch_every_n_batches: int = Field(
        1,
        ge=1,
        description="Record every Nth training batch (counted from watch_first_batch); the others are counted but "
        "record nothing, and inf/nan that appears in them is not seen there.",
    )
    watch_first_batch: int = Field(0, ge=0, description="The first 0-indexed training batch that is recorded.")
    watch_last_batch: int | None = Field(
        None, ge=0, description="The last 0-indexed training batch that is recorded (inclusive). None: no end."
    )
    summary_every_n_batches: int | None = Field(
        None,
        ge=1,
        description="Every N training batches, send the abs max of each watched module (in the last watched batch) "
        "to the framework's logging (Lightning loggers, Accelerate trackers, the HF Trainer's logs; the nanwatch "
        "logger for the plain loop). None: no summary.",
    )

    rank_wait_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="Distributed: how long a rank that saw inf/nan waits for the other ranks' word (through the "
        "process group's store, never a collective) before it raises on its own. At an optimizer step every rank "
        "usually sees the same non-finite gradients at once, so the wait is that long only when some ranks saw "
        "nothing (uneven data with ddp.join(), a nan that never reached the gradients).",
    )
    headroom_warn_fraction: float | None = Field(
        0.125,
        description="Warn (nanwatch logger) when a tensor's abs max reaches this fraction of its dtype's max (float16: "
        "65504, bfloat16: 3.39e38, float8_e4m3fn: 448, float8_e5m2: 57344), before anything is inf. 0 < x <= 1; "
        "null or 0: off. A tensor is warned about once, then again each time its headroom halves; logged by the "
        "ranks trace_ranks names.",
    )
    count_underflow: bool = Field(
        False,
        description="Also count each tensor's values that underflow (nonzero, below its dtype's smallest normal; "
        "with target_dtype, below the target's), reported in the JSON report and warned about past "
        "underflow_warn_fraction. Costs a few extra kernels per tensor.",
    )
    underflow_warn_fraction: float = Field(
        0.05,
        description="With count_underflow: warn when more than this fraction of a tensor's values underflow. "
        "0 < x <= 1.",
    )
    target_dtype: Literal["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"] | None = Field(
        None,
        description="Also judge every wider floating-point tensor against this dtype's limits, as if the run were in "
        "it: warn about tensors that would overflow it (or come within headroom_warn_fraction of its max) and, with "
        "count_underflow, that would be subnormal or flush to zero in it; a summary at close. Warnings, never errors.",
    )
    pause_gc: bool = Field(
        True,
        description="Full mode: pause Python's automatic garbage collection (the youngest generation's threshold set "
        "to 0) from the start of each watched micro-batch until it is checked, so the frames it records are freed "
        "before a collection walks them (they would otherwise reach the collector's oldest generation, whose full "
        "passes over every object of the process add several % to a step of a model of many small modules). "
        "Reference counting frees everything as usual; only garbage in reference cycles waits until the micro-batch "
        "ends. The thresholds are put back at the check (thresholds you set meanwhile stay), and a pause that no "
        "micro-batch renews for 30 s (a loop abandoned mid-batch) ends by itself. gc.disable(), gc.enable() and "
        "gc.isenabled() stay yours: nanwatch never calls them. False: nanwatch never touches the collector.",
    )
    sentinel_copy_inputs: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Sentinel mode: whether each training call's inputs are copied when kept for a replay. "
        '"auto": copied when they hold 1 MiB or less in all (token ids, small images: one small copy), kept by '
        'reference otherwise; "always": copied whatever their size; "never": kept by reference. An input kept by '
        "reference that changes before the replay (a forward that changes it in place, a loop that refills a "
        'preallocated buffer) makes the verdict "not replayable", never "not reproduced".',
    )
    on_detect: Literal["raise", "skip", "rewind"] = Field(
        "raise",
        description='What a detection in training does. "raise": every rank raises NonFiniteError (the report on '
        'disk first). "skip": the optimizer step it reaches is not applied (the gradients are cleared, so the '
        "optimizer changes nothing; a GradScaler does its own skipping as before), the report is written, the "
        "micro-batch is appended to report_dir/skipped.jsonl, and the run goes on; every rank skips the same step. "
        '"rewind": that step is not applied either, and the model and optimizer (and LR schedulers and the '
        "GradScaler, where the checkpoint holds them) are restored in place from the last checkpoint nanwatch "
        "verified finite, on every rank alike; listed in report_dir/rewinds.jsonl (not with the transformers "
        "Trainer). Both need an optimizer nanwatch guards (every adapter's, or watch(optimizer=...)); a detection in "
        'evaluation is reported and raised as with "raise".',
    )
    max_consecutive_skips: int = Field(
        3,
        ge=0,
        description='With on_detect="skip": raise (StepsSkippedInARow) at a detection that would make this many + 1 '
        "optimizer steps skipped in a row: a run that keeps going non-finite is not saved by skipping.",
    )
    max_rewinds: int = Field(
        3,
        ge=0,
        description='With on_detect="rewind": how many rewinds a run may make; the detection after them raises '
        "NonFiniteError (so does one before any checkpoint was verified finite).",
    )
    spike_window: int | None = Field(
        None,
        ge=2,
        le=100_000,
        description="Spike warnings: judge the loss (where the adapter has it) and the largest gradient magnitude "
        "about to be applied against a rolling window of this many recent values; a spike is reported (a warning and "
        "report_dir/nanwatch-spike-rank{R}-batch{N}.txt) with the watched modules whose abs max jumped most against "
        "their own recent level (in sentinel mode: the spiking micro-batch and the one before it replayed under a "
        "full watch on the same weights). None: off. Judged on the device, folded into the check's one host read.",
    )
    spike_factor: float = Field(
        2.0,
        gt=1,
        description="A spike is more than this many times the window's mean (above it by (factor - 1) x |mean|) ...",
    )
    spike_zscore: float = Field(
        6.0, gt=0, description="... and more than this many standard deviations above it (both rules must hold)."
    )
    checkpoint_guard: Literal["refuse", "quarantine", "off"] = Field(
        "refuse",
        description="Before a checkpoint is written through the framework (Lightning's save_checkpoint, the HF "
        "Trainer's checkpoint saves, Accelerate's save_state, the plain loop's handle.save_checkpoint()), check "
        "that every weight and optimizer state is finite, and that a buffer holds inf/nan only where it did when "
        'watching began (an additive -inf mask); one fused check. "refuse": a poisoned checkpoint is not written '
        "(NonFiniteCheckpoint, naming the tensors and the last checkpoint verified finite); "
        '"quarantine": the same error, after writing it into a nanwatch-quarantine folder outside the folders the '
        'framework scans or rotates (the error names it), for inspection; "off": no check.',
    )

    if not TYPE_CHECKING:  # type checkers keep the signature pydantic's plugin gives: one argument per field

        def __init__(self, /, **data: Any) -> None:
            """Build and validate; an unknown field or a bad value raises `ConfigError` naming the field (with a
            "did you mean" for a misspelt one), as every other entry point does."""
            try:
                super().__init__(**data)
            except ValidationError as error:
                raise ConfigError(_describe(error, "WatchConfig")) from None

        # Only the class call goes through here: `model_validate` (which `from_dict` wraps once) validates without
        # it, as for pydantic's own `__init__` (and RootModel's) that carry this mark.
        __init__.__pydantic_base_init__ = True

        def __setattr__(self, name: str, value: Any) -> None:
            # Assignments are validated too (validate_assignment): the same one-line error.
            try:
                super().__setattr__(name, value)
            except ValidationError as error:
                raise ConfigError(_describe(error, "WatchConfig")) from None

    @field_validator("headroom_warn_fraction", "underflow_warn_fraction", mode="before")
    @classmethod
    def _zero_is_off(cls, value: Any, info: ValidationInfo) -> Any:
        # 0 switches the headroom warnings off, as null does; a boolean (False == 0) is left to `_no_booleans`.
        off = value == 0 and not isinstance(value, bool) and info.field_name == "headroom_warn_fraction"
        return None if off else value

    @field_validator("headroom_warn_fraction", "underflow_warn_fraction")
    @classmethod
    def _a_fraction(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= 1:
            raise ValueError(f"expected a fraction with 0 < x <= 1, got {value!r}")
        return value

    @field_validator("trace_batch_nums", "trace_ranks")
    @classmethod
    def _nothing_negative(cls, value: Any, info: ValidationInfo) -> Any:
        negative = [n for n in value if n < 0] if isinstance(value, list) else []
        if negative:
            what = "batch numbers are 0-indexed and" if info.field_name == "trace_batch_nums" else "ranks"
            raise ValueError(f"{what} cannot be negative, got {negative}")
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML reads `true`/`yes` as a bool, which pydantic would quietly take for the number 1: no number field (nor a
        # list of numbers) takes one, from a file, a dict or a keyword alike.
        kind = _NUMBERS.get(info.field_name or "")
        if kind is not None and (
            isinstance(value, bool) or (isinstance(value, list) and any(isinstance(item, bool) for item in value))
        ):
            what = f"{kind}s, not booleans" if isinstance(value, list) else f"a {kind}, not a boolean"
            raise ValueError(f"expected {what}")
        return value

    @field_validator("min_loss_scale", mode="before")
    @classmethod
    def _a_positive_scale(cls, value: Any) -> Any:
        if value is not None and isinstance(value, (int, float)) and not (0 < value < math.inf):
            raise ValueError(f"expected a positive, finite loss scale or null, got {value!r}")
        return value

    @field_validator("report_dir")
    @classmethod
    def _a_usable_path(cls, value: Path | None) -> Path | None:
        if value is not None and "\x00" in str(value):
            raise ValueError("a path cannot contain a NUL byte")
        return value

    @model_validator(mode="after")
    def _capture_needs_report_dir(self) -> WatchConfig:
        if self.capture_on_detect and self.report_dir is None:
            raise ValueError("capture_on_detect=True needs report_dir: the replay file is written there")
        return self

    @model_validator(mode="after")
    def _rewind_needs_the_checkpoint_guard(self) -> WatchConfig:
        if self.on_detect == "rewind" and self.checkpoint_guard == "off":
            raise ValueError(
                "on_detect='rewind' restores the last checkpoint the checkpoint guard verified finite, and "
                "checkpoint_guard='off' verifies none: use checkpoint_guard='refuse' (the default) or 'quarantine'"
            )
        return self

    @model_validator(mode="after")
    def _sentinel_hooks_no_module(self) -> WatchConfig:
        if self.mode == "sentinel":
            wanted = [name for name in ("trace_batch_nums", "watch_gradients") if getattr(self, name)]
            if wanted:
                raise ValueError(
                    f"mode='sentinel' puts no hook on the modules, which {' and '.join(wanted)} need"
                    " (its replay of a failing micro-batch watches every module and its gradients); use mode='full'"
                )
        return self

    @model_validator(mode="after")
    def _window_in_order(self) -> WatchConfig:
        if self.watch_last_batch is not None and self.watch_last_batch < self.watch_first_batch:
            raise ValueError(
                f"watch_last_batch ({self.watch_last_batch}) comes before watch_first_batch "
                f"({self.watch_first_batch}): no batch would be watched"
            )
        return self

    @field_validator("include_modules", "exclude_modules", mode="before")
    @classmethod
    def _patterns_are_strings(cls, value: Any) -> Any:
        # A lone string would otherwise be rejected with a message about lists; say what was meant instead.
        if isinstance(value, str):
            raise ValueError(f"expected a list of glob patterns, got the single string {value!r} (write [{value!r}])")
        return value

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> WatchConfig:
        """Build a config from a mapping; unknown keys and bad values raise `ConfigError` naming the field."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of WatchConfig fields, got {type(data).__name__}")
        if too_many_values(data):
            raise ConfigError(
                f"{source}: holds more than {MAX_VALUES} values (YAML anchors and aliases nested into each other?); "
                "a config is a handful of fields"
            )
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise ConfigError(_describe(error, source)) from None

    @classmethod
    def from_file(cls, path: str | Path) -> WatchConfig:
        """Read a config from a `.yaml`/`.yml` or `.json` file.

        Raises:
            ConfigError: the file is missing, unreadable, not UTF-8, not a mapping, or holds an unknown key or a bad
                value.
        """
        return cls.from_dict(read_config_file(path), source=f"config file {str(Path(path))!r}")

    def with_overrides(self, **overrides: Any) -> WatchConfig:
        """Return a copy with some fields replaced, validated like any other input."""
        if not overrides:
            return self
        return WatchConfig.from_dict({**self.model_dump(), **overrides}, source="overrides")

    @property
    def watches_a_replay(self) -> bool:
        """Whether this is the config of sentinel mode's replay of a micro-batch (`for_rerun`)."""
        return self._for_a_replay

    def for_rerun(self, *, gradients: bool) -> WatchConfig:
        """The config of a rerun (sentinel mode's replay of a micro-batch that went non-finite): every module watched
        in full, `gradients` recorded or not, and nothing that writes, traces, summarises, warns, judges spikes
        or guards checkpoints: the rerun only records what the model computes; the run's own report says the rest."""
        rerun = self.model_copy(
            update={
                "mode": "full",
                "watch_gradients": gradients,
                "watch_eval": True,
                # the replayed micro-batch is recorded whatever the run's schedule (the inner watch counts from it)
                "watch_every_n_batches": 1,
                "watch_first_batch": 0,
                "watch_last_batch": None,
                "abort_after_batch_num": None,
                "trace_batch_nums": [],
                "capture_on_detect": False,
                "report_dir": None,
                "summary_every_n_batches": None,
                "headroom_warn_fraction": None,
                "target_dtype": None,
                "count_underflow": False,
                "spike_window": None,
                "on_detect": "raise",
                "checkpoint_guard": "off",
            }
        )
        rerun._for_a_replay = True
        return rerun


def _number_kind(annotation: Any) -> str | None:
    """ "whole number" for a field of ints (or a list of them), "number" for one that takes floats, else None."""
    kinds: set[type] = set()
    stack = [annotation]
    while stack:
        found = stack.pop()
        if found in (int, float):
            kinds.add(found)
        stack.extend(get_args(found))
    return "number" if float in kinds else "whole number" if int in kinds else None


# Every numeric field (int or float, alone, optional or in a list), with what it takes: `_no_booleans` refuses a
# boolean in any of them.
_NUMBERS = {
    name: kind for name, info in WatchConfig.model_fields.items() if (kind := _number_kind(info.annotation)) is not None
}


def _describe(error: ValidationError, source: str) -> str:
    return describe(error, source, list(WatchConfig.model_fields))


def resolve_config(config: WatchConfig | dict[str, Any] | str | Path | None, **overrides: Any) -> WatchConfig:
    """Turn whatever an entry point was given (a config, a dict, a file path, or nothing) into a `WatchConfig`."""
    if config is None:
        base = WatchConfig()
    elif isinstance(config, WatchConfig):
        base = config
    elif isinstance(config, dict):
        base = WatchConfig.from_dict(config)
    elif isinstance(config, (str, Path)):
        base = WatchConfig.from_file(config)
    else:
        raise ConfigError(
            f"config must be a WatchConfig, a dict, or a path to a YAML/JSON file, got {type(config).__name__}"
        )
    return base.with_overrides(**overrides)
