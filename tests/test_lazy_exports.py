"""Every package's lazy exports resolve, and they are the package's TYPE_CHECKING imports (one
list, Note [one list of lazy names] in fxpipe._lazy)."""

from __future__ import annotations

import importlib

import pytest

from fxpipe._lazy import type_checking_exports

PACKAGES = (
    "fxpipe",
    "fxpipe.tracer",
    "fxpipe.partitioner",
    "fxpipe.codegen",
    "fxpipe.runtime",
    "fxpipe.runtime.dataparallel",
    "fxpipe.sharding",
)


@pytest.mark.parametrize("name", PACKAGES)
def test_every_exported_name_imports(name: str) -> None:
    package = importlib.import_module(name)
    for export in package.__all__:
        assert getattr(package, export) is not None, f"{name}.{export}"


def test_the_lazy_map_is_the_type_checking_imports() -> None:
    import fxpipe.runtime

    names = type_checking_exports(fxpipe.runtime.__file__)
    assert names["RunRecord"] == "fxpipe.runtime.train.run_record"
    assert sorted(names) == fxpipe.runtime.__all__
