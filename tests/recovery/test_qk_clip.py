"""QKClip (#35 item 2): the attention-logit cap of MuonClip and Megatron-LM's ``qk_clip``.

The references are written here, independently: the logits by hand (``einsum`` of the projected
queries and keys, in float64), and the cap as Megatron-LM's ``Attention.clip_qk``
(megatron/core/transformer/attention.py) computes it: per key-value group, ``m`` the largest logit
of the group's query heads, ``eta = threshold / m`` where ``m > threshold``; the group's query rows
times ``eta ** alpha``, its key rows times ``eta ** (1 - alpha)`` -- in plain Python floats, row
by row.  The cap is compared within float32 rounding (a few ulps: ``eta`` and its power are
float32 on clipopt's side, float64 here); the rows it leaves alone must be bit-identical.
"""

from __future__ import annotations

import copy
import csv
import io
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from clipopt import ClippedOptimizer, CSVLogger, QKClip
from clipopt._part import Part

from ..hostreads import count_host_reads

E, H, L = 16, 4, 5  # embedding, heads, sequence length


class GQAttention(nn.Module):
    """A Llama-style attention block: q_proj/k_proj/v_proj/o_proj, grouped-query heads, batch first."""

    def __init__(self, dim: int = E, heads: int = 4, kv_heads: int = 2, head_dim: int = 4) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(dim, heads * head_dim)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim)
        self.o_proj = nn.Linear(heads * head_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        rep = self.num_heads // self.num_key_value_heads
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, -1, self.head_dim).transpose(1, 2).repeat_interleave(rep, dim=1)
        v = self.v_proj(x).view(b, n, -1, self.head_dim).transpose(1, 2).repeat_interleave(rep, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, n, -1))


class FusedAttention(nn.Module):
    """A timm/nanoGPT-style attention block: one ``qkv`` projection whose output is ``[q; k; v]``
    (``heads * head_dim`` query features, then ``kv_heads * head_dim`` key and as many value
    features), grouped-query heads when ``kv_heads < heads``."""

    def __init__(self, dim: int = E, heads: int = 4, kv_heads: int | None = None, name: str = "qkv") -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        if kv_heads is not None:
            self.num_key_value_heads = kv_heads
        self.kv = kv_heads or heads
        self.name = name
        setattr(self, name, nn.Linear(dim, (heads + 2 * self.kv) * self.head_dim))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        d, rep = self.head_dim, self.num_heads // self.kv
        q, k, v = getattr(self, self.name)(x).split([self.num_heads * d, self.kv * d, self.kv * d], dim=-1)
        q = q.view(b, n, self.num_heads, d).transpose(1, 2)
        k = k.view(b, n, self.kv, d).transpose(1, 2).repeat_interleave(rep, dim=1)
        v = v.view(b, n, self.kv, d).transpose(1, 2).repeat_interleave(rep, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, n, -1))


# ---------------------------------------------------------------------- independent references


def mha_logit_maxima(m: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor) -> list[float]:
    """Each head's largest ``q . k / sqrt(head_dim)`` of one ``nn.MultiheadAttention`` call, in float64
    (batch-first inputs)."""
    m = copy.deepcopy(m).requires_grad_(False)
    e, h = m.embed_dim, m.num_heads
    d = e // h
    if m.in_proj_weight is not None:
        wq, wk = m.in_proj_weight[:e].double(), m.in_proj_weight[e : 2 * e].double()
    else:
        wq, wk = m.q_proj_weight.double(), m.k_proj_weight.double()
    bq = m.in_proj_bias[:e].double() if m.in_proj_bias is not None else 0
    bk = m.in_proj_bias[e : 2 * e].double() if m.in_proj_bias is not None else 0
    q = (query.double() @ wq.T + bq).reshape(query.shape[0], query.shape[1], h, d)
    k = (key.double() @ wk.T + bk).reshape(key.shape[0], key.shape[1], h, d)
    if m.bias_k is not None:
        k = torch.cat([k, m.bias_k.double().reshape(1, 1, h, d).expand(k.shape[0], 1, h, d)], dim=1)
    logits = torch.einsum("blhd,bshd->bhls", q, k) / math.sqrt(d)
    return [float(logits[:, i].max()) for i in range(h)]


