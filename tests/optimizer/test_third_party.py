"""A third-party Optimizer subclass works like the torch ones."""

from __future__ import annotations

import copy
import io
import pickle
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from clipopt import ClippedOptimizer

from ..helpers import batches_for, mlp, mse
from ..helpers import train as helpers_train
from ..window.test_skip import assert_identical


class SignMomentum(torch.optim.Optimizer):
    """A small third-party optimizer: momentum on the sign of the gradient, with lazy state."""

    def __init__(self, params: Any, lr: float = 0.01, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                    state["k"] = 0
                state["m"].mul_(group["beta"]).add_(p.grad.sign(), alpha=1 - group["beta"])
                state["k"] += 1
                p.add_(state["m"], alpha=-group["lr"])
        return loss


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, generator=gen) for _ in range(6)]


def _reference_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()


def test_third_party_optimizer_clips_and_steps_like_torch() -> None:
    """Wrapping a custom Optimizer subclass equals clip_grad_norm_ + its own step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ref_model = copy.deepcopy(model)
    opt = ClippedOptimizer(SignMomentum(model.parameters()), max_norm=0.5)
    ref = SignMomentum(ref_model.parameters())
    for x in _batches():
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        _reference_step(ref_model, ref, x)
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt.state is opt.optimizer.state


def test_third_party_optimizer_skip_leaves_state_alone() -> None:
    """A NaN window leaves the custom optimizer's tensors and Python counters untouched."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = ClippedOptimizer(SignMomentum(model.parameters()), max_norm=0.5)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
    before = copy.deepcopy(opt.optimizer.state_dict())
    params = [p.detach().clone() for p in model.parameters()]
    model(torch.full((2, 3), float("nan"))).sum().backward()
    opt.step()
    assert opt.step_was_skipped
    after = opt.optimizer.state_dict()
    for key, st in before["state"].items():
        assert torch.equal(st["m"], after["state"][key]["m"])
        assert st["k"] == after["state"][key]["k"] == 1
    for a, b in zip(params, model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_third_party_state_dict_round_trip() -> None:
    """The wrapper's state dict of a custom optimizer loads into a fresh wrapper and continues identically."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = ClippedOptimizer(SignMomentum(model.parameters()), max_norm=0.5, accumulation_steps=2)
    batches = _batches()
    for x in batches[:3]:
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    sd = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = ClippedOptimizer(SignMomentum(model2.parameters()), max_norm=0.5, accumulation_steps=2)
    opt2.load_state_dict(sd)
    for x in batches[3:]:
        for m, o in ((model, opt), (model2, opt2)):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------ the inner optimizer's own methods (schedule-free, ZeRO)

MAX_NORM = 0.05  # below the gradient norms of these runs: every window is clipped


def _schedule_free(name: str, params: Any) -> torch.optim.Optimizer:
    """A real schedule-free optimizer: the ``schedulefree`` package's or pytorch_optimizer's."""
    import pytorch_optimizer
    import schedulefree

    makers: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
        "schedulefree.AdamWScheduleFree": lambda ps: schedulefree.AdamWScheduleFree(ps, lr=0.05),
        "schedulefree.SGDScheduleFree": lambda ps: schedulefree.SGDScheduleFree(ps, lr=0.05),
        "pytorch_optimizer.ScheduleFreeAdamW": lambda ps: pytorch_optimizer.ScheduleFreeAdamW(ps, lr=0.05),
        "pytorch_optimizer.ScheduleFreeWrapper": lambda ps: pytorch_optimizer.ScheduleFreeWrapper(
            torch.optim.SGD(ps, lr=0.05), momentum=0.9
        ),
    }
    return makers[name](params)


SCHEDULE_FREE = [
    "schedulefree.AdamWScheduleFree",
    "schedulefree.SGDScheduleFree",
    "pytorch_optimizer.ScheduleFreeAdamW",
    "pytorch_optimizer.ScheduleFreeWrapper",
]


def _schedule_free_run(name: str, wrapped: bool) -> list[list[torch.Tensor]]:
    """Windows of 2 micro-batches (gradients summed), ``eval()``/``train()`` around an evaluation
    after every micro-batch -- mid-window too -- as schedulefree's README asks; through the wrapper
    (``wrapped``) or as plain torch (accumulate, ``clip_grad_norm_``, step).  Returns the
    parameters every evaluation saw."""
    model = mlp((5, 4, 3))
    inner = _schedule_free(name, model.parameters())
    opt: Any = ClippedOptimizer(inner, MAX_NORM, accumulation_steps=2, reduction="sum") if wrapped else inner
    evaluated = []
    for i, batch in enumerate(batches_for(8, seed=3)):
        opt.train()
        mse(model, batch).backward()
        if wrapped:
            opt.step()
        elif i % 2 == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
        if wrapped or i % 2 == 1:
            opt.zero_grad()
        opt.eval()
        evaluated.append([p.detach().clone() for p in model.parameters()])
    return evaluated


@pytest.mark.parametrize("name", SCHEDULE_FREE)
def test_schedule_free_train_and_eval_work_on_the_wrapper(name: str) -> None:
    """#22 item 7: ``opt.train()``/``opt.eval()`` raised AttributeError on the wrapper.  Now they reach
    the inner schedule-free optimizer: with eval()/train() around every evaluation (inside an open
    window too) the run equals plain accumulation + clip_grad_norm_ + step, bit for bit, in both the
    training and the evaluation weights; the window's gradients survive the swap."""
    seen = _schedule_free_run(name, wrapped=True)
    ref_seen = _schedule_free_run(name, wrapped=False)
    assert len(seen) == len(ref_seen) == 8
    for got, want in zip(seen, ref_seen, strict=True):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    assert seen[0][0].ne(seen[-1][0]).any()  # it trained


def test_forwarded_names_hasattr_dir_and_the_wrappers_own() -> None:
    """What the forwarding answers: ``hasattr``/``dir`` see the inner optimizer's public names (so
    Trainer/Accelerate, which call ``optimizer.train()`` when it exists, find it); private names are
    never read through (GradScaler must not see a fused inner's ``_step_supports_amp_scaling``);
    the wrapper's own attributes win (pytorch_optimizer's Lookahead has its own ``optimizer`` and
    ``state_dict``); public non-method attributes are read (Lookahead's ``k``)."""
    from pytorch_optimizer import Lookahead

    model = mlp((5, 4, 3))
    plain = ClippedOptimizer(torch.optim.AdamW(model.parameters(), fused=True))
    assert plain.optimizer._step_supports_amp_scaling  # type: ignore[attr-defined]
    assert not hasattr(plain, "_step_supports_amp_scaling")
    assert not hasattr(plain, "train") and "train" not in dir(plain)
    with pytest.raises(
        AttributeError,
        match=re.escape("'ClippedOptimizer' object has no attribute 'train' (nor has its inner AdamW)"),
    ):
        plain.train  # type: ignore[attr-defined]  # noqa: B018

    sf = ClippedOptimizer(_schedule_free("schedulefree.AdamWScheduleFree", model.parameters()))
    assert (
        hasattr(sf, "train") and hasattr(sf, "eval") and {"train", "eval", "step", "max_norm"} <= set(dir(sf))
    )

    inner = Lookahead(torch.optim.SGD(model.parameters(), lr=0.1), k=3)
    look = ClippedOptimizer(inner)
    assert look.optimizer is inner  # the wrapper's, not Lookahead's base optimizer
    assert look.k == 3  # type: ignore[attr-defined]
    assert look.backup_and_load_cache.__self__ is inner  # type: ignore[attr-defined]
    assert type(look).state_dict is ClippedOptimizer.state_dict
    assert "clipopt" in look.state_dict()


def test_assigning_a_forwarded_name_is_refused() -> None:
    """``opt.k = 10`` on a wrapper that reads ``k`` from its inner Lookahead would have set a second
    ``k`` on the wrapper, hiding the one the inner optimizer uses; it is refused with the fix.  The
    wrapper's own attributes and new names are still assigned as usual."""
    from pytorch_optimizer import Lookahead

    model = mlp((5, 4, 3))
    look = ClippedOptimizer(Lookahead(torch.optim.SGD(model.parameters(), lr=0.1), k=3))
    message = (
        "cannot set 'k' on the ClippedOptimizer: it is the inner Lookahead's attribute, read through "
        "the wrapper; set it there: opt.optimizer.k = ..."
    )
    with pytest.raises(AttributeError, match=re.escape(message)):
        look.k = 10  # type: ignore[attr-defined]
    assert look.optimizer.k == 3  # type: ignore[attr-defined]
    look.optimizer.k = 4  # type: ignore[attr-defined]
    assert look.k == 4  # type: ignore[attr-defined]
    look.clip_value = 1.0
    look.note = "mine"  # type: ignore[attr-defined]
    assert look.note == "mine" and look.clip_value == 1.0  # type: ignore[attr-defined]


def test_an_attribute_error_inside_a_property_is_not_renamed() -> None:
    """A property that raises AttributeError inside (a bug in it, a half-restored object) made Python
    ask ``__getattr__``, which answered "no attribute '<the property>'", hiding the real error: for a
    property of the inner optimizer ("... (nor has its inner ...)") and for one of a subclass of the
    wrapper.  Now the property's own error comes through, as it does without the wrapper."""

    class Inner(torch.optim.SGD):
        @property
        def momentum_norm(self) -> float:
            return self.momentum_buffers  # type: ignore[attr-defined, no-any-return]

    class Mine(ClippedOptimizer):
        @property
        def inner_lr(self) -> float:
            return self.optimizer.learning_rate  # type: ignore[attr-defined, no-any-return]

    model = mlp((5, 4, 3))
    opt = Mine(Inner(model.parameters(), lr=0.1), MAX_NORM)
    with pytest.raises(AttributeError, match=re.escape("'Inner' object has no attribute 'momentum_buffers'")):
        opt.momentum_norm  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(AttributeError, match=re.escape("'Inner' object has no attribute 'learning_rate'")):
        opt.inner_lr  # noqa: B018
    assert not hasattr(opt, "momentum_buffers")


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_forward_to_their_own_inner_optimizer(how: str) -> None:
    """A deep copy or an unpickled copy (``__getattr__`` runs before its ``__dict__`` is filled:
    no recursion) forwards ``train()``/``eval()`` to its own inner optimizer, not the original's."""
    model = mlp((5, 4, 3))
    opt = ClippedOptimizer(_schedule_free("schedulefree.AdamWScheduleFree", model.parameters()), MAX_NORM)
    opt.train()
    helpers_train(model, opt, batches_for(3, seed=1), mse)
    pair = (model, opt)
    new_model, new = copy.deepcopy(pair) if how == "deepcopy" else pickle.loads(pickle.dumps(pair))
    new.eval()
    assert new.param_groups[0]["train_mode"] is False
    assert opt.param_groups[0]["train_mode"] is True
    assert not torch.equal(next(new_model.parameters()), next(model.parameters()))  # the copy swapped
    opt.eval()
    for a, b in zip(model.parameters(), new_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_zero_redundancy_consolidate_state_dict_through_the_wrapper() -> None:
    """#22 item 7: ``opt.consolidate_state_dict()`` of a ZeroRedundancyOptimizer raised AttributeError
    on the wrapper.  Now it reaches ZeRO (a 1-process gloo group), the wrapper's state dict is then
    taken, and a fresh model + wrapper loading it trains on bit-identically."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def make(model: torch.nn.Module) -> ClippedOptimizer:
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.05)
        return ClippedOptimizer(zero, MAX_NORM, accumulation_steps=2)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = mlp((5, 4, 3))
        opt = make(model)
        data = batches_for(8, seed=4)
        helpers_train(model, opt, data[:4], mse)
        opt.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
        sd = copy.deepcopy(opt.state_dict())
        model2 = copy.deepcopy(model)
        opt2 = make(model2)
        opt2.load_state_dict(sd)
        helpers_train(model, opt, data[4:], mse)
        helpers_train(model2, opt2, data[4:], mse)
    finally:
        dist.destroy_process_group()
    assert opt.num_updates == opt2.num_updates == 4
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_zero_redundancy_refuses_a_dict_without_torchs_keys_as_such() -> None:
    """A model's state dict handed to a wrapped ZeroRedundancyOptimizer by mistake (ZeRO overrides
    ``load_state_dict``, so it was taken for a layout of its own) raised ZeRO's "Optimizer state has not
    been consolidated ... call consolidate_state_dict" from the backup taken before loading: a fix that
    does not apply.  torch's own classes use torch's layout: the dict is refused as not an optimizer's,
    and nothing changed."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = mlp((5, 4, 3))
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.05)
        opt = ClippedOptimizer(zero, MAX_NORM)
        helpers_train(model, opt, batches_for(2, seed=4), mse)
        before = copy.deepcopy(opt.optimizer.optim.state_dict())  # type: ignore[attr-defined]
        message = (
            "invalid state_dict: 'state' must be a dict, got NoneType; "
            "pass the dict returned by opt.state_dict()"
        )
        for wrong in (model.state_dict(), {}):
            with pytest.raises(ValueError, match=re.escape(message)):
                opt.load_state_dict(wrong)
        assert_identical(opt.optimizer.optim.state_dict(), before)  # type: ignore[attr-defined]
        assert opt.num_updates == 2
    finally:
        dist.destroy_process_group()


