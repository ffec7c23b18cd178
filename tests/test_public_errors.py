"""Every exception a user can meet is reachable from ``stratagem`` itself (``sg.ClusterError``, ...)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import stratagem
import stratagem.errors

# Exception classes that never leave the module that raises them, with the reason. A class named
# with a leading underscore is private by its name and needs no entry here.
INTERNAL = {
    # Raised by a wait's own check to end the wait; caught in shm/parameter_server.py and server.py, never re-raised.
    "stratagem.shm.counters.Stop",
}


def _modules() -> list[str]:
    names = [stratagem.__name__]
    for info in pkgutil.walk_packages(stratagem.__path__, prefix="stratagem."):
        if info.name.rsplit(".", 1)[-1] != "__main__":  # running it would start the CLI
            names.append(info.name)
    return names


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == name
                and not attr.startswith("_")
            ):
                found[f"{name}.{attr}"] = value
    return found


def test_every_public_exception_class_is_exported_from_stratagem() -> None:
    classes = _exception_classes()
    assert "stratagem.errors.ClusterError" in classes  # the walk reaches the modules at all
    missing = sorted(
        qualified
        for qualified, cls in classes.items()
        if qualified not in INTERNAL and getattr(stratagem, cls.__name__, None) is not cls
    )
    assert missing == [], f"exception classes a user can meet but not reach as stratagem.<name>: {missing}"


def test_every_exported_exception_is_listed_in_all() -> None:
    exported = {name for name in stratagem.__all__ if inspect.isclass(getattr(stratagem, name))}
    errors = {name for name, value in vars(stratagem.errors).items() if inspect.isclass(value)}
    assert errors <= exported, f"missing from stratagem.__all__: {sorted(errors - exported)}"


def test_every_error_derives_from_stratagem_error() -> None:
    classes = _exception_classes()
    outside = sorted(
        qualified
        for qualified, cls in classes.items()
        if qualified not in INTERNAL and not issubclass(cls, stratagem.StratagemError)
    )
    assert outside == [], f"exception classes outside the StratagemError family: {outside}"


def test_the_internal_exceptions_listed_still_exist() -> None:
    # A stale entry would silently widen the exemption.
    assert INTERNAL <= set(_exception_classes())