def gqa_logit_maxima(m: GQAttention, x: torch.Tensor) -> list[float]:
    """Each query head's largest logit of :class:`GQAttention`, query head ``i`` reading key head
    ``i // (heads // kv_heads)``, in float64."""
    m = copy.deepcopy(m).requires_grad_(False)
    d, rep = m.head_dim, m.num_heads // m.num_key_value_heads
    q = (x.double() @ m.q_proj.weight.double().T + m.q_proj.bias.double()).reshape(*x.shape[:2], -1, d)
    k = (x.double() @ m.k_proj.weight.double().T + m.k_proj.bias.double()).reshape(*x.shape[:2], -1, d)
    out = []
    for i in range(m.num_heads):
        logits = torch.einsum("bld,bsd->bls", q[:, :, i], k[:, :, i // rep]) / math.sqrt(d)
        out.append(float(logits.max()))
    return out


def megatron_factors(maxima: list[float], kv_heads: int, threshold: float, alpha: float) -> tuple[list, list]:
    """Megatron-LM's per-group factors: (query factor of each query head, key factor of each key head).
    A group scales only where its largest logit is above the threshold (a positive logit then)."""
    group = len(maxima) // kv_heads
    q_f, k_f = [], []
    for g in range(kv_heads):
        m = max(maxima[g * group : (g + 1) * group])
        eta = threshold / m if m > threshold else 1.0
        q_f += [eta**alpha] * group
        k_f.append(eta ** (1 - alpha))
    return q_f, k_f


def scaled_rows(w: torch.Tensor, per_head: list[float], head_dim: int) -> torch.Tensor:
    """``w`` (float64) with the rows of head ``i`` (``head_dim`` rows each) times ``per_head[i]``."""
    out = w.double().clone()
    for i, f in enumerate(per_head):
        out[i * head_dim : (i + 1) * head_dim] *= f
    return out


def assert_rows(
    got: torch.Tensor, want: torch.Tensor, untouched: torch.Tensor, factors: list[float], d: int
) -> None:
    """Scaled heads within float32 rounding of the reference; heads with a factor of 1 bit-identical."""
    for i, f in enumerate(factors):
        rows = slice(i * d, (i + 1) * d)
        if f == 1.0:
            assert torch.equal(got[rows], untouched[rows]), f"head {i} changed without a cap"
        else:
            torch.testing.assert_close(got[rows].double(), want[rows], rtol=4e-7, atol=0.0)


# ---------------------------------------------------------------------- the cap on one layer


def _mha_block(
    seed: int = 0, gain: float = 6.0, batch_first: bool = True, **kwargs: Any
) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    m = nn.MultiheadAttention(E, H, batch_first=batch_first, **kwargs)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(gain)  # logits well above the threshold in some heads, not in others
    return m


def _step(model: nn.Module, opt: ClippedOptimizer, loss: torch.Tensor) -> None:
    loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("alpha", [0.5, 0.0, 1.0, 0.3])
def test_the_cap_is_megatrons_on_a_multihead_attention(alpha: float) -> None:
    m = _mha_block()
    x = torch.randn(3, L, E)
    maxima = mha_logit_maxima(m, x, x)
    threshold = sorted(maxima)[1] + 1e-3  # two heads above it, two below
    lr = 0.05
    inner = torch.optim.SGD(m.parameters(), lr=lr)
    updated: list[torch.Tensor] = []  # the parameters after SGD's update, before the cap
    inner.register_step_post_hook(lambda *_: updated.extend(p.detach().clone() for p in m.parameters()))
    opt = ClippedOptimizer(inner, max_norm=None, qk_clip=QKClip(m, threshold, alpha))
    out, _ = m(x, x, x)
    out.square().mean().backward()
    before = m.in_proj_weight.detach().clone()
    opt.step()
    updated_w, updated_b = updated[0], updated[1]
    assert updated_w.shape == (3 * E, E) and not torch.equal(updated_w, before)
    q_f, k_f = megatron_factors(maxima, H, threshold, alpha)
    d = E // H
    assert sum(f != 1.0 for f in q_f) == 2 or alpha == 0.0
    got_w, got_b = m.in_proj_weight.detach(), m.in_proj_bias.detach()
    assert_rows(got_w[:E], scaled_rows(updated_w[:E], q_f, d), updated_w[:E], q_f, d)
    assert_rows(got_w[E : 2 * E], scaled_rows(updated_w[E : 2 * E], k_f, d), updated_w[E : 2 * E], k_f, d)
    assert_rows(got_b[:E], scaled_rows(updated_b[:E], q_f, d), updated_b[:E], q_f, d)
    assert_rows(got_b[E : 2 * E], scaled_rows(updated_b[E : 2 * E], k_f, d), updated_b[E : 2 * E], k_f, d)
    assert torch.equal(got_w[2 * E :], updated_w[2 * E :])  # the value rows: never
    assert opt.last_stats.max_logit == pytest.approx(max(maxima), rel=1e-5)


def test_after_the_cap_the_largest_logit_is_the_threshold() -> None:
    m = _mha_block()
    x = torch.randn(2, L, E)
    opt = ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), qk_clip=QKClip(m, threshold=10.0))
    assert max(mha_logit_maxima(m, x, x)) > 10.0
    for _ in range(2):
        _step(m, opt, m(x, x, x)[0].sum())
    after = mha_logit_maxima(m, x, x)
    assert max(after) == pytest.approx(10.0, rel=1e-5)
    assert opt.last_stats.max_logit == pytest.approx(10.0, rel=1e-5)  # measured before the second cap


