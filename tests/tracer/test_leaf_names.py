"""``--leaf``: class names, paths and patterns on both front ends; a name that matches nothing is refused."""

from __future__ import annotations

import pytest
import torch.nn as nn

from example_models import EXAMPLES
from fxpipe.errors import TraceError
from fxpipe.modelfile import load_model_file
from fxpipe.tracer import trace_model
from fxpipe.tracer.frontend.leaves import resolve_leaves


@pytest.fixture(scope="module")
def gpt() -> tuple[nn.Module, object]:
    source = load_model_file(EXAMPLES["gpt"])
    return source.build_model(), source


def test_specs_resolve_to_module_paths(gpt: tuple[nn.Module, object]) -> None:
    model, _ = gpt
    blocks = tuple(f"blocks.{i}" for i in range(4))
    assert resolve_leaves(model, ["Block"]) == blocks
    assert resolve_leaves(model, [type(model.blocks[0])]) == blocks
    assert resolve_leaves(model, [f"{type(model.blocks[0]).__module__}.Block"]) == blocks
    assert resolve_leaves(model, ["blocks.*.mlp", "blocks.1.attn"]) == (
        "blocks.0.mlp",
        "blocks.1.attn",
        "blocks.1.mlp",
        "blocks.2.mlp",
        "blocks.3.mlp",
    )
    assert resolve_leaves(model, []) == ()


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("Blok", "did you mean 'Block'"),
        ("blocks.9.attn", "did you mean 'blocks.3.attn'"),
        ("Zzzzz", "its module classes are"),
    ],
)
def test_a_name_that_matches_nothing_is_refused(
    gpt: tuple[nn.Module, object], spec: str, fragment: str
) -> None:
    model, _ = gpt
    with pytest.raises(
        TraceError, match=f"--leaf {spec!r} matches no module class or path.*{fragment}"
    ):
        resolve_leaves(model, [spec])


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_class_name_leaves_on_both_front_ends(gpt: tuple[nn.Module, object], frontend: str) -> None:
    model, source = gpt
    traced = trace_model(
        model, source.example_inputs(2), leaves=("Block",), frontend=frontend, progress=False
    )
    assert traced.frontend == frontend
    assert [u.name for u in traced.profile.units] == [
        "wte",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.3",
        "ln_f",
        "lm_head",
    ]
    # export traces into the block but keeps its nodes in one unit: every node of blocks.2 is in unit blocks.2
    paths = {n.name: n.meta["fxpipe_path"] for n in traced.graph_module.graph.nodes}
    assert {u for n, u in traced.unit_of_node.items() if paths[n].startswith("blocks.2")} == {
        "blocks.2"
    }


def test_unknown_leaf_on_the_command_line_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from fxpipe.cli import main

    code = main(["trace", str(EXAMPLES["gpt"]), "--leaf", "Blok", "--out", "/dev/null"])
    err = capsys.readouterr().err  # progress lines ("build the model" ran) go to stdout, not here
    assert (
        code == 2
        and err.startswith("error: --leaf 'Blok' matches no module")
        and len(err.splitlines()) == 1
    )
