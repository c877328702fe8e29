"""Every relative link in README.md and docs/*.md reaches a file that exists (and a heading that does)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def _links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8")))


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(
                f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}"
            )
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_stays_short() -> None:
    """README.md is what a user reads first (issue 34): the rest lives in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move detail into a page under docs/"


def test_the_first_training_example_reads_a_data_file_of_its_own() -> None:
    """#35 item 17: the README's first `fxpipe run` (and `make demo`'s) reads its batches from
    examples/gpt_data.py with --data, the README shows that file's function, and the function
    yields what examples/gpt.py's example batch is (shapes, dtypes)."""
    import importlib.util
    from types import SimpleNamespace

    readme = (ROOT / "README.md").read_text()
    runs = re.findall(r"fxpipe run build/gpt[^`#\n]*", readme)
    assert len(runs) >= 2 and all(
        "--data examples/gpt_data.py:train_batches" in run for run in runs
    ), runs
    demo = (ROOT / "Makefile").read_text().split("\ndemo:")[1].split("\n\n")[0]
    assert (
        "fxpipe run $(DEMO_OUT) --steps 5 --lr 0.5 --data examples/gpt_data.py:train_batches"
        in demo
    )
    source = (ROOT / "examples" / "gpt_data.py").read_text()
    shown = readme.split("`examples/gpt_data.py`:\n\n```python\n")[1].split("```")[0]
    for line in shown.splitlines():
        assert line.split("  #")[0].rstrip() in source, line

    def load(name: str) -> object:
        spec = importlib.util.spec_from_file_location(
            f"_readme_{name}", ROOT / "examples" / f"{name}.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    gpt, data = load("gpt"), load("gpt_data")
    (inputs,), targets = next(data.train_batches(4, SimpleNamespace(replica=0)))  # type: ignore[attr-defined]
    (example,) = gpt.example_inputs(4)  # type: ignore[attr-defined]
    expected = gpt.example_targets(4)  # type: ignore[attr-defined]
    assert (inputs.shape, inputs.dtype) == (example.shape, example.dtype)
    assert (targets.shape, targets.dtype) == (expected.shape, expected.dtype)
    assert (inputs[:, 1:] == targets[:, :-1]).all()  # the target of each token is the next one