def test_grouped_query_heads_share_their_key_heads_cap_as_in_megatron() -> None:
    torch.manual_seed(1)
    m = GQAttention()
    with torch.no_grad():
        m.q_proj.weight.mul_(5.0)
        m.k_proj.weight.mul_(5.0)
    x = torch.randn(2, L, E)
    maxima = gqa_logit_maxima(m, x)
    group_max = [max(maxima[0:2]), max(maxima[2:4])]
    threshold = min(group_max) + 0.5 * (max(group_max) - min(group_max))  # one group capped
    qk = QKClip(m, threshold=threshold, alpha=0.5)
    assert qk.modules == ["(model)"]
    opt = ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), qk_clip=qk)
    wq, wk = m.q_proj.weight.detach().clone(), m.k_proj.weight.detach().clone()
    _step(m, opt, m(x).sum())
    q_f, k_f = megatron_factors(maxima, 2, threshold, 0.5)
    assert q_f[0] == q_f[1] and q_f[2] == q_f[3] and (q_f[0] == 1.0) != (q_f[2] == 1.0)
    assert_rows(m.q_proj.weight.detach(), scaled_rows(wq, q_f, 4), wq, q_f, 4)
    assert_rows(m.k_proj.weight.detach(), scaled_rows(wk, k_f, 4), wk, k_f, 4)
    assert opt.last_stats.max_logit == pytest.approx(max(maxima), rel=1e-5)


