"""``clipopt report``'s TensorBoard reader (needs the ``tensorboard`` package): a run's folder, its
norm, loss and lr tags (Lightning's per-layer ``grad_2.0_norm/<name>`` too) and clipopt's own tags
(``clipopt/clipped``, per-layer ``clipopt/layers/<name>/<field>``, per-group
``clipopt/group_norm/<g>`` and ``clipopt/group_coef/<g>``, the update's ``clipopt/update_norm`` and
``clipopt/update_coef``).  A folder holding several runs
(:func:`tensorboard_runs`) is never merged: one run is read, by name."""

from __future__ import annotations

import glob
import os

from .._diagnostics.layers import LAYER_FIELDS
from .._log_names import (
    BATCH_START,
    CLIPPED,
    GROUP_TAG,
    LAYERS_TAG,
    MAX_NORM,
    MICRO_BATCHES,
    PART_NUMBERS,
    RECOVERY_COLUMNS,
    RERUN_OUTCOMES,
    SKIPPED,
    UPDATE_COEF,
    UPDATE_NORM,
    column_tag,
)
from .._reasons import REASONS
from .log import LIGHTNING_LAYER as _LIGHTNING_LAYER
from .log import GradLog, Names, from_records, rerun_tag
from .names import choose, pick
from .reader import Reader

__all__ = ["TENSORBOARD", "tensorboard_runs"]

#: clipopt's TensorBoard tags read by exact name (``clipopt/<key>``), besides the norm, loss, lr and
#: the skip reasons' tags (each reason's ``tag`` in :data:`clipopt._reasons.REASONS`).
_CLIPOPT_TAGS = (MAX_NORM, CLIPPED, SKIPPED, *RECOVERY_COLUMNS, *PART_NUMBERS)


def _read_tensorboard(name: str, names: Names) -> GradLog:
    """A TensorBoard run's folder: its total-norm tag, the loss, lr and clipopt's own tags, per step."""
    scalars, hparams = _tensorboard_scalars(name)
    tags = sorted(scalars)
    # add_hparams' metrics (one point each, hparam/loss) are never picked; --loss/--norm may name them
    candidates = [t for t in tags if t not in hparams]
    norm_tag = choose("norm", tags if names.norm else candidates, names.norm, name, "scalar tag")
    if norm_tag is None:
        raise ValueError(
            f"{name} has no gradient-norm scalar; expected a tag ending in total_norm or grad_norm "
            f"(e.g. train/grad_norm, Grad/total_norm); its scalar tags: {', '.join(tags[:12]) or 'none'}; "
            "or name the tag with --norm NAME"
        )
    wanted = {
        "norm": norm_tag,
        "loss": choose("loss", tags if names.loss else candidates, names.loss, name, "scalar tag"),
        "lr": pick("lr", candidates),
        **_update_tags(candidates, norm_tag),
        **{key: column_tag(key) if column_tag(key) in scalars else None for key in _CLIPOPT_TAGS},
        **_micro_batches_tag(scalars),
        **{r.tag: r.tag if r.tag in scalars else None for r in REASONS},  # the record's key is the tag
        **{t: t if t in scalars else None for t in map(rerun_tag, RERUN_OUTCOMES)},  # a Rerun's
    }
    records: dict[int, dict[str, float]] = {}
    for key, tag in wanted.items():
        for step, value in scalars.get(tag, []) if tag is not None else []:
            records.setdefault(step, {})[key] = value
    layers, groups = _tensorboard_layers_and_groups(scalars)
    log = from_records(name, "TensorBoard", records, layers, groups)
    log.norm_column, log.loss_column = norm_tag, wanted["loss"]
    log.ignored = [t for t in tags if t not in wanted.values() and not _layer_or_group_tag(t)]
    log.has_clipping = wanted[CLIPPED] is not None
    log.update_column = wanted[UPDATE_NORM] if len(log.update_norm) else None
    return log


