"""Where nanwatch meets torch's own machinery, and nothing else.

- `hooks`: adding, pickling and removing hooks in modules' hook dicts (`HookSet`), modules looked through wrappers;
- `compiler`: torch.compile's wrapper left out of names, compiled code that predates the hooks dropped;
- `gcpause`: the garbage collector paused around a watched step where it would otherwise run inside it.
"""

__all__: list[str] = []