@pytest.mark.parametrize(
    ("name", "kv_heads"), [("qkv", None), ("c_attn", None), ("Wqkv", 2), ("qkv_proj", 1)]
)
def test_a_fused_qkv_projection_is_found_and_capped_as_in_megatron(name: str, kv_heads: int | None) -> None:
    """The rows of one fused ``[q; k; v]`` weight: the query block by ``eta ** alpha`` per query head,
    the key block by ``eta ** (1 - alpha)`` per key head, the value block never."""
    torch.manual_seed(3)
    m = FusedAttention(heads=4, kv_heads=kv_heads, name=name)
    kv, d = m.kv, m.head_dim
    with torch.no_grad():
        getattr(m, name).weight.mul_(6.0)
    x = torch.randn(2, L, E)
    w = getattr(m, name).weight.detach().double()
    b = getattr(m, name).bias.detach().double()
    q = (x.double() @ w[: 4 * d].T + b[: 4 * d]).reshape(2, L, 4, d)
    k = (x.double() @ w[4 * d : (4 + kv) * d].T + b[4 * d : (4 + kv) * d]).reshape(2, L, kv, d)
    maxima = [
        float((torch.einsum("bld,bsd->bls", q[:, :, h], k[:, :, h // (4 // kv)]) / math.sqrt(d)).max())
        for h in range(4)
    ]
    groups = [max(maxima[g * (4 // kv) : (g + 1) * (4 // kv)]) for g in range(kv)]
    threshold = min(maxima) - 1.0 if kv == 1 else sorted(groups)[len(groups) // 2 - 1] + 1e-3
    qk = QKClip(m, threshold=threshold, alpha=0.3, fused=name)
    assert qk.modules == ["(model)"] and dict(qk.settings())["qk_clip.heads"] == 4
    opt = ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), qk_clip=qk)
    before_w = getattr(m, name).weight.detach().clone()
    before_b = getattr(m, name).bias.detach().clone()
    _step(m, opt, m(x).sum())
    q_f, k_f = megatron_factors(maxima, kv, threshold, 0.3)
    assert any(f != 1.0 for f in k_f)
    got_w, got_b = getattr(m, name).weight.detach(), getattr(m, name).bias.detach()
    qs, ks = slice(0, 4 * d), slice(4 * d, (4 + kv) * d)
    for got, before in ((got_w, before_w), (got_b, before_b)):
        assert_rows(got[qs], scaled_rows(before[qs], q_f, d), before[qs], q_f, d)
        assert_rows(got[ks], scaled_rows(before[ks], k_f, d), before[ks], k_f, d)
        assert torch.equal(got[(4 + kv) * d :], before[(4 + kv) * d :])  # the value rows: never
    assert opt.last_stats.max_logit == pytest.approx(max(maxima), rel=1e-5)


def test_a_fused_projection_that_does_not_fit_its_heads_is_refused() -> None:
    headless = nn.Module()
    headless.qkv = nn.Linear(8, 24)
    with pytest.raises(ValueError, match=r"cannot tell the heads of '\(model\)'.*fused projection 'qkv'"):
        QKClip(headless, fused="qkv")
    bad = FusedAttention(heads=4)
    bad.num_key_value_heads = 2  # says grouped-query, but the projection has 4 key heads
    with pytest.raises(ValueError, match=r"do not fit its fused projection 'qkv'.*\[q; k; v\] of 32 outputs"):
        QKClip(bad, fused="qkv")
    with pytest.raises(ValueError, match=r"fused=\('Wqkv',\) names no nn.Linear child.*fused='qkv'"):
        QKClip(FusedAttention(), fused=("qkv", "Wqkv"))
    with pytest.raises(TypeError, match=r"fused must be an attribute name.*got 3; .*fused='qkv'"):
        QKClip(FusedAttention(), fused=3)  # type: ignore[arg-type]


def test_a_fused_projection_is_watched_only_when_named() -> None:
    """Names alone do not tell the layout (GPTBigCode's ``c_attn`` interleaves the heads' q, k and v):
    without ``fused=``, a module with a ``qkv`` child is not watched, and a model whose attention is
    elsewhere is watched as before."""
    model = nn.Module()
    model.attn = _mha_block()
    model.mix = nn.Module()
    model.mix.qkv = nn.Linear(8, 8)  # not attention, no heads
    assert QKClip(model).modules == ["attn"]
    with pytest.raises(ValueError, match=r"model has no attention QKClip can watch.*fused='qkv'"):
        QKClip(FusedAttention())


def test_heads_and_scale_are_read_from_the_modules_config_head_dim_and_scaling() -> None:
    """A Hugging Face-style module: heads in ``config``, ``head_dim`` and its own ``scaling`` (here not
    ``1/sqrt(head_dim)``), one key-value head for four query heads (multi-query attention)."""
    torch.manual_seed(2)
    m = GQAttention(kv_heads=1)
    del m.num_heads, m.num_key_value_heads
    m.config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=1)
    m.scaling = 0.1
    x = torch.randn(2, L, E)
    qk = QKClip(m, threshold=1e30)
    opt = ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), qk_clip=qk)
    with torch.no_grad():
        q = m.q_proj(x).double().view(2, L, 4, 4)
        k = m.k_proj(x).double().view(2, L, 1, 4)
    want = max(float((torch.einsum("bld,bsd->bls", q[:, :, h], k[:, :, 0]) * 0.1).max()) for h in range(4))
    m.num_heads, m.num_key_value_heads = 4, 1  # (GQAttention.forward reads them)
    _step(m, opt, m(x).sum())
    assert opt.last_stats.max_logit == pytest.approx(want, rel=1e-5)
    assert dict(qk.settings())["qk_clip.heads"] == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_first": False},
        {"kdim": 8, "vdim": 12},  # separate q_proj_weight / k_proj_weight
        {"add_bias_kv": True},
        {"bias": False},
    ],
    ids=["seq_first", "kdim_vdim", "add_bias_kv", "no_bias"],
)
def test_every_form_of_multihead_attention_is_measured(kwargs: dict[str, Any]) -> None:
    batch_first = kwargs.pop("batch_first", True)
    m = _mha_block(batch_first=batch_first, **kwargs)
    q_in = torch.randn(2, L, E)
    kv_in = torch.randn(2, L + 2, kwargs.get("kdim", E))
    v_in = torch.randn(2, L + 2, kwargs.get("vdim", E))
    opt = ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), qk_clip=QKClip(m, threshold=1e30))
    args = (
        (q_in, kv_in, v_in)
        if batch_first
        else (q_in.transpose(0, 1), kv_in.transpose(0, 1), v_in.transpose(0, 1))
    )
    _step(m, opt, m(*args)[0].sum())
    assert opt.last_stats.max_logit == pytest.approx(max(mha_logit_maxima(m, q_in, kv_in)), rel=1e-5)


