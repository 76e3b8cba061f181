"""Train a small regression MLP with ClippedOptimizer: clipping, accumulation, a skipped NaN window.

Run:  python examples/quickstart.py
"""

from __future__ import annotations

import torch

import clipopt


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(2048, 16)
    true_w = torch.randn(16, 1)
    y = torch.sin(x @ true_w / 4) + 0.05 * torch.randn(2048, 1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    opt = clipopt.ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        max_norm=1.0,
        accumulation_steps=4,
    )
    sched = clipopt.per_update(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=320))
    baseline = torch.nn.functional.mse_loss(y.mean().expand_as(y), y).item()

    batches = list(zip(x.split(16), y.split(16), strict=True)) * 10  # 10 epochs of 128 micro-batches
    for i, (xb, yb) in enumerate(batches):
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        if i == 41:  # one poisoned micro-batch: its whole window is skipped
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(x), y).item()
    skipped = [s.step for s in opt.stats if s.skipped]
    clipped = sum(s.clipped for s in opt.stats)
    print(f"updates applied: {opt.num_updates}, skipped windows: {skipped} (reason nonfinite)")
    last = opt.last_stats
    if last is None:
        raise SystemExit("no update was recorded")
    print(f"clipped updates: {clipped} of {opt.num_windows}; last total_norm {last.total_norm:.3f}")
    print(f"loss: {final:.4f} (predicting the mean: {baseline:.4f})")
    if not (final < 0.5 * baseline and skipped):
        raise SystemExit("quickstart did not learn")


if __name__ == "__main__":
    main()
