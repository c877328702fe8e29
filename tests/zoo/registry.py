"""The conformance zoo: which model files (and which factory in each) make up the zoo, and their traits.

Every model file under ``tests/zoo/models/`` whose name does not start with ``_`` is one entry
(its ``build_model``); ``EXTRA`` adds the second factories some files define. A model file's
``DROPOUT`` says whether it has non-zero dropout / stochastic depth (its train and eval modes
then differ), ``KWARGS_ONLY`` whether its usual (padded) call needs keyword inputs that a
positional ``example_inputs`` cannot express. Files that define ``example_kwargs`` /
``example_kwargs_labels`` return the Hugging Face-style keyword call (``labels=`` included in
the second), for the keyword-input contract of issue 10.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MODELS_DIR", "OUTSIDE_DIR", "ZooModel", "zoo_models", "outside_models", "select"]

MODELS_DIR = Path(__file__).resolve().parent / "models"
# model files written as a new user would, outside the zoo: other configs of the same families (issue 10)
OUTSIDE_DIR = Path(__file__).resolve().parent / "outside"

# name -> (file stem, factory) for the second model a file builds
EXTRA: dict[str, tuple[str, str]] = {
    "resnet18": ("resnet", "build_resnet18"),
    "mobilenet_v2": ("efficientnet", "build_mobilenet_v2"),
}


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: ``spec`` is what ``fxpipe partition`` takes (``path.py`` or ``path.py:factory``)."""

    name: str
    path: Path
    model_fn: str
    hf: bool  # built from transformers
    dropout: bool
    kwargs_only: bool
    has_kwargs: bool  # defines example_kwargs / example_kwargs_labels

    @property
    def spec(self) -> str:
        return str(self.path) if self.model_fn == "build_model" else f"{self.path}:{self.model_fn}"

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "spec": self.spec,
            "model_fn": self.model_fn,
            "hf": self.hf,
            "dropout": self.dropout,
            "kwargs_only": self.kwargs_only,
            "has_kwargs": self.has_kwargs,
        }


def _traits(path: Path) -> dict[str, object]:
    """Module-level constants and function names of a model file, read without importing it."""
    tree = ast.parse(path.read_text())
    consts: dict[str, object] = {}
    names: set[str] = set()
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            names.add(node.targets[0].id)  # e.g. example_inputs = partial(...)
            try:
                consts[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
    consts["__functions__"] = names
    consts["__hf__"] = "from transformers import" in path.read_text()
    return consts


def zoo_models() -> list[ZooModel]:
    """Every zoo entry: the transformers models first, then the torchvision/timm-style ones, by name."""
    files = {p.stem: p for p in sorted(MODELS_DIR.glob("*.py")) if not p.name.startswith("_")}
    entries = [(stem, stem, "build_model") for stem in files]
    entries += [(name, stem, fn) for name, (stem, fn) in EXTRA.items()]
    models = []
    for name, stem, fn in entries:
        t = _traits(files[stem])
        functions = t["__functions__"]
        assert isinstance(functions, set)
        models.append(
            ZooModel(
                name=name,
                path=files[stem],
                model_fn=fn,
                hf=bool(t["__hf__"]),
                dropout=bool(t.get("DROPOUT", False)),
                kwargs_only=bool(t.get("KWARGS_ONLY", False)),
                has_kwargs="example_kwargs" in functions,
            )
        )
    return sorted(models, key=lambda m: (not m.hf, m.name))


def outside_models() -> list[ZooModel]:
    """The model files of ``outside/``, each its ``build_model`` and ``example_inputs`` (no traits declared)."""
    return [
        ZooModel(
            name=p.stem,
            path=p,
            model_fn="build_model",
            hf=bool(_traits(p)["__hf__"]),
            dropout=False,
            kwargs_only=False,
            has_kwargs=False,
        )
        for p in sorted(OUTSIDE_DIR.glob("*.py"))
    ]


def select(names: list[str] | None) -> list[ZooModel]:
    """The entries named (all when ``names`` is empty); an unknown name is a ValueError listing the known ones."""
    models = zoo_models()
    if not names:
        return models
    by_name = {m.name: m for m in models}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown zoo models {unknown}; known: {sorted(by_name)}")
    return [by_name[n] for n in names]
