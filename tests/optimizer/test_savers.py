"""Resume through savers that keep only ``state`` and ``param_groups`` of an optimizer's state dict (#33).

torch's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` (and ``dcp.save``/``dcp.load``),
torchtitan's ``OptimizersContainer`` and Composer's ``Trainer`` drop every other top-level key; the
wrapper's entry rides in the first parameter group too (``_checkpoint.with_entry``).  Each resume is
compared bit for bit with a run that never stopped: both sides run the same kernels in the same order,
so equality is exact by construction.  Without the group's copy the resumed runs count 3 of 6 updates
(Composer) and 6 of 12 (torchtitan), as issue #33 measured.
"""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from clipopt import ClippedOptimizer, ZClip

from .. import saver_jobs
from ..helpers import spawn_job
from ..markers import needs_gloo

REPO = Path(__file__).resolve().parents[2]
N_BATCHES = 12
#: How .ci/run installs torchtitan (its own requirements are a data and logging stack the tests do not use).
TORCHTITAN = "pip install --no-deps torchtitan==0.3.0, then pip install tyro spmd_types==0.2.3"
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def make_batches(n: int) -> Batches:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def wrap(inner: torch.optim.Optimizer, acc: int) -> ClippedOptimizer:
    return ClippedOptimizer(inner, max_norm=ZClip(warmup_steps=2), accumulation_steps=acc)


def adamw(model: nn.Module, acc: int) -> ClippedOptimizer:
    return wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), acc)


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: Batches) -> None:
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def outcome(model: nn.Module, opt: ClippedOptimizer) -> dict[str, Any]:
    """What must match an uninterrupted run: counters, parameters, the inner and the policy state."""
    sd = opt.state_dict()
    return {
        "counters": (opt.num_updates, opt.num_skipped, opt.num_windows, opt.micro_batches),
        "params": [p.detach().clone() for p in model.parameters()],
        "inner": sd["state"],
        "policy": sd["clipopt"]["policy"],
        "zclip": [(float(s.total_norm), _float(s.max_norm)) for s in list(opt.stats)[-2:]],
    }


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["counters"] == want["counters"]
    assert got["zclip"] == want["zclip"]  # norms and ZClip's thresholds of the last windows
    for a, b in zip(got["params"], want["params"], strict=True):
        assert torch.equal(a, b)
    for key in ("inner", "policy"):
        _assert_tree_equal(got[key], want[key], key)