# ------------------------------------------------ inner state dicts in a layout of their own (#22 item 8)


def _layered(name: str, params: Any) -> torch.optim.Optimizer:
    """An inner optimizer whose state dict is not torch's layout (pytorch_optimizer's Lookahead,
    ScheduleFreeWrapper), or schedulefree's AdamW (torch's layout, extra group keys)."""
    import pytorch_optimizer

    if name == "Lookahead":
        return pytorch_optimizer.Lookahead(torch.optim.AdamW(params, lr=0.05), k=3, pullback_momentum="none")
    if name == "ScheduleFreeWrapper":
        return _schedule_free("pytorch_optimizer.ScheduleFreeWrapper", params)
    return _schedule_free("schedulefree.AdamWScheduleFree", params)


LAYERED = ["Lookahead", "ScheduleFreeWrapper", "AdamWScheduleFree"]


def _resumable_run(
    name: str, model: torch.nn.Module, opt: ClippedOptimizer, batches: list[Any], *, start: bool
) -> None:
    """Micro-batches with ``train()`` first and ``eval()`` last where the inner optimizer has them
    (schedule-free: evaluate and save in eval mode, as its README says)."""
    if hasattr(opt, "train"):
        opt.train()
    helpers_train(model, opt, batches, mse)
    if hasattr(opt, "eval") and start:
        opt.eval()


