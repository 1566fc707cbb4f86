"""`convert`: a model folder in, a TurboQuant checkpoint out (docs/format.md).

Orchestrates the reader, the plan, the streaming pipeline and the writer (the data
flow of docs/design.md). The output folder's life (partial folder, resume, swap) is
`tq_cli.io.output`; the manifest, index, config and card are written by
`tq_cli.conversion.finish`; the spec and result types are `tq_cli.conversion.spec`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from tq_cli.calibration.fisher import OutputFisher
from tq_cli.calibration.run import BlockStates
from tq_cli.calibration.stream import StreamedCalibration
from tq_cli.conversion.finish import finish
from tq_cli.conversion.pipeline import Finished, stream
from tq_cli.conversion.ranks import STATES_DIR, assign
from tq_cli.conversion.selfcheck import self_check
from tq_cli.conversion.spec import FISHER_TOKENS, ConvertResult, ConvertSpec
from tq_cli.device import resolve_device
from tq_cli.errors import (
    CorruptFileError,
    OutputError,
    SourceError,
    TqError,
    UnsupportedError,
    first_error,
)
from tq_cli.io.format import GUARD, GUARD_SHAPE, ROTATION_PREFIX
from tq_cli.io.manifest import write_json
from tq_cli.io.output import (
    PLAN_FILE,
    check_output,
    output_lock,
    partial_path,
    read_plan_hash,
    verified,
)
from tq_cli.io.safetensors_reader import SourceModel, open_source, source_sha256
from tq_cli.io.source import resolve_source
from tq_cli.io.writer import Journal, ShardWriter
from tq_cli.parallel import Comm
from tq_cli.planning.plan import Plan, TensorPlan
from tq_cli.planning.prepare import PlannedSource, plan_source
from tq_cli.quant.choose import CalibOptions
from tq_cli.quant.rotation import Rotation, make_rotation
from tq_cli.version import __version__

__all__ = ["ConvertResult", "ConvertSpec", "convert", "partial_path"]


ProgressFn = Callable[[Finished, int], None]


def convert(source: str | os.PathLike[str], out: str | os.PathLike[str],
            spec: ConvertSpec | None = None, *,
            on_plan: Callable[[Plan], None] | None = None,
            progress: ProgressFn | None = None,
            log: Callable[[str], None] | None = None,
            comm: Comm | None = None) -> ConvertResult:
    """Convert SOURCE (folder or hub id) into a TurboQuant checkpoint at OUT. Under
    torchrun (`comm`, `tq_cli.parallel`) every rank calls this alike: the ranks share the
    calibration tokens and the tensors, write into the same output folder (which every
    rank must see: a local disk on one machine, a shared file system across machines),
    and rank 0 finishes the checkpoint; the other ranks return rank 0's result."""
    if spec is None:
        spec = ConvertSpec()
    elif not isinstance(spec, ConvertSpec):  # a dict, as the CLI builds one: same checks
        try:
            spec = ConvertSpec.model_validate(spec)
        except ValidationError as e:
            where, what = first_error(e)
            raise TqError(f"tq_cli.convert: spec{'.' + where if where else ''}: {what}") \
                from None
    if not isinstance(source, str | os.PathLike) or not isinstance(out, str | os.PathLike):
        raise TqError("tq_cli.convert: source and out must be paths (or a hub id for "
                      f"source), got {type(source).__name__} and {type(out).__name__}")
    out = Path(out).expanduser()
    comm = comm or Comm()
    with (output_lock(out) if comm.rank == 0 else contextlib.nullcontext()), \
            contextlib.ExitStack() as scratch:
        return _convert(source, out, spec, on_plan, progress, log, scratch, comm)


# Below this share of its non-embedding weights stored quantized, a conversion names the
# largest tensors it kept: a checkpoint barely smaller than its source is not what anyone
# asked for, even where each kept tensor has its reason.
MIN_QUANTIZED_SHARE = 0.8


