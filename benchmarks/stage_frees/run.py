"""Peak tensor memory of emitted stages with torch.fx's frees, with the frees the emitter keeps, and with none.

Each model is traced once and emitted three times, as ``fxpipe.codegen.render.frees.RULE`` says:
``all`` (every value dropped after its last use, as torch.fx writes it), ``needed`` (the
emitter's rule, Note [frees that matter]) and ``none``. Every stage of every variant then runs
on the same inputs, once under ``torch.no_grad()`` (a forward alone, where frees matter) and
once as forward + backward, and ``TensorMemoryTracker`` (fxpipe.runtime.pipeline.peak_memory; it counts the
storages the stage creates, each once however many views share it) gives the peak. Outputs
are compared too: the three variants must agree exactly.

    PYTHONPATH=. .venv/bin/python benchmarks/stage_frees/run.py [--batch 4] [--seq 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fxpipe.codegen import load_stage, write_build_dir  # noqa: E402
from fxpipe.codegen.render import frees  # noqa: E402
from fxpipe.partitioner import plan_partition  # noqa: E402
from fxpipe.runtime.pipeline.peak_memory import TensorMemoryTracker  # noqa: E402
from fxpipe.tracer import trace_model  # noqa: E402

RULES = ("all", "needed", "none")


def llama(seq: int) -> tuple[torch.nn.Module, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2 * seq,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
    )
    return LlamaForCausalLM(config).train(), lambda b: _tokens(b, seq, with_mask=True)


def gpt2(seq: int) -> tuple[torch.nn.Module, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=1000,
        n_positions=2 * seq,
        n_embd=256,
        n_layer=4,
        n_head=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return GPT2LMHeadModel(config).train(), lambda b: _tokens(b, seq, with_mask=False)


def _tokens(batch: int, seq: int, with_mask: bool) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(1, 1000, (batch, seq), generator=torch.Generator().manual_seed(1))
    if not with_mask:
        return (ids,)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - seq // 4 :] = 0
    return ids, mask


def peak(
    stage: torch.nn.Module, inputs: list[torch.Tensor], grad: bool
) -> tuple[int, list[torch.Tensor]]:
    tracker = TensorMemoryTracker()
    with torch.set_grad_enabled(grad), tracker:
        outputs = stage(*inputs)
        if grad:
            sum(o.float().sum() for o in outputs if o.requires_grad).backward()
    return tracker.peak_bytes, [o.detach() for o in outputs]


def measure(name: str, factory: Any, batch: int, seq: int, root: Path) -> list[dict[str, Any]]:
    model, inputs_fn = factory(seq)
    inputs = inputs_fn(batch)
    traced = trace_model(model, inputs, progress=False)
    plan = plan_partition(traced.profile, 2, solver="uniform", microbatches=1)
    builds, texts = {}, {}
    for rule in RULES:
        frees.RULE = rule
        try:
            out = root / f"{name}_{rule}"
            manifest = write_build_dir(
                traced, plan, out, None, batch_size=batch, microbatches=1, check=False
            )
        finally:
            frees.RULE = "needed"
        builds[rule] = (out, manifest)
        texts[rule] = [(out / sm.source).read_text() for sm in manifest.stages]
        shared = (out / manifest.shared_source).read_text() if manifest.shared_source else ""
        texts[rule].append(
            shared
        )  # the classes the stages share (Note [classes several stages share])
    rows = []
    values: dict[str, dict[str, torch.Tensor]] = {
        rule: dict(zip(("input_ids", "attention_mask"), inputs)) for rule in RULES
    }
    for i, sm in enumerate(builds["all"][1].stages):
        row: dict[str, Any] = {"model": name, "stage": i, "batch": batch, "seq": seq}
        for rule in RULES:
            out, manifest = builds[rule]
            stage = load_stage(out, i)
            args = [values[rule][t.name] for t in manifest.stages[i].inputs]
            row[f"{rule}_no_grad"], results = peak(stage, args, grad=False)
            row[f"{rule}_train"], _ = peak(stage, args, grad=True)
            values[rule].update({t.name: r for t, r in zip(manifest.stages[i].outputs, results)})
            text = texts[rule][i]
            row[f"{rule}_lines"] = len(text.splitlines())
            row[f"{rule}_free_lines"] = sum(" = None" in ln for ln in text.splitlines())
        for rule in RULES[1:]:
            for t in manifest.stages[i].outputs:
                torch.testing.assert_close(
                    values[rule][t.name], values["all"][t.name], rtol=0, atol=0
                )
        rows.append(row)
    rows.append(
        {
            "model": name,
            "stage": "shared.py",
            **{f"{rule}_lines": len(texts[rule][-1].splitlines()) for rule in RULES},
            **{
                f"{rule}_free_lines": sum(" = None" in ln for ln in texts[rule][-1].splitlines())
                for rule in RULES
            },
        }
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, factory in (("llama", llama), ("gpt2", gpt2)):
            rows += measure(name, factory, args.batch, args.seq, Path(tmp))
    here = Path(__file__).parent
    (here / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    mib = 1 << 20
    lines = [
        "| model | stage | no-grad peak MiB: fx / kept / none | train peak MiB: fx / kept / none "
        "| lines: fx / kept | free lines: fx / kept |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["stage"] == "shared.py":
            lines.append(
                f"| {r['model']} | shared.py | | | {r['all_lines']} / {r['needed_lines']} "
                f"| {r['all_free_lines']} / {r['needed_free_lines']} |"
            )
            continue
        lines.append(
            f"| {r['model']} | {r['stage']} | {r['all_no_grad'] / mib:.2f} / {r['needed_no_grad'] / mib:.2f} / "
            f"{r['none_no_grad'] / mib:.2f} | {r['all_train'] / mib:.2f} / {r['needed_train'] / mib:.2f} / "
            f"{r['none_train'] / mib:.2f} | {r['all_lines']} / {r['needed_lines']} "
            f"| {r['all_free_lines']} / {r['needed_free_lines']} |"
        )
    table = "\n".join(lines)
    (here / "results.md").write_text(
        f"batch {args.batch}, sequence {args.seq}, 2 stages, CPU, torch "
        f"{torch.__version__}\n\n{table}\n"
    )
    print(table)


if __name__ == "__main__":
    main()