@pytest.mark.parametrize("name", LAYERED)
def test_state_dict_of_another_layout_resumes_bit_identically(name: str) -> None:
    """#22 item 8: Lookahead and ScheduleFreeWrapper save ``lookahead_state``/``schedulefree_state``
    and ``base_optimizer``, not ``state``/``param_groups``; ``opt.load_state_dict(opt.state_dict())``
    failed ("'state' must be a dict").  Now 5 micro-batches (mid-window: 2 per window), a checkpoint
    through torch.save/torch.load(weights_only=True), a fresh model and optimizer loading it and 5
    more micro-batches equal 10 in one go, bit for bit: parameters and the whole inner state dict."""

    def make(model: torch.nn.Module) -> ClippedOptimizer:
        return ClippedOptimizer(_layered(name, model.parameters()), MAX_NORM, accumulation_steps=2)

    data = batches_for(10, seed=5)
    model = mlp((5, 4, 3))
    opt = make(model)
    _resumable_run(name, model, opt, data[:5], start=True)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _resumable_run(name, model, opt, data[5:], start=False)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = mlp((5, 4, 3), seed=1)
    resumed.load_state_dict(ckpt["model"])
    opt2 = make(resumed)
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.micro_batches == 1 and opt2.num_updates == 2
    _resumable_run(name, resumed, opt2, data[5:], start=False)

    assert opt2.num_updates == opt.num_updates == 5
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert_identical(opt2.optimizer.state_dict(), opt.optimizer.state_dict())