def test_a_transformer_is_searched_whole_and_measured_only_when_training() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    qk = QKClip(model, threshold=1e30)
    assert qk.modules == ["layers.0.self_attn", "layers.1.self_attn"]
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), qk_clip=qk)
    x = torch.randn(2, L, E)
    with torch.no_grad():  # an evaluation with much larger inputs: not a training forward
        model.eval()
        model(100 * x)
        model.train()
    _step(model, opt, model(x).sum())
    first = model.layers[0].self_attn
    ref = max(mha_logit_maxima(first, x, x))  # the first layer sees x itself
    assert opt.last_stats.max_logit >= ref * (1 - 1e-5)
    assert opt.last_stats.max_logit < 1e4  # not the evaluation's 100x inputs


# ---------------------------------------------------------------------- what scales nothing


def test_a_skipped_window_scales_nothing() -> None:
    m = _mha_block()
    x = torch.randn(2, L, E)
    opt = ClippedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), max_norm=1.0, qk_clip=QKClip(m, threshold=1.0)
    )
    before = [p.detach().clone() for p in m.parameters()]
    m(x, x, x)[0].sum().backward()
    m.out_proj.weight.grad[0, 0] = math.nan  # a non-finite gradient: the window is skipped
    opt.step()
    assert opt.last_stats.skipped
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before, strict=True))
    assert opt.last_stats.max_logit > 1.0  # measured, not applied


def test_a_skip_flag_on_the_device_scales_nothing_and_is_never_read_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fused path: the skip decision stays a 0/1 tensor; the cap reads it with torch.where."""
    seen: list[Any] = []
    commit = QKClip.commit
    monkeypatch.setattr(
        QKClip, "commit", lambda self, w, d, skipped: (seen.append(skipped), commit(self, w, d, skipped))
    )
    m = _mha_block()
    x = torch.randn(2, L, E)
    inner = torch.optim.Adam(m.parameters(), lr=1e-3, fused=True)
    opt = ClippedOptimizer(inner, max_norm=1.0, qk_clip=QKClip(m, threshold=1.0))
    _step(m, opt, m(x, x, x)[0].sum())  # the first window takes the host path (no moments yet)
    applied = m.in_proj_weight.detach().clone()
    with count_host_reads() as reads:
        m(x, x, x)[0].sum().backward()  # measured in the forward pass
    assert reads.ours == []
    m.out_proj.weight.grad[0, 0] = math.nan
    before = [p.detach().clone() for p in m.parameters()]
    with count_host_reads() as reads:
        opt.step()
    assert reads.ours == []
    assert isinstance(seen[-1], torch.Tensor) and float(seen[-1]) == 1.0
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before, strict=True))
    opt.zero_grad()
    _step(m, opt, m(x, x, x)[0].sum())  # an applied fused window is capped
    assert isinstance(seen[-1], torch.Tensor) and float(seen[-1]) == 0.0
    assert not torch.equal(m.in_proj_weight, applied)
    assert max(mha_logit_maxima(m, x, x)) < max(mha_logit_maxima(_mha_block(), x, x))


def test_a_logit_at_or_below_zero_or_unmeasured_scales_nothing() -> None:
    """Megatron-LM#7382: eta from a non-positive logit gave NaN weights; here such a head keeps its rows."""
    m = _mha_block()
    qk = QKClip(m, threshold=5.0, measure=False)
    opt = ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), qk_clip=qk)
    x = torch.randn(2, L, E)
    m(x, x, x)[0].sum().backward()
    w = m.in_proj_weight.detach().clone()
    qk.observe(m, torch.tensor([-3.0, 0.0, 20.0, math.nan]))
    opt.step()
    opt.zero_grad()
    got = m.in_proj_weight.detach()
    d = E // H
    q_f, k_f = [1.0, 1.0, 0.25**0.5, 1.0], [1.0, 1.0, 0.25**0.5, 1.0]
    assert_rows(got[:E], scaled_rows(w[:E], q_f, d), w[:E], q_f, d)
    assert_rows(got[E : 2 * E], scaled_rows(w[E : 2 * E], k_f, d), w[E : 2 * E], k_f, d)
    assert torch.isfinite(got).all()
    assert opt.last_stats.max_logit == 20.0
    # a window with no measurement at all: nothing scaled, max_logit nan
    m(x, x, x)[0].sum().backward()
    w = [p.detach().clone() for p in m.parameters()]
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), w, strict=True))
    assert math.isnan(opt.last_stats.max_logit)


