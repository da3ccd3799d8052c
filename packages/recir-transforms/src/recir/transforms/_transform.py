"""Transform: a small declared graph rewrite over a StepGraph, and the registry of transforms by name."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from ._errors import ConfigError
from ._step import StepGraph


@dataclasses.dataclass(frozen=True)
class TransformResult:
    """What a transform returns: the (possibly new) step, whether it changed, and counters."""

    step: StepGraph
    changed: bool
    stats: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """Options of a transform that takes none."""


class Transform(abc.ABC):
    """A graph rewrite. Subclasses set ``name`` (``recir-<area>-<verb>-<noun>``) and ``summary``.

    ``options`` is a frozen dataclass instance (``Options`` on the class gives its type). A transform
    reads no global configuration and reports ``changed`` honestly. ``requires`` raises
    ``ConfigError`` when a precondition does not hold; ``ensures`` checks the postcondition.
    """

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: True for a lowering's last rewrite into its backend's calling convention (e.g. the GPU path's
    #: in-place ``copy_`` epilogue): the result is what the backend receives, no longer a StepGraph the
    #: verifier accepts. A Pipeline verifies nothing after it, and only other such transforms may follow.
    execution_form: ClassVar[bool] = False

    def __init__(self, options: Any | None = None, **kwargs: Any) -> None:
        if options is not None and kwargs:
            raise ConfigError(f"{self.name}: pass either an options object or keyword options, not both")
        opts = options if options is not None else self.Options(**kwargs)
        if not isinstance(opts, self.Options):
            raise ConfigError(
                f"{self.name}: options must be {self.Options.__name__}, got {type(opts).__name__}"
            )
        self.options: Any = opts

    def requires(self, step: StepGraph) -> None:  # noqa: B027 - optional hook
        """Raise ConfigError if ``step`` does not meet this transform's preconditions."""

    def ensures(self, step: StepGraph) -> None:  # noqa: B027 - optional hook
        """Raise VerificationError if the result does not meet this transform's postconditions."""

    @abc.abstractmethod
    def run(self, step: StepGraph) -> TransformResult:
        """Rewrite ``step`` (it may be mutated in place or copied) and report what changed."""

    def __call__(self, step: StepGraph) -> TransformResult:
        self.requires(step)
        result = self.run(step)
        self.ensures(result.step)
        return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, {self.options})"


_REGISTRY: dict[str, type[Transform]] = {}
T = TypeVar("T", bound=type[Transform])


def register_transform(cls: T) -> T:
    """Class decorator: make a transform available by name (for textual pipelines and CLIs)."""
    name = getattr(cls, "name", None)
    if not name or not name.startswith("recir-") or name.count("-") < 2:
        raise ConfigError(
            f"transform {cls.__name__}: name {name!r} must look like 'recir-<area>-<verb>-<noun>'"
        )
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not cls and existing.__qualname__ != cls.__qualname__:
        raise ConfigError(f"transform name {name!r} is already registered by {existing.__qualname__}")
    _REGISTRY[name] = cls
    return cls


def get_transform(name: str) -> type[Transform]:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        raise ConfigError(f"unknown transform {name!r}; registered transforms: {known}") from None


def registered_transforms() -> dict[str, type[Transform]]:
    return dict(_REGISTRY)


TransformFactory = Callable[..., Transform]