def _lookahead_checkpoint() -> tuple[dict[str, Any], Callable[..., ClippedOptimizer]]:
    """A Lookahead checkpoint after 2 applied windows, and a factory of fresh wrappers for it."""

    def make(model: torch.nn.Module, **kw: Any) -> ClippedOptimizer:
        return ClippedOptimizer(_layered("Lookahead", model.parameters()), MAX_NORM, **kw)

    model = mlp((5, 4, 3))
    opt = make(model)
    helpers_train(model, opt, batches_for(2, seed=6), mse)
    return copy.deepcopy(opt.state_dict()), make


REFUSED_LAYOUTS = [
    pytest.param(
        lambda: mlp((5, 4, 3), bias=False),
        "invalid state_dict: the inner Lookahead rejected it (lookahead state does not match the "
        "current parameters); pass the dict returned by opt.state_dict()",
        id="inner-refuses",
    ),
    pytest.param(
        lambda: mlp((5, 6, 3)),
        "invalid state_dict: state[0]['slow_params'] has shape (4, 5), parameter has (6, 5); "
        "pass the dict returned by opt.state_dict()",
        id="loaded-shapes-checked",
    ),
]


@pytest.mark.parametrize(("other_model", "message"), REFUSED_LAYOUTS)
def test_state_dict_of_another_layout_that_does_not_fit_is_refused_untouched(
    other_model: Callable[[], torch.nn.Module], message: str
) -> None:
    """A Lookahead checkpoint of another model: the inner optimizer refuses one of other parameter
    count itself; one of other shapes, which Lookahead and torch load without a word, is refused by
    the wrapper's check of the state the inner optimizer then holds (``opt.state``).  Either way the
    wrapper, its Lookahead and the base optimizer are left as they were."""
    sd, make = _lookahead_checkpoint()
    other = other_model()
    opt = make(other)
    helpers_train(other, opt, batches_for(1, seed=7), mse)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.load_state_dict(sd)
    assert_identical(opt.state_dict(), before)