def _micro_batches_tag(scalars: dict[str, list[tuple[int, float]]]) -> dict[str, str]:
    """``clipopt/micro_batches`` in a Rewind's log (with ``clipopt/batch_start``): the batches each
    window used, from which the report tells the batches a rewind dropped; ``{}`` otherwise."""
    tag = column_tag(MICRO_BATCHES)
    return {MICRO_BATCHES: tag} if tag in scalars and column_tag(BATCH_START) in scalars else {}


def _update_tags(tags: list[str], norm_tag: str) -> dict[str, str | None]:
    """The update norm's and coefficient's tags (``update_clip``/``update_stats``), None where absent
    (and when ``--norm`` read the update norm as the norm)."""
    update = pick("update", tags)
    if update is None or update == norm_tag:
        return {UPDATE_NORM: None, UPDATE_COEF: None}
    return {UPDATE_NORM: update, UPDATE_COEF: pick("update_coef", tags)}


def _tensorboard_scalars(name: str) -> tuple[dict[str, list[tuple[int, float]]], set[str]]:
    """Every scalar of the run in ``name``: tag -> ``(step, value)`` events, and the tags of the folders
    below it that ``add_hparams`` wrote (its metrics, e.g. ``<time>/hparam/loss``); needs tensorboard.

    The tags of a folder below it (``add_scalars`` writes one per key, e.g. ``Loss_train``) are
    named ``<folder>/<tag>``, so that two keys of one tag are never merged."""
    try:
        from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    except ImportError:
        raise ValueError(
            f"{name} holds TensorBoard event files; reading them needs the tensorboard package: "
            "pip install 'clipopt[tensorboard]'"
        ) from None
    mux = EventMultiplexer(size_guidance={"scalars": 0})  # 0: keep every scalar
    mux.AddRunsFromDirectory(name)
    mux.Reload()
    scalars: dict[str, list[tuple[int, float]]] = {}
    hparams_runs = {r for r in mux.PluginRunToTagToContent("hparams") if r != "."}
    hparams: set[str] = set()
    for run, tags in mux.Runs().items():
        prefix = "" if run == "." else run.replace(os.sep, "/") + "/"
        for tag in tags.get("scalars", []):
            scalars.setdefault(prefix + tag, []).extend(
                (e.step, float(e.value)) for e in mux.Scalars(run, tag)
            )
            if run in hparams_runs:
                hparams.add(prefix + tag)
    return scalars, hparams


def _layer_or_group_tag(tag: str) -> bool:
    """A per-layer (clipopt's or Lightning's) or per-group (clipopt's) tag."""
    parts = tag.split("/")
    return (
        GROUP_TAG.fullmatch(tag) is not None
        or _LIGHTNING_LAYER.fullmatch(tag) is not None
        or (len(parts) >= 4 and tag.startswith(LAYERS_TAG) and parts[-1] in LAYER_FIELDS)
    )


def _tensorboard_layers_and_groups(
    scalars: dict[str, list[tuple[int, float]]],
) -> tuple[dict[str, dict[int, dict[str, float]]], dict[int, dict[str, dict[int, float]]]]:
    """Per-layer tags (clipopt's ``clipopt/layers/<name>/<field>``, Lightning's ``grad_2.0_norm/<name>``)
    as layer -> step -> field -> value, and per-group tags as group -> "norm"/"coef" -> step -> value."""
    layers: dict[str, dict[int, dict[str, float]]] = {}
    groups: dict[int, dict[str, dict[int, float]]] = {}
    for tag, events in scalars.items():
        parts = tag.split("/")
        if (m := GROUP_TAG.fullmatch(tag)) is not None:
            groups.setdefault(int(m.group(2)), {}).setdefault(m.group(1), {}).update(events)
        elif len(parts) >= 4 and tag.startswith(LAYERS_TAG) and parts[-1] in LAYER_FIELDS:
            per = layers.setdefault("/".join(parts[2:-1]), {})
            for step, value in events:
                per.setdefault(step, {})[parts[-1]] = value
        elif (m := _LIGHTNING_LAYER.fullmatch(tag)) is not None:
            per = layers.setdefault(m.group(1), {})
            for step, value in events:
                per.setdefault(step, {})["grad_norm"] = value
    return layers, groups


