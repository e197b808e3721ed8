"""The per-batch cache of measurements: a tensor seen twice unchanged is measured once.

The hot path: every watched module call asks it for its parameters (`parameter`) and its inputs and output
(`activation`), so each lookup asks as few questions as it can. Parameters are tracked and measured together once per
batch (`stacking.StackPlan`); small activations are staged (`staging.py`) and measured when the check reads them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from nanwatch.core.stats.grouped import StackPlan
from nanwatch.core.stats.kernels import ABS_KEEPS_DTYPE
from nanwatch.core.stats.measure import _RANGE, ExtraKernels, Measurement, StackedMeasurement, measure
from nanwatch.core.stats.output_rows import STAGE_MAX_NUMEL, DtypeRows, Staging
from nanwatch.core.stats.paths import multi_tensor_kernels
from nanwatch.core.stats.pooled import Pool, PoolOwner

__all__ = ["StatsCache", "TrackedBatch"]


def _pointer(tensor: torch.Tensor) -> int:
    try:
        return tensor.data_ptr()
    except RuntimeError:  # a wrapper subclass (DTensor) has no storage of its own
        return 0


_data_ptr = torch._C.TensorBase.data_ptr


def _pointers(tensors: list[torch.Tensor]) -> list[int]:
    """`_pointer` of each tensor: `data_ptr()` mapped in C (twice as fast as a comprehension) unless a wrapper
    subclass is among them."""
    try:
        return list(map(_data_ptr, tensors))
    except RuntimeError:  # a wrapper subclass (DTensor) among them: no storage of its own
        return [_pointer(tensor) for tensor in tensors]


def _view_root(tensor: torch.Tensor) -> torch.Tensor:
    base = tensor._base
    return tensor if base is None else base


# A parameter's measurement, valid while the parameter is the same object with the same version, storage and dtype
# (`.data =` assignment, as `model.half()` and `.to()` do, keeps both the object and its `_version`).
_ParamHit = tuple[torch.Tensor, int, int, torch.dtype, Measurement]


# An activation's measurement: a weak reference to the tensor measured, its version and storage then.
class _Seen(weakref.ref[torch.Tensor]):
    """An activation's measurement: a weak reference to the tensor measured, with its version and storage then (one
    object, not a reference and a tuple: the garbage collector walks what lives until the batch ends)."""

    __slots__ = ("version", "pointer", "measurement")
    version: int
    pointer: int
    measurement: Measurement


def _seen(tensor: torch.Tensor, version: int, pointer: int, measurement: Measurement) -> _Seen:
    seen = _Seen(tensor)
    seen.version, seen.pointer, seen.measurement = version, pointer, measurement
    return seen


_ActivationHit = _Seen


@dataclass(frozen=True, slots=True)
class TrackedBatch:
    """One batch's measurements of the tracked parameters, in the plan's order, with each parameter's version
    counter and storage when it was measured: a measurement holds while the parameter still has both. `stacks` and
    `alone` are what the measurements are made of, for a check that reads them all (`StackPlan.measure_whole`)."""

    measurements: Sequence[Measurement]
    versions: list[int]
    pointers: list[int]
    stacks: list[DtypeRows]
    alone: list[Measurement]


class StatsCache:
    """Remembers measurements so a tensor seen twice unchanged is measured once.

    Parameters do not change during a forward, and a module's output is usually the next module's input. A tensor's
    `_version` goes up with every in-place change (a ReLU(inplace=True) after the module, an optimizer step), and
    its storage or dtype changes when `.data` is replaced, so a (tensor, fingerprint) pair is what a measurement
    belongs to. Writes that bypass the version counter (fused optimizers, `p.data.add_()`) are invisible to any key:
    the engine calls `forget_parameters()` between training batches for them. Activations are held by weak
    reference, so the cache never keeps a tensor alive; parameters live as long as the model anyway.

    The parameters given to `track_parameters()` are measured together, in a handful of kernel launches, when the
    first of them is asked for after `forget_parameters()` (`measure_together`): once per batch, not one launch per
    parameter.

    Args:
        kernels: the other statistics' kernels measured in this run (`extra_kernels(config)`).
    """

    def __init__(self, kernels: ExtraKernels = ()) -> None:
        self._kernels = kernels
        self._params: dict[int, _ParamHit] = {}
        # The tracked parameters (`track_parameters`), measured together once per batch: their measurements and
        # fingerprints then, in lists in the plan's order (a handful of objects per batch, not a tuple per parameter).
        self._plan: StackPlan | None = None
        self._index: dict[int, int] = {}
        self._measured: Sequence[Measurement] | None = None
        self._versions: list[int] = []
        self._pointers: list[int] = []
        self._dtypes: list[torch.dtype] = []
        # This batch's measurement of the tracked parameters once made (`tracked_batch()`), else None: read at every
        # deferred call of a module with parameters (core/engine/recording/deferral.py).
        self.measured_batch: TrackedBatch | None = None
        self.batches_measured = 0  # how many batch measurements of the tracked parameters were made
        # The tensor looked up last: most often one module's output, about to be the next one's input.
        self._last: _ActivationHit | None = None
        # Activations by identity, and by where their values live (views sharing a measurement, `_activation_miss`).
        self._by_id: dict[int, _ActivationHit] = {}
        self._activations: dict[object, _ActivationHit] = {}
        # Small activations are copied there and measured together when read (the check).
        self._staging = Staging()
        # On an accelerator, the activations of watched modules that earned it are kept there and measured together
        # when read (pooled.py): `owner` is the module whose call is being recorded (set by the recorder), None
        # outside a recorded call.
        self._pool = Pool()
        self.owner: PoolOwner | None = None

    @property
    def kernels(self) -> ExtraKernels:
        return self._kernels

    def measure(self, tensor: torch.Tensor) -> Measurement:
        """Measure without remembering (a loss, a gradient)."""
        return measure(tensor, self._kernels)

    def track_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """The parameters the hooks will ask for (those of the watched modules), to be measured together."""
        unique = {id(param): param for param in params if not param.is_inference()}  # no version: never cached
        self._plan = StackPlan(list(unique.values())) if unique else None
        self._index = {key: index for index, key in enumerate(unique)}
        self._measured = self.measured_batch = None

    def tracked_batch(self) -> TrackedBatch | None:
        """This batch's measurements of the tracked parameters, with their fingerprints then (all measured now if
        they were not yet); a new object after every `forget_parameters()`. None when no parameter is tracked."""
        tracked = self.measured_batch
        if tracked is None and self._plan is not None:
            self._measure_tracked()
            tracked = self.measured_batch
        return tracked

    def unchanged(self, batch: TrackedBatch) -> bool:
        """Whether `batch` is the current batch measurement and every parameter it measured still has the version
        counter and storage it had then (all of them at once: a few list comprehensions, not a call per module)."""
        plan = self._plan
        if plan is None or batch is not self.measured_batch:
            return False
        tensors = plan.tensors
        if [tensor._version for tensor in tensors] != batch.versions:
            return False
        return _pointers(tensors) == batch.pointers

    def index_of(self, param: torch.Tensor) -> int | None:
        """Where `param` is in `tracked_batch()`'s lists, or None when it is not tracked (`track_parameters`)."""
        return self._index.get(id(param))

    def parameter(self, param: torch.Tensor) -> Measurement:
        measured = self._measured
        index = self._index.get(id(param))
        if index is not None and measured is not None:
            plan = self._plan
            assert plan is not None
            if (
                plan.tensors[index] is param
                and param._version == self._versions[index]
                and param.dtype is self._dtypes[index]
                and _pointer(param) == self._pointers[index]
            ):
                return measured[index]
        hit = self._params.get(id(param))
        if hit is not None and hit[0] is param:
            try:
                version = param._version
            except RuntimeError:  # an inference tensor (a model built under inference_mode) keeps no version
                return measure(param, self._kernels)
            if version == hit[1] and param.dtype is hit[3] and _pointer(param) == hit[2]:
                return hit[4]
        return self._parameter_miss(param, index)

    def _parameter_miss(self, param: torch.Tensor, index: int | None) -> Measurement:
        if param.is_inference():  # no version counter: measured every time
            return measure(param, self._kernels)
        if index is not None and self._measured is None:
            # The first tracked parameter of this batch: measure every tracked one now, together.
            self._measure_tracked()
            return self.parameter(param)
        measurement = measure(param, self._kernels)
        self._params[id(param)] = (param, param._version, _pointer(param), param.dtype, measurement)
        return measurement

    def _measure_tracked(self) -> None:
        plan = self._plan
        assert plan is not None
        tensors = plan.tensors
        dtypes = [tensor.dtype for tensor in tensors]
        try:
            if dtypes != plan.dtypes:
                raise RuntimeError("dtypes changed")
            measurements, stacks, alone = plan.measure_whole(self._kernels)
        except RuntimeError:  # a parameter changed dtype, shape or device since the plan was made: make a new one
            plan = self._plan = StackPlan(tensors)
            measurements, stacks, alone = plan.measure_whole(self._kernels)
        self._versions = [tensor._version for tensor in tensors]
        self._pointers = _pointers(tensors)
        self._dtypes = dtypes
        self._measured = measurements
        self.measured_batch = TrackedBatch(measurements, self._versions, self._pointers, stacks, alone)
        self.batches_measured += 1

    def activation(self, tensor: torch.Tensor) -> Measurement:
        try:
            version = tensor._version
        except RuntimeError:  # an inference tensor keeps no version counter: measured every time
            return measure(tensor, self._kernels)
        hit = self._last
        if hit is None or hit() is not tensor:
            hit = self._by_id.get(id(tensor))
            if hit is None or hit() is not tensor:
                return self._activation_miss(tensor, version)
        # The weak reference is alive, so the memory of the tensor measured cannot have been reused. Without storage
        # to compare (pointer 0), the dtype at least.
        if (
            hit.version == version
            and hit.pointer == _pointer(tensor)
            and (hit.pointer or hit.measurement.dtype == tensor.dtype)
        ):
            self._last = hit
            return hit.measurement
        return self._activation_miss(tensor, version)

    def _activation_miss(self, tensor: torch.Tensor, version: int) -> Measurement:
        if tensor.is_nested:  # no shape or stride to key on
            return measure(tensor, self._kernels)
        owner = self.owner
        if owner is not None and type(tensor) is torch.Tensor and not self._kernels and multi_tensor_kernels(tensor):
            if owner.pooled:
                pooled = self._pool_kept(tensor, version, owner)
                if pooled is not None:
                    return pooled
            elif not owner.pool_judged and not owner.changed:
                # The module's first recorded batch: measured now, and noted for the check to judge (pooled.py).
                measured = self._measured_miss(tensor, version)
                self._pool.probe(tensor, version, owner, measured)
                return measured
        return self._measured_miss(tensor, version)

    def _measured_miss(self, tensor: torch.Tensor, version: int) -> Measurement:
        """A miss measured as it is seen: staged, looked up as a view of a tensor measured, or launched now."""
        if type(tensor) is torch.Tensor and not self._kernels:
            # The commonest miss first (a module's fresh output): plain, small, with storage: staged, one copy.
            found = self._staging.stage_plain(tensor)
            if found is not None:
                rows, row, pointer = found
                stacked = StackedMeasurement(rows, row, tensor.dtype, tuple(tensor.shape))
                self._last = self._by_id[id(tensor)] = _seen(tensor, version, pointer, stacked)
                return stacked
        pointer = _pointer(tensor)
        # Keyed by where the values live, so a view with the same layout (`hidden[:, -n:, :]` with n the length,
        # `input_ids.view(-1, n)`) shares the measurement of the tensor it views; transformers models pass such views
        # between modules, and the logits too. Only views of one base count (they share its version counter, so an
        # in-place change through either is seen); `.data` aliases have counters of their own and are measured
        # apart. Storage-less tensors (pointer 0) are known by identity only.
        key: object = None
        measurement: Measurement | None = None
        if pointer:
            # A plain tuple, not a torch.Size: the garbage collector stops walking tuples of plain numbers.
            dtype, shape = tensor.dtype, tuple(tensor.shape)
            numel = tensor.numel()
            # A plain non-empty tensor with storage (so not meta, not sparse), and no other statistic to launch.
            plain = type(tensor) is torch.Tensor and not self._kernels and numel
            # Small: one copy now, measured with the others of its shape when read (core/stats/output_rows.py). A view
            # of it is measured again rather than looked up: a copy costs less than finding it.
            staged = None
            if plain and numel <= STAGE_MAX_NUMEL:
                staged = self._staging.stage(tensor.detach() if tensor.requires_grad else tensor)
            if staged is not None:
                measurement = StackedMeasurement(staged[0], staged[1], dtype, shape)
            else:
                key = (pointer, dtype, shape, tensor.stride())
                hit = self._activations.get(key)
                if hit is not None and hit.version == version:
                    seen = hit()
                    if seen is not None and (seen is tensor or _view_root(seen) is _view_root(tensor)):
                        # views of one base share one version counter: equal versions, equal values
                        self._last = self._by_id[id(tensor)] = _seen(tensor, version, pointer, hit.measurement)
                        return hit.measurement
                if plain and dtype in ABS_KEEPS_DTYPE:
                    # The common case, straight to the kernels, whose abs keeps the dtype: every other question
                    # `measure()` would ask is answered.
                    abs_min, abs_max = _RANGE(tensor.detach() if tensor.requires_grad else tensor)
                    measurement = Measurement(abs_min, abs_max, dtype, shape)
        if measurement is None:
            measurement = measure(tensor, self._kernels)
        entry = self._last = _seen(tensor, version, pointer, measurement)
        self._by_id[id(tensor)] = entry
        if key is not None:
            self._activations[key] = entry
        return measurement

    def _pool_kept(self, tensor: torch.Tensor, version: int, owner: PoolOwner) -> Measurement | None:
        """On an accelerator, a module that earned it: the tensor kept in the pool (None when it is not kept)."""
        pooled = self._pool.keep(tensor, version, owner)
        if pooled is not None:
            self._last = self._by_id[id(tensor)] = _seen(tensor, version, _pointer(tensor), pooled)
        return pooled

    def judge_pool_probes(self) -> None:
        """At a check: the modules recorded for the first time since the last one have their tensors pooled from now
        on, unless one was changed in place after its call (pooled.py)."""
        self._pool.judge()

    def forget_parameters(self) -> None:
        """Drop parameter entries (between training batches), for writes no fingerprint sees: fused optimizers."""
        self._params.clear()
        self._measured = self.measured_batch = None

    def forget_activations(self) -> None:
        """Drop activation entries (at the end of each batch), so ids of freed tensors are not reused by mistake."""
        self._last = None
        self._by_id.clear()
        self._activations.clear()
        self._staging.rewind()
        self._pool.settle()

    def clear(self) -> None:
        """Forget everything, the tracked parameters too (`track_parameters`), and free the staging buffers: a cleared
        cache holds no tensor (a closed watcher lets the model go)."""
        self._pool.drop()  # first: nothing launched for what it kept (the device may be why the watch ends)
        self.forget_parameters()
        self.forget_activations()
        self._staging.clear()
        self._plan, self._index, self.measured_batch = None, {}, None
        self._versions, self._pointers, self._dtypes = [], [], []
