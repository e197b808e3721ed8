"""The ranks' agreement, through the process group's store and never a collective of nanwatch's own.

- `ranks`: this process's rank and world size, and `Detection` (what a rank posts when it finds inf/nan);
- `board`: the detection board: attach, post, decide, the bells and acknowledgements every rank reads;
- `listener`: the thread per distributed watcher that waits on the store for a bell, so no step asks the store
  anything while the run is clean;
- `stepvote`: under `on_detect="skip"`, the vote before each optimizer step (the same step skipped on every rank).
"""

__all__: list[str] = []