def _said_ids(record: dict, warn: Callable[[str], None]) -> None:
    """Self-calibration without a tokenizer is said, with why there was none."""
    if record.get("synthetic") == "random-ids":
        warn(f"self-calibration drew token ids from config.json's vocabulary "
             f"({record['vocab_size']} ids, special ids {record['special_ids']} left out), "
             f"without a tokenizer: {record['no_tokenizer']}")


def _low_share(plan: Plan) -> str | None:
    """A warning naming the largest kept weights when too few are stored quantized."""
    _, body = plan.quantized_share()
    kept = plan.largest_kept()
    if body >= MIN_QUANTIZED_SHARE or not kept:
        return None
    named = "; ".join(f"'{t.info.name}' {list(t.info.shape)}"
                      + (f" ({t.note})" if t.note else "") for t in kept)
    return (f"only {body:.0%} of the non-embedding weights are stored quantized; the largest "
            f"kept: {named}; convert them with a recipe that quantizes them (--recipe), or "
            "see the notes above for why tq keeps them")


def _convert(source: str | os.PathLike[str], out: Path, spec: ConvertSpec,
             on_plan: Callable[[Plan], None] | None, progress: ProgressFn | None,
             log: Callable[[str], None] | None,
             scratch: contextlib.ExitStack, comm: Comm) -> ConvertResult:
    t0 = time.perf_counter()
    warnings: list[str] = []

    def warn(msg: str) -> None:
        warnings.append(msg)
        if log:
            log(msg)

    folder = resolve_source(source)
    source_model = open_source(folder)
    if comm.rank == 0:
        check_output(out, folder, spec.overwrite)
    planned = plan_source(folder, spec.recipe, spec.quant, spec.rotation, seeds=spec.seeds,
                          seeds_file=spec.seeds_file, max_shard_bytes=spec.max_shard_bytes,
                          model=source_model, check=True, vision=spec.vision,
                          allow_partial=spec.allow_partial,
                          head_bits=spec.head_bits, head_required=spec.head_required)
    model, plan = planned.model, planned.plan
    for note in planned.notes:
        warn(note)
    low = _low_share(plan)
    if low is not None:
        warn(low)
    device = resolve_device(spec.device)
    # A fallback to the weight-only fit is said once the conversion has succeeded: a run
    # that fails says one line, its error.
    fallbacks: list[str] = []
    calib, calib_record = _calibration(spec, planned, scratch, fallbacks.append, comm)
    if comm.world > 1:
        kinds = comm.all_gather(None if calib is None else type(calib.calibration).__name__)
        if len(set(kinds)) > 1:
            raise UnsupportedError(
                f"the ranks disagree on the calibration ({', '.join(map(str, kinds))} by "
                "rank): each rank needs the same transformers, tokenizer and source; see "
                "the first rank's note")
    provenance: dict[str, Any] = {"seeds": planned.seeds_record} if planned.seeds_record else {}
    if calib_record is not None:
        provenance["calibration"] = calib_record
    if spec.target_bits is not None:
        from tq_cli.conversion.mixed_precision import choose_bits, default_bit_choices

        choices = spec.bit_choices or default_bit_choices(plan, spec.target_bits)
        if log:
            log(f"--target-bits {spec.target_bits:g}: measuring every tensor at "
                f"{', '.join(map(str, choices))} bits first")
        fisher = _fisher(spec, planned, out, scratch, warn) if calib is not None else None
        mixed = choose_bits(plan, spec.target_bits, choices, device, calib, fisher=fisher)
        if mixed.record.get("fisher_unused"):
            warn(f"--target-bits: widths by the Hessian-weighted error, not the Fisher-"
                 f"weighted one ({mixed.record['fisher_unused']})")
        plan = planned.replan(mixed.bits)
        provenance["mixed_precision"] = mixed.record
    plan.extra = {k: v for k, v in provenance.items() if k != "seeds"}
    if on_plan:
        on_plan(plan)

    partial = partial_path(out)
    plan_hash = plan.hash()
    fresh = True
    if comm.rank == 0:
        fresh = _open_partial(partial, plan_hash, spec.resume, warn)
    fresh = comm.broadcast(fresh)
    writer = ShardWriter(partial, plan.layout)
    journal = Journal(partial, comm.rank)
    done: dict[str, dict] = {}
    todo: list[TensorPlan] = []
    mine: list[TensorPlan] = []
    try:
        try:
            if comm.rank == 0:
                try:
                    writer.open(create=True)  # on resume: headers and sizes rewritten, data kept
                except OSError as e:
                    raise OutputError(f"{e.filename or partial}: cannot write "
                                      f"({e.strerror})") from e
                if not fresh:
                    done = _unchanged_inputs(verified(journal, writer), model, partial)
                    journal.rewrite(list(done.values()))  # drop unverified and cut lines
            rotations = {rid: make_rotation(rp.spec, rp.n, rp.block)
                         for rid, rp in plan.rotations.items()}
            if comm.rank == 0:
                _write_rotations(plan, rotations, writer, journal, done)
            comm.barrier()
            if comm.rank > 0:
                writer.open(create=False)
            done = comm.broadcast(done)
            todo = [t for t in plan.tensors if t.info.name not in done]
            mine = _this_rank(todo, calib, comm, partial, calib_record)
            for fin in stream(mine, writer, rotations, device, spec.allow_nonfinite, warn,
                              calib):
                entry = {"tensor": fin.plan.info.name, "digests": fin.digests,
                         "record": fin.record}
                journal.append(entry)
                done[fin.plan.info.name] = entry
                if progress:
                    progress(fin, fin.plan.info.nbytes)
            if calib is not None and isinstance(calib.calibration, StreamedCalibration):
                calib.calibration.finish()  # the stages other ranks still need
        finally:
            writer.close()
    except TqError:
        # The input is at fault (a NaN, a damaged shard): resuming cannot help, so a
        # partial folder this run started is removed. An OSError (disk full) or an
        # interrupt keeps it for --resume, and so does a run that was itself resuming.
        if fresh and comm.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if comm.world > 1:
        comm.barrier()
        mine_done = {t.info.name: done[t.info.name] for t in mine} if comm.rank else {}
        for part, said in comm.all_gather((mine_done, warnings if comm.rank else [])):
            done.update(part)
            for msg in said:
                if msg not in warnings:
                    warn(msg)  # another rank's note (a fallback, a clamped value)
        if comm.rank > 0:
            result = comm.broadcast(None)
            if isinstance(result, str):  # rank 0 failed while finishing (its self-check)
                raise TqError(f"rank 0: {result}")
            assert isinstance(result, ConvertResult)
            return result
        journal.rewrite(list(done.values()))
    shutil.rmtree(partial / STATES_DIR, ignore_errors=True)
    resumed = sum(1 for t in plan.tensors if t.info.name in done) - len(todo)
    for note in fallbacks:
        warn(note)
    try:
        result = finish(plan, partial, out, done, spec, device, time.perf_counter() - t0,
                         max(resumed, 0), warnings, provenance,
                         check=lambda folder: self_check(planned, folder, device, out))
    except BaseException as e:
        if comm.world > 1:  # the other ranks wait for the result: they get the error
            comm.broadcast(str(e) or type(e).__name__)
        raise
    result.check_seconds = planned.check_seconds
    if comm.world > 1:
        comm.broadcast(result)
    return result


