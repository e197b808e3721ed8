"""The recording path: what runs at every watched module call, and the frames it makes.

- `module_hook`: the forward hook, one small object per module (`ModuleHook`);
- `recorder`: frames made from a call (eager or compiled), pending until the check; `Recorder.append`;
- `deferral`: the common call deferred (one record per call, `DeferredCall`), its outputs measured at the check;
- `deferred_frames`: the frame of a deferred call, its lines made only when read, and the round's deferred outputs;
- `parameter_lines`: a module's parameter lines, made once per batch.
"""

__all__: list[str] = []