def _corrupt_exp_avg(sd: dict[str, Any]) -> None:
    sd["base_optimizer"]["state"][0]["exp_avg"] = torch.zeros(7)


def _corrupt_lr(sd: dict[str, Any]) -> None:
    sd["base_optimizer"]["param_groups"][0]["lr"] = "0.05"


_SHAPE_MESSAGE = (
    "invalid state_dict: state[0]['exp_avg'] has shape (7,), parameter has (4, 5); "
    "pass the dict returned by opt.state_dict()"
)
_KIND_MESSAGE = (
    "invalid state_dict: parameter group 0 has lr='0.05' (str), but the optimizer's lr is a number "
    "(or a tensor) (now 0.05); pass the dict returned by opt.state_dict()"
)
CORRUPT_BASES = [  # the ScheduleFreeWrapper's base (plain SGD) holds no state
    pytest.param("Lookahead", _corrupt_exp_avg, _SHAPE_MESSAGE, id="Lookahead-base-state-shape"),
    pytest.param("Lookahead", _corrupt_lr, _KIND_MESSAGE, id="Lookahead-base-group-kind"),
    pytest.param("ScheduleFreeWrapper", _corrupt_lr, _KIND_MESSAGE, id="ScheduleFreeWrapper-base-group-kind"),
]


@pytest.mark.parametrize(("name", "corrupt", "message"), CORRUPT_BASES)
def test_state_dict_of_another_layout_checks_the_base_optimizers_state(
    name: str, corrupt: Callable[[dict[str, Any]], None], message: str
) -> None:
    """The base optimizer's part of a Lookahead/ScheduleFreeWrapper checkpoint (``base_optimizer``, in
    torch's layout) with an ``exp_avg`` of another shape or a string ``lr`` was loaded without a word
    (only the outer optimizer's own state was checked): the good state was gone and the next step
    failed.  Now it is refused as a torch-layout entry is, and the state held before is put back."""
    model = mlp((5, 4, 3))
    opt = ClippedOptimizer(_layered(name, model.parameters()), MAX_NORM)
    _resumable_run(name, model, opt, batches_for(2, seed=6), start=True)
    bad = copy.deepcopy(opt.state_dict())
    corrupt(bad)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.load_state_dict(bad)
    assert_identical(opt.state_dict(), before)


