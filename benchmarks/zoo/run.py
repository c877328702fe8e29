"""The conformance zoo side by side: torch.distributed.pipelining's ``pipeline()`` front end and fxpipe.

For every zoo model (``tests/zoo/registry.py``):

* **pipelining**: ``pipeline(model, example_inputs(2), split_spec={middle block: SplitPoint.BEGINNING})``
  in one process (no process group is needed to trace, split and run the split module), then the
  split module's forward against the eager model on the same inputs: in eval mode (the verdict:
  "handles" = split into 2 stages and forward within rtol 1e-4 / atol 1e-5), and in train mode from
  the same seed (informational: dropout masks then depend on the order of random ops).
* **fxpipe**: the zoo probe (``tests/zoo/probe.py``) at 2 stages: front end, units, trace seconds,
  the max abs error of outputs, gradients and buffers in train and in eval mode, and with ``--train``
  whether ``fxpipe run --steps 2`` trains (torchrun, 2 ranks). "handles" = partitions and matches
  in both modes (and trains, when ``--train`` ran).
* **time to a build** (issue 37): ``fxpipe partition MODEL --stages 2`` as a user runs it (a fresh
  process: imports, build, trace, count, solve, emit and the build-time check), its wall seconds
  and the phases it prints, beside the seconds of pipelining's ``pipeline()`` call alone (its split,
  from an already built model). ``--timing`` measures only these two columns.

Usage (from the repository root)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/zoo/run.py              # both sides, every model
    PYTHONPATH=$PWD .venv/bin/python benchmarks/zoo/run.py --no-fxpipe  # pipelining only
    PYTHONPATH=$PWD .venv/bin/python benchmarks/zoo/run.py llama resnet --train
    PYTHONPATH=$PWD .venv/bin/python benchmarks/zoo/run.py --timing     # time to a build only

writes ``results.json`` and ``results.md`` next to this file (``--out DIR`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "tests" / "zoo"))

import torch  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from fxpipe.codegen.check.equivalence import ATOL, RTOL, compare_tensor  # noqa: E402
from probe import describe_error, probe_model  # noqa: E402
from registry import ZooModel, select  # noqa: E402

MICROBATCH = 2

# the block that starts the second stage: the middle of each model's stack of blocks
# (for encoder-decoders the decoder, for CNNs the middle stage)
SPLIT_AT = {
    "llama": "model.layers.2",
    "mistral": "model.layers.2",
    "qwen2": "model.layers.2",
    "gemma2": "model.layers.2",
    "phi3": "model.layers.2",
    "mixtral": "model.layers.2",
    "gpt_neox": "gpt_neox.layers.2",
    "opt": "model.decoder.layers.2",
    "falcon": "transformer.h.2",
    "bloom": "transformer.h.2",
    "gptj": "transformer.h.2",
    "gpt2": "transformer.h.2",
    "bert_mlm": "bert.encoder.layer.2",
    "t5": "decoder",
    "bart": "model.decoder",
    "vit_hf": "vit.layers.2",
    "convnext": "features.3",
    "densenet": "features.denseblock2",
    "efficientnet": "features.3",
    "mobilenet_v2": "features.4",
    "googlenet": "inception4a",
    "regnet": "trunk_output.block2",
    "resnet": "layer3",
    "resnet18": "layer3",
    "transformer_encoder": "encoder.layers.2",
    "vit_mha": "encoder.layers.encoder_layer_2",
    "vit_timm": "blocks.2",
    # the round-two models (issue 37)
    "whisper": "model.decoder",
    "llama_lora": "model.layers.2",
    "wav2vec2_ctc": "wav2vec2.encoder.layers.1",
    "hubert_ctc": "hubert.encoder.layers.1",
    "clip": "text_model",
    "chinese_clip": "text_model",
    "siglip": "text_model",
    "dict_batch": "text",
    "dataclass_batch": "lateral.1",
    "mamba": "backbone.layers.2",
    "mamba2": "backbone.layers.2",
}


def _call(source: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The model file's example call at the benchmark's microbatch: positional and keyword arguments."""
    call = source.example_call(MICROBATCH)
    return tuple(call.args), dict(call.kwargs)


def _max_abs(got: Any, want: Any) -> tuple[float, bool]:
    """Max abs error over the output leaves and whether every leaf is within tolerance (fxpipe's comparison)."""
    got_t = [t for t in tree_leaves(got) if isinstance(t, torch.Tensor)]
    want_t = [t for t in tree_leaves(want) if isinstance(t, torch.Tensor)]
    if len(got_t) != len(want_t):
        return float("inf"), False
    errors = [compare_tensor(f"output[{i}]", g, w) for i, (g, w) in enumerate(zip(got_t, want_t))]
    return max((e.max_abs for e in errors), default=0.0), all(e.ok for e in errors)