def _assert_tree_equal(a: Any, b: Any, path: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _assert_tree_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_tree_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def through_file(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def reference(acc: int) -> dict[str, Any]:
    model = make_model(0)
    opt = adamw(model, acc)
    train(model, opt, make_batches(N_BATCHES))
    return outcome(model, opt)


# ------------------------------------------------------------------ torch's distributed-checkpoint helpers


@pytest.mark.parametrize(
    ("flatten", "acc", "stop"),
    [
        pytest.param(False, 2, 6, id="boundary"),
        pytest.param(False, 2, 5, id="mid-window"),
        pytest.param(True, 1, 6, id="flattened"),
    ],
)
def test_get_and_set_optimizer_state_dict_resume_bit_identically(flatten: bool, acc: int, stop: int) -> None:
    """``get_optimizer_state_dict`` keeps only state and param_groups; saved with ``torch.save`` and read
    back with ``weights_only=True``, the resume equals the uninterrupted run (counters, ZClip, state)."""
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    batches = make_batches(N_BATCHES)
    model = make_model(0)
    opt = adamw(model, acc)
    train(model, opt, batches[:stop])
    saved = get_optimizer_state_dict(model, opt, options=options)
    assert "clipopt" not in saved  # the saver drops the top-level entry
    ckpt = through_file({"model": model.state_dict(), "optim": saved})

    model2 = make_model(1)
    opt2 = adamw(model2, acc)
    model2.load_state_dict(ckpt["model"])
    set_optimizer_state_dict(model2, opt2, ckpt["optim"], options=options)
    assert opt2.param_groups[0]["clipopt"] is None  # the live group keeps the slot, not the entry
    train(model2, opt2, batches[stop:])
    assert_same(outcome(model2, opt2), reference(acc))


def test_dcp_save_and_load_resume_bit_identically(tmp_path: Path) -> None:
    """Through files written by ``dcp.save`` and read by ``dcp.load`` into a fresh optimizer's state
    dict (the template: the loader takes the keys it lists, so its entry must have the saved one's
    layout -- with ``accumulation_steps=1`` both are an entry at a window boundary)."""
    batches = make_batches(N_BATCHES)
    model = make_model(0)
    opt = adamw(model, 1)
    train(model, opt, batches[:6])
    saved = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(saved, checkpoint_id=tmp_path)

    model2 = make_model(1)
    opt2 = adamw(model2, 1)
    state = {"model": model2.state_dict(), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(state, checkpoint_id=tmp_path)
    model2.load_state_dict(state["model"])
    set_optimizer_state_dict(model2, opt2, state["optim"])
    train(model2, opt2, batches[6:])
    assert_same(outcome(model2, opt2), reference(1))


def test_dcp_load_into_a_template_of_another_layout_fails_loudly(tmp_path: Path) -> None:
    """With ``accumulation_steps=2`` the fresh optimizer's template is mid-window (the helpers' zero-lr
    step opened a window), the saved entry is not: ``dcp.load`` names the key instead of resuming
    wrongly (docs/limitations.md)."""
    model = make_model(0)
    opt = adamw(model, 2)
    train(model, opt, make_batches(6))
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=tmp_path)
    model2 = make_model(1)
    state = {"optim": get_optimizer_state_dict(model2, adamw(model2, 2))}
    missing = r"Missing key in checkpoint state_dict: optim\.param_groups\.0\.clipopt\."
    with pytest.raises(CheckpointException, match=missing):
        dcp.load(state, checkpoint_id=tmp_path)


# ------------------------------------------------------------------------- the entry and its group copy


def _trained(acc: int = 2, stop: int = 5) -> tuple[nn.Module, ClippedOptimizer]:
    model = make_model(0)
    opt = adamw(model, acc)
    train(model, opt, make_batches(stop))
    return model, opt


def test_the_group_copy_is_the_entry_itself_also_in_the_file() -> None:
    """One object under two keys: ``torch.save`` writes it once, ``weights_only=True`` reads it back."""
    sd = _trained()[1].state_dict()
    assert sd["param_groups"][0]["clipopt"] is sd["clipopt"]
    back = through_file(sd)
    assert back["param_groups"][0]["clipopt"] is back["clipopt"]
    once, twice = io.BytesIO(), io.BytesIO()
    torch.save(sd, once)
    first, *rest = sd["param_groups"]
    torch.save({**sd, "param_groups": [{**first, "clipopt": through_file(sd["clipopt"])}, *rest]}, twice)
    assert once.getbuffer().nbytes < twice.getbuffer().nbytes  # a separate copy would be written again


@pytest.mark.parametrize("keep", ["top", "group"])
def test_either_copy_alone_resumes(keep: str) -> None:
    """A state dict with only the top-level entry (older ones) or only the group's (a saver's) resumes."""
    batches = make_batches(N_BATCHES)
    model, opt = _trained(2, 5)
    sd = through_file(opt.state_dict())
    if keep == "top":
        del sd["param_groups"][0]["clipopt"]
    else:
        del sd["clipopt"]
    model2 = make_model(1)
    model2.load_state_dict(model.state_dict())
    opt2 = adamw(model2, 2)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["clipopt"] is None
    train(model2, opt2, batches[5:])
    assert_same(outcome(model2, opt2), reference(2))


def test_without_either_copy_the_counters_start_afresh() -> None:
    """Control: with both copies removed the state dict is a plain optimizer's (fresh counters)."""
    _, opt = _trained(2, 6)
    sd = opt.state_dict()
    del sd["clipopt"]
    sd["param_groups"][0] = {k: v for k, v in sd["param_groups"][0].items() if k != "clipopt"}
    opt2 = adamw(make_model(1), 2)
    opt2.load_state_dict(sd)
    assert (opt2.num_updates, opt2.num_windows) == (0, 0)
    assert opt2.param_groups[0]["clipopt"] is None  # the slot is kept for the next save


def test_the_top_level_entry_wins_over_the_group_copy() -> None:
    """Where both are present and differ, the top-level entry is read (as before the group copy)."""
    _, opt = _trained(2, 6)
    _, other = _trained(2, 2)
    sd = opt.state_dict()
    sd["param_groups"][0]["clipopt"] = other.state_dict()["clipopt"]
    opt2 = adamw(make_model(1), 2)
    opt2.load_state_dict(sd)
    assert (opt2.num_updates, opt2.num_windows) == (3, 3)


def test_a_corrupt_group_copy_is_refused_like_a_corrupt_entry() -> None:
    """The group's copy is checked as the top-level entry is: a ValueError, nothing changed."""
    _, opt = _trained(2, 6)
    sd = opt.state_dict()
    del sd["clipopt"]
    sd["param_groups"][0]["clipopt"] = [1, 2]
    opt2 = adamw(make_model(1), 2)
    with pytest.raises(ValueError, match="'clipopt' must be a dict, got list"):
        opt2.load_state_dict(sd)
    assert (opt2.num_windows, opt2.param_groups[0]["clipopt"]) == (0, None)


def test_a_plain_optimizer_loads_the_state_dict_and_steps_as_the_inner_one() -> None:
    """A plain AdamW loads the wrapper's state dict (its first group then holds the entry, unused):
    its next update equals the inner optimizer's."""
    batches = make_batches(8)
    model, opt = _trained(1, 6)
    plain_model = make_model(1)
    plain_model.load_state_dict(model.state_dict())
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    plain.load_state_dict(through_file(opt.state_dict()))
    plain.param_groups[0].pop("clipopt")
    opt.max_norm = None  # the wrapper's step is then the inner step alone
    train(model, opt, batches[6:])
    train(plain_model, plain, batches[6:])
    for a, b in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_optimizer_with_its_own_state_dict_gets_no_slot() -> None:
    """Only an optimizer whose state dict is torch's gets the slot in its live group."""

    class OwnLayout(torch.optim.SGD):
        def state_dict(self) -> dict[str, Any]:
            return {"own": super().state_dict()}

    model = make_model(0)
    opt = ClippedOptimizer(OwnLayout(model.parameters(), lr=0.1))
    assert "clipopt" not in opt.param_groups[0]
    assert ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)).param_groups[0]["clipopt"] is None