def test_a_window_closed_without_gradients_leaves_nothing_to_the_next() -> None:
    m = _mha_block()
    qk = QKClip(m, threshold=5.0, measure=False, every=2)
    opt = ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), qk_clip=qk)
    qk.observe(m, torch.full((H,), 1e4))  # window 1: measured, but no gradient: nothing to apply
    opt.step()
    assert opt.last_stats.reason == "nograd" and opt.num_skipped == 1
    x = torch.randn(2, L, E)
    m(x, x, x)[0].sum().backward()
    qk.observe(m, torch.full((H,), 1e4))  # window 2: not due (every=2): ignored
    w = [p.detach().clone() for p in m.parameters()]
    opt.step()
    assert opt.last_stats.max_logit is None
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), w, strict=True))
    m(x, x, x)[0].sum().backward()
    qk.observe(m, torch.tensor([1.0, 2.0, 3.0, 4.0]))  # window 3: due, and window 1's 1e4 is gone
    opt.step()
    assert opt.last_stats.max_logit == 4.0
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), w, strict=True))


def test_the_csv_log_gains_the_column_after_a_first_window_without_it(tmp_path: Path) -> None:
    m = _mha_block()
    qk = QKClip(m, threshold=1e30)
    opt = ClippedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.0), qk_clip=qk, loggers=[CSVLogger(tmp_path / "g.csv")]
    )
    opt.step()  # no gradient: no cell
    x = torch.randn(2, L, E)
    _step(m, opt, m(x, x, x)[0].sum())
    opt.close()
    with open(tmp_path / "g.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and rows[0]["max_logit"] == ""
    assert float(rows[1]["max_logit"]) == pytest.approx(max(mha_logit_maxima(m, x, x)), rel=1e-5)


def test_observe_takes_the_largest_of_several_calls_and_refuses_what_it_cannot_use() -> None:
    m = _mha_block()
    qk = QKClip(m, threshold=5.0, measure=False)
    opt = ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), qk_clip=qk)
    with pytest.raises(ValueError, match=r"max_logits for \(model\) must be a tensor of its 4 query heads"):
        qk.observe(m, torch.ones(3))
    with pytest.raises(ValueError, match="not one of the attention modules"):
        qk.observe(nn.Linear(2, 2), torch.ones(4))
    x = torch.randn(2, L, E)
    m(x, x, x)[0].sum().backward()
    qk.observe(m, torch.tensor([1.0, 8.0, 2.0, 3.0]))
    qk.observe(m, torch.tensor([4.0, 2.0, 1.0, 3.0]))
    opt.step()
    assert opt.last_stats.max_logit == 8.0


def test_every_k_measures_and_caps_every_kth_window_only() -> None:
    m = _mha_block()
    x = torch.randn(2, L, E)
    opt = ClippedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.0), qk_clip=QKClip(m, threshold=1e30, every=3)
    )
    logged = []
    for _ in range(7):
        _step(m, opt, m(x, x, x)[0].sum())
        logged.append(opt.last_stats.max_logit)
    assert [v is not None for v in logged] == [True, False, False, True, False, False, True]