def pipelining_side(model: ZooModel) -> dict[str, Any]:
    """``pipeline()`` with a split at ``SPLIT_AT[model.name]``; forward vs eager in eval, then in train mode."""
    from fxpipe.modelfile import load_model_file
    from torch.distributed.pipelining import SplitPoint, pipeline

    row: dict[str, Any] = {"split_at": SPLIT_AT.get(model.name)}
    source = load_model_file(model.spec)
    args, kwargs = _call(source)
    for mode in ("eval", "train"):
        start = time.perf_counter()
        try:
            module = source.build_model().train(mode == "train")
            # with autograd on, as training runs it (under no_grad, nn.TransformerEncoder's eval fast path
            # would zero padded positions, which no traced graph does)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                want = module(*args, **kwargs)
            module.get_submodule(
                row["split_at"]
            )  # a missing name is this script's error, not pipelining's
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                split_start = time.perf_counter()
                pipe = pipeline(
                    module, args, kwargs, split_spec={row["split_at"]: SplitPoint.BEGINNING}
                )
                row.setdefault("split_s", round(time.perf_counter() - split_start, 2))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                got = pipe(*args, **kwargs)
            err, ok = _max_abs(got, want)
            result = {
                "status": "ok" if ok and pipe.num_stages == 2 else "mismatch",
                "stages": pipe.num_stages,
                "max_abs": err,
            }
        except Exception as exc:  # noqa: BLE001 - a failure is a row
            result = {"status": "error", **describe_error(exc)}
        result["seconds"] = round(time.perf_counter() - start, 2)
        row[mode] = result
    row["handles"] = row["eval"]["status"] == "ok"
    return row


PHASE_LINE = re.compile(r"^fxpipe: (?P<phase>\w[\w ]*?)(?: \(.*\))? (?P<seconds>[0-9.]+) s$")


def partition_timing(model: ZooModel) -> dict[str, Any]:
    """``fxpipe partition MODEL --stages 2`` in a fresh process, as a user runs it: wall seconds and phases."""
    with tempfile.TemporaryDirectory(prefix=f"zoo-time-{model.name}-") as tmp:
        command = [sys.executable, "-m", "fxpipe", "partition", model.spec, "--stages", "2"]
        command += ["--out", str(Path(tmp) / "build")]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        wall = round(time.perf_counter() - start, 2)
    phases = {
        m["phase"]: float(m["seconds"])
        for line in (done.stdout + done.stderr).splitlines()
        if (m := PHASE_LINE.match(line.strip()))
    }
    row: dict[str, Any] = {"status": "ok" if done.returncode == 0 else "error", "wall_s": wall}
    row["phases"] = phases
    if done.returncode:
        row["error"] = (done.stderr.strip().splitlines() or ["?"])[-1][:300]
    return row


def pipelining_split_time(model: ZooModel) -> dict[str, Any]:
    """The seconds of pipelining's ``pipeline()`` call alone, at the benchmark's split, from a built model."""
    from fxpipe.modelfile import load_model_file
    from torch.distributed.pipelining import SplitPoint, pipeline

    source = load_model_file(model.spec)
    module = source.build_model().eval()
    args, kwargs = _call(source)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipeline(module, args, kwargs, split_spec={SPLIT_AT[model.name]: SplitPoint.BEGINNING})
    except Exception as exc:  # noqa: BLE001 - a failure is a row
        return {"split_s": round(time.perf_counter() - start, 2), **describe_error(exc)}
    return {"split_s": round(time.perf_counter() - start, 2)}


def fxpipe_side(model: ZooModel, train: bool) -> dict[str, Any]:
    """The probe at 2 stages, condensed to the benchmark's columns."""
    with tempfile.TemporaryDirectory(prefix=f"zoo-bench-{model.name}-") as tmp:
        row = probe_model(model, Path(tmp), stages=(2,), train_run=train, keywords=False)
    steps = row["steps"]

    def err(name: str) -> Any:
        s = steps.get(name)
        if s is None:
            return None
        return s.get("max_abs") if s["status"] in ("ok", "mismatch") else f"{s['error_type']}"

    first_problem = next(
        (
            _problem(k, s)
            for k, s in steps.items()
            if s["status"] in ("error", "mismatch") and k not in ("kwargs", "labels")
        ),
        None,
    )
    verified = all(
        steps.get(k, {}).get("status") == "ok" for k in ("partition@2", "train@2", "eval@2")
    )
    trains = None if "run" not in steps else steps["run"]["status"] == "ok"
    return {
        "frontend": row.get("frontend"),
        "units": row.get("units"),
        "trace_s": steps.get("trace", {}).get("seconds"),
        "verify_train": err("train@2"),
        "verify_eval": err("eval@2"),
        "trains": trains,
        "kwargs": steps.get("kwargs", {}).get("status"),
        "handles": verified and trains is not False,
        "first_problem": first_problem,
        "seconds": row["seconds"],
        "steps": steps,
    }


