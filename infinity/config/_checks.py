"""Value checks shared by every config section, and the field machinery that runs them.

Each check takes a value and its full key path and returns the normalised value; `_spec`
attaches a check to a dataclass field and `_validate` runs them all on construction.

[Note: error paths]
User errors are ValueError (a bad value) or TypeError (a value of the wrong JSON type) whose
message starts with the full dotted key path, e.g.
`zero_optimization.offload_param.nvme_path: directory does not exist: /x`. Each dataclass knows
its JSON section (`_PATH`), so a value is checked where the dataclass is built, from JSON or
from Python alike. Booleans must be JSON booleans, never 0/1 or "true".
"""

from __future__ import annotations

import decimal
import json
import math
import numbers
import os
from collections.abc import Callable
from dataclasses import MISSING, field, fields
from pathlib import Path
from typing import Any


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _show(value: Any) -> str:
    """A value as the user wrote it in JSON (true, "cpu"), or its repr if it is not JSON."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{path}: expected true or false, got {_show(value)}")
    return value


def _int(value: Any, path: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{path}: expected an integer, got {_show(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{path}: expected an integer >= {minimum}, got {value}")
    return int(value)


def _size(value: Any, path: str, *, minimum: int = 0) -> int:
    """An element or byte count in any of DeepSpeed's spellings: 500000000, 5e8 or "5e8"."""
    expected = 'a whole number such as 500000000, 5e8 or "5e8"'
    if isinstance(value, bool):
        raise TypeError(f"{path}: expected {expected}, got {_show(value)}")
    if isinstance(value, numbers.Integral):
        number = int(value)
    elif isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"{path}: expected {expected}, got {_show(value)}")
        number = int(value)
    elif isinstance(value, str):
        try:
            exact = decimal.Decimal(value)
        except decimal.InvalidOperation:
            raise ValueError(f"{path}: expected {expected}, got {_show(value)}") from None
        if not (exact.is_finite() and exact == exact.to_integral_value()):
            raise ValueError(f"{path}: expected {expected}, got {_show(value)}")
        number = int(exact)
    else:
        raise TypeError(f"{path}: expected {expected}, got {_show(value)}")
    if number < minimum:
        raise ValueError(f"{path}: expected a size >= {minimum}, got {_show(value)}")
    return number


def _float(value: Any, path: str, *, minimum: float | None = None,
           maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{path}: expected a number, got {_show(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{path}: expected a finite number, got {_show(value)}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{path}: expected a number >= {minimum}, got {_show(value)}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{path}: expected a number <= {maximum}, got {_show(value)}")
    return number


def _choice(value: Any, path: str, choices: tuple[Any, ...]) -> Any:
    # Compare types too, so that true is not taken for 1 nor "3" for 3; a str subclass (a string
    # enum, as DeepSpeed's OffloadDeviceEnum.cpu) is the string it holds.
    if isinstance(value, str) and type(value) is not str:
        value = str.__str__(value)
    if any(type(value) is type(choice) and value == choice for choice in choices):
        return value
    expected = ", ".join(_show(choice) for choice in choices)
    raise ValueError(f"{path}: expected one of {expected}, got {_show(value)}")


def _lrs(value: Any, path: str) -> float | tuple[float, ...]:
    """One learning rate, or one per optimizer param group (a JSON list)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{path}: expected a number or a non-empty list of numbers, got []")
        return tuple(_float(lr, f"{path}[{i}]", minimum=0.0) for i, lr in enumerate(value))
    return _float(value, path, minimum=0.0)


def _path(value: Any, path: str) -> Path:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"{path}: expected a directory path, got {_show(value)}")
    return Path(value)


def _directory(value: Any, path: str) -> Path:
    directory = _path(value, path)
    if not directory.is_dir():
        reason = "not a directory" if directory.exists() else "directory does not exist"
        shown = str(directory) if directory.is_absolute() else f"{directory.resolve()} (given as {directory})"
        raise ValueError(f"{path}: {reason}: {shown}")
    return directory


def _instance(value: Any, path: str, cls: type | tuple[type, ...]) -> Any:
    if not isinstance(value, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise TypeError(f"{path}: expected a {names}, got {type(value).__name__}")
    return value


def _optional(check: Callable[..., Any]) -> Callable[..., Any]:
    def check_unless_none(value: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        return None if value is None else check(value, path, *args, **kwargs)
    return check_unless_none


def _check(config: Any, name: str, check: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Validate and normalise one field of a frozen dataclass, naming its full key path."""
    path = _join(type(config)._PATH, name)
    object.__setattr__(config, name, check(getattr(config, name), path, *args, **kwargs))


def _spec(check: Callable[..., Any], *args: Any, default: Any = MISSING,
          factory: Any = MISSING, **kwargs: Any) -> Any:
    """A dataclass field that `_validate` passes through check(value, path, *args, **kwargs)."""
    return field(default=default, default_factory=factory,
                 metadata={"check": (check, args, kwargs)})


def _validate(config: Any) -> None:
    """Check every field of a section dataclass with the check its `_spec` names."""
    for spec in fields(config):
        check, args, kwargs = spec.metadata["check"]
        _check(config, spec.name, check, *args, **kwargs)