def test_a_run_without_qk_clip_has_no_max_logit_and_no_hooks() -> None:
    m = _mha_block()
    opt = ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), max_norm=1.0)
    x = torch.randn(2, L, E)
    _step(m, opt, m(x, x, x)[0].sum())
    assert opt.qk_clip is None and opt.last_stats.max_logit is None
    assert not m._forward_pre_hooks and not m._forward_hooks


# ---------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"threshold": 0.0}, ValueError, "threshold must be a positive finite number, got 0.0"),
        ({"threshold": -1.0}, ValueError, "threshold"),
        ({"threshold": math.inf}, ValueError, "threshold"),
        ({"threshold": "100"}, TypeError, "threshold"),
        ({"alpha": 1.5}, ValueError, r"alpha must be in \[0, 1\], got 1.5"),
        ({"alpha": -0.1}, ValueError, "alpha"),
        ({"alpha": None}, TypeError, "alpha"),
        ({"every": 0}, ValueError, "every must be an int >= 1, got 0"),
        ({"every": 2.0}, TypeError, "every"),
        ({"measure": "yes"}, TypeError, "measure"),
    ],
)
def test_bad_settings_are_refused_naming_the_argument(
    kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        QKClip(_mha_block(), **kwargs)


def test_a_model_without_attention_or_heads_is_refused() -> None:
    with pytest.raises(ValueError, match="model has no attention QKClip can watch"):
        QKClip(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        QKClip([nn.Linear(4, 4)])  # type: ignore[arg-type]
    headless = nn.Module()
    headless.q_proj, headless.k_proj = nn.Linear(8, 8), nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"cannot tell the heads of '\(model\)'.*num_heads"):
        QKClip(headless)
    bad = GQAttention()
    bad.num_key_value_heads = 3
    with pytest.raises(ValueError, match="do not fit its projections"):
        QKClip(bad)


def test_the_weights_must_be_the_optimizers_and_the_keyword_a_qkclip() -> None:
    m, other = _mha_block(), _mha_block()
    with pytest.raises(ValueError, match=r"\(model\)\.in_proj_weight is not a parameter of the optimizer"):
        ClippedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), qk_clip=QKClip(m))
    with pytest.raises(TypeError, match="qk_clip must be a QKClip or None"):
        ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), qk_clip=100.0)
    opt = ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="not a parameter of the optimizer"):
        opt.qk_clip = QKClip(other)
    assert opt.qk_clip is None
    qk = QKClip(m)
    opt.qk_clip = qk
    assert opt.qk_clip is qk and isinstance(qk, Part)


def test_settings_are_the_ranks_agreement() -> None:
    qk = QKClip(_mha_block(), threshold=50.0, alpha=0.25, every=2)
    assert dict(qk.settings()) == {
        "qk_clip.threshold": 50.0,
        "qk_clip.alpha": 0.25,
        "qk_clip.every": 2,
        "qk_clip.heads": H,
    }


# ---------------------------------------------------------------------- checkpoints


def test_the_state_dict_keeps_an_open_windows_maxima_by_module_name() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, L, E)

    def build() -> tuple[nn.Module, ClippedOptimizer]:
        model = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False
        )
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.8)
        opt = ClippedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01), qk_clip=QKClip(model, 2.0, every=2)
        )
        return model, opt

    model, opt = build()
    _step(model, opt, model(x).sum())  # window 1 measured; window 2 not; window 3 measured
    _step(model, opt, model(x).sum())
    model(x).sum().backward()  # window 3 open, measured, not closed
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # only tensors, numbers, strings, lists, dicts
    entry = state["clipopt"]["qk_clip"]
    assert entry["due"] is True and sorted(entry["maxima"]) == ["layers.0.self_attn", "layers.1.self_attn"]
    resumed, resumed_opt = build()
    resumed.load_state_dict(model.state_dict())
    resumed_opt.load_state_dict(state)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        q.grad = p.grad.clone()  # the open window's gradients; its forward ran before the save
    opt.step()
    resumed_opt.step()
    assert resumed_opt.last_stats.max_logit == opt.last_stats.max_logit > 2.0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters(), strict=True))
    bad = {
        **state,
        "clipopt": {**state["clipopt"], "qk_clip": {"due": True, "maxima": {"nope": torch.ones(H)}}},
    }
    with pytest.raises(ValueError, match="holds maxima for 'nope'"):
        resumed_opt.load_state_dict(bad)