def _open_partial(partial: Path, plan_hash: str, resume: bool,
                  warn: Callable[[str], None]) -> bool:
    """Make (or, with `resume`, keep) the partial output folder; True: a fresh one."""
    if partial.exists():
        if resume:
            old = read_plan_hash(partial)
            if old != plan_hash:
                raise OutputError(
                    f"{partial}: an unfinished conversion made with other settings or another "
                    "source; rerun without --resume to start over")
            return False
        warn(f"removing an unfinished conversion at {partial} (pass --resume to continue it)")
        shutil.rmtree(partial)
    elif resume:
        warn(f"nothing to resume at {partial}; starting from the beginning")
    try:
        partial.mkdir(parents=True)
    except OSError as e:
        raise OutputError(f"{partial}: cannot create the output folder ({e.strerror}); "
                          "choose another OUT") from e
    write_json(partial / PLAN_FILE, {"plan_hash": plan_hash, "tq_version": __version__})
    return True


def _this_rank(todo: list[TensorPlan], calib: CalibOptions | None, comm: Comm,
               partial: Path, calib_record: dict | None) -> list[TensorPlan]:
    """This rank's tensors, in the order the conversion takes them. With a streamed
    calibration the order is block by block (a block's Hessians are quantized from and
    released before the next block runs; tensors without calibration, the head among
    them, first, while nothing else is alive), the stages every rank runs are those any
    tensor needs, and the inputs of the last blocks are kept under the partial folder so
    that a resumed conversion starts at the block it was in."""
    streamed = calib.calibration if calib is not None and isinstance(
        calib.calibration, StreamedCalibration) else None
    if streamed is None:
        return assign(todo, comm)

    def readers(tensors: list[TensorPlan]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for t in tensors:
            key = streamed.group(t.info.name)
            if t.quant is not None and not t.head and key is not None:
                out.setdefault(key, set()).add(t.info.name)
        return out

    tag = json.dumps(calib_record, sort_keys=True, default=str)
    streamed.plan(set(readers(todo)), states=BlockStates(partial / STATES_DIR, tag, comm))
    todo = sorted(todo, key=lambda t: streamed.order_key(t.info.name))
    mine = assign(todo, comm, streamed.order_key)
    streamed.keep(readers(mine))
    return mine


def _calibration(spec: ConvertSpec, planned: PlannedSource, scratch: contextlib.ExitStack,
                 warn: Callable[[str], None],
                 comm: Comm) -> tuple[CalibOptions | None, dict | None]:
    """The calibration GPTQ uses, if any, and the manifest's record of it. Self-calibration
    (the default, or --synthetic-calib N) runs the model on random tokens (its text in a
    temporary folder `scratch` removes) block by block as the conversion asks
    (`StreamedCalibration`); only --target-bits, which measures every tensor before any is
    written, makes a whole calibration file first. By default, a model it cannot run (no
    transformers, no tokenizer, no stack of blocks) gets the weight-only fit and a note."""
    from tq_cli.io.calibration import read_calibration

    gptq = {"damp": spec.damp, "act_order": spec.act_order}
    tokens = spec.self_calib_tokens
    if tokens:
        from tq_cli.calibration.random_tokens import synthetic_calibration, synthetic_run
        from tq_cli.calibration.stream import StreamedCalibration

        folder = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="tq-synth-")))
        try:
            if spec.target_bits is None:
                run, record = synthetic_run(planned, tokens, spec.rotation.seed, folder,
                                            spec.device, comm,
                                            sampled=spec.self_calib == "sampled")
                streamed = StreamedCalibration(run, check=lambda g: g.check(planned.recipe))
                _said_ids(record, warn)
                return CalibOptions(streamed, spec.damp, spec.act_order), record | gptq
            if comm.world > 1:
                raise UnsupportedError("--target-bits under torchrun: not supported yet; run "
                                       "it in one process")
            path, record = synthetic_calibration(planned, tokens, spec.rotation.seed, folder,
                                                 spec.device, spec.self_calib == "sampled")
            _said_ids(record, warn)
        except (SourceError, UnsupportedError) as e:
            if not spec.self_calib_default or isinstance(e, CorruptFileError):
                raise
            warn(f"weight-only fit: tq could not self-calibrate this model ({e}); convert "
                 "with --calib FILE (tq calibrate) for the calibrated fit, or --fast to skip "
                 "trying")
            return None, None
        calibration = read_calibration(path)
        calibration.check_source(planned.model)
        return CalibOptions(calibration, spec.damp, spec.act_order), record | gptq
    if spec.calib is None:
        return None, None
    calibration = read_calibration(spec.calib)
    calibration.check_source(planned.model)
    record = {"file": calibration.path.name, "sha256": calibration.sha256, **gptq,
              "samples": calibration.meta.get("samples"),
              "seqlen": calibration.meta.get("seqlen"),
              "tokens": calibration.meta.get("tokens")}
    return CalibOptions(calibration, spec.damp, spec.act_order), record