# --------------------------------------------------------------------------- torchtitan's container


def _titan_container(model: nn.Module, acc: int) -> Any:
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    class ClippedContainer(OptimizersContainer):  # torchtitan builds each optimizer by its name
        @staticmethod
        def _resolve_optimizer_factory(name: str) -> Any:
            base = OptimizersContainer._resolve_optimizer_factory(name)
            return lambda groups, **kwargs: wrap(base(groups, **kwargs), acc)

    no_decay = {"lr": 1e-2, "weight_decay": 0.0}
    groups = [  # two groups: the entry rides in the first only
        ParamGroupConfig(pattern="bias", optimizer_name="AdamW", optimizer_kwargs=no_decay),
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2}),
    ]
    config = OptimizersContainer.Config(param_groups=groups, implementation="for-loop")
    return ClippedContainer(config, model_parts=[model])


def _titan_reference() -> dict[str, Any]:
    model = make_model(0)
    container = _titan_container(model, 1)
    train(model, container, make_batches(N_BATCHES))
    return outcome(model, container.optimizers[0])


@pytest.mark.parametrize("medium", ["memory", "dcp"])
def test_torchtitan_container_resumes_bit_identically(medium: str, tmp_path: Path) -> None:
    """torchtitan's ``OptimizersContainer`` flattens the state dict per parameter name and restores only
    the group keys the live optimizer has; in memory and through ``dcp.save``/``dcp.load`` (as its
    checkpointer does, the container as a ``Stateful``) the resume equals the uninterrupted run."""
    pytest.importorskip("torchtitan", reason=TORCHTITAN)
    batches = make_batches(N_BATCHES)
    model = make_model(0)
    container = _titan_container(model, 1)
    train(model, container, batches[:6])

    model2 = make_model(1)
    container2 = _titan_container(model2, 1)
    if medium == "memory":
        saved = through_file(container.state_dict())
        assert not any(k.endswith("clipopt") and v for k, v in saved.items() if k.startswith("state."))
        model2.load_state_dict(model.state_dict())
        container2.load_state_dict(saved)
    else:
        dcp.save({"model": model.state_dict(), "optimizer": container}, checkpoint_id=tmp_path)
        model_sd = model2.state_dict()
        dcp.load({"model": model_sd, "optimizer": container2}, checkpoint_id=tmp_path)
        model2.load_state_dict(model_sd)
    train(model2, container2, batches[6:])
    assert_same(outcome(model2, container2.optimizers[0]), _titan_reference())


# ------------------------------------------------------------------------------ Composer's Trainer


@pytest.mark.skipif(
    importlib.util.find_spec("composer") is None,
    reason="mosaicml (Composer) 0.32.1 requires torch<2.7.1, so it is not in the test extra; "
    "install it beside torch 2.13 with: pip install --no-deps mosaicml==0.32.1 torchvision==0.28.0 "
    "torch_optimizer==0.3.0 coolname mosaicml-cli",
)
@pytest.mark.parametrize("acc", [1, 2])
def test_composer_trainer_resumes_bit_identically(acc: int, tmp_path: Path) -> None:
    """Composer's Trainer saves at batch 3 (mid-window with ``acc=2``) and a second Trainer resumes
    from that file to batch 6: equal to a Trainer that ran 6 batches (a separate process: Composer's
    import of torchvision needs a workaround on a CPU build of torch)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    job = [sys.executable, "-m", "tests.optimizer.composer_job", str(tmp_path), str(acc)]
    done = subprocess.run(job, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = torch.load(tmp_path / "outcome.pt", weights_only=True)
    assert runs["resumed"]["counters"] == (6 // acc, 0, 6 // acc, 6 % acc)
    assert_same(runs["resumed"], runs["uninterrupted"])


# ----------------------------------------------------------------------------- FSDP2 through the helpers


@needs_gloo
def test_fsdp2_resume_through_the_helpers_keeps_each_ranks_rewind_copies(tmp_path: Path) -> None:
    """FSDP2, 2 ranks, SpikeGuard and Rewind (``fsdp_jobs``): stopped between two spikes, saved by
    ``get_optimizer_state_dict`` (each rank its own shards of the copies), loaded by
    ``set_optimizer_state_dict``: the rewind after the resume and the end of the run equal the run that
    never stopped, bit for bit, on every rank."""
    for run in spawn_job(saver_jobs.fsdp_saver_job, "savers", tmp_path, 2, pass_world=True):
        assert not run["top_level_kept"]
        full, resumed = run["full"], run["resumed"]
        assert resumed["used"] == full["used"]
        assert full["log"] and resumed["log"] == full["log"]  # the same rewind, to the same copy
        _assert_tree_equal(resumed["last"], full["last"], "last")