def test_group_options_of_another_layout_are_checked_once_visible() -> None:
    """The wrapper's per-group checks apply where the groups are visible: a Lookahead checkpoint whose
    base group carries ``max_norm=-1`` is refused with the constructor's message once the inner
    optimizer has loaded it, and everything is put back; a group's own ``max_norm`` set now and absent
    from the checkpoint is kept after loading, as for torch's layout."""
    sd, make = _lookahead_checkpoint()
    bad = copy.deepcopy(sd)
    bad["base_optimizer"]["param_groups"][0]["max_norm"] = -1.0
    model = mlp((5, 4, 3))
    opt = make(model)
    before = copy.deepcopy(opt.state_dict())
    message = (
        "invalid state_dict: parameter group 0: 'max_norm' must be a positive finite number or None, got -1.0"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.load_state_dict(bad)
    assert_identical(opt.state_dict(), before)
    opt.param_groups[0]["max_norm"] = 0.5
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["max_norm"] == 0.5 and opt.num_updates == 2


def test_torch_layout_refused_by_an_inner_optimizer_with_read_only_groups() -> None:
    """A torch-layout state dict (a wrapped AdamW's) handed to a wrapped Lookahead: Lookahead refuses
    it, and putting its state back raised ``AttributeError`` (its ``param_groups`` has no setter)
    instead of the ``ValueError`` saying why.  Now only replaced objects are put back: the refusal is
    reported, and nothing changed."""
    model = mlp((5, 4, 3))
    plain = ClippedOptimizer(torch.optim.AdamW(model.parameters()), MAX_NORM)
    helpers_train(model, plain, batches_for(1, seed=8), mse)
    opt = ClippedOptimizer(_layered("Lookahead", model.parameters()), MAX_NORM)
    before = copy.deepcopy(opt.state_dict())
    message = (
        "invalid state_dict: the inner Lookahead rejected it ('lookahead_state'); "
        "pass the dict returned by opt.state_dict()"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.load_state_dict(plain.state_dict())
    assert_identical(opt.state_dict(), before)


# ---------------------------------------------- optimizers whose state keeps a layout of its own (#33 item 2)


class LayerNovoGrad(torch.optim.Optimizer):
    """NovoGrad in the layout of timm's ``NvNovoGrad``: ``exp_avg`` per element, ``exp_avg_sq`` one
    number per tensor (a 0-d tensor), where torch's optimizers keep a tensor of the parameter's shape
    under that name."""

    def __init__(self, params: Any, lr: float = 0.01, betas: tuple[float, float] = (0.95, 0.98)) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": 1e-8})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros([])
                norm = p.grad.pow(2).sum()
                state["exp_avg_sq"].mul_(beta2).add_(norm, alpha=1 - beta2)
                scaled = p.grad / (state["exp_avg_sq"].sqrt() + group["eps"])
                state["exp_avg"].mul_(beta1).add_(scaled)
                p.add_(state["exp_avg"], alpha=-group["lr"])
        return None


class PrivateGroupKeys(torch.optim.SGD):
    """heavyball's way with groups: it keeps private keys in them (``_shapes`` here, ``__class__`` and
    ``_orig_shapes`` there) and leaves out of ``state_dict()`` every key that starts with ``_``,
    setting them again itself."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, lr=lr, momentum=0.9)
        for group in self.param_groups:
            group["_shapes"] = [tuple(p.shape) for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        groups = sd["param_groups"]
        sd["param_groups"] = [{k: v for k, v in g.items() if not k.startswith("_")} for g in groups]
        return sd

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for group in self.param_groups:
            group["_shapes"] = [tuple(p.shape) for p in group["params"]]
        return super().step(closure)


#: The heavyball optimizers that refused their own state dict (#33: "parameter group 0 lacks '__class__'").
HEAVYBALL = ["AdamW", "Muon", "ADOPT", "LaProp", "SFAdamW", "NAdam", "MuonAdamW"]


@pytest.fixture
def eager_heavyball(monkeypatch: pytest.MonkeyPatch) -> None:
    """heavyball compiles its kernels (minutes on a CPU with max-autotune): run them eagerly."""
    import heavyball

    monkeypatch.setattr(heavyball.utils, "compile_mode", None)


def _own_layout(name: str, params: Any) -> torch.optim.Optimizer:
    """A fresh inner optimizer: ``LayerNovoGrad``, ``PrivateGroupKeys``, ``timm.NvNovoGrad`` or
    ``heavyball.<name>``."""
    if name == "LayerNovoGrad":
        return LayerNovoGrad(params)
    if name == "PrivateGroupKeys":
        return PrivateGroupKeys(params)
    if name == "timm.NvNovoGrad":  # not in the test extra: timm imports torchvision, and PyPI's
        # torchvision for torch 2.13 fails to import beside the CPU build ("torchvision::nms does not exist")
        reason = "needs timm and a torchvision that imports beside this torch (not in the test extra)"
        timm_optim = pytest.importorskip("timm.optim", reason=reason)
        return timm_optim.NvNovoGrad(params, lr=0.01)
    import heavyball

    return getattr(heavyball, name.removeprefix("heavyball."))(params, lr=0.01)


def _resumes_bit_identically(name: str) -> None:
    """5 micro-batches (mid-window), a checkpoint through torch.save/torch.load(weights_only=True), a
    fresh model and optimizer loading it and 5 more micro-batches equal 10 in one go, bit for bit:
    parameters and the inner state dict."""

    def make(model: torch.nn.Module) -> ClippedOptimizer:
        return ClippedOptimizer(_own_layout(name, model.parameters()), MAX_NORM, accumulation_steps=2)

    data = batches_for(10, seed=5)
    model = mlp((5, 4, 3))
    opt = make(model)
    _resumable_run(name, model, opt, data[:5], start=True)
    buf = io.BytesIO()
    # heavyball's Muon rounds stochastically (torch's global generator): a checkpoint keeps its state
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()}, buf)
    _resumable_run(name, model, opt, data[5:], start=False)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = mlp((5, 4, 3), seed=1)
    resumed.load_state_dict(ckpt["model"])
    opt2 = make(resumed)
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.micro_batches == 1 and opt2.num_updates == 2
    torch.set_rng_state(ckpt["rng"])
    _resumable_run(name, resumed, opt2, data[5:], start=False)

    assert opt2.num_updates == opt.num_updates == 5
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert_identical(opt2.optimizer.state_dict(), opt.optimizer.state_dict())


@pytest.mark.parametrize("name", ["LayerNovoGrad", "PrivateGroupKeys", "timm.NvNovoGrad"])
def test_optimizers_with_a_layout_of_their_own_resume_bit_identically(name: str) -> None:
    """#33 item 2: NvNovoGrad's one-number ``exp_avg_sq`` was refused ("state[0]['exp_avg_sq'] has
    shape (), parameter has (4, 5)"), and a state dict whose groups leave out keys the optimizer's
    groups hold ("parameter group 0 lacks '_shapes'"), though the optimizer itself loads both; now
    they resume bit for bit (:func:`_resumes_bit_identically`)."""
    _resumes_bit_identically(name)


@pytest.mark.parametrize("name", HEAVYBALL)
@pytest.mark.usefixtures("eager_heavyball")
def test_heavyball_optimizers_resume_bit_identically(name: str) -> None:
    """#33 item 2: heavyball's state dicts leave out the keys of its groups that start with ``_``
    (``__class__``, ``_orig_shapes``): "parameter group 0 lacks '__class__'".  Now they resume bit for
    bit (:func:`_resumes_bit_identically`)."""
    _resumes_bit_identically(f"heavyball.{name}")


def _drop_a_parameter(sd: dict[str, Any]) -> None:
    sd["param_groups"][0]["params"].pop()


def _add_a_group(sd: dict[str, Any]) -> None:
    sd["param_groups"].append({**sd["param_groups"][0], "params": [99]})


def _string_lr(sd: dict[str, Any]) -> None:
    sd["param_groups"][0]["lr"] = "0.01"


def _drop_a_hyperparameter(sd: dict[str, Any]) -> None:
    group = sd["param_groups"][0]
    del group["betas" if "betas" in group else "momentum"]


def _state_of_no_parameter(sd: dict[str, Any]) -> None:
    sd["state"][99] = sd["state"][0]


CORRUPT_OWN_LAYOUTS = [
    pytest.param(_drop_a_parameter, "parameter group 0 has 3 parameters, the optimizer's has 4", id="params"),
    pytest.param(_add_a_group, "it has 2 parameter groups, the optimizer has 1", id="groups"),
    pytest.param(
        _string_lr, "parameter group 0 has lr='0.01' (str), but the optimizer's lr is a number", id="lr"
    ),
    pytest.param(_drop_a_hyperparameter, "parameter group 0 lacks '", id="betas-or-momentum"),
    pytest.param(
        _state_of_no_parameter, "state for parameter id 99 that no parameter group lists", id="state"
    ),
]


@pytest.mark.parametrize(("corrupt", "message"), CORRUPT_OWN_LAYOUTS)
@pytest.mark.parametrize("name", ["LayerNovoGrad", "PrivateGroupKeys"])
def test_corrupt_state_dicts_of_a_layout_of_its_own_are_still_refused_untouched(
    name: str, corrupt: Callable[[dict[str, Any]], None], message: str
) -> None:
    """What the inner optimizer's layout does not explain is still refused before anything changes: a
    group of another size, another group count, a string ``lr``, a group without a key the optimizer's
    own state dict keeps (``betas``, SGD's ``momentum``), state for a parameter no group lists."""
    _refused_untouched(name, corrupt, message)


@pytest.mark.parametrize(("corrupt", "message"), CORRUPT_OWN_LAYOUTS)
@pytest.mark.usefixtures("eager_heavyball")
def test_corrupt_heavyball_state_dicts_are_still_refused_untouched(
    corrupt: Callable[[dict[str, Any]], None], message: str
) -> None:
    """As above, for heavyball's AdamW (whose saved groups lack ``__class__`` and ``_orig_shapes``)."""
    _refused_untouched("heavyball.AdamW", corrupt, message)


def _refused_untouched(name: str, corrupt: Callable[[dict[str, Any]], None], message: str) -> None:
    """``corrupt`` applied to a wrapper's state dict mid-window: ``message``, nothing changed."""
    model = mlp((5, 4, 3))
    opt = ClippedOptimizer(_own_layout(name, model.parameters()), MAX_NORM, accumulation_steps=2)
    helpers_train(model, opt, batches_for(3, seed=6), mse)
    bad = copy.deepcopy(opt.state_dict())
    corrupt(bad)
    before = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]
    with pytest.raises(ValueError, match=re.escape(f"invalid state_dict: {message}")):
        opt.load_state_dict(bad)
    assert_identical(opt.state_dict(), before)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))