def _fisher(spec: ConvertSpec, planned: PlannedSource, out: Path,
            scratch: contextlib.ExitStack, warn: Callable[[str], None]) -> OutputFisher | None:
    """The Fisher information at every converted layer's output, on FISHER_TOKENS random
    tokens (what `--target-bits` weighs each tensor's error by), or None with a note where
    the model cannot be run backwards (the widths then follow the Hessian-weighted error).
    Its block inputs (10 GB for a 70B model) go beside OUT, not to a small /tmp."""
    from tq_cli.calibration.fisher import output_fisher
    from tq_cli.calibration.random_tokens import synthetic_run

    folder = Path(scratch.enter_context(tempfile.TemporaryDirectory(
        prefix=f".{out.name}.tq-fisher-", dir=out.parent if out.parent.is_dir() else None)))
    try:
        run, _record = synthetic_run(planned, FISHER_TOKENS, spec.rotation.seed, folder,
                                     spec.device)
        return output_fisher(run, folder / "states", spec.rotation.seed)
    except CorruptFileError:
        raise
    except (TqError, RuntimeError, OSError, ValueError) as e:  # out of memory or disk too
        warn(f"--target-bits: widths by the Hessian-weighted error; tq could not measure "
             f"the Fisher information of this model ({str(e).splitlines()[0][:200]})")
        return None


