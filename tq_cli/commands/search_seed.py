"""`tq search-seed`: grid-search the rotation seed per tensor or per model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError
from rich.table import Table

from tq_cli.commands._common import (
    emit_json,
    progress_bar,
    quant_option,
    quant_values,
    stdout,
    usage_error,
)

HELP = "Grid-search the rotation seed that quantizes each tensor (or the model) best."
EPILOG = """Each tensor is read once and every seed is screened with a one-pass fit; the
--finalists best (and seed 0, the reference) are then scored with the exact fit
tq convert does, so `tq convert --seeds SEEDS` reproduces the chosen scores.
--exhaustive scores every seed exactly. Scores are logged to SEEDS.log/ as they come:
rerunning the same command skips what is done.

Examples:

  tq search-seed ./SmolLM2-135M 0..100 -o seeds.json --bits 3

  tq search-seed ./SmolLM2-135M 0..100:5 -o seeds.json --objective calib --calib smol.calib

  torchrun --nproc-per-node 4 -m tq_cli search-seed ./model 0..100 -o seeds.json

  tq convert ./SmolLM2-135M -o smol-tq3 --bits 3 --seeds seeds.json
"""


def main(
    source: str = typer.Argument(..., help="Model folder, or a Hugging Face hub id."),
    seeds: str = typer.Argument(..., help="Seeds: 0..100, 0..100:5 or 1,7,42."),
    out: Path = typer.Option(..., "-o", "--out", help="SEEDS JSON to write."),
    objective: str = typer.Option("mse", "--objective", help="mse | calib."),
    calib: Path | None = typer.Option(None, "--calib", help="Calibration file (tq calibrate) "
                                      "for --objective calib."),
    per: str = typer.Option("tensor", "--per", help="tensor | model: a seed per tensor, or "
                            "one for the whole model."),
    bits: int = quant_option("bits"),
    group_size: int = quant_option("group-size"),
    rotation: str = quant_option("rotation"),
    rotation_block: int | None = quant_option("rotation-block"),
    codebook: str = quant_option("codebook"),
    outliers: float = quant_option("outliers"),
    scale_iters: int = quant_option("scale-iters"),
    col_scale: str = quant_option("col-scale"),
    recipe: str | None = typer.Option(None, "--recipe", help="Recipe name or TOML path."),
    finalists: int = typer.Option(4, "--finalists", min=1,
                                  help="Seeds per tensor scored exactly after the screen."),
    exhaustive: bool = typer.Option(False, "--exhaustive", help="Score every seed exactly."),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Local processes (torchrun: ignored)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    from tq_cli.seedsearch.distributed import run_local, torchrun_comm
    from tq_cli.seedsearch.grid import SearchSpec, search
    from tq_cli.seedsearch.ranges import parse_seeds

    seed_list = parse_seeds(seeds)
    try:
        spec = SearchSpec.model_validate(quant_values(locals()) | {
            "seeds": seed_list, "objective": objective,
            "calib": str(calib) if calib else None, "per": per,
            "recipe": recipe, "finalists": None if exhaustive else finalists, "device": device,
        })
    except ValidationError as e:
        raise usage_error(e) from None

    comm = torchrun_comm()
    rank0 = comm is None or comm.rank == 0
    with progress_bar(enabled=rank0) as bar:
        task = bar.add_task("tensors", total=None)

        def progress(name: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, description=name[-40:])

        if comm is not None:
            doc = search(source, out, spec, progress=progress, comm=comm)
        else:
            doc = run_local(search, (source, out, spec), jobs, progress)
    if comm is not None and comm.world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    if doc is None:
        return
    if as_json:
        emit_json(doc)
    else:
        stdout.print(result_table(doc))


def result_table(doc: dict[str, Any]) -> Table:
    s = doc["summary"]
    table = Table(title=f"Rotation seeds: {doc['source']['name']}, {doc['quant']['bits']}-bit "
                        f"{doc['rotation']['kind']}, objective {doc['objective']}, "
                        f"per {doc['per']}",
                  caption=f"{len(doc['seeds_searched'])} seeds screened; screen = one-pass "
                          f"fit, exact = the fit tq convert does. Weighted exact score "
                          f"{s['weighted_score_best']:.6g} vs seed 0 "
                          f"{s['weighted_score_seed0']:.6g}: "
                          f"{s['gain_over_seed0']:+.3%} better in {doc['seconds']:.0f} s")
    for c in ("tensor", "seed", "exact", "seed 0", "gain", "screen best", "median", "worst"):
        table.add_column(c, justify="left" if c == "tensor" else "right")
    for name, t in doc["tensors"].items():
        sc = t["screen"]
        table.add_row(name, str(t["seed"]), f"{t['score']:.5g}", f"{t['seed0_score']:.5g}",
                      f"{t['gain_over_seed0']:+.2%}", f"{sc['best']:.5g}",
                      f"{sc['median']:.5g}", f"{sc['worst']:.5g}")
    return table
