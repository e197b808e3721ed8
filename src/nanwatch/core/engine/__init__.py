"""The engine's parts, one job each; `core/watcher.py` wires them into the facade adapters use.

- `recording/`: the module hooks and the frames they make (eager and compiled), pending until a check;
- `counters`: the phase, the micro-batch counters, the framework's optimizer step and epoch;
- `checker`: the check (one host read), the reports, the ring of earlier frames;
- `arbiter`: a detection from found, to held until the step, to agreed across ranks, to raised;
- `publisher`: a report into the log and onto disk, before anything raises;
- `feature_set`: the features (core/features/) and how their events are dispatched;
- `feature_context`: the `EngineContext` features get (core/feature_api.py declares it);
- `watcher_reads`: what the facade offers adapters to read;
- `assembly`: how the parts are made and wired; `held_model`: the model, held weakly once closed;
  `nothing_recorded`: the warning for a watched batch that recorded nothing.
"""

__all__: list[str] = []