def _read_run(name: str, runs: list[str], names: Names, run: str | None) -> GradLog:
    """The TensorBoard run ``run`` of the folder; several runs and no ``run``: an error naming them."""
    if run is None:
        raise ValueError(
            f"{name} holds {len(runs)} TensorBoard runs ({', '.join(runs)}), which are never merged; "
            "pick one with --run NAME"
        )
    if not runs:
        raise ValueError(f"--run {run}: {name} holds no TensorBoard runs; pass the log itself without --run")
    run = os.path.normpath(run) if os.path.normpath(run) in runs else run  # exp1/, ./exp1: exp1
    if run not in runs:
        raise ValueError(f"{name} has no TensorBoard run {run!r} (--run {run}); its runs: {', '.join(runs)}")
    log = _read_tensorboard(_run_folder(name, run), names)
    log.run = run
    return log


def tensorboard_runs(path: str | os.PathLike[str]) -> list[str]:
    """The TensorBoard runs of a folder read as TensorBoard (``[]`` for a file, or a folder read as a
    trainer_state.json or metrics.csv), sorted, as paths relative to it (``"."``: the folder itself).

    A run is a folder holding event files none of whose parents (up to ``path``) holds any, as
    SummaryWriter's ``runs/<run>/`` and Lightning's ``version_<n>/``; a folder below a run (written by
    ``add_scalars``, one per key) belongs to that run."""
    name = os.fspath(path)
    if not os.path.isdir(name) or any(
        os.path.isfile(os.path.join(name, c)) for c in ("trainer_state.json", "metrics.csv")
    ):
        return []
    events = glob.glob(os.path.join(glob.escape(name), "**", "events.out.tfevents*"), recursive=True)
    folders = {os.path.relpath(os.path.dirname(e), name) for e in events}
    return sorted(f for f in folders if not any(p in folders for p in _parents(f)))


def _run_folder(name: str, run: str) -> str:
    """The folder of the run ``run`` (:func:`tensorboard_runs`) of the folder ``name``."""
    return name if run == "." else os.path.join(name, run)


def _parents(folder: str) -> list[str]:
    """The parent folders of a relative path, ``"."`` included (none for ``"."``)."""
    if folder == ".":
        return []
    parts = folder.split(os.sep)
    return [".", *(os.sep.join(parts[:k]) for k in range(1, len(parts)))]


def _read(path: str, names: Names, run: str | None) -> GradLog:
    """An event file's run folder, or a folder: the run ``run``, or its one run (``log.path``: the folder)."""
    if not os.path.isdir(path):  # an event file (run is None: read_log refuses --run for a file)
        return _read_tensorboard(os.path.dirname(path) or ".", names)
    runs = tensorboard_runs(path)
    if run is not None or len(runs) > 1:
        return _read_run(path, runs, names, run)
    # one run: the folder itself or one below it (runs/<run>/, lightning_logs/version_0/)
    log = _read_tensorboard(_run_folder(path, runs[0]), names)
    log.path = path
    return log


def _runs_in(folder: str, run: str | None) -> str | None:
    """The folder itself when it holds TensorBoard runs (:func:`tensorboard_runs`) or ``--run`` names one."""
    return folder if run is not None or tensorboard_runs(folder) else None


#: An event file (by its name), or a folder of runs; ``--run`` is this reader's alone.
TENSORBOARD = Reader(
    name="TensorBoard",
    reads="a TensorBoard run's folder (event files), or a folder of runs read one at a time (--run)",
    claims_file=lambda path, head: os.path.basename(path).startswith("events.out.tfevents"),
    find=_runs_in,
    read=_read,
)
