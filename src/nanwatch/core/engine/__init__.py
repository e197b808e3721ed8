"""The engine's parts, one job each; `core/watcher.py` wires them into the facade adapters use.

- `recorder`: the module hooks and the frames they make (eager and compiled), pending until a check.
- `counters`: the phase, the micro-batch counters, the framework's optimizer step and epoch.
- `checker`: the check (one host read), the reports, the ring of earlier frames.
- `arbiter`: a detection from found, to held until the step, to agreed across ranks, to raised.
- `publisher`: a report into the log and onto disk, before anything raises.
- `plugins`: the features (core/features/) and how their events are dispatched.
- `context`: the `EngineContext` features get; `readings`: what the facade offers to read.
- `assembly`: how the parts are made and wired; `holding`: the model, held weakly once closed;
  `parameter_lines`: a module's parameter lines, made once per batch; `notices`: the "nothing recorded" warning.
"""

__all__: list[str] = []