def _write_rotations(plan: Plan, rotations: dict[str, Rotation], writer: ShardWriter,
                     journal: Journal, done: dict[str, dict]) -> None:
    for rid in plan.rotations:
        rot = rotations[rid]
        name = f"{ROTATION_PREFIX}{rid}"
        if name in done:
            continue
        digests = {key: writer.write(key, t) for key, t in rot.tensors().items()}
        entry = {"tensor": name, "digests": digests, "record": {"action": "rotation"}}
        journal.append(entry)
        done[name] = entry
    if plan.guard is not None and GUARD not in done:
        guard = torch.zeros(GUARD_SHAPE, dtype=torch.uint8)
        digests = {plan.guard: writer.write(plan.guard, guard)}
        entry = {"tensor": GUARD, "digests": digests, "record": {"action": "rotation"}}
        journal.append(entry)
        done[GUARD] = entry


def _unchanged_inputs(done: dict[str, dict], model: SourceModel,
                      partial: Path) -> dict[str, dict]:
    """Finished tensors whose source bytes are still those they were converted from.

    The plan hash only samples the source, so every finished input is hashed again: a
    source changed in the middle must not resume into a mix of old and new tensors.
    """
    kept: dict[str, dict] = {}
    for name, entry in done.items():
        record = entry.get("record", {})
        if record.get("action") == "rotation":
            kept[name] = entry
            continue
        info = model.tensors.get(name)
        want = record.get("source_sha256")
        if info is None or want is None:
            continue  # journaled by an older tq: convert it again
        if source_sha256(info) != want:
            raise OutputError(
                f"{info.file.name}: tensor '{name}' changed since the interrupted conversion "
                f"at {partial}; rerun without --resume to convert from the start")
        kept[name] = entry
    return kept