def _problem(step: str, s: dict[str, Any]) -> str:
    """One line for the first failing step: its error, or the tensor furthest off."""
    if s["status"] == "mismatch":
        return f"{step}: differs by {s['max_abs']:.2g} ({s['worst']})"
    return (
        f"{step}: {s['error_type']}: {s.get('cause') or s['error']}"
        if step == "run"
        else f"{step}: {s['error_type']}: {s['error']}"
    )


def _fmt_err(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "0" if v == 0 else f"{v:.1e}"
    return str(v)


def write_results(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> None:
    """``results.json`` (everything) and ``results.md`` (the side-by-side table and the counts)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    n = len(rows)
    pp = sum(bool(r["pipelining"].get("handles")) for r in rows if r.get("pipelining"))
    fx_rows = [r for r in rows if r.get("fxpipe")]
    fx = sum(bool(r["fxpipe"]["handles"]) for r in fx_rows)
    lines = [
        "# Conformance zoo: torch.distributed.pipelining vs fxpipe",
        "",
        f"torch {meta['torch']}, transformers {meta['transformers']}, Python {meta['python']}, "
        f"{meta['cpus']} CPUs; "
        + (
            f"rows of several runs (the latest {meta['date']}, {meta['seconds']:.0f} s; each row's "
            "date is in results.json)."
            if meta.get("merged")
            else f"{meta['seconds']:.0f} s in all."
        )
        + f" Microbatch {MICROBATCH}; tolerance rtol {RTOL:g}, "
        f"atol {ATOL:g}; * = the model has dropout or stochastic depth.",
    ]
    if meta.get("timing"):
        rows_table: list[dict[str, Any]] = []
    else:
        rows_table = rows
        lines += _verdict_table(rows, pp, n, fx, fx_rows, meta)
    lines += _timing_table(rows)
    errors = [
        (r["name"], r["pipelining"]["eval"])
        for r in rows_table
        if r.get("pipelining", {}).get("eval", {}).get("status") == "error"
    ]
    if errors:
        lines += ["", "pipelining errors (eval mode):", ""]
        lines += [
            f"- {name}: {e['error_type']}: {e['error'][:200]}"
            + (f" (cause: {e['cause'][:200]})" if e.get("cause") else "")
            for name, e in errors
        ]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def _verdict_table(
    rows: list[dict[str, Any]],
    pp: int,
    n: int,
    fx: int,
    fx_rows: list[dict[str, Any]],
    meta: dict[str, Any],
) -> list[str]:
    """The side-by-side verdicts: does each front end split the model and compute the same thing."""
    lines = [
        "",
        f"**pipelining `pipeline()` handles {pp} of {n}**"
        + (
            f"; **fxpipe handles {fx} of {len(fx_rows)}** (partitions at 2 stages and matches in train and eval mode"
            + (", and trains" if meta.get("train") else "; `fxpipe run` not tried")
            + ")."
            if fx_rows
            else "."
        ),
        "",
        "| model | split at | pipelining | pp err (eval) | pp err (train) | fxpipe front end | units | trace s "
        "| fxpipe err train | fxpipe err eval | trains | fxpipe | first fxpipe problem |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, f = r.get("pipelining") or {}, r.get("fxpipe") or {}

        def pp_cell(mode: str) -> str:
            s = p.get(mode)
            if not s:
                return "-"
            return _fmt_err(s["max_abs"]) if s["status"] != "error" else f"{s['error_type']}"

        lines.append(
            "| "
            + " | ".join(
                [
                    r["name"] + (" *" if r.get("dropout") else ""),
                    f"`{p.get('split_at', '-')}`",
                    ("yes" if p.get("handles") else "**no**") if p else "-",
                    pp_cell("eval"),
                    pp_cell("train"),
                    str(f.get("frontend") or "-"),
                    str(f.get("units") or "-"),
                    "-" if f.get("trace_s") is None else f"{f['trace_s']:.1f}",
                    _fmt_err(f.get("verify_train")),
                    _fmt_err(f.get("verify_eval")),
                    {True: "yes", False: "**no**", None: "-"}[f.get("trains")],
                    ("yes" if f.get("handles") else "**no**") if f else "-",
                    (f.get("first_problem") or "")[:110].replace("|", "/"),
                ]
            )
            + " |"
        )
    return lines


def _timing_table(rows: list[dict[str, Any]]) -> list[str]:
    """Time to a build: fxpipe partition's wall seconds and phases beside pipeline()'s split."""
    lines: list[str] = []
    timed = [r for r in rows if r.get("partition")]
    if timed:
        names = ["build the model", "trace", "count", "solve", "emit", "check"]
        lines += [
            "",
            "## Time to a build",
            "",
            "`fxpipe partition MODEL --stages 2` in a fresh process (wall seconds, the phases it prints), "
            "beside pipelining's `pipeline()` call alone on a built model.",
            "",
            "| model | fxpipe partition s | " + " | ".join(names) + " | pipeline() split s |",
            "|---|" + "---|" * (len(names) + 2),
        ]
        for r in timed:
            t, split = r["partition"], (r.get("pipelining") or {}).get("split_s")
            cells = [f"{t['phases'][n]:.1f}" if n in t["phases"] else "-" for n in names]
            wall = f"{t['wall_s']:.1f}" + ("" if t["status"] == "ok" else " (failed)")
            lines.append(
                f"| {r['name']} | {wall} | "
                + " | ".join(cells)
                + f" | {'-' if split is None else f'{split:.1f}'} |"
            )
    return lines


def _kept_rows(out: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``--merge``: the rows of the last run's results.json, by model, when it measured the same
    things (``--train``, ``--timing``); its rows keep their own dates."""
    path = out / "results.json"
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text())
    meta = saved["meta"]
    if bool(meta.get("train")) != args.train or bool(meta.get("timing")) != args.timing:
        raise SystemExit(
            f"--merge: {path} was a run with --train={meta.get('train')} --timing={meta.get('timing')}; "
            "merge a run of the same kind"
        )
    return {r["name"]: {"date": meta.get("date"), **r} for r in saved["rows"]}


def _in_zoo_order(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    order = {m.name: i for i, m in enumerate(select([]))}
    return sorted(rows.values(), key=lambda r: order.get(r["name"], len(order)))


def _meta(train: bool, start: float, timing: bool = False, merged: bool = False) -> dict[str, Any]:
    import transformers

    return {
        "merged": merged,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "seconds": round(time.perf_counter() - start, 1),
        "train": train,
        "timing": timing,
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="zoo models (default: all)")
    parser.add_argument("--no-fxpipe", action="store_true", help="only the pipelining side")
    parser.add_argument("--no-pipelining", action="store_true", help="only the fxpipe side")
    parser.add_argument(
        "--train",
        action="store_true",
        help="fxpipe side: also `fxpipe run --steps 2` (~20-60 s each)",
    )
    parser.add_argument(
        "--timing",
        action="store_true",
        help="only the time to a build: `fxpipe partition` wall and phases, pipeline()'s split",
    )
    parser.add_argument("--out", default=str(HERE), help="folder for results.json / results.md")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other models' rows of results.json (a run of some models updates theirs)",
    )
    parser.add_argument(
        "--render", action="store_true", help="only rewrite results.md from results.json"
    )
    args = parser.parse_args(argv)
    if args.render:
        saved = json.loads((Path(args.out) / "results.json").read_text())
        write_results(saved["rows"], saved["meta"], Path(args.out))
        return 0
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    kept = _kept_rows(Path(args.out), args) if args.merge else {}
    for model in select(args.names):
        row: dict[str, Any] = {
            "name": model.name,
            "date": time.strftime("%Y-%m-%d"),
            "dropout": model.dropout,
            "spec": str(Path(model.spec).relative_to(ROOT))
            if model.spec.startswith(str(ROOT))
            else model.spec,
        }
        if args.timing:
            row["pipelining"] = pipelining_split_time(model) if model.name in SPLIT_AT else {}
            row["partition"] = partition_timing(model)
        else:
            if not args.no_pipelining:
                row["pipelining"] = pipelining_side(model)
            if not args.no_fxpipe:
                row["fxpipe"] = fxpipe_side(model, args.train)
            row["partition"] = partition_timing(model)
        rows.append(row)
        p, f, t = row.get("pipelining", {}), row.get("fxpipe", {}), row["partition"]
        timing = (
            f"partition {t['wall_s']:.1f} s ({t['status']}), pipeline() {p.get('split_s', '-')} s"
        )
        verdicts = (
            f"pipelining {'yes' if p.get('handles') else 'no ':3s} "
            f"fxpipe {'yes' if f.get('handles') else 'no ':3s} {f.get('first_problem') or ''}"
        )
        print(f"{model.name:20s} {timing if args.timing else verdicts}"[:160], flush=True)
        write_results(
            _in_zoo_order({**kept, **{r["name"]: r for r in rows}}),
            _meta(args.train, start, args.timing, merged=bool(kept)),
            Path(args.out),
        )  # after every model: a cut-off run keeps its rows
    print(f"wrote {Path(args.out) / 'results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
