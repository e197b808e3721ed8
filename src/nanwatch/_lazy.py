"""Names a package exports but imports only when first used (PEP 562), so importing it stays cheap."""

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, homes: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The module-level `__getattr__` of `package`: each name in `homes` is imported from its module on first use,
    then kept in `namespace` (the package's globals), so later look-ups find it directly."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    return __getattr__
