"""What nanwatch writes to disk, each format in its own module: `jsonl` (schema version 2, derived from the
statistics registry), `files` (report and trace files), `replay_file` (the capture of a failing forward; imports
torch, so it is not imported here)."""

__all__: list[str] = []
