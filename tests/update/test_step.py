"""The step's seam for a one-pass Adam/AdamW kernel (`step.KERNELS`): a kernel registered for
the family is handed, per group, the lists torch's own functional Adam takes, with each
parameter's master; the update it makes is the class's own, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.adam import adam

import precision_annot as pa
from precision_annot._src.update import step as update_step


def functional_adam(group: dict[str, Any], params: list[torch.Tensor],
                    grads: list[torch.Tensor], masters: list[torch.Tensor | None],
                    exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                    max_exp_avg_sqs: list[torch.Tensor] | None, steps: list[torch.Tensor],
                    adamw: bool, grad_scale: torch.Tensor | None,
                    found_inf: torch.Tensor | None) -> None:
    """A kernel as the seam takes it, made of torch's functional Adam over the masters."""
    assert grad_scale is None and found_inf is None  # no GradScaler here
    targets = [m if m is not None else p for p, m in zip(params, masters, strict=True)]
    upcast = [g.to(t.dtype) for g, t in zip(grads, targets, strict=True)]
    adam(targets, upcast, exp_avgs, exp_avg_sqs, max_exp_avg_sqs or [], steps,
                          foreach=False, amsgrad=group["amsgrad"], beta1=group["betas"][0],
                          beta2=group["betas"][1], lr=group["lr"], eps=group["eps"],
                          weight_decay=group["weight_decay"], maximize=group["maximize"],
                          decoupled_weight_decay=adamw)
    for p, m in zip(params, masters, strict=True):
        if m is not None:
            p.copy_(m)


@pytest.mark.parametrize("spec", ["bf16-true,master=fp32", "fp32"])
def test_a_registered_kernel_gets_the_lists_and_steps_as_the_class_does(
        spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def run(kernel: Any) -> tuple[nn.Module, Any, int]:
        calls = []
        if kernel is not None:
            def counted(*args: Any) -> None:
                calls.append(len(args[1]))
                kernel(*args)

            monkeypatch.setitem(update_step.KERNELS, "AdamW", counted)
        else:
            monkeypatch.delitem(update_step.KERNELS, "AdamW", raising=False)
        torch.manual_seed(0)
        model = pa.apply(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4)), default=spec)
        opt = pa.optimizer(model, torch.optim.AdamW, [
            {"params": [model[0].weight]}, {"params": list(model[1].parameters()),
                                             "weight_decay": 0.0}, {"params": [model[0].bias]}],
            lr=1e-2)
        for i in range(4):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(i))
            opt.zero_grad()
            model(x.to(model[0].weight.dtype)).float().pow(2).mean().backward()
            opt.step()
        return model, opt, sum(calls)

    ours, with_kernel, taken = run(functional_adam)
    theirs, plain, _ = run(None)
    assert taken == 4 * 4 if spec != "fp32" else taken == 0  # plain fp32: the class's own step
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p, q)
        a, b = with_kernel.master(p), plain.master(q)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
        assert torch.equal(with_kernel.state[p]["exp_avg"], plain.state[q]["exp_avg"])
