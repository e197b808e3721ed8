"""What nanwatch writes to disk, each format in its own modules: JSON Lines (`jsonl_schema`, schema version 2
derived from the statistics registry; `jsonl_writer`; `jsonl_reader`, for the tools), `files` (report and trace
files), `replay_file` (the capture of a failing forward; imports torch, so it is not imported here)."""

__all__: list[str] = []