def test_a_key_the_optimizers_own_state_dict_keeps_is_still_required() -> None:
    """Control for ``PrivateGroupKeys``: without its own ``state_dict`` (torch's, which keeps every key)
    a saved group without ``_shapes`` is refused, as before."""
    model = mlp((5, 4, 3))
    inner = PrivateGroupKeys(model.parameters())
    opt = ClippedOptimizer(inner, MAX_NORM)
    helpers_train(model, opt, batches_for(1, seed=6), mse)
    sd = copy.deepcopy(opt.state_dict())
    assert "_shapes" not in sd["param_groups"][0]
    inner.state_dict = lambda: torch.optim.SGD.state_dict(inner)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=re.escape("invalid state_dict: parameter group 0 lacks '_shapes'")):
        opt.load_state_dict(sd)


class DerivedAdamW(torch.optim.AdamW):
    """A user's class derived from torch's AdamW: its inherited step needs torch's moments (the
    parameter's shape); ``rows`` is an entry of its own, of another shape."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        out = super().step(closure)
        for p, state in self.state.items():
            state["rows"] = p.detach().reshape(p.shape[0], -1).sum(1) if p.dim() > 1 else p.detach().sum()
        return out


def _transposed_moment(sd: dict[str, Any]) -> None:
    """The first matrix's ``exp_avg`` transposed: as many elements as the parameter, another shape
    (e.g. a checkpoint of another model)."""
    state = next(s for s in sd["state"].values() if s["exp_avg"].dim() == 2)
    state["exp_avg"] = state["exp_avg"].t().contiguous()


@pytest.mark.parametrize("corrupt", [None, _transposed_moment], ids=["as_saved", "transposed_exp_avg"])
def test_a_class_derived_from_a_torch_optimizer_keeps_its_moments_checked(
    corrupt: Callable[[dict[str, Any]], None] | None,
) -> None:
    """A fresh ``class DerivedAdamW(torch.optim.AdamW)`` (a resume) refuses an ``exp_avg`` whose
    shape is not its parameter's before anything changes, as torch's AdamW does: loaded, its
    inherited step would have updated some parameters before failing on that one.  Its own entry
    of another shape (``rows``) still loads."""
    model = mlp((5, 4, 3))
    opt = ClippedOptimizer(DerivedAdamW(model.parameters(), lr=0.01), MAX_NORM)
    helpers_train(model, opt, batches_for(2, seed=6), mse)
    sd = copy.deepcopy(opt.state_dict())
    fresh = mlp((5, 4, 3))
    fresh.load_state_dict(model.state_dict())
    resumed = ClippedOptimizer(DerivedAdamW(fresh.parameters(), lr=0.01), MAX_NORM)
    if corrupt is None:
        resumed.load_state_dict(sd)
        assert_identical(resumed.state_dict(), opt.state_dict())
        return
    corrupt(sd)
    params = [p.detach().clone() for p in fresh.parameters()]
    moment = re.escape("invalid state_dict: state[") + r".*\['exp_avg'\] has shape"
    with pytest.raises(ValueError, match=moment):
        resumed.load_state_dict(sd)
    assert not resumed.optimizer.state
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), params, strict=True))


@pytest.mark.usefixtures("eager_heavyball", "fresh_accelerate_state")
def test_heavyball_under_accelerate_prepares_and_trains_as_without_it() -> None:
    """#33 item 2: Accelerate's ``prepare()`` loads the optimizer's own state dict back into it
    (``AcceleratedOptimizer``), which the wrapper over heavyball's AdamW refused, so training could not
    start.  Now it prepares, and 4 windows of 2 micro-batches through ``accelerator.accumulate`` equal
    the same windows without Accelerate, bit for bit."""
    import accelerate
    import heavyball

    data = batches_for(8, seed=9)

    def run(prepared: bool) -> tuple[torch.nn.Module, ClippedOptimizer]:
        model = mlp((5, 4, 3))
        opt = ClippedOptimizer(heavyball.AdamW(model.parameters(), lr=0.01), MAX_NORM)
        step: Any = opt
        accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True) if prepared else None
        if accelerator is not None:
            model, step = accelerator.prepare(model, opt)
        for i, batch in enumerate(data):
            if accelerator is not None:
                with accelerator.accumulate(model):
                    accelerator.backward(mse(model, batch))  # divided by 2 there
                    step.step()
                    step.zero_grad()
            else:
                (mse(model, batch) / 2).backward()
                if i % 2 == 1:
                    opt.step()
                    opt.zero_grad()
        return model, opt

    model, opt = run(prepared=True)
    ref_model, ref_opt = run(prepared=False)
    assert opt.num_updates == ref_opt.num_updates == 4
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)
